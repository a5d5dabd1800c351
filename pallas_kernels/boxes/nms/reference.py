"""Pure-JAX greedy NMS with fixed shapes: the semantics every kernel matches
(``torchvision.ops.nms``'s, made total: empty and NaN boxes, NaN scores and
ties are defined). The IoU is computed with the kernels' float32 operations in
the same order, so indices agree exactly. Rules: docs/design/nms.md.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _compat

# Rows of the coordinate-plane layout shared by all implementations.
X1, Y1, X2, Y2, AREA = range(5)


def _inter_union(a, b):
  """Intersection and union areas of boxes given as (x1, y1, x2, y2, area)."""
  ax1, ay1, ax2, ay2, aarea = a
  bx1, by1, bx2, by2, barea = b
  iw = jnp.maximum(jnp.minimum(ax2, bx2) - jnp.maximum(ax1, bx1), 0.0)
  ih = jnp.maximum(jnp.minimum(ay2, by2) - jnp.maximum(ay1, by1), 0.0)
  inter = iw * ih
  return inter, (aarea + barea) - inter


def iou_exceeds(a, b, iou_threshold, div=None):
  """Whether IoU(a, b) > iou_threshold; ``a``, ``b`` are (x1, y1, x2, y2, area).
  The one IoU formula of the package: kernels call it on their tiles so every
  backend rounds identically. ``div`` lets a kernel supply a correctly rounded
  division where its platform's ``/`` is approximate."""
  inter, union = _inter_union(a, b)
  iou = inter / union if div is None else div(inter, union)
  return iou > iou_threshold


def box_areas(boxes):
  """Areas with inverted extents clamped to zero (float32)."""
  w = jnp.maximum(boxes[..., 2] - boxes[..., 0], 0.0)
  h = jnp.maximum(boxes[..., 3] - boxes[..., 1], 0.0)
  return w * h


def sort_by_score(scores, score_threshold=None):
  """Stable descending-score order and, in that order, which boxes may be kept.
  Unkeepable boxes (NaN score, score <= score_threshold) sort last."""
  scores = scores.astype(jnp.float32)
  valid = ~jnp.isnan(scores)
  if score_threshold is not None:
    valid = valid & (scores > score_threshold)
  # "+ 0.0" turns -0.0 into +0.0 so that 0.0 and -0.0 scores tie.
  key = jnp.where(valid, -scores + 0.0, jnp.inf)
  order = jnp.argsort(key, stable=True).astype(jnp.int32)
  return order, valid[order]


def sorted_planes(boxes, order):
  """[5, N] float32 rows x1, y1, x2, y2, area of the boxes in ``order``."""
  boxes = boxes.astype(jnp.float32)[order]
  return jnp.stack([boxes[:, 0], boxes[:, 1], boxes[:, 2], boxes[:, 3],
                    box_areas(boxes)])


def keep_to_indices(keep, order, max_output_size):
  """Kept sorted positions -> (original indices padded with -1, count)."""
  keep = keep.astype(jnp.int32)
  slot = jnp.cumsum(keep) - 1
  count = jnp.minimum(jnp.sum(keep), max_output_size).astype(jnp.int32)
  target = jnp.where((keep > 0) & (slot < max_output_size), slot,
                     max_output_size)
  out = jnp.full((max_output_size,), -1, jnp.int32)
  out = out.at[target].set(order, mode="drop")
  return out, count


def greedy_keep(planes, classes, valid, iou_threshold, max_output_size):
  """Keep mask over sorted positions: one while-loop step per kept box."""

  def cond(state):
    alive, _, count = state
    return (count < max_output_size) & jnp.any(alive)

  def body(state):
    alive, keep, count = state
    i = jnp.argmax(alive)
    kept = tuple(planes[r, i] for r in range(5))
    suppress = iou_exceeds(kept, tuple(planes[r] for r in range(5)),
                           iou_threshold) & (classes == classes[i])
    alive = alive & ~suppress
    alive = alive.at[i].set(False)
    return alive, keep.at[i].set(True), count + 1

  # All False, typed like valid: inside shard_map(check_vma=True) the loop
  # carry varies over the axes the scores vary over.
  keep = valid & False
  _, keep, _ = jax.lax.while_loop(cond, body, (valid, keep, jnp.int32(0)))
  return keep


@functools.partial(jax.jit, static_argnames=(
    "iou_threshold", "max_output_size", "score_threshold"))
