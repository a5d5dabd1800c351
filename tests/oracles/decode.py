"""float64 NumPy oracle for decode attention (independent of pallas_kernels).

Semantics of ``pallas_kernels.decode_attention``, written from its
docstring: query t of sequence b sits at position ``L_b - T + t`` (``L_b =
kv_lengths[b]``) and sees cache positions ``p - window <= j <= p``; logits
``sm_scale * q . k``, then ``cap * tanh(s / cap)``; the softmax denominator
also holds ``exp(sink_h)``; a query with no visible key gives 0. A paged
cache is first laid out per sequence: position j is row ``j % page_size``
of page ``page_table[b, j // page_size]``. An 8-bit cache holds ``k_cache
* k_scale[hk]`` (v the same), multiplied out in float64 first. v's head_dim may
differ from q's and k's (MLA): the output takes v's. Each query is
computed on its own, by loops over sequences, heads and queries.
"""
from __future__ import annotations

import math

import numpy as np


def gather_pages(cache, page_table):
  """``[B, Hkv, pages_per_seq * page_size, D]`` from a paged cache."""
  cache = np.asarray(cache)
  table = np.asarray(page_table)
  b, n = table.shape
  _, hkv, ps, d = cache.shape
  out = np.zeros((b, hkv, n * ps, d), cache.dtype)
  for i in range(b):
    for p in range(n):
      out[i, :, p * ps:(p + 1) * ps] = cache[table[i, p]]
  return out


def decode_attention(q, k_cache, v_cache, kv_lengths, *, sm_scale=None,
                     logit_soft_cap=None, sliding_window=None, sinks=None,
                     page_table=None, k_scale=None, v_scale=None):
  """``[B, H, T, Dv]`` float64 (``Dv``: v_cache's head_dim)."""
  k = np.asarray(k_cache).astype(np.float64)
  v = np.asarray(v_cache).astype(np.float64)
  if k_scale is not None:   # kv heads are axis 1 of either layout
    k = k * np.asarray(k_scale, np.float64).reshape(-1, 1, 1)
    v = v * np.asarray(v_scale, np.float64).reshape(-1, 1, 1)
  if page_table is not None:
    k = gather_pages(k, page_table)
    v = gather_pages(v, page_table)
  q = np.asarray(q).astype(np.float64)
  lengths = np.asarray(kv_lengths)
  b_n, h_n, t_n, d = q.shape
  group = h_n // k.shape[1]
  scale = 1 / math.sqrt(d) if sm_scale is None else sm_scale
  out = np.zeros(q.shape[:3] + v.shape[3:])
  for b in range(b_n):
    for h in range(h_n):
      kh, vh = k[b, h // group], v[b, h // group]
      for t in range(t_n):
        pos = int(lengths[b]) - t_n + t
        lo = 0 if sliding_window is None else max(0, pos - sliding_window)
        keys = np.arange(lo, pos + 1)
        if keys.size == 0:
          continue
        s = kh[keys] @ q[b, h, t] * scale
        if logit_soft_cap is not None:
          s = logit_soft_cap * np.tanh(s / logit_soft_cap)
        terms = s if sinks is None else np.append(s, float(sinks[h]))
        top = terms.max()
        weights = np.exp(terms - top)
        p = weights[:keys.size] / weights.sum()
        out[b, h, t] = p @ vh[keys]
  return out


def decode_attention_grads(q, k_cache, v_cache, kv_lengths, d_out, *,
                           sm_scale=None, logit_soft_cap=None,
                           sliding_window=None, sinks=None, page_table=None,
                           k_scale=None, v_scale=None):
  """float64 gradients of ``sum(out * d_out)``: (dq, dk_cache, dv_cache,
  dsinks or None), the caches' in their layout (paged: the page pool) and
  in dequantized units for 8-bit caches. Only visible keys get gradient;
  other cache rows (whatever they hold) get 0. Per query, with ``p`` the
  softmax weights (the sink's ``p_sink`` too) and ``delta = d_out . out``:
  ``ds_j = p_j (d_out . v_j - delta)`` (times ``1 - tanh^2`` under a cap),
  ``dq = scale sum_j ds_j k_j``, ``dk_j = scale ds_j q``, ``dv_j = p_j
  d_out``, ``dsink = -p_sink delta``."""
  k = np.asarray(k_cache).astype(np.float64)
  v = np.asarray(v_cache).astype(np.float64)
  if k_scale is not None:
    k = k * np.asarray(k_scale, np.float64).reshape(-1, 1, 1)
    v = v * np.asarray(v_scale, np.float64).reshape(-1, 1, 1)
  pool_shapes = k.shape, v.shape
  if page_table is not None:
    k = gather_pages(k, page_table)
    v = gather_pages(v, page_table)
  q = np.asarray(q).astype(np.float64)
  do = np.asarray(d_out).astype(np.float64)
  lengths = np.asarray(kv_lengths)
  b_n, h_n, t_n, d = q.shape
  group = h_n // k.shape[1]
  scale = 1 / math.sqrt(d) if sm_scale is None else sm_scale
  dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
  dsinks = np.zeros(h_n)
  for b in range(b_n):
    for h in range(h_n):
      kh, vh = k[b, h // group], v[b, h // group]
      for t in range(t_n):
        pos = int(lengths[b]) - t_n + t
        lo = 0 if sliding_window is None else max(0, pos - sliding_window)
        keys = np.arange(lo, pos + 1)
        if keys.size == 0:
          continue        # out = 0 whatever the inputs: no gradient
        x = kh[keys] @ q[b, h, t] * scale
        s = x if logit_soft_cap is None else logit_soft_cap * np.tanh(
            x / logit_soft_cap)
        terms = s if sinks is None else np.append(s, float(sinks[h]))
        weights = np.exp(terms - terms.max())
        p_all = weights / weights.sum()
        p = p_all[:keys.size]
        out = p @ vh[keys]
        delta = do[b, h, t] @ out
        ds = p * (vh[keys] @ do[b, h, t] - delta)
        if logit_soft_cap is not None:
          ds = ds * (1 - np.tanh(x / logit_soft_cap) ** 2)
        dq[b, h, t] = scale * ds @ kh[keys]
        dk[b, h // group, keys] += scale * ds[:, None] * q[b, h, t][None, :]
        dv[b, h // group, keys] += p[:, None] * do[b, h, t][None, :]
        if sinks is not None:
          dsinks[h] -= p_all[-1] * delta
  if page_table is not None:
    dk, dv = (_scatter_pages(x, page_table, shape)
              for x, shape in zip((dk, dv), pool_shapes))
  return dq, dk, dv, (None if sinks is None else dsinks)


def _scatter_pages(x, page_table, pool_shape):
  """Inverse of ``gather_pages``: per-sequence rows summed into the pool."""
  table = np.asarray(page_table)
  ps = pool_shape[2]
  out = np.zeros(pool_shape)
  for i in range(table.shape[0]):
    for p in range(table.shape[1]):
      out[table[i, p]] += x[i, :, p * ps:(p + 1) * ps]
  return out
