"""Decode attention for NVIDIA GPUs: split-KV (flash decoding) in Pallas with
the Triton lowering.

One program per ``(b, hk, split)``: it holds the ``T * G`` query rows of kv
head ``hk`` (``splits.pack_queries``, padded to a power of two >= 16, the
smallest Triton dot) and walks its run of the sequence's visible key blocks
(``splits.split_range``) with ``lax.fori_loop`` and the online softmax in
base 2, then writes its normalized ``(out, lse)``; XLA merges the splits and
the sinks (``splits.finish``). The split count is the power of two at or
below ``PROGRAMS / (B * Hkv)`` (rounded up): about one program per SM, so a
batch of 1 fills the GPU, and whole blocks split evenly.
The cache is read in place: a contiguous block is ``block`` rows (the last
one shifted back to end at S, its rows already seen masked out); a paged
block is one page, found through the page table. Every block masks logits
by position and zeroes value rows at or past the length (garbage there never
reaches the output). Triton tiles need power-of-two sizes, so head_dim and
the page size must be powers of two >= 16 (``supports``); other calls take
another kernel. 8-bit caches (int8, float8_e4m3fn, float8_e5m2) are loaded
as they are and converted to q's dtype in registers; the kv head's
``k_scale`` joins ``sm_scale`` and ``v_scale`` multiplies the merged output
(``splits.finish``). Triton has float8_e4m3fn only from sm_89 (Ada) on.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _backend, _compat, _cost
from pallas_kernels.decode import splits as _splits

pl = _compat.pl

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
MIN_TILE = 16          # smallest dimension of a Triton dot
TILE_BYTES = 32 << 10  # bytes of one K tile (registers/shared memory)
PROGRAMS = 132         # one per SM of an H100
NUM_WARPS = 4
NUM_STAGES = 3


def _pow2(n: int) -> bool:
  return n >= MIN_TILE and not n & (n - 1)


def _next_pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def supports(q, k_cache, page_table) -> str | None:
  """Why the kernel cannot run the call, else None."""
  head_dim = q.shape[3]
  if not _pow2(head_dim):
    return (f"the Triton decode kernel reads the cache in place and needs "
            f"head_dim a power of two >= {MIN_TILE}, got {head_dim}")
  if page_table is not None and not _pow2(k_cache.shape[2]):
    return (f"the Triton decode kernel needs page_size a power of two >= "
            f"{MIN_TILE}, got {k_cache.shape[2]}")
  capability = _backend.target().gpu_capability
  if (k_cache.dtype == jnp.float8_e4m3fn and capability
      and tuple(map(int, capability.split(".")[:2])) < (8, 9)):
    return (f"Triton supports float8_e4m3fn only on sm_89+ GPUs, this is "
            f"sm_{capability.replace('.', '')}: use an int8 or float8_e5m2 "
            "cache")
  return None


def default_splits(batch: int, kv_heads: int) -> int:
  """Splits per (sequence, kv head): the power of two at or below
  ceil(PROGRAMS / (batch * kv_heads))."""
  wanted = max(1, -(-PROGRAMS // (batch * kv_heads)))
  return 1 << (wanted.bit_length() - 1)


def block_rows(capacity: int, head_dim: int, itemsize: int,
               page_size: int | None) -> int:
  """Keys per loop step: a page, else a power of two of about TILE_BYTES
  that fits in the cache."""
  if page_size is not None:
    return page_size
  rows = max(MIN_TILE, min(128, TILE_BYTES // (head_dim * itemsize)))
  while rows > MIN_TILE and rows > capacity:
    rows //= 2
  return rows


def _kernel(lengths_ref, q_ref, k_ref, v_ref, *rest, queries, group, window,
            sm_scale, cap, block, num_splits, paged, capacity, quantized):
  rest = list(rest)
  pages_ref = rest.pop(0) if paged else None
  scale_ref = rest.pop(0) if quantized else None
  o_ref, lse_ref = rest
  b, split = pl.program_id(0), pl.program_id(2)
  if quantized:  # the kv head's k_scale joins the logit scale
    sm_scale = sm_scale * scale_ref[pl.program_id(1)]
  length = lengths_ref[b]
  start, per, hi = _splits.split_range(length, split, queries, window, block,
                                       num_splits)
  end = jnp.minimum(start + per, hi + 1)
  base = length - queries
  q = q_ref[...]
  rows_n = q.shape[0]
  rows = lax.broadcasted_iota(jnp.int32, (rows_n, block), 0)
  key_iota = lax.broadcasted_iota(jnp.int32, (rows_n, block), 1)
  value_iota = lax.broadcasted_iota(jnp.int32, (block, q.shape[1]), 0)

  def body(c, carry):
    acc, m_prev, l_prev = carry
    if paged:
      page = jnp.clip(pages_ref[c], 0, k_ref.shape[0] - 1)
      k, v = k_ref[page], v_ref[page]
      first = c * block
    else:
      # The last block ends at the cache's end; rows before c * block were
      # the previous block's.
      first = jnp.minimum(c * block, capacity - block)
      k = k_ref[pl.ds(first, block), :]
      v = v_ref[pl.ds(first, block), :]
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    qk = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                         preferred_element_type=jnp.float32)
    if cap is None:
      s = qk * (sm_scale * LOG2E)
    else:
      s = cap * LOG2E * jnp.tanh(qk * (sm_scale / cap))
    cols = first + key_iota
    fresh = cols >= c * block
    visible = fresh & (cols < length) & (rows >= (cols - base) * group)
    if window is not None:
      visible &= rows < (cols + window - base + 1) * group
    s = jnp.where(visible, s, -jnp.inf)
    value_cols = first + value_iota
    v = jnp.where((value_cols >= c * block) & (value_cols < length), v,
                  jnp.zeros_like(v))
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    m_shift = jnp.where(m_next == -jnp.inf, 0.0, m_next)
    alpha = jnp.exp2(m_prev - m_shift)
    p = jnp.exp2(s - m_shift[:, None])
    l_next = l_prev * alpha + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + lax.dot_general(
        p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
        preferred_element_type=jnp.float32)
    return acc, m_next, l_next

  carry = (jnp.zeros(q.shape, jnp.float32),
           jnp.full((rows_n,), -jnp.inf, jnp.float32),
           jnp.zeros((rows_n,), jnp.float32))
  acc, m, l = lax.fori_loop(start, end, body, carry)
  empty = l == 0.0
  o_ref[...] = acc / jnp.where(empty, 1.0, l)[:, None]
  lse_ref[...] = jnp.where(empty, -jnp.inf, (m + jnp.log2(l)) * LN2)


def decode(q, k_cache, v_cache, kv_lengths, sinks, page_table, k_scale=None,
           v_scale=None, *, sm_scale, logit_soft_cap, sliding_window,
           interpret, block_kv=None, num_splits=None):
  """``[B, H, T, D]`` in q's dtype (arguments as checked by the API and
  ``supports``, scales ``[Hkv]`` float32 with 8-bit caches;
  ``block_kv``/``num_splits`` override the defaults of a contiguous
  cache)."""
  batch, heads, queries, head_dim = q.shape
  paged = page_table is not None
  if not paged and k_cache.shape[2] < MIN_TILE:  # tiny: pad it to one tile
    pad = ((0, 0), (0, 0), (0, MIN_TILE - k_cache.shape[2]), (0, 0))
    k_cache, v_cache = jnp.pad(k_cache, pad), jnp.pad(v_cache, pad)
  kv_heads, group, itemsize, page_size, _, capacity = _splits.cache_layout(
      q, k_cache, page_table)
  block = page_size if paged else (
      block_kv or block_rows(capacity, head_dim, itemsize, None))
  num_blocks = -(-capacity // block)
  if num_splits is None:
    num_splits = default_splits(batch, kv_heads)
  num_splits = max(1, min(num_splits, num_blocks))
  rows = max(MIN_TILE, _next_pow2(queries * group))
  packed = _splits.pack_queries(q, kv_heads, rows)

  lengths_spec = pl.BlockSpec((batch,), lambda b, h, s: (0,))
  q_spec = pl.BlockSpec((None, None, rows, head_dim),
                        lambda b, h, s: (b, h, 0, 0))
  if paged:
    kv_spec = pl.BlockSpec((k_cache.shape[0], None, block, head_dim),
                           lambda b, h, s: (0, h, 0, 0))
    extra_specs = [pl.BlockSpec((None, page_table.shape[1]),
                                lambda b, h, s: (b, 0))]
    extra = [page_table]
  else:
    kv_spec = pl.BlockSpec((None, None, capacity, head_dim),
                           lambda b, h, s: (b, h, 0, 0))
    extra_specs, extra = [], []
  if k_scale is not None:
    extra_specs.append(pl.BlockSpec((kv_heads,), lambda b, h, s: (0,)))
    extra.append(k_scale)
  out_shape = [
      jax.ShapeDtypeStruct((batch, kv_heads, num_splits, rows, head_dim),
                           jnp.float32),
      jax.ShapeDtypeStruct((batch, kv_heads, num_splits, rows), jnp.float32)]
  kernel = functools.partial(
      _kernel, queries=queries, group=group, window=sliding_window,
      sm_scale=sm_scale, cap=logit_soft_cap, block=block,
      num_splits=num_splits, paged=paged, capacity=capacity,
      quantized=k_scale is not None)
  pairs = batch * kv_heads * rows * capacity
  out, lse = _compat.pallas_call(
      kernel,
      grid=(batch, kv_heads, num_splits),
      in_specs=[lengths_spec, q_spec, kv_spec, kv_spec, *extra_specs],
      out_specs=[
          pl.BlockSpec((None, None, None, rows, head_dim),
                       lambda b, h, s: (b, h, s, 0, 0)),
          pl.BlockSpec((None, None, None, rows),
                       lambda b, h, s: (b, h, s, 0))],
      out_shape=out_shape,
      compiler_params=_compat.gpu_compiler_params(num_warps=NUM_WARPS,
                                                  num_stages=NUM_STAGES),
      interpret=interpret,
      cost_estimate=_cost.estimate(
          flops=4 * pairs * head_dim, transcendentals=pairs,
          bytes_accessed=(2 * batch * kv_heads * capacity * head_dim
                          * itemsize + _cost.nbytes(packed, *out_shape))),
      name="decode_attention_gpu",
  )(kv_lengths, packed, k_cache, v_cache, *extra)
  return _splits.finish(out, lse, sinks, heads=heads, queries=queries,
                        dtype=q.dtype, v_scale=v_scale)
