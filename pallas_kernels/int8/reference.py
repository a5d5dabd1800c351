"""Plain-JAX int8 quantization and int8 matmul: the semantics every kernel matches.

quantize_int8(x, axis)
  amax  = max |x| over ``axis`` (keepdims; every axis when ``axis=None``)
  scale = amax * float32(1/127), or 1 where amax == 0 (never a division by 0)
  q     = clip(round_half_to_even(x / scale), -127, 127) as int8; NaN -> 0
  Returned scale is float32 with ``axis`` kept as size 1 (a 0-d scalar for
  ``axis=None``), so ``q * scale`` broadcasts back to ``x``. A row holding
  NaN or +-inf gets a NaN/inf scale, so anything dequantized from it is
  non-finite too: quantization never turns a bad value into a plausible one.

int8_matmul(x, w, x_scale, w_scale, bias, out_dtype, weight_only)
  acc = x @ w with exact int32 accumulation (int8 x) or float32 accumulation
        of x @ float(w) (weight-only, float x).
  raw mode (int8 x, no scale, no bias, out_dtype None/int32): acc itself.
  otherwise: out = ((float32(acc) * x_scale) * w_scale + bias) -> out_dtype,
        in that order, all in float32; a missing scale is 1, missing bias 0.
  float x without ``weight_only`` is first quantized per row
  (``quantize_int8(x, axis=-1)``) and its scale used as x_scale.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

INT8_MAX = 127


def round_to_int8(x, scale):
  q = jnp.round(x / scale)  # jnp.round rounds half to even
  q = jnp.clip(q, -INT8_MAX, INT8_MAX)
  q = jnp.where(jnp.isnan(q), 0.0, q)
  return q.astype(jnp.int8)


def scale_from_amax(amax):
  # A multiply, not a division: compilers may turn a division by a constant
  # into one, and kernel and reference must round identically.
  return jnp.where(amax == 0, jnp.float32(1), amax * jnp.float32(1 / INT8_MAX))


def quantize_xla(x, axis=-1):
  """Symmetric int8 quantization of ``x`` along ``axis`` (see module doc)."""
  x = jnp.asarray(x).astype(jnp.float32)
  if axis is None:
    scale = scale_from_amax(jnp.max(jnp.abs(x)) if x.size else jnp.float32(0))
    return round_to_int8(x, scale), scale
  amax = jnp.max(jnp.abs(x), axis=axis, keepdims=True, initial=0.0)
  scale = scale_from_amax(amax)
  return round_to_int8(x, scale), scale


def int32_dot(x2, w):
  return jax.lax.dot_general(x2, w, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.int32)


def float_dot(x2, w):
  """x (float) @ w (int8) with the weights upcast exactly to x's dtype."""
  return jax.lax.dot_general(x2, w.astype(x2.dtype), (((1,), (0,)), ((), ())),
                             precision=jax.lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)


def epilogue(acc, x_scale, w_scale, bias, out_dtype):
  """acc [M, N] -> ((acc * x_scale) * w_scale + bias) in float32 -> out_dtype.

  x_scale is [M, 1] or None, w_scale and bias are [1, N] or None.
  """
  out = acc.astype(jnp.float32)
  if x_scale is not None:
    out = out * x_scale
  if w_scale is not None:
    out = out * w_scale
  if bias is not None:
    out = out + bias
  return out.astype(out_dtype)


def matmul_2d(x2, w, x_scale, w_scale, bias, *, mode, out_dtype,
              w_layout="kn"):
  """The 2-D problem after the public API normalized shapes and dtypes.

  mode: "raw" (int8 x, int32 out), "dequant" (int8 x), "dynamic" (float x,
  quantized per row here) or "weight_only" (float x). Scales are float32
  [M, 1] / [1, N] or None, bias float32 [1, N] or None. w is [K, N], or
  [N, K] for w_layout "nk".
  """
  if w_layout == "nk":
    w = w.T
  if mode == "raw":
    return int32_dot(x2, w)
  if mode == "weight_only":
    return epilogue(float_dot(x2, w), None, w_scale, bias, out_dtype)
  if mode == "dynamic":
    x2, x_scale = quantize_xla(x2, axis=-1)
  return epilogue(int32_dot(x2, w), x_scale, w_scale, bias, out_dtype)


def quantize_int8(x, *, axis=-1):
  """Same as ``pallas_kernels.quantize_int8(..., backend="reference")``."""
  from pallas_kernels.int8 import api
  return api.quantize_int8(x, axis=axis, backend="reference")


def int8_matmul(x, w, *, x_scale=None, w_scale=None, bias=None,
                out_dtype=None, weight_only=False, weight_layout="kn"):
  """Same as ``pallas_kernels.int8_matmul(..., backend="reference")``."""
  from pallas_kernels.int8 import api
  return api.int8_matmul(x, w, x_scale=x_scale, w_scale=w_scale, bias=bias,
                         out_dtype=out_dtype, weight_only=weight_only,
                         weight_layout=weight_layout, backend="reference")


def split_kernel_refs(refs, *, has_xs, has_ws, has_b):
  """(x, w, x_scale|None, w_scale|None, bias|None, out, [scratch...]) from a
  Pallas kernel's positional refs, in the order both kernels pass them."""
  refs = list(refs)
  x_ref, w_ref = refs.pop(0), refs.pop(0)
  xs_ref = refs.pop(0) if has_xs else None
  ws_ref = refs.pop(0) if has_ws else None
  b_ref = refs.pop(0) if has_b else None
  o_ref = refs.pop(0)
  return x_ref, w_ref, xs_ref, ws_ref, b_ref, o_ref, refs
