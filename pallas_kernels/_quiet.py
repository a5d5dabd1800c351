"""Keeps libtpu's start-up noise away on machines without a TPU: where none is
attached and no platform was chosen, JAX executes on CPU; compile-only TPU
topologies (``tpu_aot``) keep working.
"""
from __future__ import annotations

import glob
import os
import sys


def tpu_attached() -> bool:
  return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def gpu_attached() -> bool:
  return bool(glob.glob("/dev/nvidia[0-9]*"))


def select_cpu_when_no_accelerator() -> None:
  """Sets JAX_PLATFORMS=cpu unless the user chose or a device is present."""
  if os.environ.get("JAX_PLATFORMS") or os.environ.get("JAX_PLATFORM_NAME"):
    return
  if tpu_attached() or gpu_attached():
    return
  os.environ["JAX_PLATFORMS"] = "cpu"
  if "jax" in sys.modules:  # jax reads JAX_PLATFORMS when it is imported
    sys.modules["jax"].config.update("jax_platforms", "cpu")
  # Silence C++ logging that libtpu emits while being probed.
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
