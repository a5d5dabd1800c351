"""The IoU family: matching, pairwise and loss box metrics."""
from __future__ import annotations

import functools

import torch

from torch_bridge import _shards
from torch_bridge._core import JaxOp
from torch_bridge.ops._common import (
    _BOX_DTYPES, _as_float_boxes, _check_devices, _check_tensor, _sharding,
    _widened)


# pallas_kernels.boxes.iou's DEFAULT_EPS (not imported: that would load JAX
# at ``import torch_bridge.ops``); tests/torch/test_torch_boxes.py checks it.
_EPS = 1e-7
_KINDS = ("iou", "giou", "diou", "ciou")
_REDUCTIONS = ("none", "mean", "sum")


def _box_jax(b1, b2, *, fn_name, **static):
  import pallas_kernels
  return getattr(pallas_kernels, fn_name)(b1, b2, **static)


def _broadcast_shape(op, names, b1, b2, keep=1):
  """Broadcast shape of two box arrays' leading dims (all but ``keep``)."""
  try:
    return tuple(torch.broadcast_shapes(b1.shape[:b1.dim() - keep],
                                        b2.shape[:b2.dim() - keep]))
  except RuntimeError:
    raise ValueError(f"{op}: shapes of {names[0]} {tuple(b1.shape)} and "
                     f"{names[1]} {tuple(b2.shape)} do not broadcast"
                     ) from None


def _elementwise_box_shards(op, names):
  def shards(static, spec, arrays, mesh):
    b1, b2 = arrays
    if static.get("reduction", "none") != "none":
      raise ValueError(
          f"{op}: a reduced loss (reduction={static['reduction']!r}) cannot "
          "run per shard: each device would reduce only its own boxes. "
          f"torch_bridge.{op} computes the per-box losses sharded and "
          "reduces them in torch")
    from pallas_kernels.boxes.iou import api
    _broadcast_shape(op, names, b1, b2)
    rule = api.call_rule(op, b1.shape, b2.shape, names=names)
    return _shards.specs(
        op, rule, spec, arrays, names,
        lead=("the boxes", " ".join(rule.results[0] + ("c",))),
        what="boxes broadcast to [..., 4]",
        why="each box needs its 4 coordinates")
  return shards


def _pairwise_shards(op):
  def shards(static, spec, arrays, mesh):
    from pallas_kernels.boxes.iou import api
    b1, b2 = arrays
    names = ("boxes1", "boxes2")
    _broadcast_shape(op, names, b1, b2, keep=2)
    rule = api.call_rule(op, b1.shape, b2.shape, pairwise=True)
    return _shards.specs(op, rule, spec, arrays, names,
                         lead=("the output", " ".join(rule.results[0])),
                         what="[..., N, M]", why="")
  return shards


def _box_op(name, shards):
  return JaxOp(name, functools.partial(_box_jax, fn_name=name),
               shard_specs=shards)


# The registered ops, by name: "iou", "pairwise_iou", "iou_loss", ... for
# each kind, and "box_iou".
_BOX_OPS = {}
for _kind in _KINDS:
  _BOX_OPS[_kind] = _box_op(
      _kind, _elementwise_box_shards(_kind, ("boxes1", "boxes2")))
  _BOX_OPS[f"pairwise_{_kind}"] = _box_op(
      f"pairwise_{_kind}", _pairwise_shards(f"pairwise_{_kind}"))
  _BOX_OPS[f"{_kind}_loss"] = _box_op(
      f"{_kind}_loss", _elementwise_box_shards(f"{_kind}_loss",
                                               ("pred", "target")))
_BOX_OPS["box_iou"] = _box_op("box_iou", _pairwise_shards("box_iou"))
del _kind


def _boxes(op, names, b1, b2, pairwise=False):
  for name, t in zip(names, (b1, b2)):
    _check_tensor(op, name, t, dtypes=_BOX_DTYPES,
                  min_ndim=2 if pairwise else 1)
    if t.shape[-1] != 4:
      raise ValueError(f"{op}: {name} must have a last dimension of 4 (box "
                       f"coordinates), got shape {tuple(t.shape)}")
  _check_devices(op, dict(zip(names, (b1, b2))))


