"""float64 NumPy oracle for flash attention (independent of pallas_kernels).

Semantics of ``pallas_kernels.flash_attention``, written from its docstring:
logits ``s = sm_scale * q k^T``, then ``cap * tanh(s / cap)``, then ``+ bias``;
keys allowed where the causal/window band (ends aligned: offset = Lk - Lq)
and equal segment ids allow them; ``out = softmax(s) v``, ``lse = log sum
exp s`` over the allowed keys. A row with no allowed key (or whose allowed
logits are all -inf) gets ``out = 0`` and ``lse = -inf``. Query head ``h``
reads kv head ``h // (H // Hkv)``. v's head dim may differ from q's and k's
(MLA): out and dv have v's, dq and dk q's.
"""
from __future__ import annotations

import math

import numpy as np


def window(sliding_window, causal):
  """(left, right) reach of the band, None meaning unbounded: ``w`` is
  ``(w, 0)`` if causal else ``(w, w)``; causal caps right at 0."""
  if sliding_window is None:
    left = right = None
  elif isinstance(sliding_window, (tuple, list)):
    left, right = sliding_window
  else:
    left, right = sliding_window, (0 if causal else sliding_window)
  if causal:
    right = 0 if right is None else min(right, 0)
  return left, right


def mask(q_len, kv_len, *, causal=False, sliding_window=None,
         segment_ids=None):
  """bool ``[B or 1, 1, Lq, Lk]``, True where query i may attend to key j."""
  left, right = window(sliding_window, causal)
  rows = np.arange(q_len)[:, None] + (kv_len - q_len)
  cols = np.arange(kv_len)[None, :]
  allowed = np.ones((q_len, kv_len), bool)
  if right is not None:
    allowed &= cols <= rows + right
  if left is not None:
    allowed &= cols >= rows - left
  allowed = allowed[None, None]
  if segment_ids is not None:
    q_seg, kv_seg = (np.asarray(x) for x in segment_ids)
    allowed = allowed & (q_seg[:, None, :, None] == kv_seg[:, None, None, :])
  return allowed


def _f64(x):
  return None if x is None else np.asarray(x).astype(np.float64)


def attention(q, k, v, *, causal=False, sm_scale=None, segment_ids=None,
              sliding_window=None, logit_soft_cap=None, bias=None, d_out=None,
              d_lse=None, allowed=None, sinks=None):
  """(out, lse) in float64; with ``d_out`` (and optionally ``d_lse``, the
  cotangent of lse) also the gradients (dq, dk, dv, dbias or None) and,
  with ``sinks``, a fifth: dsinks.

  ``allowed``: an extra bool mask ``[H or 1, Lq, Lk]`` intersected with the
  others. ``sinks [H]``: one more logit per head in every row's softmax
  denominator, with no value (so lse includes it and a row without keys
  has out 0, lse = sink)."""
  q, k, v, bias = _f64(q), _f64(k), _f64(v), _f64(bias)
  b, h, lq, d = q.shape
  hk, lk = k.shape[1], k.shape[2]
  group = h // hk
  kr, vr = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
  scale = 1 / math.sqrt(d) if sm_scale is None else sm_scale
  x = np.einsum("bhqd,bhkd->bhqk", q, kr) * scale
  tanh = None if logit_soft_cap is None else np.tanh(x / logit_soft_cap)
  s = x if tanh is None else logit_soft_cap * tanh
  if bias is not None:
    s = s + bias
  extra = True if allowed is None else np.asarray(allowed, bool)[None]
  allowed = np.broadcast_to(
      mask(lq, lk, causal=causal, sliding_window=sliding_window,
           segment_ids=segment_ids) & extra, s.shape) & (s != -np.inf)
  with np.errstate(invalid="ignore"):
    m = np.max(np.where(allowed, s, -np.inf), axis=-1, keepdims=True)
  sink = None if sinks is None else _f64(sinks)[None, :, None, None]
  if sink is not None:
    m = np.maximum(m, sink)
  m = np.where(np.isfinite(m), m, 0.0)
  e = np.where(allowed, np.exp(np.where(allowed, s, 0.0) - m), 0.0)
  total = e.sum(-1, keepdims=True)
  if sink is not None:
    total = total + np.exp(sink - m)
  has_keys = total[..., 0] > 0
  p = e / np.where(total > 0, total, 1.0)
  out = np.einsum("bhqk,bhkd->bhqd", p, vr)
  lse = np.where(has_keys, m[..., 0] + np.log(np.where(total > 0, total,
                                                          1.0))[..., 0],
                 -np.inf)
  if d_out is None:
    return out, lse
  do = _f64(d_out)
  delta = np.sum(do * out, -1)
  if d_lse is not None:
    delta = delta - _f64(d_lse)
  ds = p * (np.einsum("bhqd,bhkd->bhqk", do, vr) - delta[..., None])
  dbias = None
  if bias is not None:
    dbias = ds.sum(axis=tuple(a for a in (0, 1) if bias.shape[a] == 1),
                   keepdims=True)
  if tanh is not None:
    ds = ds * (1 - tanh ** 2)
  fold = lambda a: a.reshape(b, hk, group, lk, a.shape[-1]).sum(2)  # noqa: E731
  dq = np.einsum("bhqk,bhkd->bhqd", ds, kr) * scale
  dk = fold(np.einsum("bhqk,bhqd->bhkd", ds, q)) * scale
  dv = fold(np.einsum("bhqk,bhqd->bhkd", p, do))
  if sink is None:
    return out, lse, (dq, dk, dv, dbias)
  p_sink = np.exp(sink[..., 0] - lse)
  dsinks = -(p_sink * delta).sum(axis=(0, 2))
  return out, lse, (dq, dk, dv, dbias, dsinks)
