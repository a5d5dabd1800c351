"""float64 numpy oracle of ragged paged attention: one sequence at a time."""
from __future__ import annotations

import numpy as np


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens,
                           num_seqs, sinks=None, *, sm_scale=1.0,
                           sliding_window=None, soft_cap=None, k_scale=None,
                           v_scale=None):
  """[T, H, D] float64 (``sinks [H]``: exp(sink) joins each softmax's
  denominator); tokens outside the first ``num_seqs`` sequences and
  tokens that see no key give zeros. Inputs must be valid (monotone
  ``cu_q_lens``, ``kv_lens`` within the page table)."""
  q = np.asarray(q, np.float64)
  pages = np.asarray(kv_pages, np.float64)
  tokens, heads, d = q.shape
  page_size, kv_heads = pages.shape[1], pages.shape[2] // 2
  group = heads // kv_heads
  out = np.zeros_like(q)
  cu = np.asarray(cu_q_lens)
  for i in range(int(np.asarray(num_seqs).reshape(-1)[0])):
    start, end = int(cu[i]), int(cu[i + 1])
    length = int(kv_lens[i])
    n_pages = -(-length // page_size)
    kv = pages[np.asarray(page_indices[i][:n_pages])].reshape(
        n_pages * page_size, 2 * kv_heads, d)[:length]
    k, v = kv[:, 0::2], kv[:, 1::2]
    if k_scale is not None:
      k = k * k_scale
    if v_scale is not None:
      v = v * v_scale
    for t in range(start, end):
      pos = length - (end - start) + (t - start)
      lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
      hi = min(pos + 1, length)
      if hi <= lo:
        continue
      for h in range(heads):
        kh = h // group
        s = k[lo:hi, kh] @ q[t, h] * sm_scale
        if soft_cap is not None:
          s = soft_cap * np.tanh(s / soft_cap)
        top = s.max() if sinks is None else max(s.max(), float(sinks[h]))
        p = np.exp(s - top)
        total = p.sum() + (0 if sinks is None else np.exp(sinks[h] - top))
        out[t, h] = p @ v[lo:hi, kh] / total
  return out


def mla_ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens,
                               num_seqs, sinks=None, *, latent_dim, sm_scale,
                               sliding_window=None, soft_cap=None,
                               k_scale=None, v_scale=None):
  """[T, H, latent_dim] float64: every head of token t attends to its
  sequence's rows ``kv_pages [P, page_size, D]`` with key the whole row and
  value its first ``latent_dim`` columns; otherwise as
  ``ragged_paged_attention`` (same input rules)."""
  q = np.asarray(q, np.float64)
  pages = np.asarray(kv_pages, np.float64)
  tokens, heads, d = q.shape
  page_size = pages.shape[1]
  out = np.zeros((tokens, heads, latent_dim))
  cu = np.asarray(cu_q_lens)
  for i in range(int(np.asarray(num_seqs).reshape(-1)[0])):
    start, end = int(cu[i]), int(cu[i + 1])
    length = int(kv_lens[i])
    rows = np.concatenate(
        [pages[int(page_indices[i][p])] for p in
         range(-(-length // page_size))] or [np.zeros((0, d))])[:length]
    k = rows * (1.0 if k_scale is None else k_scale)
    v = rows[:, :latent_dim] * (1.0 if v_scale is None else v_scale)
    for t in range(start, end):
      pos = length - (end - start) + (t - start)
      lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
      hi = min(pos + 1, length)
      if hi <= lo:
        continue
      s = q[t] @ k[lo:hi].T * sm_scale           # [H, keys]
      if soft_cap is not None:
        s = soft_cap * np.tanh(s / soft_cap)
      top = s.max(axis=1)
      if sinks is not None:
        top = np.maximum(top, np.asarray(sinks, np.float64))
      p = np.exp(s - top[:, None])
      total = p.sum(axis=1)
      if sinks is not None:
        total = total + np.exp(np.asarray(sinks, np.float64) - top)
      out[t] = p @ v[lo:hi] / total[:, None]
  return out
