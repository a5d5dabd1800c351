"""Pure-JAX ragged paged attention (gathers each sequence's pages);
``seq_bounds``, which tokens belong to which sequence, is shared with the
kernels.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def seq_bounds(cu_q_lens, num_seqs, tokens: int):
  """[S + 1] int32 token boundaries: sequence i owns tokens
  ``[c[i], c[i+1])``. ``cu_q_lens`` clipped to [0, tokens] and made
  non-decreasing; sequences at or past ``num_seqs`` are empty."""
  s = cu_q_lens.shape[0] - 1
  n = jnp.clip(num_seqs.reshape(-1)[0], 0, s)
  c = lax.cummax(jnp.clip(cu_q_lens.astype(jnp.int32), 0, tokens), axis=0)
  last = c[n]
  return jnp.where(jnp.arange(s + 1) > n, last, c)


def token_seqs(bounds, tokens: int):
  """[T] int32: each token's sequence, S for tokens outside every one."""
  t = jnp.arange(tokens, dtype=jnp.int32)
  seq = jnp.searchsorted(bounds[1:], t, side="right").astype(jnp.int32)
  s = bounds.shape[0] - 1
  return jnp.where(t < bounds[0], s, seq)


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens,
                           num_seqs, sinks=None, *, sm_scale=1.0,
                           sliding_window=None, soft_cap=None, k_scale=None,
                           v_scale=None, **unused):
  """``pallas_kernels.ragged_paged_attention`` in plain JAX: per sequence,
  its pages gathered and every token attends to them (float32 softmax),
  masked to the sequence's own tokens. Arguments as the op's (checked)."""
  del unused
  _, _, combined, head_dim = kv_pages.shape
  capacity = page_indices.shape[1] * kv_pages.shape[1]

  def kv(pages):   # [pages_per_seq, page_size, 2 Hkv, D] -> K, V
    pages = pages.reshape(capacity, combined, head_dim)
    return pages[:, 0::2], pages[:, 1::2]

  return _attend(q, kv_pages, kv, combined // 2, head_dim, kv_lens,
                 page_indices, cu_q_lens, num_seqs, sinks, sm_scale=sm_scale,
                 sliding_window=sliding_window, soft_cap=soft_cap,
                 k_scale=k_scale, v_scale=v_scale)


def mla_ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens,
                               num_seqs, sinks=None, *, latent_dim,
                               sm_scale=None, sliding_window=None,
                               soft_cap=None, k_scale=None, v_scale=None,
                               **unused):
  """``pallas_kernels.mla_ragged_paged_attention`` in plain JAX: as
  ``ragged_paged_attention`` with one kv head whose K is the whole cache row
  and V its first ``latent_dim`` columns. Arguments as the op's (checked);
  ``sm_scale`` defaults to ``1 / sqrt(D)``."""
  del unused
  if sm_scale is None:
    sm_scale = kv_pages.shape[2] ** -0.5
  capacity = page_indices.shape[1] * kv_pages.shape[1]

  def kv(pages):   # [pages_per_seq, page_size, D] -> K, V of one head
    rows = pages.reshape(capacity, 1, kv_pages.shape[2])
    return rows, rows[..., :latent_dim]

  return _attend(q, kv_pages, kv, 1, latent_dim, kv_lens, page_indices,
                 cu_q_lens, num_seqs, sinks, sm_scale=sm_scale,
                 sliding_window=sliding_window, soft_cap=soft_cap,
                 k_scale=k_scale, v_scale=v_scale)


