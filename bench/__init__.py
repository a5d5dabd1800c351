"""Benchmarks (see run.py). Importing the package keeps JAX from taking
most of the GPU memory up front, which the torch peers in the same process
need."""
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
