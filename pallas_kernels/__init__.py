"""Pallas kernels for TPU (Mosaic) and GPU, each beside a pure-JAX reference.

Ops: attention, int8 and quantized matmuls, grouped matmul, ragged paged
attention, IoU family and NMS (``_registry.FAMILIES``); each takes ``backend=``
(``_backend``). ``pallas_kernels.reference`` holds the plain-JAX versions.
Without a TPU or GPU, importing selects JAX's CPU platform unless
``JAX_PLATFORMS`` is set.
"""
from __future__ import annotations

import importlib

from pallas_kernels import _quiet, _registry

# On a host with libtpu installed but no accelerator, JAX would probe for a TPU
# and libtpu would print start-up errors: select the CPU (AOT TPU compiles
# still work). A platform the user chose is kept.
_quiet.select_cpu_when_no_accelerator()

from pallas_kernels._backend import BACKENDS, force_interpret  # noqa: E402,F401

__version__ = "0.1.0"

# Public name -> module that defines it (the op registry). Families load on
# first use, so ``import pallas_kernels`` stays cheap and one family never
# breaks another.
_EXPORTS = _registry.exports()
_SUBMODULES = ("reference", "nn", "tpu_aot", "attention", "decode", "int8",
               "quant", "boxes", "gmm", "ragged")

__all__ = sorted(_EXPORTS) + ["BACKENDS", "force_interpret"] + list(_SUBMODULES)


def __getattr__(name):
  if name in _EXPORTS:
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
  elif name in _SUBMODULES:
    value = importlib.import_module(f"pallas_kernels.{name}")
  else:
    raise AttributeError(f"module 'pallas_kernels' has no attribute {name!r}")
  globals()[name] = value
  return value


def __dir__():
  return __all__
