"""Layers for training: quantized dense layers and a mixture of experts.

``quantized_dense`` (frozen quantized weights, QLoRA style) follows
``int8_dense``; ``moe_feed_forward`` (top-k routed experts on
``grouped_matmul``) is at the end.

``int8_dense(x, w, bias=None, *, int8_input_grad=False, backend=None)``
computes ``x @ w + bias`` with an int8 forward pass and a float backward
pass (``jax.custom_vjp``):

Forward. The weights are quantized per output channel
(``quantize_int8(w, axis=0)``: one scale per column of w), the activations
dynamically per row (``int8_matmul``'s w8a8 dynamic mode, a Pallas
quantization pre-pass), then one int8 x int8 -> int32 matmul whose epilogue
applies both scales and the bias. The output has x's dtype. K (= w.shape[0])
is limited to ``int8_matmul.MAX_INT8_K``.

Backward: the straight-through estimator. Rounding is treated as the
identity, so the gradients are those of the float layer ``x @ w + bias``
evaluated at the float (unquantized) x and w:

  dx    = dy @ w.T             (float32 accumulation, cast to x's dtype)
  dw    = x.T @ dy             (summed over x's leading dimensions)
  dbias = sum of dy over the leading dimensions

With ``int8_input_grad=True`` the input gradient dx uses an int8 matmul as
well: dy is quantized per row on the fly and w per row (one scale per input
channel k, i.e. per output column of w.T). That trades a little accuracy of
dx for the int8 rate; dw stays in float because quantizing activations and
output gradients along the token dimension loses too much.
"""
from __future__ import annotations

import functools
import math
import operator

import jax
import jax.numpy as jnp

from pallas_kernels import _backend
from pallas_kernels.int8 import api as _int8
from pallas_kernels.int8 import operands as _operands

__all__ = ["int8_dense", "quantized_dense", "moe_feed_forward",
           "init_moe_feed_forward"]


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
    int8_input_grad: compute dx with an int8 matmul too (see module doc).
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
  from pallas_kernels.quant import api as _quant
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


MOE = "moe_feed_forward"


def _check_moe(x, w_router, w_gate, w_up, w_down, top_k, renormalize,
               return_aux_loss):
  names = ("x", "w_router", "w_gate", "w_up", "w_down")
  values = (x, w_router, w_gate, w_up, w_down)
  for name, value in zip(names, values):
    if not hasattr(value, "dtype") or not _operands.is_float(value.dtype):
      got = getattr(value, "dtype", type(value).__name__)
      raise TypeError(f"{MOE}: {name} must be a bfloat16, float16 or float32 "
                      f"array, got {got}")
  if x.ndim < 1:
    raise ValueError(f"{MOE}: x must be [..., D], got a scalar")
  d = x.shape[-1]
  if w_router.ndim != 2 or w_router.shape[0] != d:
    raise ValueError(f"{MOE}: w_router must be [D, E] with D = {d} (x's last "
                     f"dimension), got shape {w_router.shape}")
  e = w_router.shape[1]
  if e == 0:
    raise ValueError(f"{MOE}: w_router must route to at least one expert "
                     "(E = w_router.shape[1] >= 1)")
  if w_gate.ndim != 3 or w_gate.shape[:2] != (e, d):
    raise ValueError(f"{MOE}: w_gate must be [E, D, F] with E = {e} "
                     f"(w_router.shape[1]) and D = {d}, got shape "
                     f"{w_gate.shape}")
  if w_up.shape != w_gate.shape:
    raise ValueError(f"{MOE}: w_up must have w_gate's shape {w_gate.shape} "
                     f"[E, D, F], got {w_up.shape}")
  f = w_gate.shape[2]
  if w_down.shape != (e, f, d):
    raise ValueError(f"{MOE}: w_down must be [E, F, D] = {(e, f, d)}, got "
                     f"shape {w_down.shape}")
  if (isinstance(top_k, bool) or not hasattr(top_k, "__index__")
      or not 1 <= operator.index(top_k) <= e):
    raise ValueError(f"{MOE}: top_k must be an int in [1, E] with E = {e} "
                     f"experts (w_router.shape[1]), got {top_k!r}")
  for name, value in (("renormalize", renormalize),
                      ("return_aux_loss", return_aux_loss)):
    if not isinstance(value, bool):
      raise TypeError(f"{MOE}: {name} must be a bool (True or False), got "
                      f"{value!r}")


