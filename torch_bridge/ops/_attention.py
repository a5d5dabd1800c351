"""flash_attention on torch tensors (masks travel in the static string)."""
from __future__ import annotations

import dataclasses

from torch_bridge import _shards
from torch_bridge._core import JaxOp
from torch_bridge.ops._common import (
    _FLOATS, _INTS, _check_devices, _check_tensor, _ids_int32, _sharding)


# Masks (``attention.masks``) are hashable but not literals. Formula masks
# travel in the static string as ``(class name, *fields)`` (per head:
# ``("heads", *masks)``), rebuilt on the JAX side: Dynamo defers a registry's
# update until the graph has run, so the kernels would not find a new mask.
# Others (``Dense``: an array) carry their number in this process's registry
# (equal masks, one number); Dynamo cannot hash them (no fullgraph=True).
_MASK_NUMBERS: dict = {}
_MASKS: list = []
_MASK_FIELDS = {"Causal": (), "Local": ("left", "right"),
                "ChunkedCausal": ("chunk_size",),
                "PrefixLM": ("prefix_length",), "And": ("a", "b"),
                "Or": ("a", "b")}


def _mask_literal(mask):
  """``mask`` as a nested literal tuple, or None where it has none."""
  from pallas_kernels.attention import masks
  name = type(mask).__name__
  if name not in _MASK_FIELDS or type(mask) is not getattr(masks, name):
    return None
  parts = [name]
  for field in _MASK_FIELDS[name]:
    value = getattr(mask, field)
    if isinstance(value, masks.Mask):
      value = _mask_literal(value)
      if value is None:
        return None
    parts.append(value)
  return tuple(parts)


def _mask_from_literal(value):
  from pallas_kernels.attention import masks
  if value[0] == "heads":
    return [_mask_from_literal(m) for m in value[1:]]
  return getattr(masks, value[0])(*(
      _mask_from_literal(v) if isinstance(v, tuple) else v
      for v in value[1:]))


def _mask_static(mask):
  """``mask`` for the static string: its literal, or its number."""
  if mask is None:
    return None
  from pallas_kernels.attention import masks
  per_head = isinstance(mask, (tuple, list))
  if not all(isinstance(m, masks.Mask) for m in (mask if per_head
                                                 else (mask,))):
    raise TypeError("flash_attention: mask must be a mask from "
                    "pallas_kernels.attention.masks or a list of them (one "
                    f"per query head), got {mask!r}")
  literals = [_mask_literal(m) for m in (mask if per_head else (mask,))]
  if all(lit is not None for lit in literals):
    return ("heads", *literals) if per_head else literals[0]
  key = tuple(mask) if per_head else mask
  if key not in _MASK_NUMBERS:
    _MASK_NUMBERS[key] = len(_MASKS)
    _MASKS.append(list(mask) if per_head else mask)
  return _MASK_NUMBERS[key]


def _attention_jax(q, k, v, q_segment_ids, kv_segment_ids, bias, sinks,
                   *, mask=None, **static):
  import pallas_kernels
  segments = (None if q_segment_ids is None
              else (q_segment_ids, kv_segment_ids))
  static["block_sizes"] = _block_sizes_from_plain(static.get("block_sizes"))
  if isinstance(mask, tuple):
    mask = _mask_from_literal(mask)
  elif mask is not None:
    mask = _MASKS[mask]
  return pallas_kernels.flash_attention(
      q, k, v, segment_ids=segments, bias=bias, sinks=sinks, mask=mask,
      **static)


