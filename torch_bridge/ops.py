"""The pallas_kernels ops as torch functions (autograd, torch.library, SPMD).

Each function takes and returns torch tensors, with the argument names and
semantics of the ``pallas_kernels`` op of the same name (see there), plus:

  partition_spec, mesh  under torch_xla SPMD: the kernel runs on each
      device's shard in manual sharding mode. ``partition_spec`` has one
      entry (a mesh axis name, a tuple of them, or None) per dimension of
      the op's main operand; the op's docstring says which dimensions may
      be split (those whose rows the op treats independently: batch, heads,
      rows, boxes, images). Splitting any other dimension, or naming an axis
      the mesh lacks, raises ValueError. A split dimension the mesh does not
      divide (an odd batch) is zero-padded up to a multiple inside the op
      and the results are cut back: the outputs always have the unsharded
      shapes. ``mesh`` defaults to the global mesh. The spec is checked
      everywhere but only used for XLA tensors under SPMD; there, calling an
      op without one runs it unsharded and warns once per op
      (``UnshardedWarning``; an all-None spec replicates it on purpose).

Where the tensors live picks how the op runs (``torch_bridge._core``): XLA
tensors embed the JAX op into the torch_xla graph (Mosaic kernel on TPU,
generic Pallas interpreter on CPU), CPU and CUDA tensors go through DLPack
to a jitted JAX call. Each function is also the public torch operator
``torch.ops.pallas_kernels.<name>``, whose schema has the tensors and static
parameters as typed arguments (``torch_bridge.schemas``; ``mask``,
``return_lse``, ``block_sizes``, ``partition_spec`` and ``mesh`` are Python
function only), and runs on internal ops
``torch.ops.pallas_kernels_impl.*`` (static parameters encoded in a string).

JAX runs without 64-bit types: ids given as int64 (torch's default;
segment and class ids) are passed as int32 with equality kept exactly (values
outside int32 are renumbered); box ops take integer boxes (upcast to float32,
as torchvision does) and float64 boxes (computed in float32, returned as
float64); index outputs are int32.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from pallas_kernels import _registry
from torch_bridge import _shards, schemas
from torch_bridge._core import JaxOp, UnshardedWarning

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_INTS = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)
# Boxes as torchvision takes them: integers are upcast, float64 runs in float32.
_BOX_DTYPES = _FLOATS + (torch.float64,) + _INTS


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


_INT32 = torch.iinfo(torch.int32)


def _ids_int32(*ids):
  """Integer id tensors as int32 with equality kept exactly (ids are only
  compared for equality; JAX runs without 64-bit types).

  int64 values that may not fit int32 are replaced by their rank among all
  the given ids, on their device (a sort; no host sync on XLA tensors, and
  none while tracing: fake tensors, torch.compile, dispatch modes).
  """
  from torch._subclasses.fake_tensor import is_fake

  from torch_bridge import _eager
  present = [t for t in ids if t is not None]
  wide = [t for t in present if t.dtype == torch.int64]
  lazy = wide and (_eager.transformed() or any(
      t.device.type in ("xla", "meta") or is_fake(t) for t in wide))
  if wide and (lazy or any(
      t.numel() and (int(t.min()) < _INT32.min or int(t.max()) > _INT32.max)
      for t in wide)):
    flat = torch.cat([t.reshape(-1).long() for t in present])
    values, order = torch.sort(flat)
    new = torch.zeros_like(values)
    new[1:] = (values[1:] != values[:-1]).long()
    ranks = torch.empty_like(flat).scatter_(0, order, torch.cumsum(new, 0))
    sizes = [t.numel() for t in present]
    present = [r.reshape(t.shape) for r, t in
               zip(torch.split(ranks, sizes), present)]
  it = iter(t.to(torch.int32) for t in present)
  return tuple(None if t is None else next(it) for t in ids)


def _as_float_boxes(*tensors):
  """torchvision's convention: integer boxes are upcast to float32; float64
  runs in float32 (JAX runs without 64-bit types). Returns the tensors and
  whether a float64 input asks for a float64 result."""
  wide = any(t is not None and t.dtype == torch.float64 for t in tensors)
  out = tuple(t if t is None or t.dtype in _FLOATS else t.float()
              for t in tensors)
  return out, wide


def _is_axis(a) -> bool:
  return isinstance(a, str) or (isinstance(a, int) and not isinstance(a, bool))


def _sharding(static: dict, partition_spec, mesh, op: str):
  if partition_spec is None:
    if mesh is not None:
      raise ValueError(f"{op}: mesh given without partition_spec")
    return static
  if not isinstance(partition_spec, (tuple, list)) or not all(
      e is None or _is_axis(e) or (isinstance(e, (tuple, list)) and
                                   all(_is_axis(a) for a in e))
      for e in partition_spec):
    raise TypeError(f"{op}: partition_spec must be a tuple with one entry per "
                    "dimension: a mesh axis name, a tuple of names, or None; "
                    f"got {partition_spec!r}")
  partition_spec = tuple(tuple(e) if isinstance(e, list) else e
                         for e in partition_spec)
  static = dict(static, _partition_spec=partition_spec)
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


def _plain_matmul_block_sizes(block_sizes):
  """A matmul ``BlockSizes`` dataclass as the literal dict of its fields
  (the JAX matmuls take such a dict); other values unchanged."""
  if dataclasses.is_dataclass(block_sizes):
    return dataclasses.asdict(block_sizes)
  return block_sizes


def _block_sizes_from_plain(block_sizes):
  if not isinstance(block_sizes, dict) or "_class" not in block_sizes:
    return block_sizes
  from pallas_kernels.attention import block_sizes as tpu_blocks, triton
  classes = {"BlockSizes": tpu_blocks.BlockSizes,
             "GpuBlockSizes": triton.GpuBlockSizes}
  fields = dict(block_sizes)
  return classes[fields.pop("_class")](**fields)


# ------------------------------------------------------------- attention --

# Attention masks (``pallas_kernels.attention.masks``) are hashable values
# but not literals. Formula masks travel in the static string as literals,
# ``(class name, *fields)`` (a per-head list: ``("heads", *masks)``), and
# are rebuilt on the JAX side: under torch.compile a mask may be new to this
# process, and Dynamo defers the update of a registry until after the graph
# has run, so the fake and real kernels would not find it there. Other
# masks (``Dense``: an array) carry their number in a registry of this
# process (equal masks, the same number); Dynamo cannot hash them, so they
# do not compile with fullgraph=True.
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


# ----------------------------------------------------------- int8 matmul --

def _quantize_jax(x, *, axis, backend=None):
  import pallas_kernels
  return pallas_kernels.quantize_int8(x, axis=axis, backend=backend)


def _quantize_shards(static, spec, arrays, mesh):
  from pallas_kernels.quant import int8_api
  (x,), axis, op = arrays, static["axis"], "quantize_int8"
  if axis is not None and not -x.dim() <= axis < x.dim():
    raise ValueError(f"{op}: axis={axis} is out of range for x of rank "
                     f"{x.dim()}")
  rule = int8_api.quantize_rule(op, x.dim(),
                                None if axis is None else axis % x.dim())
  return _shards.specs(
      op, rule, spec, arrays, ("x",), lead="x", describe={"r": f"axis={axis}"},
      why="axis=None takes one scale over the whole tensor" if axis is None
      else "the scale is the maximum over that dimension")


_QUANTIZE = JaxOp("quantize_int8", _quantize_jax, differentiable=(),
                  shard_specs=_quantize_shards)


def quantize_int8(x, *, axis=-1, backend=None, partition_spec=None,
                  mesh=None):
  """``(q int8, scale float32)`` with ``x ~= q * scale`` (no gradient).

  ``partition_spec``: one entry per dim of x; any dimension but ``axis``
  (the one the scale is taken over) may be split.
  """
  op = "quantize_int8"
  _check_tensor(op, "x", x, dtypes=_FLOATS)
  static = _sharding(dict(axis=axis, backend=backend), partition_spec, mesh,
                     op)
  q, scale = _QUANTIZE([x], **static)
  return q, scale


def _matmul_jax(x, w, x_scale, w_scale, bias, **static):
  import pallas_kernels
  return pallas_kernels.int8_matmul(x, w, x_scale=x_scale, w_scale=w_scale,
                                    bias=bias, **static)


def _rows_specs(op, rule, spec, arrays, names, k_name):
  """Specs of a matmul on ``x [..., K]`` (the first array): rows may be
  split, K may not; the weights are replicated."""
  return _shards.specs(op, rule, spec, arrays, names, lead="x",
                       describe={"k": k_name},
                       why="the matmul contracts over it (only rows can be "
                       "split)")


def _matmul_shards(static, spec, arrays, mesh):
  from pallas_kernels.quant import int8_api
  x, _, x_scale, w_scale, bias = arrays
  rule = int8_api.matmul_rule(static["weight_layout"], x_scale, w_scale,
                              bias, x.dim())
  return _rows_specs("int8_matmul", rule, spec, arrays,
                     ("x", "w", "x_scale", "w_scale", "bias"), "K")


_MATMUL = JaxOp("int8_matmul", _matmul_jax, differentiable=(0, 4),
                shard_specs=_matmul_shards)


def int8_matmul(x, w, *, x_scale=None, w_scale=None, bias=None,
                out_dtype=None, block_sizes=None, weight_only=False,
                weight_layout="kn", backend=None, partition_spec=None,
                mesh=None):
  """``pallas_kernels.int8_matmul``: int8 ``x [..., K] @ w [K, N]`` (``[N,
  K]`` with ``weight_layout="nk"``).

  ``partition_spec``: one entry per dim of x; the row dims may be split
  (x_scale follows x), K may not.
  Gradients as the JAX op's: in float x of a weight-only call and in bias;
  none for w and the scales (frozen), and asking for x's in dynamic mode
  (float x quantized on the fly) raises. For a trainable int8 layer use
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
  static = dict(out_dtype=out_dtype,
                block_sizes=_plain_matmul_block_sizes(block_sizes),
                weight_only=weight_only, weight_layout=weight_layout,
                backend=backend)
  static = _sharding(static, partition_spec, mesh, op)
  return _MATMUL([x, w, x_scale, w_scale, bias], **static)[0]


