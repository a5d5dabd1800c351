"""Decode attention: split-KV (flash-decoding) kernels over contiguous and
paged KV caches, Mosaic TPU and Triton, plus a JAX reference.

    from pallas_kernels import decode_attention
"""
from __future__ import annotations

import importlib

_EXPORTS = {"decode_attention": "pallas_kernels.decode.api"}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
  if name not in _EXPORTS:
    raise AttributeError(
        f"module 'pallas_kernels.decode' has no attribute {name!r}")
  value = getattr(importlib.import_module(_EXPORTS[name]), name)
  globals()[name] = value
  return value
