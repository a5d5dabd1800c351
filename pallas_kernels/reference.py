"""Plain-JAX versions of every op, with the same semantics as the kernels.

``pallas_kernels.reference.flash_attention(...)`` equals
``pallas_kernels.flash_attention(..., backend="reference")``.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "flash_attention": "pallas_kernels.attention.reference",
    "quantize_int8": "pallas_kernels.int8.reference",
    "int8_matmul": "pallas_kernels.int8.reference",
    "giou": "pallas_kernels.giou.reference",
    "pairwise_giou": "pallas_kernels.giou.reference",
    "giou_loss": "pallas_kernels.giou.reference",
    "nms": "pallas_kernels.nms.reference",
    "batched_nms": "pallas_kernels.nms.reference",
}


def __getattr__(name):
  if name not in _EXPORTS:
    raise AttributeError(f"pallas_kernels.reference has no attribute {name!r}")
  value = getattr(importlib.import_module(_EXPORTS[name]), name)
  globals()[name] = value
  return value


def __dir__():
  return sorted(_EXPORTS)
