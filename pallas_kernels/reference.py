"""Plain-JAX versions of every op, with the same semantics as the kernels.

``pallas_kernels.reference.flash_attention(...)`` equals
``pallas_kernels.flash_attention(..., backend="reference")``.
"""
from __future__ import annotations

import importlib

from pallas_kernels import _registry

_EXPORTS = _registry.references()


def __getattr__(name):
  if name not in _EXPORTS:
    raise AttributeError(f"pallas_kernels.reference has no attribute {name!r}")
  value = getattr(importlib.import_module(_EXPORTS[name]), name)
  globals()[name] = value
  return value


def __dir__():
  return sorted(_EXPORTS)
