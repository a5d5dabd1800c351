"""``quantized_dense``: a dense layer over frozen quantized weights (QLoRA
style): int8, int4 or fp8 base product, float LoRA adapter.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import _backend
from pallas_kernels.quant import operands as _operands
from pallas_kernels.quant import api as _quant


def _check_lora(lora, k, n, lora_scale):
  if not isinstance(lora, (tuple, list)) or len(lora) != 2:
    raise TypeError("quantized_dense: lora must be a pair (a [K, r], "
                    f"b [r, N]), got {type(lora).__name__}")
  a, b = lora
  for name, value in (("lora[0]", a), ("lora[1]", b)):
    if not hasattr(value, "dtype") or not _operands.is_float(value.dtype):
      raise TypeError(f"quantized_dense: {name} must be a bfloat16, float16 "
                      "or float32 array")
  if a.ndim != 2 or b.ndim != 2 or a.shape[0] != k or b.shape[1] != n or (
      a.shape[1] != b.shape[0]):
    raise ValueError(f"quantized_dense: lora must be (a [K, r], b [r, N]) "
                     f"with K = {k}, N = {n}; got {a.shape} and {b.shape}")
  number = (isinstance(lora_scale, (int, float))
            and not isinstance(lora_scale, bool))
  scalar_array = (hasattr(lora_scale, "dtype") and jnp.ndim(lora_scale) == 0
                  and jnp.issubdtype(lora_scale.dtype, jnp.number))
  if not (number or scalar_array):
    raise TypeError(f"quantized_dense: lora_scale must be a scalar, got "
                    f"{lora_scale!r}")


def quantized_dense(x, w_q, w_scale, bias=None, *, w_zero=None,
                    group_size=None, lora=None, lora_scale=1.0,
                    weight_layout="kn", backend=None):
  """``x @ dequant(w_q) + bias + lora_scale * (x @ a) @ b`` with frozen
  quantized weights (QLoRA-style fine-tuning).

  The base product is ``quantized_matmul(x, w_q, w_scale=..., w_zero=...,
  group_size=..., weight_only=True)`` (int8, int4 or fp8 w_q; per-channel or
  grouped scales) in float32; the LoRA term is plain JAX in float32. The
  result has x's dtype. Differentiable in x, bias and the LoRA pair
  ``lora = (a [K, r], b [r, N])``; asking for a gradient of w_q, w_scale or
  w_zero raises a TypeError naming it (the quantized weights are frozen).

  Args:
    x: [..., K] float activations.
    w_q: [K, N] quantized weight ([N, K] with weight_layout="nk").
    w_scale, w_zero, group_size: as for ``quantized_matmul``.
    bias: optional [N] float.
    lora: optional (a, b) float adapter; lora_scale multiplies its product.
    backend: forwarded to ``quantized_matmul``.
  Returns:
    [..., N] in x's dtype.
  """
  for name, value in (("x", x),):
    if not hasattr(value, "dtype") or not _operands.is_float(value.dtype):
      raise TypeError(f"quantized_dense: {name} must be a bfloat16, float16 "
                      "or float32 array, got "
                      f"{getattr(value, 'dtype', type(value).__name__)}")
  _backend.check_backend("quantized_dense", backend)
  out = _quant.quantized_matmul(
      x, w_q, w_scale=w_scale, w_zero=w_zero, group_size=group_size,
      bias=bias, out_dtype=jnp.float32, weight_only=True,
      weight_layout=weight_layout, backend=backend)
  if lora is not None:
    k = x.shape[-1]
    _check_lora(lora, k, out.shape[-1], lora_scale)
    a, b = lora
    low = jnp.dot(x.astype(jnp.float32), a.astype(jnp.float32),
                  precision=jax.lax.Precision.HIGHEST)
    out = out + lora_scale * jnp.dot(low, b.astype(jnp.float32),
                                     precision=jax.lax.Precision.HIGHEST)
  return out.astype(x.dtype)