def _box_metric(op, boxes1, boxes2, partition_spec, mesh, pairwise=False,
                **static):
  """Checks and runs the box op ``op`` on two box tensors (torchvision's
  dtype conventions: see ``_as_float_boxes``)."""
  _boxes(op, ("boxes1", "boxes2"), boxes1, boxes2, pairwise=pairwise)
  static = _sharding(static, partition_spec, mesh, op)
  (boxes1, boxes2), wide = _as_float_boxes(boxes1, boxes2)
  return _widened(_BOX_OPS[op]([boxes1, boxes2], **static)[0], wide)


def _named(fn, name, doc):
  fn.__name__ = fn.__qualname__ = name
  fn.__doc__ = doc
  return fn


def _metric_op(name, doc, *, with_eps, pairwise=False):
  """The public function ``name`` (the JAX op's arguments: ``eps`` only for
  DIoU and CIoU)."""
  if with_eps:
    def metric(boxes1, boxes2, *, eps=_EPS, box_format="xyxy", backend=None,
               partition_spec=None, mesh=None):
      return _box_metric(name, boxes1, boxes2, partition_spec, mesh,
                         pairwise=pairwise, eps=eps, box_format=box_format,
                         backend=backend)
  else:
    def metric(boxes1, boxes2, *, box_format="xyxy", backend=None,
               partition_spec=None, mesh=None):
      return _box_metric(name, boxes1, boxes2, partition_spec, mesh,
                         pairwise=pairwise, box_format=box_format,
                         backend=backend)
  return _named(metric, name, doc)


iou = _metric_op("iou", """\
IoU of matching boxes ``[..., 4]`` (broadcast) -> ``[...]`` in [0, 1]: the
diagonal of torchvision's ``box_iou`` (``pallas_kernels.iou``; 0 where the
union is 0).

``box_format`` "xyxy" (x1, y1, x2, y2) or "cxcywh" (centre, width, height).
``partition_spec``: one entry per dim of the broadcast box shape ``[...,
4]``; any but the last (coordinates) may be split.
""", with_eps=False)
giou = _metric_op("giou", """\
Generalized IoU of matching boxes ``[..., 4]`` -> ``[...]`` in [-1, 1]
(``pallas_kernels.giou``; the diagonal of ``generalized_box_iou``).

``box_format`` and ``partition_spec`` as for ``iou``.
""", with_eps=False)
diou = _metric_op("diou", """\
Distance IoU of matching boxes ``[..., 4]`` -> ``[...]``: IoU minus the
squared centre distance over the squared hull diagonal (+ ``eps``)
(``pallas_kernels.diou``; the diagonal of ``distance_box_iou``).

``box_format`` and ``partition_spec`` as for ``iou``.
""", with_eps=True)
ciou = _metric_op("ciou", """\
Complete IoU of matching boxes ``[..., 4]`` -> ``[...]``: DIoU minus
``alpha * v`` (``v`` the aspect-ratio term) (``pallas_kernels.ciou``; the
diagonal of ``complete_box_iou``).

``box_format`` and ``partition_spec`` as for ``iou``.
""", with_eps=True)
pairwise_iou = _metric_op("pairwise_iou", """\
IoU of every pair: ``[..., N, 4] x [..., M, 4] -> [..., N, M]``
(torchvision's ``box_iou``; leading dims broadcast).

``partition_spec``: one entry per dim of the output ``[..., N, M]``; all may
be split (N splits boxes1's boxes, M boxes2's).
""", with_eps=False, pairwise=True)
pairwise_giou = _metric_op("pairwise_giou", """\
GIoU of every pair: ``[..., N, 4] x [..., M, 4] -> [..., N, M]``
(torchvision's ``generalized_box_iou``).

``partition_spec`` as for ``pairwise_iou``.
""", with_eps=False, pairwise=True)
pairwise_diou = _metric_op("pairwise_diou", """\
DIoU of every pair: ``[..., N, 4] x [..., M, 4] -> [..., N, M]``
(torchvision's ``distance_box_iou``).

``partition_spec`` as for ``pairwise_iou``.
""", with_eps=True, pairwise=True)
pairwise_ciou = _metric_op("pairwise_ciou", """\
CIoU of every pair: ``[..., N, 4] x [..., M, 4] -> [..., N, M]``
(torchvision's ``complete_box_iou``).

``partition_spec`` as for ``pairwise_iou``.
""", with_eps=True, pairwise=True)


