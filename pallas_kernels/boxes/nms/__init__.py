"""Greedy non-maximum suppression: blocked on-chip kernels for TPU and GPU.

``nms`` (one image), ``batched_nms`` (many images, optionally class-aware)
and ``soft_nms`` (reference only). See ``reference`` for the semantics,
``mosaic_tpu`` and ``triton`` for the algorithms.
"""
from .api import batched_nms, nms, shard_batched_nms, soft_nms

__all__ = ["nms", "batched_nms", "shard_batched_nms", "soft_nms"]

