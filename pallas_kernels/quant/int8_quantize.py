"""Symmetric int8 quantization and the dequantizing epilogue, shared by the
reference and every int8 kernel so that they round alike:
``scale = amax / 127`` (1 where amax is 0), ``q = round_half_even(x / scale)``
clipped to [-127, 127] (NaN -> 0), ``out = ((acc * x_scale) * w_scale + bias)``
in float32 (the last multiply-add may be one FMA).
"""
from __future__ import annotations

import jax.numpy as jnp

INT8_MAX = 127


def scale_from_amax(amax):
  # A multiply, not a division: compilers may turn a division by a constant
  # into one, and kernel and reference must round identically.
  return jnp.where(amax == 0, jnp.float32(1), amax * jnp.float32(1 / INT8_MAX))


def amax(x, axis):
  """max |x| over ``axis`` (kept as size 1; a scalar for None), NaN where x
  holds a NaN: XLA's CPU max reduction can skip NaNs, so that is explicit."""
  keep = axis is not None
  a = jnp.max(jnp.abs(x), axis=axis, keepdims=keep, initial=0.0)
  nan = jnp.max(jnp.isnan(x).astype(jnp.float32), axis=axis, keepdims=keep,
                initial=0.0)  # a float reduction: Mosaic has no bool one
  return jnp.where(nan > 0, jnp.float32(jnp.nan), a)


def round_to_int8(x, scale):
  # One reciprocal per row and a multiply (what XLA makes of a division by
  # a broadcast anyway), so every implementation rounds the same product.
  q = jnp.round(x * (1 / scale))  # jnp.round rounds half to even
  q = jnp.clip(q, -INT8_MAX, INT8_MAX)
  q = jnp.where(jnp.isnan(q), 0.0, q)
  return q.astype(jnp.int8)


def quantize(x, axis=-1):
  """(int8 q, float32 scale) of ``x`` along ``axis`` (kept as size 1; a 0-d
  scale for ``axis=None``), in plain JAX."""
  x = jnp.asarray(x).astype(jnp.float32)
  scale = scale_from_amax(amax(x, axis))
  return round_to_int8(x, scale), scale


def epilogue(acc, x_scale, w_scale, bias, out_dtype):
  """acc [M, N] -> ((acc * x_scale) * w_scale + bias) in float32 -> out_dtype.
  x_scale is [M, 1] or None, w_scale and bias are [1, N] or None."""
  out = acc.astype(jnp.float32)
  if x_scale is not None:
    out = out * x_scale
  if w_scale is not None:
    out = out * w_scale
  if bias is not None:
    out = out + bias
  return out.astype(out_dtype)


def epilogue_from_refs(acc, x_scale_ref, w_scale_ref, bias_ref, out_dtype):
  """``epilogue`` inside a kernel: scales and bias read from their refs
  (None where the call has none)."""
  def read(ref):
    return None if ref is None else ref[...]
  return epilogue(acc, read(x_scale_ref), read(w_scale_ref), read(bias_ref),
                  out_dtype)