def nms(boxes, scores, *, iou_threshold, max_output_size,
        score_threshold=None, class_ids=None):
  """Greedy NMS of one image: (indices int32 [max_output_size], num_valid)."""
  n = scores.shape[0]
  if n == 0 or max_output_size == 0:
    return (jnp.full((max_output_size,), -1, jnp.int32), jnp.int32(0))
  order, valid = sort_by_score(scores, score_threshold)
  planes = sorted_planes(boxes, order)
  classes = (jnp.zeros((n,), jnp.int32) if class_ids is None
             else class_ids.astype(jnp.int32)[order])
  keep = greedy_keep(planes, classes, valid, iou_threshold, max_output_size)
  return keep_to_indices(keep, order, max_output_size)


@functools.partial(jax.jit, static_argnames=(
    "iou_threshold", "max_output_size", "score_threshold"))
def batched_nms(boxes, scores, *, iou_threshold, max_output_size,
                score_threshold=None, class_ids=None):
  """NMS of each image: ([B, max_output_size] int32, [B] int32)."""
  one = functools.partial(nms, iou_threshold=iou_threshold,
                          max_output_size=max_output_size,
                          score_threshold=score_threshold)
  if class_ids is None:
    return jax.vmap(lambda b, s: one(b, s))(boxes, scores)
  return jax.vmap(lambda b, s, c: one(b, s, class_ids=c))(
      boxes, scores, class_ids)


def soft_nms_decay(iou, method, sigma, iou_threshold):
  """Score multiplier of soft-NMS for a box overlapping a kept one by ``iou``."""
  if method == "linear":
    return jnp.where(iou > iou_threshold, 1.0 - iou, 1.0)
  return jnp.exp(-(iou * iou) / sigma)


def _pair_iou(a, b):
  inter, union = _inter_union(a, b)
  return jnp.where(union > 0, inter / jnp.where(union > 0, union, 1.0), 0.0)


@functools.partial(jax.jit, static_argnames=(
    "max_output_size", "method", "sigma", "iou_threshold", "score_threshold"))
def soft_nms(boxes, scores, *, max_output_size, method="gaussian", sigma=0.5,
             iou_threshold=0.3, score_threshold=0.001, class_ids=None):
  """Soft-NMS (Bodla et al. 2017): decay overlapping scores instead of dropping.

  Repeatedly picks the remaining box with the highest current score (ties:
  lower index), records it with that score, and multiplies every other
  remaining box's score by ``exp(-iou**2 / sigma)`` ("gaussian") or by
  ``1 - iou`` where ``iou > iou_threshold`` ("linear"). Stops after
  ``max_output_size`` picks or when no remaining score exceeds
  ``score_threshold``. Returns (indices [M] padded -1, decayed scores [M]
  padded 0, count).
  """
  n = scores.shape[0]
  scores = scores.astype(jnp.float32)
  if n == 0 or max_output_size == 0:
    return (jnp.full((max_output_size,), -1, jnp.int32),
            jnp.zeros((max_output_size,), jnp.float32), jnp.int32(0))
  boxes = boxes.astype(jnp.float32)
  planes = tuple(boxes[:, c] for c in range(4)) + (box_areas(boxes),)
  classes = (jnp.zeros((n,), jnp.int32) if class_ids is None
             else class_ids.astype(jnp.int32))
  current = jnp.where(jnp.isnan(scores), -jnp.inf, scores)
  remaining = current > score_threshold

  def cond(state):
    remaining, current, _, _, count = state
    return (count < max_output_size) & jnp.any(remaining)

  def body(state):
    remaining, current, out_idx, out_score, count = state
    i = jnp.argmax(jnp.where(remaining, current, -jnp.inf))
    out_idx = out_idx.at[count].set(i.astype(jnp.int32))
    out_score = out_score.at[count].set(current[i])
    iou = _pair_iou(tuple(p[i] for p in planes), planes)
    decay = soft_nms_decay(iou, method, sigma, iou_threshold)
    decay = jnp.where(classes == classes[i], decay, 1.0)
    current = current * decay
    remaining = remaining.at[i].set(False) & (current > score_threshold)
    return remaining, current, out_idx, out_score, count + 1

  # Typed like the scores: inside shard_map(check_vma=True) the loop carry
  # varies over the axes they vary over.
  like = lambda x: _compat.make_varying(x, _compat.varying_axes(current))
  out_idx = like(jnp.full((max_output_size,), -1, jnp.int32))
  out_score = like(jnp.zeros((max_output_size,), jnp.float32))
  _, _, out_idx, out_score, count = jax.lax.while_loop(
      cond, body, (remaining, current, out_idx, out_score, jnp.int32(0)))
  return out_idx, out_score, count
