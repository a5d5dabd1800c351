"""IoU-family box ops (IoU, GIoU, DIoU, CIoU): elementwise, pairwise, losses,
with torchvision's semantics (``_math`` defines the values where torchvision
divides by zero). Kernels: ``mosaic_tpu``, ``triton``; ``reference`` is plain
JAX.
"""
from .api import (  # noqa: F401
    box_iou, ciou, ciou_loss, diou, diou_loss, giou, giou_loss, iou, iou_loss,
    pairwise_ciou, pairwise_diou, pairwise_giou, pairwise_iou)

__all__ = [
    "box_iou", "ciou", "ciou_loss", "diou", "diou_loss", "giou", "giou_loss",
    "iou", "iou_loss", "pairwise_ciou", "pairwise_diou", "pairwise_giou",
    "pairwise_iou",
]

