"""The pallas_kernels ops as torch functions (autograd, torch.library, SPMD).

Each function takes and returns torch tensors, with the argument names and
semantics of the ``pallas_kernels`` op of the same name (see there), plus:

  partition_spec, mesh  (flash_attention, int8_matmul, int8_dense) under
      torch_xla SPMD: the kernel runs on each device's shard in manual
      sharding mode. ``partition_spec`` names the mesh axes of the main
      operand (q for attention, x for the matmuls); only batch (and heads)
      may be split. ``mesh`` defaults to the global mesh. Ignored when SPMD
      is off or the tensors are not XLA tensors.

Where the tensors live picks how the op runs (``torch_bridge._core``): XLA
tensors embed the JAX op into the torch_xla graph (Mosaic kernel on TPU,
generic Pallas interpreter on CPU), CPU and CUDA tensors go through DLPack
to a jitted JAX call. Each op is also ``torch.ops.pallas_kernels.<name>``
(static parameters encoded in its first, string argument).

Integer inputs given as int64 (torch's default) are narrowed to int32, as
JAX runs without 64-bit types; index outputs are int32.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from torch_bridge._core import JaxOp

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


# ---------------------------------------------------------------- checks --

def _check_tensor(op: str, name: str, t, *, dtypes=None, ndim=None,
                  min_ndim=None, optional=False):
  if t is None:
    if optional:
      return None
    raise TypeError(f"{op}: {name} must be a torch.Tensor, got None")
  if not isinstance(t, torch.Tensor):
    raise TypeError(f"{op}: {name} must be a torch.Tensor, got "
                    f"{type(t).__name__}")
  if dtypes is not None and t.dtype not in dtypes:
    names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
    raise TypeError(f"{op}: {name} must have dtype {names}; got "
                    f"{str(t.dtype).replace('torch.', '')}")
  if ndim is not None and t.dim() != ndim:
    raise ValueError(f"{op}: {name} must have {ndim} dimensions, got shape "
                     f"{tuple(t.shape)}")
  if min_ndim is not None and t.dim() < min_ndim:
    raise ValueError(f"{op}: {name} must have at least {min_ndim} "
                     f"dimension(s), got shape {tuple(t.shape)}")
  return t


def _check_devices(op: str, named: dict[str, torch.Tensor | None]):
  first = None
  for name, t in named.items():
    if t is None:
      continue
    if t.device.type not in ("cpu", "cuda", "xla", "meta"):
      raise ValueError(f"{op}: {name} is on device {t.device}; supported: "
                       "cpu, cuda, xla, meta")
    if first is None:
      first = (name, t.device)
    elif t.device != first[1]:
      raise ValueError(f"{op}: {name} is on {t.device} but {first[0]} is on "
                       f"{first[1]}; all tensors must share a device")


def _int32(t):
  return None if t is None else (t.to(torch.int32) if t.dtype == torch.int64
                                 else t)


def _sharding(static: dict, partition_spec, mesh, op: str):
  if partition_spec is None:
    if mesh is not None:
      raise ValueError(f"{op}: mesh given without partition_spec")
    return static
  if not isinstance(partition_spec, (tuple, list)):
    raise TypeError(f"{op}: partition_spec must be a tuple of mesh axis names "
                    f"(or None entries), got {partition_spec!r}")
  static = dict(static, _partition_spec=tuple(partition_spec))
  if mesh is not None:
    static["_mesh"] = str(mesh)
  return static


def _plain_block_sizes(block_sizes):
  """A block-size dataclass as a literal dict (the op schema's static string)
  tagged with its class, so ``_block_sizes_from_plain`` can rebuild it."""
  if dataclasses.is_dataclass(block_sizes):
    fields = {k: v for k, v in dataclasses.asdict(block_sizes).items()
              if v is not None}
    return {"_class": type(block_sizes).__name__, **fields}
  return block_sizes


def _block_sizes_from_plain(block_sizes):
  if not isinstance(block_sizes, dict) or "_class" not in block_sizes:
    return block_sizes
  from pallas_kernels.attention import block_sizes as tpu_blocks, gpu
  classes = {"BlockSizes": tpu_blocks.BlockSizes,
             "GpuBlockSizes": gpu.GpuBlockSizes}
  fields = dict(block_sizes)
  return classes[fields.pop("_class")](**fields)


# ------------------------------------------------------------- attention --

def _attention_jax(q, k, v, q_segment_ids, kv_segment_ids, bias, **static):
  import pallas_kernels
  segments = (None if q_segment_ids is None
              else (q_segment_ids, kv_segment_ids))
  static["block_sizes"] = _block_sizes_from_plain(static.get("block_sizes"))
  return pallas_kernels.flash_attention(q, k, v, segment_ids=segments,
                                        bias=bias, **static)


def _attention_shards(static, spec, arrays):
  if len(spec) != 4:
    raise ValueError("flash_attention: partition_spec must have 4 entries "
                     f"(batch, heads, seq, head_dim), got {spec!r}")
  if spec[2] is not None or spec[3] is not None:
    raise ValueError("flash_attention: only batch and heads may be sharded "
                     f"(partition_spec={spec!r})")
  batch_axis, head_axis = spec[0], spec[1]
  bias = arrays[5]
  bias_spec = None if bias is None else (
      batch_axis if bias.shape[0] > 1 else None,
      head_axis if bias.shape[1] > 1 else None, None, None)
  seg = (batch_axis, None)
  ins = (spec, spec, spec, seg, seg, bias_spec)
  outs = (spec, (batch_axis, head_axis, None)) if static.get(
      "return_lse") else (spec,)
  return ins, outs


_ATTENTION = JaxOp("flash_attention", _attention_jax,
                   differentiable=(0, 1, 2, 5), shard_specs=_attention_shards)


def flash_attention(q, k, v, *, causal=False, sm_scale=None, segment_ids=None,
                    sliding_window=None, logit_soft_cap=None, bias=None,
                    return_lse=False, block_sizes=None, backend=None,
                    partition_spec=None, mesh=None):
  """``pallas_kernels.flash_attention`` on torch tensors ``[B, H, S, D]``."""
  op = "flash_attention"
  for name, t in (("q", q), ("k", k), ("v", v)):
    _check_tensor(op, name, t, dtypes=_FLOATS, ndim=4)
  q_seg = kv_seg = None
  if segment_ids is not None:
    if not isinstance(segment_ids, (tuple, list)) or len(segment_ids) != 2:
      raise TypeError(f"{op}: segment_ids must be a (q_segment_ids, "
                      "kv_segment_ids) pair of tensors")
    ints = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)
    q_seg = _int32(_check_tensor(op, "q_segment_ids", segment_ids[0],
                                 dtypes=ints, ndim=2))
    kv_seg = _int32(_check_tensor(op, "kv_segment_ids", segment_ids[1],
                                  dtypes=ints, ndim=2))
  _check_tensor(op, "bias", bias, dtypes=_FLOATS, ndim=4, optional=True)
  _check_devices(op, dict(q=q, k=k, v=v, q_segment_ids=q_seg,
                          kv_segment_ids=kv_seg, bias=bias))
  static = dict(causal=causal, sm_scale=sm_scale,
                sliding_window=sliding_window, logit_soft_cap=logit_soft_cap,
                return_lse=return_lse,
                block_sizes=_plain_block_sizes(block_sizes), backend=backend)
  static = _sharding(static, partition_spec, mesh, op)
  outs = _ATTENTION([q, k, v, q_seg, kv_seg, bias], **static)
  return tuple(outs) if return_lse else outs[0]


# ----------------------------------------------------------- int8 matmul --

def _quantize_jax(x, *, axis):
  import pallas_kernels
  return pallas_kernels.quantize_int8(x, axis=axis)


_QUANTIZE = JaxOp("quantize_int8", _quantize_jax, differentiable=())


def quantize_int8(x, *, axis=-1):
  """``(q int8, scale float32)`` with ``x ~= q * scale`` (no gradient)."""
  _check_tensor("quantize_int8", "x", x, dtypes=_FLOATS)
  q, scale = _QUANTIZE([x], axis=axis)
  return q, scale


def _matmul_jax(x, w, x_scale, w_scale, bias, **static):
  import pallas_kernels
  return pallas_kernels.int8_matmul(x, w, x_scale=x_scale, w_scale=w_scale,
                                    bias=bias, **static)


def _matmul_shards(static, spec, arrays):
  x, _, x_scale, w_scale, bias = arrays
  spec = tuple(spec)
  if len(spec) != x.dim() or spec[-1] is not None:
    raise ValueError("partition_spec must give one entry per dimension of x "
                     f"with the last (K) unsharded, got {spec!r} for x of "
                     f"shape {tuple(x.shape)}")
  replicated = lambda t: None if t is None else (None,) * t.dim()
  x_scale_spec = (None if x_scale is None else
                  (replicated(x_scale) if x_scale.dim() < x.dim() else spec))
  ins = (spec, replicated(arrays[1]), x_scale_spec, replicated(w_scale),
         replicated(bias))
  return ins, (spec,)


_MATMUL = JaxOp("int8_matmul", _matmul_jax, differentiable=(),
                shard_specs=_matmul_shards)


def int8_matmul(x, w, *, x_scale=None, w_scale=None, bias=None,
                out_dtype=None, block_sizes=None, weight_only=False,
                backend=None, partition_spec=None, mesh=None):
  """``pallas_kernels.int8_matmul``: int8 ``x [..., K] @ w [K, N]``.

  No gradient (the JAX op defines none); for a trainable layer use
  ``int8_dense`` / ``Int8Linear``.
  """
  op = "int8_matmul"
  _check_tensor(op, "x", x, dtypes=(torch.int8,) + _FLOATS, min_ndim=1)
  _check_tensor(op, "w", w, dtypes=(torch.int8,), ndim=2)
  for name, t in (("x_scale", x_scale), ("w_scale", w_scale),
                  ("bias", bias)):
    _check_tensor(op, name, t, dtypes=_FLOATS, optional=True)
  _check_devices(op, dict(x=x, w=w, x_scale=x_scale, w_scale=w_scale,
                          bias=bias))
  if out_dtype is not None:
    from torch_bridge import _convert
    import numpy as np
    out_dtype = np.dtype(_convert.jax_dtype(out_dtype)).name
  static = dict(out_dtype=out_dtype, block_sizes=_plain_block_sizes(
      block_sizes), weight_only=weight_only, backend=backend)
  static = _sharding(static, partition_spec, mesh, op)
  return _MATMUL([x, w, x_scale, w_scale, bias], **static)[0]


def _dense_jax(x, weight, bias, **static):
  from pallas_kernels import nn
  return nn.int8_dense(x, weight.T, bias, **static)


def _dense_shards(static, spec, arrays):
  x, w, bias = arrays
  spec = tuple(spec)
  if len(spec) != x.dim() or spec[-1] is not None:
    raise ValueError("partition_spec must give one entry per dimension of x "
                     f"with the last (in_features) unsharded, got {spec!r}")
  return (spec, (None, None), None if bias is None else (None,)), (spec,)


_DENSE = JaxOp("int8_dense", _dense_jax, shard_specs=_dense_shards)


def int8_dense(x, weight, bias=None, *, int8_input_grad=False, backend=None,
               partition_spec=None, mesh=None):
  """``x @ weight.T + bias`` with int8 operands (``nn.Linear`` layout).

  ``pallas_kernels.nn.int8_dense`` on ``weight.T``. Forward: ``weight [out,
  in]`` is quantized per output channel and ``x`` per row (symmetric int8),
  multiplied by the int8 kernel with int32 accumulation and rescaled.
  Backward: straight-through estimator, i.e. the gradients of the float
  ``x @ weight.T + bias`` (``int8_input_grad=True``: dx by an int8 matmul).
  """
  op = "int8_dense"
  _check_tensor(op, "x", x, dtypes=_FLOATS, min_ndim=1)
  _check_tensor(op, "weight", weight, dtypes=_FLOATS, ndim=2)
  _check_tensor(op, "bias", bias, dtypes=_FLOATS, ndim=1, optional=True)
  _check_devices(op, dict(x=x, weight=weight, bias=bias))
  if x.shape[-1] != weight.shape[1]:
    raise ValueError(f"{op}: x's last dimension ({x.shape[-1]}) must equal "
                     f"weight's in_features ({weight.shape[1]})")
  if bias is not None and bias.shape[0] != weight.shape[0]:
    raise ValueError(f"{op}: bias has {bias.shape[0]} entries, weight has "
                     f"{weight.shape[0]} out_features")
  static = _sharding(dict(int8_input_grad=int8_input_grad, backend=backend),
                     partition_spec, mesh, op)
  return _DENSE([x, weight, bias], **static)[0]


# ------------------------------------------------------------------ GIoU --

def _box_jax(b1, b2, *, fn_name, **static):
  import pallas_kernels
  return getattr(pallas_kernels, fn_name)(b1, b2, **static)


_GIOU = JaxOp("giou", functools.partial(_box_jax, fn_name="giou"))
_PAIRWISE_GIOU = JaxOp("pairwise_giou",
                       functools.partial(_box_jax, fn_name="pairwise_giou"))
_GIOU_LOSS = JaxOp("giou_loss",
                   functools.partial(_box_jax, fn_name="giou_loss"))


def _boxes(op, names, b1, b2, pairwise=False):
  for name, t in zip(names, (b1, b2)):
    _check_tensor(op, name, t, dtypes=_FLOATS, min_ndim=1)
    if t.shape[-1] != 4:
      raise ValueError(f"{op}: {name} must have a last dimension of 4 (box "
                       f"coordinates), got shape {tuple(t.shape)}")
  _check_devices(op, dict(zip(names, (b1, b2))))


def giou(boxes1, boxes2, **kwargs):
  """Generalized IoU of matching boxes ``[..., 4]`` (``pallas_kernels.giou``)."""
  _boxes("giou", ("boxes1", "boxes2"), boxes1, boxes2)
  return _GIOU([boxes1, boxes2], **kwargs)[0]


def pairwise_giou(boxes1, boxes2, **kwargs):
  """GIoU of every pair: ``[..., N, 4] x [..., M, 4] -> [..., N, M]``."""
  _boxes("pairwise_giou", ("boxes1", "boxes2"), boxes1, boxes2)
  return _PAIRWISE_GIOU([boxes1, boxes2], **kwargs)[0]


def giou_loss(pred, target, *, reduction="none", eps=1e-7, **kwargs):
  """``1 - giou(pred, target)`` reduced by "none", "mean" or "sum"."""
  _boxes("giou_loss", ("pred", "target"), pred, target)
  if reduction not in ("none", "mean", "sum"):
    raise ValueError(f"giou_loss: reduction must be 'none', 'mean' or 'sum', "
                     f"got {reduction!r}")
  return _GIOU_LOSS([pred, target], reduction=reduction, eps=eps,
                    **kwargs)[0]


# ------------------------------------------------------------------- NMS --

def _nms_jax(boxes, scores, class_ids, *, fn_name, **static):
  import pallas_kernels
  fn = getattr(pallas_kernels, fn_name)
  if fn_name == "batched_nms":
    return fn(boxes, scores, **static)
  return fn(boxes, scores, class_ids=class_ids, **static)


_NMS = JaxOp("nms", functools.partial(_nms_jax, fn_name="nms"),
             differentiable=())
_BATCHED_NMS = JaxOp("batched_nms",
                     functools.partial(_nms_jax, fn_name="batched_nms"),
                     differentiable=())


def _nms_checks(op, boxes, scores, class_ids, iou_threshold, max_output_size):
  _check_tensor(op, "boxes", boxes, dtypes=_FLOATS, min_ndim=2)
  _check_tensor(op, "scores", scores, dtypes=_FLOATS, min_ndim=1)
  if boxes.shape[-1] != 4:
    raise ValueError(f"{op}: boxes must be [..., N, 4], got shape "
                     f"{tuple(boxes.shape)}")
  if tuple(scores.shape) != tuple(boxes.shape[:-1]):
    raise ValueError(f"{op}: scores must have shape {tuple(boxes.shape[:-1])} "
                     f"(boxes without the last axis), got "
                     f"{tuple(scores.shape)}")
  ints = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)
  _check_tensor(op, "class_ids", class_ids, dtypes=ints, optional=True)
  if isinstance(iou_threshold, torch.Tensor) or isinstance(
      max_output_size, torch.Tensor):
    raise TypeError(f"{op}: iou_threshold and max_output_size must be Python "
                    "numbers (they are static)")
  _check_devices(op, dict(boxes=boxes, scores=scores, class_ids=class_ids))


def nms(boxes, scores, *, iou_threshold, max_output_size, score_threshold=None,
        class_ids=None, backend=None):
  """Greedy NMS: ``(indices int32 [max_output_size], num_valid int32)``.

  ``indices[:num_valid]`` are the kept boxes by descending score; the rest
  is padding (see ``pallas_kernels.nms``). No gradient.
  """
  _nms_checks("nms", boxes, scores, class_ids, iou_threshold, max_output_size)
  idx, num_valid = _NMS([boxes, scores, _int32(class_ids)],
                        iou_threshold=iou_threshold,
                        max_output_size=max_output_size,
                        score_threshold=score_threshold, backend=backend)
  return idx, num_valid


def batched_nms(boxes, scores, *, iou_threshold, max_output_size,
                **kwargs):
  """``pallas_kernels.batched_nms``: NMS of each image in a batch."""
  _nms_checks("batched_nms", boxes, scores, None, iou_threshold,
              max_output_size)
  outs = _BATCHED_NMS([boxes, scores, None], iou_threshold=iou_threshold,
                      max_output_size=max_output_size, **kwargs)
  return tuple(outs)


__all__ = ["flash_attention", "quantize_int8", "int8_matmul", "int8_dense",
           "giou", "pairwise_giou", "giou_loss", "nms", "batched_nms"]
