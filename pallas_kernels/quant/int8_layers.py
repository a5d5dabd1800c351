"""``int8_dense``: a dense layer with an int8 forward (w quantized per output
channel, x per row, one int8 x int8 matmul with a fused epilogue) and
straight-through float gradients (``jax.custom_vjp``).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels import _backend
from pallas_kernels.quant import int8_api as _int8
from pallas_kernels.quant import operands as _operands


def _check(x, w, bias):
  for name, value in (("x", x), ("w", w)):
    if not hasattr(value, "dtype") or not _operands.is_float(value.dtype):
      raise TypeError(f"int8_dense: {name} must be a bfloat16, float16 or "
                      f"float32 array, got "
                      f"{getattr(value, 'dtype', type(value).__name__)}")
  if w.ndim != 2:
    raise ValueError(f"int8_dense: w must be 2-D [K, N], got shape {w.shape}")
  if x.ndim < 1 or x.shape[-1] != w.shape[0]:
    raise ValueError(f"int8_dense: x's last dimension must equal w's first "
                     f"(K = {w.shape[0]}), got x of shape {x.shape}")
  if bias is not None:
    if not hasattr(bias, "dtype") or not _operands.is_float(bias.dtype):
      raise TypeError("int8_dense: bias must be a float array")
    if bias.shape != (w.shape[1],):
      raise ValueError(f"int8_dense: bias must have shape ({w.shape[1]},), "
                       f"got {bias.shape}")


def _quantize(w, axis, backend):
  # quantize_int8 has no GPU kernel: on GPUs XLA's fused quantization runs.
  if backend in _backend.GPU_KERNELS:
    backend = "reference"
  return _int8.quantize_int8(w, axis=axis, backend=backend)


def _forward(x, w, bias, backend):
  w_q, w_scale = _quantize(w, 0, backend)
  return _int8.int8_matmul(x, w_q, w_scale=w_scale, bias=bias,
                           out_dtype=x.dtype, backend=backend)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _int8_dense(x, w, bias, int8_input_grad, backend):
  return _forward(x, w, bias, backend)


def _fwd(x, w, bias, int8_input_grad, backend):
  return _forward(x, w, bias, backend), (x, w, bias)


def _bwd(int8_input_grad, backend, residuals, dy):
  x, w, bias = residuals
  k, n = w.shape
  rows = math.prod(x.shape[:-1])  # not -1: K or N may be 0
  dy2 = dy.reshape(rows, n)
  x2 = x.reshape(rows, k)
  if int8_input_grad:
    w_q, w_scale = _quantize(w, 1, backend)  # [K, 1]
    # dy @ w_q.T: w_q [K, N] is that product's weight in the "nk" layout.
    dx = _int8.int8_matmul(dy2, w_q, w_scale=w_scale.reshape(k),
                           out_dtype=x.dtype, weight_layout="nk",
                           backend=backend)
  else:
    dx = jnp.dot(dy2, w.T.astype(dy2.dtype),
                 preferred_element_type=jnp.float32).astype(x.dtype)
  dw = jnp.dot(x2.T, dy2.astype(x2.dtype), preferred_element_type=jnp.float32)
  dbias = (None if bias is None else
           jnp.sum(dy2.astype(jnp.float32), axis=0).astype(bias.dtype))
  return dx.reshape(x.shape), dw.astype(w.dtype), dbias


_int8_dense.defvjp(_fwd, _bwd)


def int8_dense(x, w, bias=None, *, int8_input_grad=False, backend=None):
  """``x @ w + bias`` with an int8 forward and straight-through gradients.

  Args:
    x: [..., K] float activations.
    w: [K, N] float weights (quantized per output channel each call).
    bias: optional [N] float.
    int8_input_grad: compute dx with an int8 matmul too (dy quantized per
      row, w per input channel); dw stays float.
    backend: forwarded to the int8 kernels.
  Returns:
    [..., N] in x's dtype.
  """
  _check(x, w, bias)
  if not isinstance(int8_input_grad, bool):
    raise TypeError(f"int8_dense: int8_input_grad must be a bool (True or "
                    f"False), got {int8_input_grad!r}")
  _backend.check_backend("int8_dense", backend)
  if x.shape[-1] > _int8.MAX_INT8_K:
    raise ValueError(f"int8_dense: K={x.shape[-1]} exceeds "
                     f"{_int8.MAX_INT8_K}, the int32 accumulator's safe bound")
  return _int8_dense(x, w, bias, bool(int8_input_grad), backend)
