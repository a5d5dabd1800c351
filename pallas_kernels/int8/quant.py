"""Symmetric int8 quantization and the dequantizing epilogue: the arithmetic
that the reference and every int8 kernel share, so that they round alike.

  scale = amax * float32(1/127), or 1 where amax == 0
  q     = clip(round_half_to_even(x / scale), -127, 127) as int8; NaN -> 0
  out   = ((float32(acc) * x_scale) * w_scale + bias) -> out_dtype
"""
from __future__ import annotations

import jax.numpy as jnp

INT8_MAX = 127


def scale_from_amax(amax):
  # A multiply, not a division: compilers may turn a division by a constant
  # into one, and kernel and reference must round identically.
  return jnp.where(amax == 0, jnp.float32(1), amax * jnp.float32(1 / INT8_MAX))


def round_to_int8(x, scale):
  q = jnp.round(x / scale)  # jnp.round rounds half to even
  q = jnp.clip(q, -INT8_MAX, INT8_MAX)
  q = jnp.where(jnp.isnan(q), 0.0, q)
  return q.astype(jnp.int8)


def quantize(x, axis=-1):
  """(int8 q, float32 scale) of ``x`` along ``axis`` (kept as size 1; a 0-d
  scale for ``axis=None``), in plain JAX."""
  x = jnp.asarray(x).astype(jnp.float32)
  if axis is None:
    scale = scale_from_amax(jnp.max(jnp.abs(x)) if x.size else jnp.float32(0))
    return round_to_int8(x, scale), scale
  amax = jnp.max(jnp.abs(x), axis=axis, keepdims=True, initial=0.0)
  scale = scale_from_amax(amax)
  return round_to_int8(x, scale), scale


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
