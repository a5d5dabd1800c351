"""Plain-JAX ``quantize`` and ``quantized_matmul``: the semantics every kernel
matches (the arithmetic is ``formats``'). Integer sums are exact, fp8
products exact and summed in float32; group scales apply per group in order,
then bias; weight-only dequantizes w per group in float32 and rounds to x's
dtype before the float32-summed dot. Modes in full: docs/design/quantized.md.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.quant import int8_quantize as int8_quant
from pallas_kernels.quant import int8_reference
from pallas_kernels.quant import formats, operands


def quantize_groups(x, fmt, axis, group_size, symmetric):
  """``quantize``'s normalized call in plain JAX."""
  x = jnp.asarray(x).astype(jnp.float32)
  quantize_ = formats.symmetric if symmetric else formats.asymmetric
  if axis is None or group_size is None:
    return quantize_(x, fmt, axis)
  length = x.shape[axis]
  groups = operands.group_count(length, group_size)
  # A partial last group is padded with copies of its last value, which
  # leave its max |x|, min and max unchanged.
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, groups * group_size - length)
  padded = jnp.pad(x, widths, mode="edge")
  xg = padded.reshape(x.shape[:axis] + (groups, group_size)
                      + x.shape[axis + 1:])
  q, *rest = quantize_(xg, fmt, axis + 1)
  kept = x.shape[:axis] + (groups,) + x.shape[axis + 1:]
  q = jax.lax.slice_in_dim(q.reshape(padded.shape), 0, length, axis=axis)
  return (q, *(r.reshape(kept) for r in rest))


def quantize(x, dtype, *, axis=-1, group_size=None, symmetric=True):
  """Same as ``pallas_kernels.quantize`` (plain JAX)."""
  fmt, axis, group_size = operands.quantize_args(x, dtype, axis, group_size,
                                                 symmetric)
  return quantize_groups(x, fmt, axis, group_size, symmetric)


def expand_groups(a, group_size):
  """[G, N] -> [G * group_size, N], each row repeated group_size times."""
  return jnp.repeat(a, group_size, axis=0)


def dequantize_weight(w, w_scale, w_zero, group_size, dtype):
  """w [K, N] with per-group [G, N] scale (and zero) -> ``dtype``, computed
  as ((w - zero) * scale) in float32."""
  wf = w.astype(jnp.float32)
  if w_zero is not None:
    wf = wf - expand_groups(w_zero, group_size)
  return (wf * expand_groups(w_scale, group_size)).astype(dtype)


def _dot(x, w, precision=jax.lax.Precision.HIGHEST):
  return jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())),
                             precision=precision,
                             preferred_element_type=jnp.float32)


def group_products(x2, w, x_scale, w_scale, group_size):
  """sum over groups g of (x_g @ w_g) * x_scale[:, g] * w_scale[g] in
  float32, groups in order: x2 [M, K] and w [K, N] int8 (each group's sum
  exact in int32) or fp8 (exact products, float32 sums); x_scale [M, G],
  w_scale [G, N]."""
  m, k = x2.shape
  n = w.shape[1]
  groups = k // group_size
  xg = x2.reshape(m, groups, group_size).transpose(1, 0, 2)
  wg = w.reshape(groups, group_size, n)
  integer = x2.dtype == jnp.int8

  def add_group(total, group):
    x_, w_, xs, ws = group
    if integer:
      acc = jax.lax.dot_general(x_, w_, (((1,), (0,)), ((), ())),
                                preferred_element_type=jnp.int32)
    else:
      acc = _dot(x_.astype(jnp.float32), w_.astype(jnp.float32))
    return total + acc.astype(jnp.float32) * xs[:, None] * ws[None, :], None

  total, _ = jax.lax.scan(add_group, jnp.zeros((m, n), jnp.float32),
                          (xg, wg, x_scale.T, w_scale))
  return total


def matmul_2d(x2, w, x_scale, w_scale, w_zero, bias, *, mode, out_dtype,
              w_layout="kn", group_size=None):
  """The normalized 2-D problem (``operands.MatmulCall``)."""
  if w_layout == "nk":
    w = w.T
  fmt = formats.format_of(w.dtype)
  if fmt.name == "int8" and mode != "weight_only" and group_size is None:
    return int8_reference.matmul_2d(x2, w, x_scale, w_scale, bias, mode=mode,
                                    out_dtype=out_dtype)
  if mode == "dynamic":
    x2, x_scale = quantize_groups(x2, fmt, 1, None, True)
    mode = "dequant"
  if mode == "dequant" and group_size is not None:
    out = group_products(x2, w, x_scale, w_scale, group_size)
    return int8_quant.epilogue(out, None, None, bias, out_dtype)
  if mode == "dequant":  # fp8 x fp8: exact products, float32 sums
    acc = _dot(x2.astype(jnp.float32), w.astype(jnp.float32))
    return int8_quant.epilogue(acc, x_scale, w_scale, bias, out_dtype)
  if group_size is None:
    acc = _dot(x2, w.astype(jnp.float32).astype(x2.dtype))
    return int8_quant.epilogue(acc, None, w_scale, bias, out_dtype)
  w_deq = dequantize_weight(w, w_scale, w_zero, group_size, x2.dtype)
  return int8_quant.epilogue(_dot(x2, w_deq), None, None, bias, out_dtype)


def quantized_matmul(x, w, *, x_scale=None, w_scale=None, w_zero=None,
                     group_size=None, bias=None, out_dtype=None,
                     weight_only=False, weight_layout="kn"):
  """Same as ``pallas_kernels.quantized_matmul(..., backend="reference")``."""
  call = operands.matmul_call(
      x, w, x_scale=x_scale, w_scale=w_scale, w_zero=w_zero,
      group_size=group_size, bias=bias, out_dtype=out_dtype,
      weight_only=weight_only, weight_layout=weight_layout)
  return call.result(matmul_2d(*call.operands, **call.static))