def box_iou(boxes1, boxes2, *, iou_kind="iou", eps=_EPS, box_format="xyxy",
            backend=None, partition_spec=None, mesh=None):
  """``[..., N, 4] x [..., M, 4] -> [..., N, M]``: the pairwise matrix of
  ``iou_kind`` ("iou", "giou", "diou" or "ciou"; ``eps`` is used by "diou"
  and "ciou"). The default is torchvision's ``box_iou``.

  ``partition_spec`` as for ``pairwise_iou``.
  """
  if iou_kind not in _KINDS:
    raise ValueError(f"box_iou: iou_kind must be one of {_KINDS}, got "
                     f"{iou_kind!r}")
  return _box_metric("box_iou", boxes1, boxes2, partition_spec, mesh,
                     pairwise=True, iou_kind=iou_kind, eps=eps,
                     box_format=box_format, backend=backend)


def _box_loss(op, pred, target, reduction, partition_spec, mesh, **static):
  """``op`` (``<kind>_loss``) on ``pred``/``target``, reduced.

  Without a spec the JAX op reduces. With one, the kernel computes the
  per-box losses (sharded under SPMD) and torch reduces them here, outside
  the sharded op, so the sum spans every shard and never sees the padding
  of an odd batch: accumulated in float32, a mean over no boxes is 0.
  """
  _boxes(op, ("pred", "target"), pred, target)
  if reduction not in _REDUCTIONS:
    raise ValueError(f"{op}: reduction must be 'none', 'mean' or 'sum', "
                     f"got {reduction!r}")
  (pred, target), wide = _as_float_boxes(pred, target)
  if partition_spec is None:
    static = _sharding(dict(static, reduction=reduction), None, mesh, op)
    return _widened(_BOX_OPS[op]([pred, target], **static)[0], wide)
  static = _sharding(dict(static, reduction="none"), partition_spec, mesh, op)
  loss = _BOX_OPS[op]([pred, target], **static)[0]
  if reduction == "none":
    return _widened(loss, wide)
  total = loss.float().sum()
  if reduction == "mean":
    total = total / max(loss.numel(), 1)
  return _widened(total.to(loss.dtype), wide)


def _loss_op(kind, doc):
  """The public ``<kind>_loss`` function (the JAX op's arguments)."""
  name = f"{kind}_loss"

  def loss(pred, target, *, reduction="none", eps=_EPS, box_format="xyxy",
           backend=None, partition_spec=None, mesh=None):
    return _box_loss(name, pred, target, reduction, partition_spec, mesh,
                     eps=eps, box_format=box_format, backend=backend)
  return _named(loss, name, doc)


iou_loss = _loss_op("iou", """\
``1 - inter / (union + eps)`` of matching boxes ``[..., 4]`` (broadcast),
reduced by "none" (``[...]``), "mean" or "sum" (a scalar).

``partition_spec``: as for ``iou`` (boxes, not coordinates). With a spec the
kernel computes the per-box losses (sharded under SPMD) and torch reduces
them, accumulating in float32 (a mean over no boxes is 0).
""")
giou_loss = _loss_op("giou", """\
``1 - giou(pred, target)`` (``eps`` added to the union and the hull area),
reduced as ``iou_loss``: torchvision's ``generalized_box_iou_loss``.

``partition_spec`` as for ``iou_loss``.
""")
diou_loss = _loss_op("diou", """\
``1 - diou(pred, target)``, reduced as ``iou_loss``: torchvision's
``distance_box_iou_loss``.

``partition_spec`` as for ``iou_loss``.
""")
ciou_loss = _loss_op("ciou", """\
``1 - ciou(pred, target)``, reduced as ``iou_loss``: torchvision's
``complete_box_iou_loss``.

``partition_spec`` as for ``iou_loss``.
""")
