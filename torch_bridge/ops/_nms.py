"""nms, batched_nms and soft_nms."""
from __future__ import annotations

import functools

import torch

from torch_bridge import _shards
from torch_bridge._core import JaxOp
from torch_bridge.ops._common import (
    _BOX_DTYPES, _INTS, _as_float_boxes, _check_devices, _check_tensor,
    _ids_int32, _sharding, _widened)


def _nms_jax(boxes, scores, class_ids, *, fn_name, **static):
  import pallas_kernels
  return getattr(pallas_kernels, fn_name)(boxes, scores, class_ids=class_ids,
                                          **static)


def _one_image_shards(op, n_indexed):
  """Shard rule of an op on one image's ``boxes [N, 4]`` that compares every
  pair of its boxes: nothing can be split. Outputs: ``n_indexed`` arrays
  ``[max_output_size]``, then a scalar count."""
  def shards(static, spec, arrays, mesh):
    from pallas_kernels.boxes.nms import api
    rule = api.sharding_rule(op, arrays[2], batched=False, indexed=n_indexed)
    return _shards.specs(op, rule, spec, arrays, _NMS_ARRAYS, lead="boxes",
                         why=f"{op} compares every pair of boxes of the "
                         "image; batched_nms can split images")
  return shards


_NMS_ARRAYS = ("boxes", "scores", "class_ids")


def _batched_nms_shards(static, spec, arrays, mesh):
  from pallas_kernels.boxes.nms import api
  op = "batched_nms"
  return _shards.specs(op, api.sharding_rule(op, arrays[2]), spec, arrays,
                       _NMS_ARRAYS, lead="boxes", what="images, boxes, 4",
                       why="greedy NMS compares every pair of boxes of an "
                       "image; only images (dim 0) can be split")


def _nms_op(name, shards):
  return JaxOp(name, functools.partial(_nms_jax, fn_name=name),
               differentiable=(), shard_specs=shards)


_NMS = _nms_op("nms", _one_image_shards("nms", 1))
_BATCHED_NMS = _nms_op("batched_nms", _batched_nms_shards)
# Its decayed scores are a float output but get no gradient (the JAX op is a
# while loop, which reverse mode cannot differentiate).
_SOFT_NMS = _nms_op("soft_nms", _one_image_shards("soft_nms", 2))


def _nms_checks(op, boxes, scores, class_ids, **numbers):
  """Checks boxes ``[..., N, 4]``, scores ``[..., N]``, optional integer
  class_ids, and that the ``numbers`` (static parameters) are not tensors."""
  _check_tensor(op, "boxes", boxes, dtypes=_BOX_DTYPES, min_ndim=2)
  _check_tensor(op, "scores", scores, dtypes=_BOX_DTYPES, min_ndim=1)
  if boxes.shape[-1] != 4:
    raise ValueError(f"{op}: boxes must be [..., N, 4], got shape "
                     f"{tuple(boxes.shape)}")
  if tuple(scores.shape) != tuple(boxes.shape[:-1]):
    raise ValueError(f"{op}: scores must have shape {tuple(boxes.shape[:-1])} "
                     f"(boxes without the last axis), got "
                     f"{tuple(scores.shape)}")
  ints = _INTS
  _check_tensor(op, "class_ids", class_ids, dtypes=ints, optional=True)
  for name, value in numbers.items():
    if isinstance(value, torch.Tensor):
      raise TypeError(f"{op}: {name} must be a Python number (it is static), "
                      "got a torch.Tensor")
  _check_devices(op, dict(boxes=boxes, scores=scores, class_ids=class_ids))


def nms(boxes, scores, *, iou_threshold, max_output_size, score_threshold=None,
        class_ids=None, backend=None, partition_spec=None, mesh=None):
  """Greedy NMS: ``(indices int32 [max_output_size], num_valid int32)``.

  ``indices[:num_valid]`` are the kept boxes by descending score; the rest
  is padding (see ``pallas_kernels.nms``). No gradient.
  ``partition_spec``: nothing can be split (all-None replicates the op).
  """
  idx, num_valid = _run_nms(
      _NMS, "nms", boxes, scores, class_ids, partition_spec, mesh,
      iou_threshold=iou_threshold, max_output_size=max_output_size,
      score_threshold=score_threshold, backend=backend)
  return idx, num_valid


def batched_nms(boxes, scores, *, iou_threshold, max_output_size,
                score_threshold=None, class_ids=None, backend=None,
                partition_spec=None, mesh=None):
  """``pallas_kernels.batched_nms``: NMS of each image of ``boxes [B, N, 4]``.

  Returns ``(indices int32 [B, max_output_size], num_valid int32 [B])``.
  ``partition_spec``: 3 entries for boxes; only images (dim 0) may be split.
  """
  return tuple(_run_nms(
      _BATCHED_NMS, "batched_nms", boxes, scores, class_ids, partition_spec,
      mesh, iou_threshold=iou_threshold, max_output_size=max_output_size,
      score_threshold=score_threshold, backend=backend))


def soft_nms(boxes, scores, *, max_output_size, method="gaussian", sigma=0.5,
             iou_threshold=0.3, score_threshold=0.001, class_ids=None,
             backend=None, partition_spec=None, mesh=None):
  """Soft-NMS of one image (``pallas_kernels.soft_nms``): overlapping scores
  decay instead of their boxes being dropped.

  Repeatedly picks the remaining box of ``boxes [N, 4]`` (xyxy) with the
  highest current score (ties: lower index) and multiplies the scores of the
  other remaining boxes (of its class, with ``class_ids [N]``) by
  ``exp(-iou**2 / sigma)`` (``method="gaussian"``) or, where ``iou >
  iou_threshold``, by ``1 - iou`` (``"linear"``); stops after
  ``max_output_size`` picks or when no remaining score exceeds
  ``score_threshold``. Returns ``(indices int32 [max_output_size] padded
  with -1, decayed scores [max_output_size] padded with 0, count int32)``;
  the scores are float32 (float64 for float64 boxes or scores). No gradient.
  ``partition_spec``: nothing can be split (all-None replicates the op).
  """
  idx, decayed, count = _run_nms(
      _SOFT_NMS, "soft_nms", boxes, scores, class_ids, partition_spec, mesh,
      max_output_size=max_output_size, method=method, sigma=sigma,
      iou_threshold=iou_threshold, score_threshold=score_threshold,
      backend=backend)
  wide = torch.float64 in (boxes.dtype, scores.dtype)
  return idx, _widened(decayed, wide), count


def _run_nms(jax_op, op, boxes, scores, class_ids, partition_spec, mesh,
             **static):
  _nms_checks(op, boxes, scores, class_ids, **{
      k: v for k, v in static.items() if k not in ("method", "backend")})
  static = _sharding(static, partition_spec, mesh, op)
  (boxes, scores), _ = _as_float_boxes(boxes, scores)
  return jax_op([boxes, scores, _ids_int32(class_ids)[0]], **static)
