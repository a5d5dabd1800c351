"""Float64 and exact numpy oracles for the box ops, independent of
pallas_kernels (numpy alone, written from the documented semantics).

IoU family: torchvision's formulas (``torchvision.ops.boxes`` and the
``*_box_iou_loss`` modules) in float64, NaN / Inf wherever torchvision gives
them, so compare where the oracle is finite. ``formula="pairwise"`` is
``box_iou`` / ``generalized_box_iou`` / ``distance_box_iou`` /
``complete_box_iou`` (no eps in IoU and GIoU, enclosing box clamped at 0),
``formula="loss"`` the losses' (IoU = inter / (union + eps), enclosing box
not clamped). CIoU's alpha is a constant for gradients (torchvision computes
it under ``no_grad``). Gradients are central differences in float64.

Greedy NMS: exact. IoU in float32 in the documented order (area = clamped
width * height; inter = clamped width * height; union = (area_a + area_b) -
inter; IoU = inter / union, NaN for 0 / 0, which suppresses nothing), a box
suppressed when its IoU with a kept box of its class is > threshold (float32);
boxes by descending score, ties by lower index (a stable sort of -score,
-0.0 equal to 0.0, subnormals to 0); NaN scores and scores <=
score_threshold never kept.
"""
from __future__ import annotations

import math

import numpy as np

KINDS = ("iou", "giou", "diou", "ciou")
EPS = 1e-7
STEP = 1e-5  # central differences: error ~ STEP**2, roundoff ~ 1e-16 / STEP


# ------------------------------------------------------------- IoU family
def to_xyxy(boxes, box_format="xyxy"):
  boxes = np.asarray(boxes, np.float64)
  if box_format == "xyxy":
    return boxes
  centre, size = boxes[..., :2], boxes[..., 2:]
  return np.concatenate([centre - size / 2, centre + size / 2], axis=-1)


def from_xyxy(boxes, box_format):
  boxes = np.asarray(boxes)
  if box_format == "xyxy":
    return boxes
  return np.concatenate([(boxes[..., :2] + boxes[..., 2:]) / 2,
                         boxes[..., 2:] - boxes[..., :2]], axis=-1)


def _aspect_term(w1, h1, w2, h2):
  return 4 / math.pi ** 2 * (np.arctan(w2 / h2) - np.arctan(w1 / h1)) ** 2


def _score(kind, formula, b1, b2, eps, alpha=None):
  """Elementwise score of xyxy float64 boxes [..., 4] (broadcasting)."""
  x1, y1, x2, y2 = np.moveaxis(b1, -1, 0)
  u1, v1, u2, v2 = np.moveaxis(b2, -1, 0)
  w1, h1, w2, h2 = x2 - x1, y2 - y1, u2 - u1, v2 - v1
  loss = formula == "loss"
  with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
    iw = np.minimum(x2, u2) - np.maximum(x1, u1)
    ih = np.minimum(y2, v2) - np.maximum(y1, v1)
    if loss:  # torchvision's _loss_inter_union
      inter = np.where((iw > 0) & (ih > 0), iw * ih, 0.0)
    else:
      inter = np.clip(iw, 0, None) * np.clip(ih, 0, None)
    union = w1 * h1 + w2 * h2 - inter
    iou = inter / (union + eps) if loss else inter / union
    if kind == "iou":
      return iou
    hull_w = np.maximum(x2, u2) - np.minimum(x1, u1)
    hull_h = np.maximum(y2, v2) - np.minimum(y1, v1)
    if not loss:
      hull_w, hull_h = np.clip(hull_w, 0, None), np.clip(hull_h, 0, None)
    if kind == "giou":
      hull = hull_w * hull_h
      return iou - (hull - union) / (hull + eps if loss else hull)
    diagonal = hull_w ** 2 + hull_h ** 2 + eps
    distance = (((x1 + x2) - (u1 + u2)) / 2) ** 2 + (((y1 + y2) - (v1 + v2))
                                                     / 2) ** 2
    diou = iou - distance / diagonal
    if kind == "diou":
      return diou
    v = _aspect_term(w1, h1, w2, h2)
    if alpha is None:
      alpha = v / (1 - iou + v + eps)
    return diou - alpha * v


