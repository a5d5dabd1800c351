"""Plain-JAX attention with exactly the semantics of the flash kernels.

``s = cap(sm_scale q k^T) + bias``, masked (causal/window ends-aligned,
segment ids, static mask), ``out = softmax(s) v`` in float32 cast to q's
dtype, ``lse`` float32; a row with no allowed key gives 0, -inf and zero
gradients. Sinks (``with_sinks``) add one logit per head to the denominator.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.attention import masks as _masks


def normalize_window(sliding_window, causal: bool):
  """``sliding_window`` -> (left, right), None meaning unbounded."""
  if sliding_window is None:
    left, right = None, None
  elif isinstance(sliding_window, (tuple, list)):
    left, right = sliding_window
  else:
    left = sliding_window
    right = 0 if causal else sliding_window
  if causal:
    right = 0 if right is None else min(right, 0)
  return left, right


def attention_mask(q_len, kv_len, q_segment_ids=None, kv_segment_ids=None, *,
                   window_left=None, window_right=None, mask=None):
  """Boolean ``[B or 1, H or 1, Lq, Lk]`` mask, True where attention is
  allowed; ``mask`` is a static mask or a per-head tuple of them."""
  static_mask = mask
  offset = kv_len - q_len
  rows = jnp.arange(q_len)[:, None] + offset
  cols = jnp.arange(kv_len)[None, :]
  mask = jnp.ones((q_len, kv_len), bool)
  if window_right is not None:
    mask &= cols <= rows + window_right
  if window_left is not None:
    mask &= cols >= rows - window_left
  mask = mask[None, None]
  if static_mask is not None:
    heads = static_mask if isinstance(static_mask, tuple) else (static_mask,)
    mask = mask & jnp.asarray(np.stack(
        [_masks.dense(m, q_len, kv_len) for m in heads]))[None]
  if q_segment_ids is not None:
    same = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    mask = mask & same[:, None]
  return mask


def attention(q, k, v, q_segment_ids=None, kv_segment_ids=None, bias=None, *,
              sm_scale, causal=False, window_left=None, window_right=None,
              logit_soft_cap=None, mask=None):
  """(out, lse) with the internal backend signature (window already split)."""
  if causal:
    window_right = 0 if window_right is None else min(window_right, 0)
  batch, heads, q_len, _ = q.shape
  kv_heads, kv_len = k.shape[1], k.shape[2]
  group = heads // kv_heads
  qg = q.reshape(batch, kv_heads, group, q_len, -1)
  # float32 operands: exact for 16-bit values, and the CPU runtime of jax
  # 0.7 has no bf16 x bf16 -> f32 dot for some shapes.
  s = jnp.einsum("bkgqd,bkld->bkgql", qg.astype(jnp.float32),
                 k.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
  s = s.reshape(batch, heads, q_len, kv_len) * sm_scale
  if logit_soft_cap is not None:
    s = logit_soft_cap * jnp.tanh(s / logit_soft_cap)
  if bias is not None:
    s = s + bias.astype(jnp.float32)
  mask = attention_mask(q_len, kv_len, q_segment_ids, kv_segment_ids,
                        window_left=window_left, window_right=window_right,
                        mask=mask)
  mask = jnp.broadcast_to(mask, s.shape)
  # Double `where` keeps masked entries out of both values and gradients.
  s_kept = jnp.where(mask, s, 0.0)
  row_max = jnp.max(jnp.where(mask, s, -jnp.inf), axis=-1, keepdims=True)
  row_max = jax.lax.stop_gradient(
      jnp.where(jnp.isfinite(row_max), row_max, 0.0))
  e = jnp.where(mask, jnp.exp(s_kept - row_max), 0.0)
  total = jnp.sum(e, axis=-1, keepdims=True)
  has_keys = total != 0          # NaN inputs stay NaN rather than "empty"
  safe_total = jnp.where(has_keys, total, 1.0)
  p = e / safe_total
  pg = p.reshape(batch, kv_heads, group, q_len, kv_len)
  out = jnp.einsum("bkgql,bkld->bkgqd", pg, v.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
  out = out.reshape(batch, heads, q_len, -1).astype(q.dtype)
  lse = jnp.where(has_keys, row_max + jnp.log(safe_total), -jnp.inf)[..., 0]
  return out, lse


def with_sinks(out, lse, sinks):
  """(out, lse) of attention whose softmax also spans one extra logit per
  head, ``sinks [H]``, with no value: ``lse' = logaddexp(lse, sink)`` and
  ``out' = out * exp(lse - lse')``. Differentiable in all three."""
  sink = sinks.astype(jnp.float32)[None, :, None]
  new_lse = jnp.logaddexp(lse, sink)
  keep = jnp.isfinite(lse)       # no key: no weight (avoids -inf - -inf)
  weight = jnp.where(keep, jnp.exp(jnp.where(keep, lse, 0.0) - new_lse), 0.0)
  out = (out.astype(jnp.float32) * weight[..., None]).astype(out.dtype)
  return out, new_lse


def flash_attention(q, k, v, *, causal=False, sm_scale=None, segment_ids=None,
                    sliding_window=None, logit_soft_cap=None, bias=None,
                    sinks=None, mask=None, return_lse=False, block_sizes=None):
  """Reference for :func:`pallas_kernels.flash_attention` (same arguments and
  results; no argument checks). ``block_sizes`` is accepted and ignored, so
  calls can switch freely."""
  del block_sizes
  if sm_scale is None:
    sm_scale = 1.0 / math.sqrt(q.shape[-1])
  left, right = normalize_window(sliding_window, causal)
  q_seg, kv_seg = (None, None) if segment_ids is None else segment_ids
  if mask is not None:
    mask = _masks.per_head(mask, q.shape[1])
  out, lse = attention(q, k, v, q_seg, kv_seg, bias, sm_scale=sm_scale,
                       causal=causal, window_left=left, window_right=right,
                       logit_soft_cap=logit_soft_cap, mask=mask)
  if sinks is not None:
    out, lse = with_sinks(out, lse, sinks)
  return (out, lse) if return_lse else out