def moe_feed_forward(x, w_router, w_gate, w_up, w_down, *, top_k: int,
                     renormalize: bool = True, return_aux_loss: bool = False,
                     backend: str | None = None):
  """A top-k routed mixture-of-experts SwiGLU feed-forward (dropless).

  Per token t (x's leading dimensions flattened into T tokens):
    p = softmax(x_t @ w_router)                 (float32, [E])
    S = the top_k experts by logit (ties: the lower index)
    w_e = p_e / sum_{S} p  if renormalize else  p_e       (e in S)
    out_t = sum_{e in S} w_e * (silu(x_t @ w_gate[e]) * (x_t @ w_up[e]))
                                 @ w_down[e]

  Algorithm: the T * top_k (token, slot) pairs are sorted by expert (stable
  argsort), their rows gathered, ``group_sizes`` = tokens per expert; three
  ``grouped_matmul`` calls (gate, up, down) run every expert on its rows
  with no capacity limit (no token is dropped), then the rows are put back
  in (token, slot) order and summed with the routing weights.

  ``renormalize=True`` (the default) is Mixtral's and Qwen3-MoE's routing;
  ``False`` is DeepSeek-V2's and Switch's (with top_k=1 renormalising makes
  every weight 1, so the router would learn from the auxiliary loss alone).

  The expert matmuls run in x's dtype (weights are cast to it) with float32
  sums; the router and the weighted sum run in float32. Gradients reach x
  and every weight; the choice of experts is piecewise constant, so the
  router's gradient comes through the weights w_e (and the auxiliary loss).

  Args:
    x: [..., D] float activations.
    w_router: [D, E] router weights.
    w_gate, w_up: [E, D, F] per-expert gate and up projections.
    w_down: [E, F, D] per-expert down projections.
    top_k: experts per token, 1 <= top_k <= E.
    renormalize: scale each token's top_k weights to sum to 1.
    return_aux_loss: also return the Switch-Transformer load-balancing loss
      ``E * sum_e f_e * P_e``: f_e the fraction of the T * top_k assignments
      that go to expert e, P_e the mean router probability of e (1 when
      balanced; Hugging Face's Mixtral loss is top_k times this).
    backend: forwarded to ``grouped_matmul``.
  Returns:
    [..., D] in x's dtype; with ``return_aux_loss``, (out, aux) with aux a
    float32 scalar.
  """
  from pallas_kernels.gmm import api as _gmm
  _check_moe(x, w_router, w_gate, w_up, w_down, top_k, renormalize,
             return_aux_loss)
  _backend.check_backend(MOE, backend)
  top_k = operator.index(top_k)
  d = x.shape[-1]
  e = w_router.shape[1]
  tokens = math.prod(x.shape[:-1])
  x2 = x.reshape(tokens, d)

  logits = jnp.dot(x2.astype(jnp.float32), w_router.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
  probs = jax.nn.softmax(logits, axis=-1)
  top_logits, experts = jax.lax.top_k(logits, top_k)           # [T, k]
  if renormalize:  # p_e / sum_S p is the softmax of the chosen logits
    weights = jax.nn.softmax(top_logits, axis=-1)
  else:
    weights = jnp.take_along_axis(probs, experts, axis=-1)

  # Sort the (token, slot) pairs by expert: each expert's rows contiguous.
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
  rows = x2[order // top_k]                                    # [T*k, D]

  def gmm(lhs, w):
    return _gmm.grouped_matmul(lhs, w.astype(x.dtype), sizes, backend=backend)

  hidden = jax.nn.silu(gmm(rows, w_gate)) * gmm(rows, w_up)    # [T*k, F]
  y = gmm(hidden, w_down)                                      # [T*k, D]

  # Unsort: position of each (token, slot) pair in the sorted order.
  slots = jnp.zeros_like(order).at[order].set(
      jnp.arange(order.shape[0], dtype=order.dtype))
  y = y[slots].reshape(tokens, top_k, d).astype(jnp.float32)
  out = jnp.einsum("tkd,tk->td", y, weights,
                   precision=jax.lax.Precision.HIGHEST)
  out = out.astype(x.dtype).reshape(x.shape)
  if not return_aux_loss:
    return out
  fraction = sizes.astype(jnp.float32) / max(tokens * top_k, 1)
  mean_prob = jnp.sum(probs, axis=0) / max(tokens, 1)
  return out, e * jnp.sum(fraction * mean_prob)


def init_moe_feed_forward(key, d_model: int, d_ff: int, num_experts: int, *,
                          dtype=jnp.float32):
  """Parameters for ``moe_feed_forward(x, **params, top_k=...)``.

  Normal with standard deviation 1/sqrt(fan in) (D for the router, gate and
  up; F for down), as a dict of w_router [D, E], w_gate and w_up [E, D, F],
  w_down [E, F, D] in ``dtype``.
  """
  shapes = {"w_router": ((d_model, num_experts), d_model),
            "w_gate": ((num_experts, d_model, d_ff), d_model),
            "w_up": ((num_experts, d_model, d_ff), d_model),
            "w_down": ((num_experts, d_ff, d_model), d_ff)}
  keys = jax.random.split(key, len(shapes))
  return {name: (jax.random.normal(k, shape, jnp.float32)
                 / math.sqrt(max(fan_in, 1))).astype(dtype)
          for k, (name, (shape, fan_in)) in zip(keys, shapes.items())}