def score(kind, boxes1, boxes2, *, formula="pairwise", eps=EPS,
          box_format="xyxy"):
  """Score of matching boxes [..., 4] x [..., 4] -> [...] (float64)."""
  return _score(kind, formula, to_xyxy(boxes1, box_format),
                to_xyxy(boxes2, box_format), eps)


def pairwise(kind, boxes1, boxes2, *, eps=EPS, box_format="xyxy"):
  """[..., N, 4] x [..., M, 4] -> [..., N, M] (leading dims broadcast)."""
  b1 = to_xyxy(boxes1, box_format)[..., :, None, :]
  b2 = to_xyxy(boxes2, box_format)[..., None, :, :]
  return _score(kind, "pairwise", b1, b2, eps)


def reduce(values, reduction):
  """torchvision's loss reductions (the mean of nothing is 0)."""
  values = np.asarray(values, np.float64)
  if reduction == "sum":
    return values.sum()
  if reduction == "mean":
    return values.mean() if values.size else 0.0
  return values


def loss(kind, pred, target, *, reduction="none", eps=EPS,
         box_format="xyxy"):
  """torchvision's *_box_iou_loss: 1 - score with the loss formulas."""
  return reduce(1.0 - score(kind, pred, target, formula="loss", eps=eps,
                            box_format=box_format), reduction)


def score_grads(kind, boxes1, boxes2, cotangent, *, formula="pairwise",
                eps=EPS, box_format="xyxy"):
  """d/d(boxes1, boxes2) of sum(cotangent * score) for matching boxes
  [P, 4] (central differences; CIoU's alpha held constant)."""
  b1 = np.asarray(boxes1, np.float64)
  b2 = np.asarray(boxes2, np.float64)
  cot = np.broadcast_to(np.asarray(cotangent, np.float64), b1.shape[:-1])
  alpha = None
  if kind == "ciou":  # the CIoU trade-off weight of the unperturbed boxes
    x1, x2 = to_xyxy(b1, box_format), to_xyxy(b2, box_format)
    iou = _score("iou", formula, x1, x2, eps)
    v = _aspect_term(x1[..., 2] - x1[..., 0], x1[..., 3] - x1[..., 1],
                     x2[..., 2] - x2[..., 0], x2[..., 3] - x2[..., 1])
    alpha = v / (1 - iou + v + eps)

  def value(p1, p2):
    return _score(kind, formula, to_xyxy(p1, box_format),
                  to_xyxy(p2, box_format), eps, alpha)

  grads = []
  for which in (0, 1):
    grad = np.zeros_like(b1 if which == 0 else b2)
    for c in range(4):
      step = np.zeros(4)
      step[c] = STEP
      args_plus, args_minus = [b1, b2], [b1, b2]
      args_plus[which] = args_plus[which] + step
      args_minus[which] = args_minus[which] - step
      grad[..., c] = cot * (value(*args_plus) - value(*args_minus)) / (
          2 * STEP)
    grads.append(grad)
  return grads


def loss_grads(kind, pred, target, cotangent=1.0, *, reduction="none",
               eps=EPS, box_format="xyxy"):
  """d/d(pred, target) of the reduced loss times ``cotangent`` (a [P]
  array for reduction="none", else a number)."""
  scale = np.asarray(cotangent, np.float64)
  if reduction == "mean":
    scale = scale / max(np.asarray(pred).shape[0], 1)
  return score_grads(kind, pred, target, -scale, formula="loss", eps=eps,
                     box_format=box_format)


