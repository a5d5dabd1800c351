"""Plain-JAX decode attention with exactly the semantics of the kernels: the
T queries are the newest cached tokens (causal, optional window, soft cap,
sinks in the denominator); 8-bit caches are dequantized in float32; a row
with no visible key gives 0. Written out: docs/design/decode.md.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def contiguous_cache(cache, page_table):
  """``[B, Hkv, pages_per_seq * page_size, D]``: each sequence's pages in
  order (a gather; the kernels read the pages in place)."""
  pages = cache[page_table]                  # [B, n, Hkv, ps, D]
  b, n, hkv, ps, d = pages.shape
  return pages.transpose(0, 2, 1, 3, 4).reshape(b, hkv, n * ps, d)


def dequantize(cache, scale):
  """float32 ``cache * scale[hk]`` (kv heads on axis 1, either layout)."""
  return cache.astype(jnp.float32) * scale.astype(jnp.float32)[:, None, None]


def decode_attention_reference(q, k_cache, v_cache, kv_lengths, sinks=None,
                               page_table=None, k_scale=None, v_scale=None, *,
                               sm_scale, logit_soft_cap, sliding_window):
  """``[B, H, T, Dv]`` in q's dtype; arguments as checked by the API."""
  if k_scale is not None:
    k_cache = dequantize(k_cache, k_scale)
    v_cache = dequantize(v_cache, v_scale)
  if page_table is not None:
    k_cache = contiguous_cache(k_cache, page_table)
    v_cache = contiguous_cache(v_cache, page_table)
  batch, heads, queries, _ = q.shape
  kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
  group = heads // kv_heads
  lengths = kv_lengths.astype(jnp.int32)
  cols = jnp.arange(capacity)
  # Rows past the length may hold anything (NaN, inf): zeroed before the
  # products with a select, since a zero weight times NaN is NaN in the
  # values and in the gradients (dq = dS k).
  written = (cols[None, :] < lengths[:, None])[:, None, :, None]
  k = jnp.where(written, k_cache.astype(jnp.float32), 0.0)
  v = jnp.where(written, v_cache.astype(jnp.float32), 0.0)
  # float32 operands: products of bf16/f16 values are exact in float32.
  qg = q.astype(jnp.float32).reshape(batch, kv_heads, group, queries, -1)
  s = jnp.einsum("bkgtd,bkjd->bkgtj", qg, k,
                 precision=jax.lax.Precision.HIGHEST)
  s = s * sm_scale
  if logit_soft_cap is not None:
    s = logit_soft_cap * jnp.tanh(s / logit_soft_cap)
  pos = lengths[:, None] - queries + jnp.arange(queries)[None, :]   # [B, T]
  visible = cols[None, None, :] <= pos[:, :, None]                   # [B,T,S]
  if sliding_window is not None:
    visible &= cols[None, None, :] >= pos[:, :, None] - sliding_window
  visible = visible[:, None, None]                                   # b k g t j
  row_max = jnp.max(jnp.where(visible, s, -jnp.inf), axis=-1, keepdims=True)
  if sinks is not None:
    sink = sinks.astype(jnp.float32).reshape(1, kv_heads, group, 1, 1)
    row_max = jnp.maximum(row_max, sink)
  row_max = jax.lax.stop_gradient(
      jnp.where(jnp.isfinite(row_max), row_max, 0.0))
  e = jnp.where(visible, jnp.exp(jnp.where(visible, s, 0.0) - row_max), 0.0)
  total = jnp.sum(e, axis=-1, keepdims=True)
  if sinks is not None:
    total = total + jnp.exp(sink - row_max)
  p = e / jnp.where(total != 0, total, 1.0)
  out = jnp.einsum("bkgtj,bkjd->bkgtd", p, v,
                   precision=jax.lax.Precision.HIGHEST)
  return out.reshape(batch, heads, queries, -1).astype(q.dtype)


def decode_attention(q, k_cache, v_cache, kv_lengths, *, sm_scale=None,
                     logit_soft_cap=None, sliding_window=None, sinks=None,
                     page_table=None, k_scale=None, v_scale=None):
  """Reference for :func:`pallas_kernels.decode_attention` (same arguments
  and result; no argument checks; scales ``[Hkv]``)."""
  if sm_scale is None:
    sm_scale = 1.0 / math.sqrt(q.shape[-1])
  return decode_attention_reference(
      q, k_cache, v_cache, kv_lengths, sinks, page_table, k_scale, v_scale,
      sm_scale=sm_scale,
      logit_soft_cap=logit_soft_cap, sliding_window=sliding_window)
