"""Public ops: ``quantize`` and ``quantized_matmul`` for int8, int4,
float8_e4m3fn and float8_e5m2 weights (``w.dtype`` picks the format); modes
raw, dequant, dynamic and weight-only, per channel or with group scales.
Kernel choice: the first of mosaic_tpu, mosaic_gpu, triton, reference that
supports the call; int8 x int8 calls without groups run the int8 kernels.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp

from pallas_kernels import _backend, _frozen, _sharding
from pallas_kernels.quant import int8_api
from pallas_kernels.quant import int8_mosaic_gpu
from pallas_kernels.quant import int8_mosaic_tpu
from pallas_kernels.quant import (formats, mosaic_gpu, mosaic_tpu, operands,
                                  reference, triton)

OP = "quantized_matmul"


def quantize(x, dtype, *, axis=-1, group_size=None, symmetric=True,
             backend=None):
  """Quantize float ``x`` to ``dtype`` (int8, int4, float8_e4m3fn,
  float8_e5m2): ``(q, scale)``, or ``(q, scale, zero)`` for
  ``symmetric=False``, with ``x ~= q * scale`` (``(q - zero) * scale``).

  Groups of ``group_size`` consecutive values along ``axis`` share a scale
  (without it the whole axis; ``axis=None``: all of x). Symmetric: scale =
  max|x| / qmax (127, 7, 448, 57344), q = round_half_even(x * (1/scale))
  clipped to +-qmax (fp8: saturated, then rounded to the fp8 grid).
  Asymmetric (int8, int4): scale = (max(x, 0) - min(x, 0)) / (2^bits - 1),
  zero = round(qmin - min / scale), q = round(x / scale) + zero, clipped.
  NaN quantizes to 0 and makes its group's scale NaN. Formulas:
  ``quant.formats`` (docs/design/quantized.md).

  Args:
    x: bfloat16, float16 or float32 array.
    dtype: jnp.int8, jnp.int4, jnp.float8_e4m3fn or jnp.float8_e5m2.
    axis: the axis reduced (an int), or None for one scale.
    group_size: values per scale along ``axis`` (the last group holds the
      remainder when it does not divide the length).
    symmetric: False adds a zero point (integer formats).
    backend: None, "mosaic_tpu", "interpret" or "reference"; the TPU kernel
      takes symmetric int8 along the last axis (``quantize_int8``'s).
  Returns:
    q: ``dtype``, x's shape. scale (float32) and zero (``dtype``): x's shape
    with ``axis`` of length ceil(len / group_size) (1 without groups), 0-d
    for ``axis=None``.
  """
  _backend.check_backend("quantize", backend)
  fmt, axis, group_size = operands.quantize_args(x, dtype, axis, group_size,
                                                 symmetric)
  if backend == "gpu":
    backend = "reference"  # XLA fuses the reference into one pass
  xla = functools.partial(reference.quantize_groups, fmt=fmt, axis=axis,
                          group_size=group_size, symmetric=symmetric)

  def supports():
    if not (fmt.name == "int8" and symmetric and group_size is None):
      return "the TPU kernel quantizes symmetric int8 without groups"
    if axis is None or axis != x.ndim - 1 or x.size == 0:
      return "the TPU kernel quantizes along the last axis of a non-empty x"
    return None

  def tpu(x_, interpret=None):
    q, scale = int8_mosaic_tpu.quantize_rows(
        x_.reshape(-1, x_.shape[-1]), interpret=interpret or False)
    return q.reshape(x_.shape), scale.reshape(x_.shape[:-1] + (1,))

  rule = None
  if supports() is None:  # rows split freely; the quantized axis never
    lead = " ".join(f"a{i}" for i in range(x.ndim - 1))
    rule = _sharding.make_rule(
        "quantize", [("x", lead + " r")], [lead + " r", lead + " one"],
        split=lead, helper="jax.shard_map",
        names={"r": "quantized (last)"})
  return _backend.dispatch(
      "quantize", backend,
      [_backend.Kernel("mosaic_tpu", tpu, supports=supports),
       _backend.Kernel("reference", xla)], x, rule=rule)


def _int8_kernel(w, static) -> bool:
  """Whether the int8 family's kernels take the call."""
  return (formats.format_of(w.dtype).name == "int8"
          and static["group_size"] is None)


def quantized_matmul(x, w, *, x_scale=None, w_scale=None, w_zero=None,
                     group_size=None, bias=None, out_dtype=None,
                     weight_only=False, weight_layout="kn", block_sizes=None,
                     backend=None):
  """x @ w for quantized w (int8, int4, fp8) with a fused epilogue.

  Modes: raw (int8 x int8, exact int32); dequant (int8 x int8 or fp8 x fp8
  with scales: ``((acc * x_scale) * w_scale + bias)`` in float32, per group
  with ``group_size``); dynamic (float x quantized per row into w's format,
  then dequant); weight_only (float x times w dequantized exactly or per
  group in float32, rounded to x's dtype; float32 sums). Not differentiable
  in w. Details: docs/design/quantized.md.

  Args:
    x: [..., K] bfloat16/float16/float32, or int8 / fp8 (with x_scale).
    w: [K, N] (or [N, K] with weight_layout="nk") of int8, jnp.int4,
      float8_e4m3fn or float8_e5m2.
    x_scale: quantized x only: a scalar, x.shape[:-1] or x.shape[:-1] + (1,);
      with group_size also x.shape[:-1] + (G,), G = ceil(K / g).
    w_scale: a scalar, [N] or [1, N] ("nk" also [N, 1]: what quantize(w,
      axis=<K's axis>) returns); with group_size [G, N] ([N, G] for "nk").
    w_zero: integer w of a weight-only call: zero points, w_scale's shape
      (per channel: one group of all K; what quantize(..., symmetric=False)
      returns).
    group_size: sub-channel group along K (weight-only or quantized x). If
      it does not divide K, the last group is partial: x and w are then
      zero-padded along K on every call (pad w once, ahead, to avoid that
      copy).
    bias: [N] or [1, N], added after scaling.
    out_dtype: int32 (raw mode) or a float dtype.
    weight_only: float x times the dequantized w.
    weight_layout: "kn" or "nk".
    block_sizes: None, BlockSizes / (bm, bk, bn[, warps, stages]), a dict,
      or a TPU generation name for that table row.
    backend: None, "mosaic_tpu", "triton", "gpu", "interpret", "reference".
  Returns:
    x.shape[:-1] + (N,): int32 in raw mode, else out_dtype (default bfloat16
    for quantized x, x's dtype for float x).
  """
  _backend.check_backend(OP, backend)
  call = operands.matmul_call(
      x, w, x_scale=x_scale, w_scale=w_scale, w_zero=w_zero,
      group_size=group_size, bias=bias, out_dtype=out_dtype,
      weight_only=weight_only, weight_layout=weight_layout)
  user_blocks, generation = int8_api.as_block_sizes(block_sizes, OP)
  if call.empty:
    return call.result(reference.matmul_2d(*call.operands, **call.static))
  kernels = _kernels(call, user_blocks, generation)
  out = _frozen.frozen(
      OP, lambda *a: _backend.dispatch(OP, backend, kernels, *a,
                                       rule=_rule(call)),
      NAMES, call.operands, _linear(call), _reasons(call))
  return call.result(out)


NAMES = ("x", "w", "x_scale", "w_scale", "w_zero", "bias")


def _linear(call):
  """The operands the result is differentiable in, and its tangent in each
  (plain JAX, so reverse mode transposes it)."""
  m, n = call.operands[0].shape[0], call.n

  def bias(t, *_):
    return jnp.broadcast_to(t.astype(jnp.float32), (m, n))

  if call.mode != "weight_only":
    return {"bias": bias}

  def x(t, x2, w, xs, ws, wz, b):
    return reference.matmul_2d(t, w, None, ws, wz, None, mode="weight_only",
                               out_dtype=jnp.float32, w_layout=call.w_layout,
                               group_size=call.group_size)
  return {"x": x, "bias": bias}


def _reasons(call):
  w = call.operands[1]
  frozen = "quantized weights are frozen (not differentiable)"
  x_reason = (
      f"x is quantized ({call.operands[0].dtype.name}); {frozen}"
      if call.mode == "dequant" else
      "float x is quantized per row on the fly (dynamic mode), which has no "
      "gradient: pass weight_only=True to differentiate in x")
  return {
      "x": x_reason,
      "w": (f"w is a quantized weight ({w.dtype.name}): {frozen}; train "
            "through pallas_kernels.nn.quantized_dense (a LoRA adapter)"),
      "x_scale": "x_scale belongs to the quantized x: not differentiable",
      "w_scale": f"w_scale belongs to the quantized weight: {frozen}",
      "w_zero": f"w_zero belongs to the quantized weight: {frozen}",
  }


def _kernels(call, user_blocks, generation):
  """quantized_matmul's implementations for one normalized call, best first."""
  static = call.static
  w = call.operands[1]
  int8_path = _int8_kernel(w, static)
  int8_static = dict(mode=call.mode, out_dtype=call.out_dtype,
                     w_layout=call.w_layout)

  def tpu(x2, w_, xs, ws, wz, b, interpret=None):
    interpret = interpret or False
    if int8_path:
      return int8_mosaic_tpu.matmul(x2, w_, xs, ws, b, **int8_static,
                                    block_sizes=user_blocks,
                                    generation=generation, interpret=interpret)
    return mosaic_tpu.matmul(x2, w_, xs, ws, wz, b, **static,
                             block_sizes=user_blocks, generation=generation,
                             interpret=interpret)

  def triton_(x2, w_, xs, ws, wz, b, interpret=None):
    interpret = interpret or False
    if int8_path:
      return triton.int8_matmul(x2, w_, xs, ws, b, **int8_static,
                                block_sizes=user_blocks, interpret=interpret)
    return triton.matmul(x2, w_, xs, ws, wz, b, **static,
                         block_sizes=user_blocks, interpret=interpret)

  product = call.mode != "weight_only"  # 8-bit x (or x quantized) times w

  def mgpu(x2, w_, xs, ws, wz, b, interpret=None):
    if product:
      return mosaic_gpu.matmul(x2, w_, xs, ws, b, **int8_static,
                               interpret=interpret or False)
    return int8_mosaic_gpu.matmul(x2, w_, xs, ws, b, **int8_static,
                                  group_size=call.group_size, w_zero=wz,
                                  integer_zero=call.integer_zero,
                                  interpret=interpret or False)

  def mgpu_supports():
    if product:
      if call.group_size is not None:
        return ("the Mosaic GPU 8-bit kernel takes per-row x and "
                "per-channel w scales only (no group_size)")
      return mosaic_gpu.auto_refusal(call.operands[0], w, mode=call.mode,
                                     out_dtype=call.out_dtype,
                                     user_blocks=user_blocks)
    return int8_api.mosaic_gpu_refusal(call.operands[0], w, call.operands[2],
                                       call.mode, call.w_layout, user_blocks,
                                       group_size=call.group_size,
                                       w_zero=call.operands[4])

  def supports(kernel):
    return lambda: (None if int8_path else
                    kernel.supports(w, call.group_size, call.w_layout,
                                    call.mode))

  return [
      _backend.Kernel("mosaic_tpu", tpu, supports=supports(mosaic_tpu)),
      _backend.Kernel("mosaic_gpu", mgpu, supports=mgpu_supports,
                      hardware=(mosaic_gpu.hardware if product
                                else int8_mosaic_gpu.hardware)),
      _backend.Kernel("triton", triton_, supports=supports(triton)),
      _backend.Kernel("reference", functools.partial(reference.matmul_2d,
                                                     **static)),
  ]


def _rule(call):
  """Rows (m) and output columns (n) split; K and groups never."""
  x2, w, x_scale, w_scale, w_zero, bias = call.operands
  return matmul_rule(x_scale, w_scale, w_zero, bias,
                     group_size=call.group_size, weight_layout=call.w_layout)


def matmul_rule(x_scale, w_scale, w_zero, bias, *, group_size,
                weight_layout, x_ndim=2):
  """:func:`quantized_matmul`'s rule on its operands (x of rank
  ``x_ndim``, ``[..., K]``; the kernel's x is 2-D); the scales, zeros and
  bias broadcast against x and the output numpy-style."""
  rows = _sharding.row_factors(x_ndim - 1)
  maybe = lambda value, factors: (  # noqa: E731
      None if value is None else
      _sharding.trailing_factors(value.shape, factors, "one"))
  grouped = group_size is not None
  return _sharding.make_rule(
      OP,
      [("x", rows + " k"), ("w", "k n" if weight_layout == "kn" else "n k"),
       ("x_scale", maybe(x_scale, rows + (" g" if grouped else " s"))),
       ("w_scale", maybe(w_scale, "g n" if grouped else "s n")),
       ("w_zero", maybe(w_zero, "g n")), ("bias", maybe(bias, "s n"))],
      [rows + " n"], split=rows + " n", helper="jax.shard_map",
      names={"k": "K (contracted)", "n": "N (output columns)",
             "g": "K groups", **{m: "rows" for m in rows.split()}})