def _dense_jax(x, weight, bias, **static):
  from pallas_kernels import nn
  return nn.int8_dense(x, weight.T, bias, **static)


def _dense_shards(static, spec, arrays, mesh):
  from pallas_kernels.quant import int8_api
  x, _, bias = arrays
  rule = int8_api.matmul_rule("nk", None, None, bias, x.dim())
  return _rows_specs("int8_dense", rule, spec, arrays,
                     ("x", "w", "bias"), "in_features")


_DENSE = JaxOp("int8_dense", _dense_jax, shard_specs=_dense_shards)


def int8_dense(x, weight, bias=None, *, int8_input_grad=False, backend=None,
               partition_spec=None, mesh=None):
  """``x @ weight.T + bias`` with int8 operands (``nn.Linear`` layout).

  ``pallas_kernels.nn.int8_dense`` on ``weight.T``. Forward: ``weight [out,
  in]`` is quantized per output channel and ``x`` per row (symmetric int8),
  multiplied by the int8 kernel with int32 accumulation and rescaled.
  Backward: straight-through estimator, i.e. the gradients of the float
  ``x @ weight.T + bias`` (``int8_input_grad=True``: dx by an int8 matmul).
  ``partition_spec``: one entry per dim of x; the row dims may be split,
  in_features may not (weight and bias are replicated).
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


# -------------------------------------------------- quantized formats --

# torch dtypes of the 8-bit formats; float8 crosses DLPack as its bytes
# (uint8) and is bitcast back inside the JAX function.
_FLOAT8 = {torch.float8_e4m3fn: "float8_e4m3fn",
           torch.float8_e5m2: "float8_e5m2"}
_QUANT_DTYPES = {torch.int8: "int8", **_FLOAT8}


def _bytes_of(t):
  """``t`` as DLPack can carry it: float8 viewed as uint8, else itself."""
  return t.view(torch.uint8) if t is not None and t.dtype in _FLOAT8 else t


def _format_name(t):
  return None if t is None else _QUANT_DTYPES.get(t.dtype)


def _from_bytes(a, format_name):
  """The JAX side of ``_bytes_of``."""
  import jax
  import jax.numpy as jnp
  if a is None or format_name not in _FLOAT8.values():
    return a
  return jax.lax.bitcast_convert_type(a, getattr(jnp, format_name))


def _to_bytes(a):
  """float8 JAX results as uint8 (viewed back as float8 in torch)."""
  import jax
  import jax.numpy as jnp
  if jnp.dtype(a.dtype).name in _FLOAT8.values():
    return jax.lax.bitcast_convert_type(a, jnp.uint8)
  return a


def _torch_format(dtype, op: str, name: str) -> str:
  if dtype not in _QUANT_DTYPES:
    names = ", ".join(str(d).replace("torch.", "") for d in _QUANT_DTYPES)
    raise TypeError(
        f"{op}: {name} must be one of {names}, got "
        f"{str(dtype).replace('torch.', '')} (int4: torch has no 4-bit "
        "dtype that DLPack can carry; use pallas_kernels from JAX)")
  return _QUANT_DTYPES[dtype]


def _quantize_any_jax(x, *, fmt, axis, group_size, symmetric, backend=None):
  import jax.numpy as jnp

  import pallas_kernels
  out = pallas_kernels.quantize(x, getattr(jnp, fmt), axis=axis,
                                group_size=group_size, symmetric=symmetric,
                                backend=backend)
  return tuple(_to_bytes(a) for a in out)


_QUANTIZE_ANY = JaxOp("quantize", _quantize_any_jax, differentiable=())


def quantize(x, dtype, *, axis=-1, group_size=None, symmetric=True,
             backend=None):
  """``pallas_kernels.quantize``: float ``x`` to ``dtype`` (torch.int8,
  torch.float8_e4m3fn or torch.float8_e5m2) -> ``(q, scale)``, or ``(q,
  scale, zero)`` with ``symmetric=False`` (int8). No gradient."""
  op = "quantize"
  _check_tensor(op, "x", x, dtypes=_FLOATS)
  fmt = _torch_format(dtype, op, "dtype")
  _check_devices(op, dict(x=x))
  outs = _QUANTIZE_ANY([x], fmt=fmt, axis=axis, group_size=group_size,
                       symmetric=symmetric, backend=backend)
  q = outs[0].view(dtype) if dtype in _FLOAT8 else outs[0]
  if len(outs) == 3 and dtype in _FLOAT8:
    return q, outs[1], outs[2].view(dtype)
  return (q, *outs[1:])


def _quantized_matmul_jax(x, w, x_scale, w_scale, w_zero, bias, *, x_format,
                          w_format, **static):
  import pallas_kernels
  return pallas_kernels.quantized_matmul(
      _from_bytes(x, x_format), _from_bytes(w, w_format), x_scale=x_scale,
      w_scale=w_scale, w_zero=_from_bytes(w_zero, w_format), bias=bias,
      **static)


def _quantized_matmul_shards(static, spec, arrays, mesh):
  from pallas_kernels.quant import api
  x, _, x_scale, w_scale, w_zero, bias = arrays
  rule = api.matmul_rule(x_scale, w_scale, w_zero, bias,
                         group_size=static["group_size"],
                         weight_layout=static["weight_layout"],
                         x_ndim=x.dim())
  return _rows_specs("quantized_matmul", rule, spec, arrays, api.NAMES, "K")


_QUANTIZED_MATMUL = JaxOp("quantized_matmul", _quantized_matmul_jax,
                          differentiable=(0, 5),
                          shard_specs=_quantized_matmul_shards)


def quantized_matmul(x, w, *, x_scale=None, w_scale=None, w_zero=None,
                     group_size=None, bias=None, out_dtype=None,
                     weight_only=False, weight_layout="kn", block_sizes=None,
                     backend=None, partition_spec=None, mesh=None):
  """``pallas_kernels.quantized_matmul``: ``x [..., K] @ w`` for int8 or
  float8 ``w`` (``[K, N]``, or ``[N, K]`` with ``weight_layout="nk"``),
  with per-channel or group scales; x float (weight-only / dynamic) or of
  w's format with ``x_scale`` (w8a8, fp8 x fp8).

  ``partition_spec``: one entry per dim of x; the row dims may be split, K
  may not. Gradients as the JAX op's: in float x of a weight-only call and
  in bias; none for w, its scales and zeros (frozen), and asking for x's in
  dynamic mode (float x quantized on the fly) raises. For a trainable layer
  on frozen quantized weights (a LoRA adapter) use ``quantized_dense``.
  """
  op = "quantized_matmul"
  _check_tensor(op, "x", x, dtypes=tuple(_QUANT_DTYPES) + _FLOATS,
                min_ndim=1)
  _check_tensor(op, "w", w, ndim=2)
  w_format = _torch_format(w.dtype, op, "w")
  for name, t in (("x_scale", x_scale), ("w_scale", w_scale),
                  ("bias", bias)):
    _check_tensor(op, name, t, dtypes=_FLOATS, optional=True)
  if w_zero is not None and w_zero.dtype != w.dtype:
    raise TypeError(f"{op}: w_zero must have w's dtype "
                    f"({str(w.dtype).replace('torch.', '')}), got "
                    f"{str(w_zero.dtype).replace('torch.', '')}")
  _check_devices(op, dict(x=x, w=w, x_scale=x_scale, w_scale=w_scale,
                          w_zero=w_zero, bias=bias))
  if out_dtype is not None:
    import numpy as np

    from torch_bridge import _convert
    out_dtype = np.dtype(_convert.jax_dtype(out_dtype)).name
  static = dict(x_format=_format_name(x), w_format=w_format,
                group_size=group_size, out_dtype=out_dtype,
                weight_only=weight_only, weight_layout=weight_layout,
                block_sizes=_plain_matmul_block_sizes(block_sizes),
                backend=backend)
  static = _sharding(static, partition_spec, mesh, op)
  return _QUANTIZED_MATMUL([_bytes_of(x), _bytes_of(w), x_scale, w_scale,
                            _bytes_of(w_zero), bias], **static)[0]


def _quantized_dense_jax(x, w_q, w_scale, bias, w_zero, lora_a, lora_b, *,
                         w_format, **static):
  from pallas_kernels import nn
  lora = None if lora_a is None else (lora_a, lora_b)
  return nn.quantized_dense(x, _from_bytes(w_q, w_format), w_scale, bias,
                            w_zero=_from_bytes(w_zero, w_format), lora=lora,
                            **static)


def _quantized_dense_shards(static, spec, arrays, mesh):
  from pallas_kernels.quant import api
  rule = api.matmul_rule(None, None, None, None, group_size=None,
                         weight_layout="kn", x_ndim=arrays[0].dim())
  return _rows_specs("quantized_dense", rule, spec, arrays,
                     ("x", "w_q", "w_scale", "bias", "w_zero", "lora_a",
                      "lora_b"), "K")


_QUANTIZED_DENSE = JaxOp("quantized_dense", _quantized_dense_jax,
                         differentiable=(0, 3, 5, 6),
                         shard_specs=_quantized_dense_shards)


def quantized_dense(x, w_q, w_scale, bias=None, *, w_zero=None,
                    group_size=None, lora=None, lora_scale=1.0,
                    weight_layout="kn", backend=None, partition_spec=None,
                    mesh=None):
  """``pallas_kernels.nn.quantized_dense``: ``x @ dequant(w_q) + bias +
  lora_scale * (x @ a) @ b`` with frozen int8/float8 ``w_q`` (QLoRA-style).
  Differentiable in x, bias and ``lora = (a [K, r], b [r, N])``; w_q,
  w_scale and w_zero get no gradient.

  ``partition_spec``: one entry per dim of x; the row dims may be split, K
  may not (weights, scales and the adapter are replicated).
  """
  op = "quantized_dense"
  _check_tensor(op, "x", x, dtypes=_FLOATS, min_ndim=1)
  _check_tensor(op, "w_q", w_q, ndim=2)
  w_format = _torch_format(w_q.dtype, op, "w_q")
  _check_tensor(op, "w_scale", w_scale, dtypes=_FLOATS)
  _check_tensor(op, "bias", bias, dtypes=_FLOATS, optional=True)
  lora_a = lora_b = None
  if lora is not None:
    if not isinstance(lora, (tuple, list)) or len(lora) != 2:
      raise TypeError(f"{op}: lora must be an (a, b) pair of tensors")
    lora_a = _check_tensor(op, "lora[0]", lora[0], dtypes=_FLOATS, ndim=2)
    lora_b = _check_tensor(op, "lora[1]", lora[1], dtypes=_FLOATS, ndim=2)
  _check_devices(op, dict(x=x, w_q=w_q, w_scale=w_scale, bias=bias,
                          w_zero=w_zero, lora_a=lora_a, lora_b=lora_b))
  static = dict(w_format=w_format, group_size=group_size,
                lora_scale=float(lora_scale), weight_layout=weight_layout,
                backend=backend)
  static = _sharding(static, partition_spec, mesh, op)
  return _QUANTIZED_DENSE([x, _bytes_of(w_q), w_scale, bias,
                           _bytes_of(w_zero), lora_a, lora_b], **static)[0]


# ------------------------------------------------------ decode attention --

def _decode_jax(q, k_cache, v_cache, kv_lengths, sinks, page_table, k_scale,
                v_scale, *, cache_format, **static):
  import pallas_kernels
  return pallas_kernels.decode_attention(
      q, _from_bytes(k_cache, cache_format),
      _from_bytes(v_cache, cache_format), kv_lengths, sinks=sinks,
      page_table=page_table, k_scale=k_scale, v_scale=v_scale, **static)


def _decode_shards(static, spec, arrays, mesh):
  from pallas_kernels.decode import api
  _, _, _, _, sinks, page_table, k_scale, _ = arrays
  return _shards.specs(
      "decode_attention", api.call_rule(sinks, page_table, k_scale), spec,
      arrays, ("q", "k_cache", "v_cache", "kv_lengths", "sinks", "page_table",
               "k_scale", "v_scale"),
      lead="q", split="b", why="only the batch may be split")


_DECODE = JaxOp("decode_attention", _decode_jax, differentiable=(0, 4),
                shard_specs=_decode_shards)


def decode_attention(q, k_cache, v_cache, kv_lengths, *, sm_scale=None,
                     logit_soft_cap=None, sliding_window=None, sinks=None,
                     page_table=None, k_scale=None, v_scale=None,
                     backend=None, partition_spec=None, mesh=None):
  """``pallas_kernels.decode_attention``: ``q [B, H, T, D]`` attending to a
  contiguous ``[B, Hkv, S, D]`` or paged ``[pages, Hkv, page_size, D]`` KV
  cache (``page_table [B, pages_per_seq]``) of ``kv_lengths [B]`` tokens;
  8-bit caches (int8, float8) with ``k_scale``/``v_scale [Hkv]``.
  Differentiable in q and sinks.

  ``partition_spec``: 4 entries for q's dims; only the batch may be split
  (a contiguous cache, kv_lengths and the page table follow it; a paged
  cache's pages are shared, so they are replicated).
  """
  op = "decode_attention"
  _check_tensor(op, "q", q, dtypes=_FLOATS, ndim=4)
  for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
    _check_tensor(op, name, t, dtypes=_FLOATS + tuple(_QUANT_DTYPES), ndim=4)
  _check_tensor(op, "kv_lengths", kv_lengths, dtypes=_INTS, ndim=1)
  _check_tensor(op, "sinks", sinks, dtypes=_FLOATS, ndim=1, optional=True)
  _check_tensor(op, "page_table", page_table, dtypes=_INTS, ndim=2,
                optional=True)
  for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
    _check_tensor(op, name, t, dtypes=_FLOATS, optional=True)
  if k_cache.dtype != v_cache.dtype:
    raise TypeError(f"{op}: k_cache and v_cache must share a dtype, got "
                    f"{k_cache.dtype} and {v_cache.dtype}")
  _check_devices(op, dict(q=q, k_cache=k_cache, v_cache=v_cache,
                          kv_lengths=kv_lengths, sinks=sinks,
                          page_table=page_table, k_scale=k_scale,
                          v_scale=v_scale))
  # Lengths and page numbers are int32 in JAX (no 64-bit types there).
  kv_lengths, page_table = (
      t if t is None or t.dtype == torch.int32 else t.to(torch.int32)
      for t in (kv_lengths, page_table))
  static = dict(cache_format=_format_name(k_cache), sm_scale=sm_scale,
                logit_soft_cap=logit_soft_cap, sliding_window=sliding_window,
                backend=backend)
  static = _sharding(static, partition_spec, mesh, op)
  return _DECODE([q, _bytes_of(k_cache), _bytes_of(v_cache), kv_lengths,
                  sinks, page_table, k_scale, v_scale], **static)[0]


# -------------------------------------------------------- grouped matmul --

def _grouped_matmul_jax(lhs, rhs, group_sizes, group_offset, rhs_scale, *,
                        out_dtype, rhs_format, **static):
  import pallas_kernels
  if group_offset is not None:
    group_offset = group_offset.reshape(())
  return pallas_kernels.grouped_matmul(
      lhs, _from_bytes(rhs, rhs_format), group_sizes,
      group_offset=group_offset, rhs_scale=rhs_scale,
      preferred_element_type=out_dtype, **static)


def _grouped_matmul_shards(static, spec, arrays, mesh):
  from pallas_kernels.gmm import api
  return _shards.specs(
      "grouped_matmul", api.call_rule(arrays[4], static["transpose_rhs"]),
      spec, arrays, ("lhs", "rhs", "group_sizes", "group_offset",
                     "rhs_scale"),
      lead=("the output", "m n"), what="[M, N]",
      why="group_sizes count rows of all of lhs (each group a consecutive "
      "range); only N (dim 1) can be split")


_GROUPED_MATMUL = JaxOp("grouped_matmul", _grouped_matmul_jax,
                        differentiable=(0, 1, 4),
                        shard_specs=_grouped_matmul_shards)


def _group_sizes_int32(group_sizes, m: int):
  """int32 sizes with the op's result kept: int64 values are first clamped
  to [0, M] (negative sizes count as 0, a running sum stops at M)."""
  if group_sizes.dtype == torch.int64:
    group_sizes = group_sizes.clamp(0, m)
  return group_sizes.to(torch.int32)


def _float_dtype_name(op: str, name: str, dtype):
  """A torch float dtype (or None) as the JAX dtype's name."""
  if dtype is None:
    return None
  if dtype not in _FLOATS:
    raise TypeError(f"{op}: {name} must be None or one of float32, "
                    f"bfloat16, float16, got {dtype!r}")
  return str(dtype).replace("torch.", "")


def _tiles(op: str, name: str, tiles):
  """``(tm, tk, tn)`` as a tuple of ints, or None (the JAX op checks what
  the kernel needs of them)."""
  if tiles is None:
    return None
  if (not isinstance(tiles, (tuple, list)) or len(tiles) != 3 or not all(
      isinstance(t, int) and not isinstance(t, bool) for t in tiles)):
    raise ValueError(f"{op}: {name} must be None or three ints (tm, tk, "
                     f"tn), got {tiles!r}")
  return tuple(tiles)


def _grouped_checks(op, lhs, second, group_sizes, second_name, second_ndim,
                    quantized=False):
  _check_tensor(op, "lhs", lhs, dtypes=_FLOATS, ndim=2)
  _check_tensor(op, second_name, second, ndim=second_ndim,
                dtypes=tuple(_QUANT_DTYPES) if quantized else _FLOATS)
  _check_tensor(op, "group_sizes", group_sizes, dtypes=_INTS, ndim=1)
  _check_devices(op, {"lhs": lhs, second_name: second,
                      "group_sizes": group_sizes})
  if group_sizes.shape[0] == 0:
    raise ValueError(f"{op}: group_sizes must have at least one group "
                     "(G >= 1), got shape (0,)")


def grouped_matmul(lhs, rhs, group_sizes, *, transpose_rhs=False,
                   preferred_element_type=None, group_offset=None,
                   rhs_scale=None, block_sizes=None, backend=None,
                   partition_spec=None, mesh=None):
  """``pallas_kernels.grouped_matmul`` (``jax.lax.ragged_dot``): the rows of
  ``lhs [M, K]`` come in consecutive groups of ``group_sizes [G]`` (an
  integer tensor; changing it does not recompile) and group ``g``'s rows
  are multiplied by ``rhs[g]`` (``rhs [G, K, N]``, ``[G, N, K]`` with
  ``transpose_rhs``) -> ``[M, N]``; rows past the last group are zeros.
  Sizes are clamped to the rows that exist (negative ones count as 0).

  ``group_offset`` (expert parallelism): None, an int, or an integer
  tensor of one element; ``rhs`` then holds groups ``group_offset ..
  group_offset + G - 1`` of ``group_sizes [G_total]`` and rows of other
  groups give zeros. A tensor offset may change without recompiling.

  ``rhs_scale`` (quantized experts): ``rhs`` holds int8 or float8 codes and
  ``rhs_scale`` float32 their scales, ``[G, 1, N]`` per output channel or
  ``[G, K / group, N]`` per K group (``[G, N, 1]`` / ``[G, N, K / group]``
  with ``transpose_rhs``), as ``quantize`` makes them along K. Gradients
  reach lhs and rhs_scale.

  ``preferred_element_type``: the output dtype (a torch float dtype;
  default lhs's); sums are float32. Gradients in lhs and rhs (d lhs by the
  same kernel on the transposed weights, d rhs by the transposed grouped
  matmul); group_sizes takes none.

  ``partition_spec``: 2 entries for the output ``[M, N]``; only N may be
  split (rhs's N dimension follows it, lhs and group_sizes are replicated
  and d lhs is summed over the N shards). Rows cannot be split: the group
  sizes count rows of all of lhs.
  """
  op = "grouped_matmul"
  _grouped_checks(op, lhs, rhs, group_sizes, "rhs", 3,
                  quantized=rhs_scale is not None)
  _check_tensor(op, "rhs_scale", rhs_scale, dtypes=_FLOATS, ndim=3,
                optional=True)
  if not isinstance(transpose_rhs, bool):
    raise TypeError(f"{op}: transpose_rhs must be a bool, got "
                    f"{transpose_rhs!r}")
  k_axis = 2 if transpose_rhs else 1
  if rhs.shape[k_axis] != lhs.shape[1]:
    raise ValueError(f"{op}: rhs.shape[{k_axis}]={rhs.shape[k_axis]} must "
                     f"equal lhs's K={lhs.shape[1]} (rhs is "
                     f"{'[G, N, K]' if transpose_rhs else '[G, K, N]'} with "
                     f"transpose_rhs={transpose_rhs})")
  offset = _group_offset(op, group_offset, group_sizes, rhs.shape[0])
  if offset is None and group_sizes.shape[0] != rhs.shape[0]:
    raise ValueError(f"{op}: group_sizes must have shape ({rhs.shape[0]},) "
                     f"(one size per group of rhs), got "
                     f"{tuple(group_sizes.shape)}")
  static = dict(transpose_rhs=transpose_rhs, rhs_format=_format_name(rhs),
                out_dtype=_float_dtype_name(op, "preferred_element_type",
                                            preferred_element_type),
                block_sizes=_tiles(op, "block_sizes", block_sizes),
                backend=backend)
  static = _sharding(static, partition_spec, mesh, op)
  return _GROUPED_MATMUL([lhs, _bytes_of(rhs), _group_sizes_int32(
      group_sizes, lhs.shape[0]), offset, rhs_scale], **static)[0]


def _group_offset(op, group_offset, group_sizes, local_groups):
  """group_offset as an int32 tensor of shape (1,) on group_sizes' device,
  or None."""
  if group_offset is None:
    return None
  if group_sizes.shape[0] < local_groups:
    raise ValueError(f"{op}: with group_offset, group_sizes [G_total] must "
                     f"have at least rhs's {local_groups} groups, got "
                     f"{tuple(group_sizes.shape)}")
  if isinstance(group_offset, torch.Tensor):
    if group_offset.numel() != 1 or group_offset.dim() > 1 or (
        group_offset.dtype not in _INTS):
      raise ValueError(f"{op}: group_offset must be an int or an integer "
                       f"tensor of one element, got {group_offset.dtype} of "
                       f"shape {tuple(group_offset.shape)}")
    offset = group_offset.reshape(1).to(torch.int32)
  elif isinstance(group_offset, int) and not isinstance(group_offset, bool):
    total = group_sizes.shape[0]
    if not 0 <= group_offset <= total - local_groups:
      raise ValueError(f"{op}: group_offset={group_offset} must be in [0, "
                       f"{total - local_groups}] (group_sizes has {total} "
                       f"groups, rhs {local_groups})")
    offset = torch.tensor([group_offset], dtype=torch.int32)
  else:
    raise TypeError(f"{op}: group_offset must be None, an int or an integer "
                    f"tensor, got {type(group_offset).__name__}")
  return offset.to(group_sizes.device)


def _tgmm_jax(lhs, dout, group_sizes, group_offset, *, out_dtype,
              num_groups, block_sizes, backend):
  import jax.numpy as jnp

  from pallas_kernels import _backend
  from pallas_kernels.gmm import api
  _backend.check_backend(api.OP, backend)
  offset = (jnp.zeros((), jnp.int32) if group_offset is None
            else group_offset.reshape(()))
  return api._run_tgmm(lhs, dout.astype(lhs.dtype), group_sizes, offset,
                       num_groups, jnp.dtype(out_dtype or lhs.dtype),
                       api._check_tiles(block_sizes), backend)


# No gradient: torch_xla's tgmm has none, and the kernels have no VJP.
_TGMM = JaxOp("grouped_matmul_tgmm", _tgmm_jax, differentiable=())


def _grouped_matmul_tgmm(lhs, dout, group_sizes, *, out_dtype=None,
                         block_sizes=None, group_offset=None, num_groups=None,
                         backend=None):
  """The transposed grouped matmul, ``grouped_matmul``'s d rhs: ``lhs [M,
  K]``, ``dout [M, N]`` -> ``[G, K, N]`` with ``out[g] = lhs_g^T @ dout_g``
  over group ``g``'s rows (grouped as by ``grouped_matmul``; rows past the
  last group add nothing, a group with no rows gives zeros). dout is cast
  to lhs's dtype, sums are float32, the output is ``out_dtype`` (default
  lhs's). With ``group_offset`` / ``num_groups`` (default 0 / G - offset
  for an int offset, G for a tensor one), the output holds groups
  ``group_offset .. group_offset + num_groups - 1``. No gradient."""
  op = "tgmm"
  _grouped_checks(op, lhs, dout, group_sizes, "dout", 2)
  if dout.shape[0] != lhs.shape[0]:
    raise ValueError(f"{op}: dout has {dout.shape[0]} rows, lhs has "
                     f"{lhs.shape[0]}; they must be equal (M)")
  total = group_sizes.shape[0]
  if num_groups is None:
    num_groups = total - group_offset if isinstance(group_offset, int) and (
        not isinstance(group_offset, bool)) else total
  if (isinstance(num_groups, bool) or not isinstance(num_groups, int)
      or not 1 <= num_groups <= total):
    raise ValueError(f"{op}: num_groups must be an int in [1, {total}] (the "
                     f"groups of group_sizes), got {num_groups!r}")
  offset = _group_offset(op, group_offset, group_sizes, num_groups)
  static = dict(out_dtype=_float_dtype_name(op, "out_dtype", out_dtype),
                num_groups=num_groups,
                block_sizes=_tiles(op, "block_sizes", block_sizes),
                backend=backend)
  return _TGMM([lhs, dout, _group_sizes_int32(group_sizes, lhs.shape[0]),
                offset], **static)[0]


# ----------------------------------------------- ragged paged attention --

def _ragged_jax(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                sinks, *, cache_format, **static):
  import pallas_kernels
  return pallas_kernels.ragged_paged_attention(
      q, _from_bytes(kv_pages, cache_format), kv_lens, page_indices,
      cu_q_lens, num_seqs, sinks=sinks, **static)


def _mla_jax(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sinks,
             *, cache_format, **static):
  import pallas_kernels
  return pallas_kernels.mla_ragged_paged_attention(
      q, _from_bytes(kv_pages, cache_format), kv_lens, page_indices,
      cu_q_lens, num_seqs, sinks=sinks, **static)


# pallas_kernels.ragged's (JAX's) default, computed without importing JAX.
_RAGGED_MASK_VALUE = -0.7 * float(torch.finfo(torch.float32).max)
# Forward only (serving): the kernels have no VJP.
_RAGGED = JaxOp("ragged_paged_attention", _ragged_jax, differentiable=())
_MLA = JaxOp("mla_ragged_paged_attention", _mla_jax, differentiable=())


def _static_float(op: str, name: str, value):
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise TypeError(f"{op}: {name} must be a Python float or None, got "
                    f"{type(value).__name__}")
  return float(value)


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens,
                           num_seqs, *, sm_scale=1.0, sliding_window=None,
                           soft_cap=None, mask_value=_RAGGED_MASK_VALUE,
                           k_scale=None, v_scale=None,
                           num_kv_pages_per_block=None,
                           num_queries_per_block=None, vmem_limit_bytes=None,
                           sinks=None, backend=None):
  """``pallas_kernels.ragged_paged_attention`` (JAX's convention): the
  query tokens ``q [T, H, D]`` of ragged sequences (``cu_q_lens [S + 1]``;
  prefill and decode mixed) attend causally to their paged KV cache
  ``kv_pages [num_pages, page_size, 2 * Hkv, D]`` (K of kv head h at
  combined head 2h, V at 2h + 1; float, or int8/float8 with the float
  ``k_scale``/``v_scale``) of ``kv_lens [S]`` tokens through
  ``page_indices [S, pages_per_seq]``; only the first ``num_seqs [1]``
  sequences count. Token t of sequence i sits at position ``kv_lens[i] -
  q_len_i + (t - cu_q_lens[i])``. ``sinks [H]``: attention sinks.
  ``mask_value`` is accepted and unused (masked logits are excluded
  exactly). Returns ``[T, H, D]`` in q's dtype (zeros for tokens outside
  the sequences). Forward only: no gradient. No ``partition_spec`` (under
  SPMD it runs unsharded).
  """
  op = "ragged_paged_attention"
  args, static = _paged_args(
      op, 4, q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sinks,
      sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
      k_scale=k_scale, v_scale=v_scale,
      num_kv_pages_per_block=num_kv_pages_per_block,
      num_queries_per_block=num_queries_per_block,
      vmem_limit_bytes=vmem_limit_bytes, backend=backend)
  del mask_value
  return _RAGGED(args, **static)[0]


