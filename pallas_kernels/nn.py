"""Layers for training: ``moe_feed_forward`` (top-k routed experts on
``grouped_matmul``) lives here; ``int8_dense`` and ``quantized_dense`` live in
their families (``quant.int8_layers``, ``quant.layers``) and are re-exported.
"""
from __future__ import annotations

import math
import operator

import jax
import jax.numpy as jnp

from pallas_kernels import _backend
from pallas_kernels.quant import operands as _operands
from pallas_kernels.quant.int8_layers import int8_dense
from pallas_kernels.quant.layers import quantized_dense

__all__ = ["int8_dense", "quantized_dense", "moe_feed_forward",
           "init_moe_feed_forward"]


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

  The (token, slot) pairs are sorted by expert and run through three
  ``grouped_matmul`` calls (gate, up, down) with no capacity limit. Expert
  matmuls run in x's dtype with float32 sums; the router and the weighted
  sum in float32. Gradients reach x and every weight (the router's through
  w_e and the auxiliary loss).

  Args:
    x: [..., D] float activations.
    w_router: [D, E] router weights.
    w_gate, w_up: [E, D, F] per-expert gate and up projections.
    w_down: [E, F, D] per-expert down projections.
    top_k: experts per token, 1 <= top_k <= E.
    renormalize: scale each token's top_k weights to sum to 1 (Mixtral,
      Qwen3-MoE); False: DeepSeek-V2, Switch (with top_k=1 every weight
      would be 1).
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
