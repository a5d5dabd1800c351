"""Plain-JAX int8 quantization and int8 matmul: the semantics every kernel
matches (the arithmetic itself is ``quant``'s).

quantize_int8(x, axis)
  amax  = max |x| over ``axis`` (keepdims; every axis when ``axis=None``)
  scale = amax * float32(1/127), or 1 where amax == 0 (never a division by 0)
  q     = clip(round_half_to_even(x * (1 / scale)), -127, 127) as int8;
          NaN -> 0
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

from pallas_kernels.quant import int8_operands as operands, int8_quantize as quant


def _int32_dot(x2, w):
  return jax.lax.dot_general(x2, w, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.int32)


def _float_dot(x2, w):
  """x (float) @ w (int8) with the weights upcast exactly to x's dtype."""
  return jax.lax.dot_general(x2, w.astype(x2.dtype), (((1,), (0,)), ((), ())),
                             precision=jax.lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)


def matmul_2d(x2, w, x_scale, w_scale, bias, *, mode, out_dtype,
              w_layout="kn"):
  """The normalized 2-D problem (``operands.MatmulCall``).

  mode: "raw" (int8 x, int32 out), "dequant" (int8 x), "dynamic" (float x,
  quantized per row here) or "weight_only" (float x). Scales are float32
  [M, 1] / [1, N] or None, bias float32 [1, N] or None. w is [K, N], or
  [N, K] for w_layout "nk".
  """
  if w_layout == "nk":
    w = w.T
  if mode == "raw":
    return _int32_dot(x2, w)
  if mode == "weight_only":
    return quant.epilogue(_float_dot(x2, w), None, w_scale, bias, out_dtype)
  if mode == "dynamic":
    x2, x_scale = quant.quantize(x2, axis=-1)
  return quant.epilogue(_int32_dot(x2, w), x_scale, w_scale, bias, out_dtype)


def quantize_int8(x, *, axis=-1):
  """Same as ``pallas_kernels.quantize_int8(..., backend="reference")``."""
  return quant.quantize(x, operands.quantize_axis(x, axis))


def int8_matmul(x, w, *, x_scale=None, w_scale=None, bias=None,
                out_dtype=None, weight_only=False, weight_layout="kn"):
  """Same as ``pallas_kernels.int8_matmul(..., backend="reference")``."""
  call = operands.matmul_call(x, w, x_scale=x_scale, w_scale=w_scale,
                              bias=bias, out_dtype=out_dtype,
                              weight_only=weight_only,
                              weight_layout=weight_layout)
  return call.result(matmul_2d(*call.operands, **call.static))