def mla_ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens,
                               num_seqs, *, latent_dim, sm_scale=None,
                               sliding_window=None, soft_cap=None,
                               k_scale=None, v_scale=None,
                               num_kv_pages_per_block=None,
                               num_queries_per_block=None,
                               vmem_limit_bytes=None, sinks=None,
                               backend=None):
  """``pallas_kernels.mla_ragged_paged_attention``: DeepSeek's absorbed MLA
  over a paged cache of one latent row per token, ``kv_pages [num_pages,
  page_size, D]`` (latent ‖ rope); every head of ``q [T, H, D]`` attends
  with keys the whole row and values its first ``latent_dim`` columns.
  Metadata and options as ``ragged_paged_attention``'s; ``sm_scale``
  defaults to ``1 / sqrt(D)``. Returns ``[T, H, latent_dim]`` in q's dtype.
  Forward only; no ``partition_spec``.
  """
  op = "mla_ragged_paged_attention"
  args, static = _paged_args(
      op, 3, q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sinks,
      sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
      k_scale=k_scale, v_scale=v_scale,
      num_kv_pages_per_block=num_kv_pages_per_block,
      num_queries_per_block=num_queries_per_block,
      vmem_limit_bytes=vmem_limit_bytes, backend=backend)
  return _MLA(args, latent_dim=latent_dim, **static)[0]


