"""Plain-JAX versions of every op, with the same semantics as the kernels.

``pallas_kernels.reference.flash_attention(...)`` equals
``pallas_kernels.flash_attention(..., backend="reference")``.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "flash_attention": "pallas_kernels.attention.reference",
    "decode_attention": "pallas_kernels.decode.reference",
    "quantize_int8": "pallas_kernels.int8.reference",
    "int8_matmul": "pallas_kernels.int8.reference",
    "quantize": "pallas_kernels.quant.reference",
    "quantized_matmul": "pallas_kernels.quant.reference",
    "iou": "pallas_kernels.boxes.iou.reference",
    "giou": "pallas_kernels.boxes.iou.reference",
    "diou": "pallas_kernels.boxes.iou.reference",
    "ciou": "pallas_kernels.boxes.iou.reference",
    "box_iou": "pallas_kernels.boxes.iou.reference",
    "pairwise_iou": "pallas_kernels.boxes.iou.reference",
    "pairwise_giou": "pallas_kernels.boxes.iou.reference",
    "pairwise_diou": "pallas_kernels.boxes.iou.reference",
    "pairwise_ciou": "pallas_kernels.boxes.iou.reference",
    "iou_loss": "pallas_kernels.boxes.iou.reference",
    "giou_loss": "pallas_kernels.boxes.iou.reference",
    "diou_loss": "pallas_kernels.boxes.iou.reference",
    "ciou_loss": "pallas_kernels.boxes.iou.reference",
    "nms": "pallas_kernels.boxes.nms.reference",
    "batched_nms": "pallas_kernels.boxes.nms.reference",
    "soft_nms": "pallas_kernels.boxes.nms.reference",
    "grouped_matmul": "pallas_kernels.gmm.reference",
    "ragged_paged_attention": "pallas_kernels.ragged.reference",
    "mla_ragged_paged_attention": "pallas_kernels.ragged.reference",
    "write_kv_pages": "pallas_kernels.ragged.reference",
}


def __getattr__(name):
  if name not in _EXPORTS:
    raise AttributeError(f"pallas_kernels.reference has no attribute {name!r}")
  value = getattr(importlib.import_module(_EXPORTS[name]), name)
  globals()[name] = value
  return value


def __dir__():
  return sorted(_EXPORTS)
