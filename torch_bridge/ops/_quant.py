"""The quantization family: quantize_int8, int8_matmul, int8_dense, quantize,
quantized_matmul, quantized_dense.
"""
from __future__ import annotations

import dataclasses

import torch

from torch_bridge import _shards
from torch_bridge._core import JaxOp
from torch_bridge.ops._common import (
    _FLOAT8, _FLOATS, _QUANT_DTYPES, _bytes_of, _check_devices,
    _check_tensor, _format_name, _from_bytes, _sharding, _to_bytes,
    _torch_format)


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


def _plain_matmul_block_sizes(block_sizes):
  """A matmul ``BlockSizes`` dataclass as the literal dict of its fields
  (the JAX matmuls take such a dict); other values unchanged."""
  if dataclasses.is_dataclass(block_sizes):
    return dataclasses.asdict(block_sizes)
  return block_sizes


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