def _paged_args(op, cache_ndim, q, kv_pages, kv_lens, page_indices,
                cu_q_lens, num_seqs, sinks, *, sm_scale, soft_cap, k_scale,
                v_scale, **static):
  """The paged ops' checked tensors (lengths as int32, the cache as bytes)
  and static arguments."""
  _check_tensor(op, "q", q, dtypes=_FLOATS, ndim=3)
  _check_tensor(op, "kv_pages", kv_pages,
                dtypes=_FLOATS + tuple(_QUANT_DTYPES), ndim=cache_ndim)
  _check_tensor(op, "kv_lens", kv_lens, dtypes=_INTS, ndim=1)
  _check_tensor(op, "page_indices", page_indices, dtypes=_INTS, ndim=2)
  _check_tensor(op, "cu_q_lens", cu_q_lens, dtypes=_INTS, ndim=1)
  _check_tensor(op, "num_seqs", num_seqs, dtypes=_INTS, ndim=1)
  _check_tensor(op, "sinks", sinks, dtypes=_FLOATS, ndim=1, optional=True)
  _check_devices(op, dict(q=q, kv_pages=kv_pages, kv_lens=kv_lens,
                          page_indices=page_indices, cu_q_lens=cu_q_lens,
                          num_seqs=num_seqs, sinks=sinks))
  # Lengths and page numbers are int32 in JAX (no 64-bit types there).
  kv_lens, page_indices, cu_q_lens, num_seqs = (
      t if t.dtype == torch.int32 else t.to(torch.int32)
      for t in (kv_lens, page_indices, cu_q_lens, num_seqs))
  static = dict(static, cache_format=_format_name(kv_pages),
                sm_scale=_static_float(op, "sm_scale", sm_scale),
                soft_cap=_static_float(op, "soft_cap", soft_cap),
                k_scale=_static_float(op, "k_scale", k_scale),
                v_scale=_static_float(op, "v_scale", v_scale))
  return [q, _bytes_of(kv_pages), kv_lens, page_indices, cu_q_lens,
          num_seqs, sinks], static


# ------------------------------------------------------------ IoU family --

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


def _widened(t, wide: bool):
  return t.double() if wide else t


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


# ------------------------------------------------------------------- NMS --

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


__all__ = ["UnshardedWarning"] + [op.name for op in _registry.torch_ops()]

# The public typed ops ``torch.ops.pallas_kernels.<name>`` (they call the
# functions above).
schemas.register({op.name: globals()[op.name]
                  for op in _registry.torch_ops()})
