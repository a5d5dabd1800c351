"""The IoU-family formulas, written once for coordinate planes: every kernel
and the reference evaluate the same ``score``. Two formula sets, as in
torchvision: "pairwise" (``box_iou`` and kin) and "loss" (``*_box_iou_loss``,
eps in the denominators). Where torchvision divides by zero (NaN/Inf), the
quotient is 0 (``safe_div``), so values and gradients stay finite.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels import _cost

KINDS = ("iou", "giou", "diou", "ciou")
BOX_FORMATS = ("xyxy", "cxcywh")

_HALF_PI = math.pi / 2
_QUARTER_PI = math.pi / 4
_TAN_3PI_8 = 2.414213562373095
_TAN_PI_8 = 0.4142135623730951


def safe_div(num, den):
  """num / den, defined as 0 where den == 0 (finite gradient there too)."""
  zero = den == 0
  return jnp.where(zero, jnp.zeros_like(num),
                   num / jnp.where(zero, 1.0, den))


def atan(x):
  """float32 arctangent from elementwise ops only (Mosaic and Triton lower it).
  Cephes-style range reduction to |x| <= tan(pi/8) and an odd polynomial; error
  below 2 ulp in float32. float64 (reference only) uses jnp.arctan."""
  if x.dtype == jnp.float64:
    return jnp.arctan(x)
  ax = jnp.abs(x)
  big = ax > _TAN_3PI_8
  mid = jnp.logical_and(ax > _TAN_PI_8, jnp.logical_not(big))
  # Safe denominators keep the unused branches finite (and their gradients).
  reduced = jnp.where(
      big, -1.0 / jnp.where(big, ax, 1.0),
      jnp.where(mid, (ax - 1.0) / (ax + 1.0), ax))
  offset = jnp.where(big, _HALF_PI, jnp.where(mid, _QUARTER_PI, 0.0))
  z = reduced * reduced
  poly = (((8.05374449538e-2 * z - 1.38776856032e-1) * z
           + 1.99777106478e-1) * z - 3.33329491539e-1) * z * reduced + reduced
  result = offset + poly
  return jnp.where(x < 0, -result, result)


def aspect_angle(w, h):
  """atan(w / h) as torch computes it, finite where torch gives NaN."""
  flat = h == 0
  sign_w = jnp.where(w > 0, 1.0, jnp.where(w < 0, -1.0, 0.0))
  ratio = w / jnp.where(flat, 1.0, h)
  return jnp.where(flat, sign_w * _HALF_PI, atan(ratio))


def to_xyxy(box_format, a, b, c, d):
  """Four coordinate planes in ``box_format`` -> (x1, y1, x2, y2)."""
  if box_format == "xyxy":
    return a, b, c, d
  half_w, half_h = c * 0.5, d * 0.5
  return a - half_w, b - half_h, a + half_w, b + half_h


def box_terms(kind, box):
  """The parts of ``score`` that depend on one box only: (width, height,
  area, centre x, centre y, aspect angle), None where ``kind`` needs none.
  Pairwise kernels compute them once per box instead of once per pair."""
  x1, y1, x2, y2 = box
  w, h = x2 - x1, y2 - y1
  centre = kind in ("diou", "ciou")
  return (w, h, w * h, (x1 + x2) * 0.5 if centre else None,
          (y1 + y2) * 0.5 if centre else None,
          aspect_angle(w, h) if kind == "ciou" else None)


def score(kind, formula, eps, box1, box2, terms1=None, terms2=None):
  """IoU / GIoU / DIoU / CIoU of matching elements of two box sets. box1, box2:
  (x1, y1, x2, y2) tuples of broadcast-compatible float arrays; ``terms1``,
  ``terms2``: their ``box_terms`` if computed already. The loss is
  ``1 - score`` for every kind (torchvision's losses)."""
  x1, y1, x2, y2 = box1
  u1, v1, u2, v2 = box2
  loss = formula == "loss"
  _, _, area1, cx1, cy1, angle1 = terms1 or box_terms(kind, box1)
  _, _, area2, cx2, cy2, angle2 = terms2 or box_terms(kind, box2)
  inter_w = jnp.maximum(jnp.minimum(x2, u2) - jnp.maximum(x1, u1), 0.0)
  inter_h = jnp.maximum(jnp.minimum(y2, v2) - jnp.maximum(y1, v1), 0.0)
  inter = inter_w * inter_h
  union = area1 + area2 - inter
  iou = safe_div(inter, union + eps if loss else union)
  if kind == "iou":
    return iou
  hull_w = jnp.maximum(x2, u2) - jnp.minimum(x1, u1)
  hull_h = jnp.maximum(y2, v2) - jnp.minimum(y1, v1)
  if not loss:
    hull_w = jnp.maximum(hull_w, 0.0)
    hull_h = jnp.maximum(hull_h, 0.0)
  if kind == "giou":
    hull_area = hull_w * hull_h
    return iou - safe_div(hull_area - union,
                          hull_area + eps if loss else hull_area)
  diagonal_sq = hull_w * hull_w + hull_h * hull_h + eps
  dx = cx1 - cx2
  dy = cy1 - cy2
  diou = iou - safe_div(dx * dx + dy * dy, diagonal_sq)
  if kind == "diou":
    return diou
  angle_diff = angle1 - angle2
  v = (4.0 / (math.pi ** 2)) * angle_diff * angle_diff
  alpha = jax.lax.stop_gradient(safe_div(v, 1.0 - iou + v + eps))
  return diou - alpha * v


def pairwise_score_lean(kind, box1, box2, terms1=None, terms2=None,
                        eps=0.0):
  """``score(kind, "pairwise", eps, box1, box2, terms1, terms2)`` in fewer
  elementwise operations, for the pairwise kernels (whose time is set by
  operations per pair, not bytes): a quotient with a zero denominator is
  replaced by 0 after dividing (one select instead of two); with eps > 0
  CIoU's two penalties share one division (both denominators are >= eps).
  IoU and GIoU equal ``score`` bit for bit, DIoU and CIoU to float32
  rounding. Forward only (the quotients are not safe to differentiate).
  """
  x1, y1, x2, y2 = box1
  u1, v1, u2, v2 = box2

  def quotient(num, den):
    return jnp.where(den == 0, 0.0, num / den)

  _, _, area1, cx1, cy1, angle1 = terms1 or box_terms(kind, box1)
  _, _, area2, cx2, cy2, angle2 = terms2 or box_terms(kind, box2)
  inter_w = jnp.maximum(jnp.minimum(x2, u2) - jnp.maximum(x1, u1), 0.0)
  inter_h = jnp.maximum(jnp.minimum(y2, v2) - jnp.maximum(y1, v1), 0.0)
  inter = inter_w * inter_h
  union = (area1 + area2) - inter
  iou = quotient(inter, union)
  if kind == "iou":
    return iou
  hull_w = jnp.maximum(jnp.maximum(x2, u2) - jnp.minimum(x1, u1), 0.0)
  hull_h = jnp.maximum(jnp.maximum(y2, v2) - jnp.minimum(y1, v1), 0.0)
  if kind == "giou":
    hull = hull_w * hull_h
    return iou - quotient(hull - union, hull)
  diagonal_sq = hull_w * hull_w + hull_h * hull_h + eps
  dx, dy = cx1 - cx2, cy1 - cy2
  distance_sq = dx * dx + dy * dy
  if kind == "diou":
    return iou - quotient(distance_sq, diagonal_sq)
  angle_diff = angle1 - angle2
  v = (4.0 / (math.pi ** 2)) * angle_diff * angle_diff
  den = 1.0 - iou + v + eps
  if eps == 0:
    return iou - quotient(distance_sq, diagonal_sq) - quotient(v * v, den)
  # distance / diagonal + v^2 / den over one division; den == 0 (possible
  # for inverted boxes) drops the aspect penalty as ``score`` does.
  flat = den == 0
  den = jnp.where(flat, 1.0, den)
  v_sq = jnp.where(flat, 0.0, v * v)
  return iou - (distance_sq * den + v_sq * diagonal_sq) / (diagonal_sq * den)


def score_from_planes(kind, formula, eps, box_format, planes1, planes2):
  """``score`` on coordinate planes given in ``box_format``."""
  return score(kind, formula, eps, to_xyxy(box_format, *planes1),
               to_xyxy(box_format, *planes2))


def score_vjp(kind, formula, eps, box_format, planes1, planes2, cotangent):
  """(d planes1, d planes2) of sum(cotangent * score): 8 closed-form planes.
  jax.vjp here runs at trace time and emits elementwise ops only, so inside a
  kernel this is the analytic derivative evaluated in the same pass."""
  def fn(p1, p2):
    return score_from_planes(kind, formula, eps, box_format, p1, p2)
  _, pullback = jax.vjp(fn, tuple(planes1), tuple(planes2))
  grads1, grads2 = pullback(cotangent)
  return grads1, grads2


@functools.lru_cache(maxsize=None)
def ops_per_box(kind, formula, eps, box_format, backward=False):
  """(flops, transcendentals) per box of the forward score, or of its
  gradient (``score_vjp``), counted from the formula's jaxpr."""
  if backward:
    def fn(*v):
      return score_vjp(kind, formula, eps, box_format, v[0:4], v[4:8], v[8])
    return _cost.scalar_ops(fn, 9)

  def fn(*v):
    return score_from_planes(kind, formula, eps, box_format, v[0:4], v[4:8])
  return _cost.scalar_ops(fn, 8)


@functools.lru_cache(maxsize=None)
def ops_per_pair(kind, eps):
  """(flops, transcendentals) per pair of the pairwise kernel's formula."""
  def fn(*v):
    if kind in ("iou", "giou"):
      return pairwise_score_lean(kind, v[0:4], v[4:8])
    return score(kind, "pairwise", eps, v[0:4], v[4:8])
  return _cost.scalar_ops(fn, 8)