def _attend(q, kv_pages, kv, kv_heads, value_dim, kv_lens, page_indices,
            cu_q_lens, num_seqs, sinks, *, sm_scale, sliding_window,
            soft_cap, k_scale, v_scale):
  """[T, H, Dv] in q's dtype. ``kv(pages)`` turns one sequence's gathered
  pages into K [C, Hkv, D] and V [C, Hkv, Dv] (C = its capacity)."""
  tokens, heads, head_dim = q.shape
  num_pages, page_size = kv_pages.shape[:2]
  group = heads // kv_heads
  s, pages_per_seq = page_indices.shape
  capacity = pages_per_seq * page_size
  bounds = seq_bounds(cu_q_lens, num_seqs, tokens)
  owner = token_seqs(bounds, tokens)
  lens = jnp.clip(kv_lens.astype(jnp.int32), 0, capacity)
  table = jnp.clip(page_indices, 0, num_pages - 1)
  qf = q.astype(jnp.float32).reshape(tokens, kv_heads, group, head_dim)
  t_idx = jnp.arange(tokens, dtype=jnp.int32)
  keys = jnp.arange(capacity, dtype=jnp.int32)
  if sinks is not None:
    sink = sinks.astype(jnp.float32).reshape(1, kv_heads, group, 1)

  def one(i):
    k, v = kv(kv_pages[table[i]])
    k, v = k.astype(jnp.float32), v.astype(jnp.float32)
    if k_scale is not None:
      k = k * k_scale
    if v_scale is not None:
      v = v * v_scale
    length = lens[i]
    pos = length - (bounds[i + 1] - bounds[i]) + (t_idx - bounds[i])  # [T]
    visible = (keys[None] <= pos[:, None]) & (keys[None] < length)
    if sliding_window is not None:
      visible &= keys[None] > pos[:, None] - sliding_window
    visible &= (owner == i)[:, None]
    logits = jnp.einsum("tkgd,ckd->tkgc", qf, k,
                        precision=lax.Precision.HIGHEST) * sm_scale
    if soft_cap is not None:
      logits = soft_cap * jnp.tanh(logits / soft_cap)
    logits = jnp.where(visible[:, None, None], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    if sinks is not None:
      m = jnp.maximum(m, sink)
    p = jnp.exp(logits - jnp.where(m == -jnp.inf, 0.0, m))
    l = jnp.sum(p, axis=-1, keepdims=True)
    if sinks is not None:   # exp(sink) joins the denominator
      l = l + jnp.exp(sink - m)
    v = jnp.where((keys < length)[:, None, None], v, 0.0)  # garbage past it
    out = jnp.einsum("tkgc,ckd->tkgd", p, v, precision=lax.Precision.HIGHEST)
    # Only sequence i's tokens: another's (or one past num_seqs, whose
    # pages may hold anything) must not leak 0 * NaN in.
    mine = (owner == i)[:, None, None, None] & (l > 0)
    return jnp.where(mine, out / jnp.where(l > 0, l, 1.0), 0.0)

  def body(i, acc):
    return acc + one(i)

  out = lax.fori_loop(0, s, body, jnp.zeros(
      (tokens, kv_heads, group, value_dim), jnp.float32))
  return out.reshape(tokens, heads, value_dim).astype(q.dtype)


def token_slots(kv_lens, page_indices, cu_q_lens, num_seqs, tokens: int,
                num_pages: int, page_size: int):
  """(page, row) [T] int32 of each new token's cache slot; page = num_pages
  (out of range: not written) for tokens outside the first ``num_seqs``
  sequences, past the page table, or whose table entry is not a page."""
  s, pages_per_seq = page_indices.shape
  capacity = pages_per_seq * page_size
  bounds = seq_bounds(cu_q_lens, num_seqs, tokens)
  owner = token_seqs(bounds, tokens)
  seq = jnp.minimum(owner, s - 1)
  t = jnp.arange(tokens, dtype=jnp.int32)
  lens = jnp.clip(kv_lens.astype(jnp.int32), 0, capacity)
  pos = lens[seq] - (bounds[seq + 1] - bounds[seq]) + (t - bounds[seq])
  ok = (owner < s) & (pos >= 0) & (pos < capacity)
  slot = jnp.clip(pos, 0, capacity - 1)
  page = page_indices[seq, slot // page_size]
  ok &= (page >= 0) & (page < num_pages)
  return (jnp.where(ok, page, num_pages).astype(jnp.int32),
          (slot % page_size).astype(jnp.int32))


def write_kv_pages(kv_pages, new_kv, kv_lens, page_indices, cu_q_lens,
                   num_seqs):
  """``pallas_kernels.write_kv_pages`` in plain JAX: one scatter (in place
  when the caller donates kv_pages)."""
  num_pages, page_size = kv_pages.shape[:2]
  page, row = token_slots(kv_lens, page_indices, cu_q_lens, num_seqs,
                          new_kv.shape[0], num_pages, page_size)
  return kv_pages.at[page, row].set(new_kv.astype(kv_pages.dtype),
                                    mode="drop")
