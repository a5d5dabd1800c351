"""IoU-family box ops (IoU, GIoU, DIoU, CIoU): elementwise, pairwise, losses.

Semantics follow torchvision.ops (see ``api`` and ``_math`` for the exact
formulas and the values defined where torchvision divides by zero).
Kernels: ``mosaic_tpu`` (lane-dense coordinate planes, a free view of XLA's
TPU layout for ``[P, 4]``), ``triton`` (Triton-lowered Pallas); ``reference``
is plain JAX.
"""
from .api import (  # noqa: F401
    box_iou, ciou, ciou_loss, diou, diou_loss, giou, giou_loss, iou, iou_loss,
    pairwise_ciou, pairwise_diou, pairwise_giou, pairwise_iou)

__all__ = [
    "box_iou", "ciou", "ciou_loss", "diou", "diou_loss", "giou", "giou_loss",
    "iou", "iou_loss", "pairwise_ciou", "pairwise_diou", "pairwise_giou",
    "pairwise_iou",
]

