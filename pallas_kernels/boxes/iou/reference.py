"""Plain-JAX IoU-family ops with exactly the kernels' semantics (``_math``):
the ``backend="reference"`` implementation and the baseline the kernels are
measured against. Arithmetic in float32 (float64 for float64 inputs); results
in the inputs' floating dtype (float32 for integer boxes).
"""
from __future__ import annotations

import jax.numpy as jnp

from . import _math

DEFAULT_EPS = 1e-7


def result_dtype(*boxes):
  dtype = jnp.result_type(*boxes)
  return dtype if jnp.issubdtype(dtype, jnp.floating) else jnp.dtype(jnp.float32)


def compute_dtype(*boxes):
  return jnp.promote_types(result_dtype(*boxes), jnp.float32)


def _planes(boxes, dtype):
  boxes = jnp.asarray(boxes).astype(dtype)
  return tuple(boxes[..., c] for c in range(4))


def elementwise_score(kind, formula, eps, box_format, boxes1, boxes2):
  """Score of matching boxes, [..., 4] x [..., 4] -> [...] (compute dtype)."""
  dtype = compute_dtype(boxes1, boxes2)
  return _math.score_from_planes(kind, formula, eps, box_format,
                                 _planes(boxes1, dtype), _planes(boxes2, dtype))


def pairwise_score(kind, eps, box_format, boxes1, boxes2):
  """[..., N, 4] x [..., M, 4] -> [..., N, M] with torchvision's pairwise formulas."""
  dtype = compute_dtype(boxes1, boxes2)
  p1 = tuple(p[..., :, None] for p in _planes(boxes1, dtype))
  p2 = tuple(p[..., None, :] for p in _planes(boxes2, dtype))
  return _math.score_from_planes(kind, "pairwise", eps, box_format, p1, p2)


def reduce_loss(loss, reduction):
  if reduction == "sum":
    return jnp.sum(loss)
  if reduction == "mean":
    # torchvision returns 0 for an empty mean (0.0 * loss.sum()).
    return jnp.sum(loss) / max(loss.size, 1)
  return loss


def _elementwise(kind, formula, eps, box_format, boxes1, boxes2):
  out_dtype = result_dtype(boxes1, boxes2)
  shape = jnp.broadcast_shapes(jnp.shape(boxes1), jnp.shape(boxes2))
  boxes1 = jnp.broadcast_to(boxes1, shape)
  boxes2 = jnp.broadcast_to(boxes2, shape)
  return elementwise_score(kind, formula, eps, box_format, boxes1,
                           boxes2), out_dtype


def _metric(kind, boxes1, boxes2, eps, box_format):
  value, dtype = _elementwise(kind, "pairwise", eps, box_format, boxes1, boxes2)
  return value.astype(dtype)


def _loss(kind, pred, target, reduction, eps, box_format):
  value, dtype = _elementwise(kind, "loss", eps, box_format, pred, target)
  return reduce_loss(1.0 - value, reduction).astype(dtype)


def _pairwise(kind, boxes1, boxes2, eps, box_format):
  dtype = result_dtype(boxes1, boxes2)
  return pairwise_score(kind, eps, box_format, boxes1, boxes2).astype(dtype)


# Elementwise metrics: the diagonal of torchvision's pairwise functions.
def iou(boxes1, boxes2, *, box_format="xyxy"):
  return _metric("iou", boxes1, boxes2, 0.0, box_format)


def giou(boxes1, boxes2, *, box_format="xyxy"):
  return _metric("giou", boxes1, boxes2, 0.0, box_format)


def diou(boxes1, boxes2, *, eps=DEFAULT_EPS, box_format="xyxy"):
  return _metric("diou", boxes1, boxes2, eps, box_format)


def ciou(boxes1, boxes2, *, eps=DEFAULT_EPS, box_format="xyxy"):
  return _metric("ciou", boxes1, boxes2, eps, box_format)


# Pairwise matrices: torchvision's box_iou, generalized_box_iou, ...
def pairwise_iou(boxes1, boxes2, *, box_format="xyxy"):
  return _pairwise("iou", boxes1, boxes2, 0.0, box_format)


box_iou = pairwise_iou


def pairwise_giou(boxes1, boxes2, *, box_format="xyxy"):
  return _pairwise("giou", boxes1, boxes2, 0.0, box_format)


def pairwise_diou(boxes1, boxes2, *, eps=DEFAULT_EPS, box_format="xyxy"):
  return _pairwise("diou", boxes1, boxes2, eps, box_format)


def pairwise_ciou(boxes1, boxes2, *, eps=DEFAULT_EPS, box_format="xyxy"):
  return _pairwise("ciou", boxes1, boxes2, eps, box_format)


# Losses: torchvision's *_box_iou_loss (iou_loss = 1 - IoU with the same eps).
def iou_loss(pred, target, *, reduction="none", eps=DEFAULT_EPS,
             box_format="xyxy"):
  return _loss("iou", pred, target, reduction, eps, box_format)


def giou_loss(pred, target, *, reduction="none", eps=DEFAULT_EPS,
              box_format="xyxy"):
  return _loss("giou", pred, target, reduction, eps, box_format)


def diou_loss(pred, target, *, reduction="none", eps=DEFAULT_EPS,
              box_format="xyxy"):
  return _loss("diou", pred, target, reduction, eps, box_format)


def ciou_loss(pred, target, *, reduction="none", eps=DEFAULT_EPS,
              box_format="xyxy"):
  return _loss("ciou", pred, target, reduction, eps, box_format)
