"""Greedy non-maximum suppression: ``nms``, ``batched_nms`` (optionally
class-aware) and ``soft_nms`` (reference only), with blocked on-chip kernels
for TPU and GPU.
"""
from .api import batched_nms, nms, shard_batched_nms, soft_nms

__all__ = ["nms", "batched_nms", "shard_batched_nms", "soft_nms"]