# -------------------------------------------------------------------- NMS
def _iou_f32(box, boxes):
  """IoU of one box with many in float32, in the documented order."""
  def area(b):
    return (np.maximum(b[..., 2] - b[..., 0], np.float32(0))
            * np.maximum(b[..., 3] - b[..., 1], np.float32(0)))
  iw = np.maximum(np.minimum(box[2], boxes[:, 2])
                  - np.maximum(box[0], boxes[:, 0]), np.float32(0))
  ih = np.maximum(np.minimum(box[3], boxes[:, 3])
                  - np.maximum(box[1], boxes[:, 1]), np.float32(0))
  inter = iw * ih
  with np.errstate(invalid="ignore", divide="ignore"):
    return inter / ((area(box) + area(boxes)) - inter)


def iou64(box, boxes):
  """float64 IoU of one box with many; 0 where the union is 0."""
  box, boxes = np.asarray(box, np.float64), np.asarray(boxes, np.float64)
  iw = np.clip(np.minimum(box[2], boxes[:, 2])
               - np.maximum(box[0], boxes[:, 0]), 0, None)
  ih = np.clip(np.minimum(box[3], boxes[:, 3])
               - np.maximum(box[1], boxes[:, 1]), 0, None)
  inter = iw * ih
  area = lambda b: (np.clip(b[..., 2] - b[..., 0], 0, None)  # noqa: E731
                    * np.clip(b[..., 3] - b[..., 1], 0, None))
  union = area(box) + area(boxes) - inter
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)


def score_order(scores, score_threshold=None):
  """(order, keepable): stable descending score, unkeepable boxes last.

  Subnormal scores count as 0: XLA flushes them on every platform.
  """
  scores = np.asarray(scores, np.float32)
  scores = np.where(np.abs(scores) < np.finfo(np.float32).tiny,
                    np.float32(0), scores)
  keepable = ~np.isnan(scores)
  if score_threshold is not None:
    keepable &= scores > np.float32(score_threshold)
  key = np.where(keepable, -scores + np.float32(0), np.float32(np.inf))
  return np.argsort(key, kind="stable"), keepable


def nms(boxes, scores, iou_threshold, max_output_size, *,
        score_threshold=None, class_ids=None):
  """Greedy NMS of one image.

  Returns (indices int32 [max_output_size] padded with -1, count, close):
  ``close`` says whether some decision had a float64 IoU within 1e-6 of the
  threshold, where a float32 computation that fused a multiply-add (as XLA
  may) could round the other way.
  """
  boxes = np.asarray(boxes, np.float32)
  n = boxes.shape[0]
  classes = (np.zeros(n, np.int64) if class_ids is None
             else np.asarray(class_ids, np.int64))
  order, alive = score_order(scores, score_threshold)
  threshold = np.float32(iou_threshold)
  kept, close = [], False
  for i in order:
    if len(kept) == max_output_size:
      break
    if not alive[i]:
      continue
    kept.append(int(i))
    alive[i] = False
    rivals = alive & (classes == classes[i])
    with np.errstate(invalid="ignore"):
      close |= bool(np.any(rivals & (np.abs(iou64(boxes[i], boxes)
                                            - iou_threshold) <= 1e-6)))
      alive &= ~(rivals & (_iou_f32(boxes[i], boxes) > threshold))
  out = np.full(max_output_size, -1, np.int32)
  out[:len(kept)] = kept
  return out, len(kept), close


def soft_nms(boxes, scores, max_output_size, *, method, sigma,
             iou_threshold, score_threshold):
  """Soft-NMS in float64: (indices, decayed scores) of the picks in order."""
  boxes = np.asarray(boxes, np.float64)
  current = np.where(np.isnan(scores), -np.inf, np.asarray(scores,
                                                           np.float64))
  remaining = current > score_threshold
  picked, picked_scores = [], []
  while remaining.any() and len(picked) < max_output_size:
    i = int(np.argmax(np.where(remaining, current, -np.inf)))
    picked.append(i)
    picked_scores.append(current[i])
    iou = iou64(boxes[i], boxes)
    if method == "linear":
      current = current * np.where(iou > iou_threshold, 1 - iou, 1)
    else:
      current = current * np.exp(-iou ** 2 / sigma)
    remaining[i] = False
    remaining &= current > score_threshold
  return np.asarray(picked, np.int64), np.asarray(picked_scores)