def _attention_shards(static, spec, arrays, mesh):
  from pallas_kernels.attention import api
  q, k, _, q_seg, kv_seg, bias, sinks = arrays
  op = "flash_attention"
  ins, outs = _shards.specs(
      op, api.call_rule(q_seg, kv_seg, bias, sinks), spec, arrays,
      ("q", "k", "v", "q_segment_ids", "kv_segment_ids", "bias", "sinks"),
      lead="q", what="batch, heads, seq, head_dim",
      describe={"l": "sequence"},
      why="only batch (dim 0) and heads (dim 1) can be split: each query "
      "needs every key and the whole head_dim",
      results=2 if static.get("return_lse") else 1)
  head_axis = spec[1]
  if head_axis is not None and mesh is not None and k.shape[1] != q.shape[1]:
    from torch_bridge import _xla
    n = _xla.entry_size(mesh, head_axis)
    if k.shape[1] % n:
      # Padding k/v heads would move the boundaries of the query-head groups.
      raise ValueError(
          f"{op}: heads are split over mesh axis {head_axis!r} of size {n}, "
          f"which does not divide k/v's {k.shape[1]} heads (grouped-query "
          f"attention, {q.shape[1]} query heads; padding would regroup "
          "them): use a multiple of that many kv heads or leave heads "
          "unsplit")
  return ins, outs


_ATTENTION = JaxOp("flash_attention", _attention_jax,
                   differentiable=(0, 1, 2, 5, 6),
                   shard_specs=_attention_shards)


def flash_attention(q, k, v, *, causal=False, sm_scale=None, segment_ids=None,
                    sliding_window=None, logit_soft_cap=None, bias=None,
                    sinks=None, mask=None, return_lse=False, block_sizes=None,
                    backend=None, partition_spec=None, mesh=None):
  """``pallas_kernels.flash_attention`` on torch tensors ``[B, H, S, D]``
  (v's D may differ from q's and k's: MLA; out has v's).

  ``sinks``: float ``[H]``, one learnable logit per query head that joins
  each row's softmax denominator (gets a gradient). ``mask``: a static mask
  from ``pallas_kernels.attention.masks`` (or a list, one per query head).

  ``partition_spec``: 4 entries for q's (batch, heads, seq, head_dim); batch
  and heads may be split (k, v, segment_ids, bias and sinks follow q). An odd
  batch, or (for MHA) a head count the axis does not divide, is padded
  inside; grouped-query attention needs the kv heads divisible by the heads'
  axis size.
  """
  op = "flash_attention"
  for name, t in (("q", q), ("k", k), ("v", v)):
    _check_tensor(op, name, t, dtypes=_FLOATS, ndim=4)
  q_seg = kv_seg = None
  if segment_ids is not None:
    if not isinstance(segment_ids, (tuple, list)) or len(segment_ids) != 2:
      raise TypeError(f"{op}: segment_ids must be a (q_segment_ids, "
                      "kv_segment_ids) pair of tensors")
    ints = _INTS
    q_seg, kv_seg = _ids_int32(
        _check_tensor(op, "q_segment_ids", segment_ids[0], dtypes=ints,
                      ndim=2),
        _check_tensor(op, "kv_segment_ids", segment_ids[1], dtypes=ints,
                      ndim=2))
  _check_tensor(op, "bias", bias, dtypes=_FLOATS, ndim=4, optional=True)
  _check_tensor(op, "sinks", sinks, dtypes=_FLOATS, ndim=1, optional=True)
  _check_devices(op, dict(q=q, k=k, v=v, q_segment_ids=q_seg,
                          kv_segment_ids=kv_seg, bias=bias, sinks=sinks))
  static = dict(causal=causal, sm_scale=sm_scale,
                sliding_window=sliding_window, logit_soft_cap=logit_soft_cap,
                return_lse=return_lse,
                block_sizes=_plain_block_sizes(block_sizes), backend=backend)
  if mask is not None:  # absent from the static string when unused
    static["mask"] = _mask_static(mask)
  static = _sharding(static, partition_spec, mesh, op)
  outs = _ATTENTION([q, k, v, q_seg, kv_seg, bias, sinks], **static)
  return tuple(outs) if return_lse else outs[0]


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
  from pallas_kernels.attention import block_sizes as tpu_blocks, triton
  classes = {"BlockSizes": tpu_blocks.BlockSizes,
             "GpuBlockSizes": triton.GpuBlockSizes}
  fields = dict(block_sizes)
  return classes[fields.pop("_class")](**fields)
