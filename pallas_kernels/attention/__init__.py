"""Flash attention: Mosaic TPU, Mosaic GPU and Triton kernels plus a JAX
reference (``flash_attention``, ``shard_flash_attention``). Names load on first
use, so importing ``reference`` does not import the API.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "flash_attention": "pallas_kernels.attention.api",
    "shard_flash_attention": "pallas_kernels.attention.sharded",
    "BlockSizes": "pallas_kernels.attention.block_sizes",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
  if name not in _EXPORTS:
    raise AttributeError(
        f"module 'pallas_kernels.attention' has no attribute {name!r}")
  value = getattr(importlib.import_module(_EXPORTS[name]), name)
  globals()[name] = value
  return value
