"""IoU-family box ops (IoU, GIoU, DIoU, CIoU): elementwise, pairwise, losses.

Semantics follow torchvision.ops (see ``api`` and ``_math`` for the exact
formulas and the values defined where torchvision divides by zero).
Kernels: ``mosaic_tpu`` (lane-dense coordinate planes, a free view of XLA's
TPU layout for ``[P, 4]``), ``gpu`` (Triton-lowered Pallas); ``reference``
is plain JAX.
"""
import sys
import types

from .api import (  # noqa: F401
    box_iou, ciou, ciou_loss, diou, diou_loss, giou, giou_loss, iou, iou_loss,
    pairwise_ciou, pairwise_diou, pairwise_giou, pairwise_iou)

__all__ = [
    "box_iou", "ciou", "ciou_loss", "diou", "diou_loss", "giou", "giou_loss",
    "iou", "iou_loss", "pairwise_ciou", "pairwise_diou", "pairwise_giou",
    "pairwise_iou",
]


class _CallableFamilyModule(types.ModuleType):
  """``pallas_kernels.giou`` is both this package and the op ``giou``.

  Importing the package binds the name ``giou`` on ``pallas_kernels`` to the
  module, shadowing the lazily exported function; calling the module calls
  the op, so ``pallas_kernels.giou(boxes1, boxes2)`` works either way.
  Drop this once the family package is renamed (imports inside the package
  are relative, so a rename needs no edits here).
  """

  def __call__(self, boxes1, boxes2, **kwargs):
    return giou(boxes1, boxes2, **kwargs)


sys.modules[__name__].__class__ = _CallableFamilyModule
