"""Plain-JAX ``quantize_int8`` and ``int8_matmul``: the semantics every int8
kernel matches. Quantization is symmetric per ``axis`` (scale float32 with
``axis`` kept as size 1; NaN/inf rows get a non-finite scale); the matmul
sums exactly in int32 (float32 for weight-only) and applies
``((acc * x_scale) * w_scale + bias)`` in float32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.quant import operands, int8_quantize as quant


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
  """The normalized 2-D problem (``operands.Int8MatmulCall``). mode: "raw" (int8 x,
  int32 out), "dequant" (int8 x), "dynamic" (float x, quantized per row here) or
  "weight_only" (float x). Scales are float32 [M, 1] / [1, N] or None, bias
  float32 [1, N] or None. w is [K, N], or [N, K] for w_layout "nk"."""
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
  call = operands.int8_matmul_call(x, w, x_scale=x_scale, w_scale=w_scale,
                              bias=bias, out_dtype=out_dtype,
                              weight_only=weight_only,
                              weight_layout=weight_layout)
  return call.result(matmul_2d(*call.operands, **call.static))
