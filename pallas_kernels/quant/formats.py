"""The four weight formats (int8, int4, float8_e4m3fn, float8_e5m2) and the
quantization arithmetic every kernel shares: symmetric (scale = amax / qmax)
and asymmetric (scale and zero point) rounding, so that all round alike.
Formulas: docs/design/quantized.md.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels.quant import int8_quantize as int8_quant


@dataclasses.dataclass(frozen=True)
class Format:
  name: str
  integer: bool
  qmin: float         # smallest code (integers) / -max (fp8)
  qmax: float         # largest code / max finite fp8 value
  mantissa_bits: int = 0   # fp8 only
  min_exponent: int = 0    # fp8 only: exponent of the smallest normal

  @property
  def dtype(self):
    return jnp.dtype(self.name)

  @property
  def symmetric_max(self) -> float:
    """The largest |q| symmetric quantization produces."""
    return min(-self.qmin, self.qmax)


FORMATS = {
    "int8": Format("int8", True, -128.0, 127.0),
    "int4": Format("int4", True, -8.0, 7.0),
    "float8_e4m3fn": Format("float8_e4m3fn", False, -448.0, 448.0, 3, -6),
    "float8_e5m2": Format("float8_e5m2", False, -57344.0, 57344.0, 2, -14),
}
NAMES = tuple(FORMATS)


def format_of(dtype) -> Format | None:
  """The Format of ``dtype`` (a quantized dtype), else None."""
  try:
    return FORMATS.get(jnp.dtype(dtype).name)
  except TypeError:
    return None


def round_to_fp8_grid(v, fmt: Format):
  """float32 ``v`` (|v| <= fmt.qmax) rounded half to even onto fmt's grid,
  as float32: the step is 2^(exponent - mantissa_bits), where the exponent
  is v's (at least the smallest normal's), so every step is exact."""
  _, e = jnp.frexp(v)  # |v| = m * 2^e with m in [0.5, 1)
  step_exp = jnp.maximum(e - 1, fmt.min_exponent) - fmt.mantissa_bits
  step = jnp.ldexp(jnp.float32(1), step_exp)
  return jnp.round(v / step) * step


def encode(t, fmt: Format):
  """float32 t (x already divided by its scale) -> q in fmt (symmetric)."""
  top = fmt.symmetric_max
  t = jnp.clip(t, -top, top)
  t = jnp.where(jnp.isnan(t), 0.0, t)
  if fmt.integer:
    return jnp.round(t).astype(fmt.dtype)
  return round_to_fp8_grid(t, fmt).astype(fmt.dtype)


def symmetric(x, fmt: Format, axis):
  """(q, scale) of float32 x, amax over ``axis`` (kept; None: all)."""
  amax = int8_quant.amax(x, axis)
  scale = jnp.where(amax == 0, jnp.float32(1),
                    amax * jnp.float32(1 / fmt.symmetric_max))
  return encode(x * (1 / scale), fmt), scale


def asymmetric(x, fmt: Format, axis):
  """(q, scale, zero) of float32 x over ``axis`` (kept); integer fmt."""
  keep = axis is not None
  lo = jnp.min(x, axis=axis, keepdims=keep, initial=0.0)
  hi = jnp.max(x, axis=axis, keepdims=keep, initial=0.0)
  nan = int8_quant.amax(x, axis)  # NaN where the group holds one
  span = jnp.where(jnp.isnan(nan), jnp.float32(jnp.nan), hi - lo)
  scale = jnp.where(span == 0, jnp.float32(1),
                    span * jnp.float32(1 / (fmt.qmax - fmt.qmin)))
  inv = 1 / scale
  zero = jnp.clip(jnp.round(fmt.qmin - lo * inv), fmt.qmin, fmt.qmax)
  zero = jnp.where(jnp.isnan(zero), 0.0, zero)
  q = jnp.clip(jnp.round(x * inv) + zero, fmt.qmin, fmt.qmax)
  q = jnp.where(jnp.isnan(q), 0.0, q)
  return q.astype(fmt.dtype), scale, zero.astype(fmt.dtype)
