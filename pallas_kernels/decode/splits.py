"""What the decode kernels share on the host: the TPU kernel's t-major query
rows (``pack_queries``), the split-KV block ranges (``split_range``) and the
merge of the splits with the sinks and ``v_scale`` (``finish``; the Triton
kernel merges in the kernel). Formulas: docs/design/decode.md.
"""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax


def round_up(x: int, m: int) -> int:
  return -(-x // m) * m


class CacheLayout(NamedTuple):
  """Sizes of a call's KV cache."""
  kv_heads: int
  group: int                 # query heads per kv head
  itemsize: int
  page_size: int | None      # paged: rows per page; contiguous: None
  pages_per_seq: int | None  # paged: the page table's width
  capacity: int              # keys one sequence can hold


def cache_layout(q, k_cache, page_table) -> CacheLayout:
  """The layout of a contiguous ``[B, Hkv, L, D]`` or paged ``[pages, Hkv,
  page_size, D]`` (with ``page_table [B, pages_per_seq]``) cache."""
  kv_heads = k_cache.shape[1]
  itemsize = jnp.dtype(k_cache.dtype).itemsize
  page_size = pages_per_seq = None
  capacity = k_cache.shape[2]
  if page_table is not None:
    page_size, pages_per_seq = k_cache.shape[2], page_table.shape[1]
    capacity = page_size * pages_per_seq
  return CacheLayout(kv_heads, q.shape[1] // kv_heads, itemsize, page_size,
                     pages_per_seq, capacity)


def pack_queries(q, kv_heads: int, rows: int):
  """q ``[B, H, T, D]`` -> ``[B, Hkv, rows, D]`` (t-major rows, zero
  padded to ``rows``)."""
  batch, heads, queries, dim = q.shape
  group = heads // kv_heads
  packed = q.reshape(batch, kv_heads, group, queries, dim)
  packed = packed.transpose(0, 1, 3, 2, 4).reshape(
      batch, kv_heads, queries * group, dim)
  return jnp.pad(packed, ((0, 0), (0, 0), (0, rows - queries * group),
                          (0, 0)))


def unpack_rows(out, heads: int, queries: int):
  """``[B, Hkv, rows, D]`` -> ``[B, H, T, D]`` (inverse of pack_queries)."""
  batch, kv_heads, _, dim = out.shape
  group = heads // kv_heads
  out = out[:, :, :queries * group].reshape(batch, kv_heads, queries, group,
                                            dim)
  return out.transpose(0, 1, 3, 2, 4).reshape(batch, heads, queries, dim)


def block_range(length, queries: int, window: int | None, block: int):
  """First and last block (of ``block`` keys) holding a key visible to some
  query of a sequence of ``length`` (traced int32); ``hi < lo`` when none."""
  first_key = jnp.int32(0)
  if window is not None:
    first_key = jnp.maximum(length - queries - window, 0)
  lo = lax.div(first_key, jnp.int32(block))
  hi = lax.div(length + (block - 1), jnp.int32(block)) - 1
  return lo, hi


def split_range(length, split, queries: int, window: int | None, block: int,
                num_splits: int):
  """(first block, block count, last visible block) of split ``split``:
  its run of ``ceil(n / num_splits)`` of the sequence's n visible blocks,
  clipped to the last one."""
  lo, hi = block_range(length, queries, window, block)
  count = jnp.maximum(hi - lo + 1, 0)
  per = lax.div(count + (num_splits - 1), jnp.int32(num_splits))
  return lo + split * per, per, hi


def combine(out, lse, sinks_rows=None):
  """Merges the splits: out ``[B, Hkv, splits, rows, D]`` and lse ``[B, Hkv,
  splits, rows]`` (float32, -inf where a split saw no key) -> ``[B, Hkv,
  rows, D]`` float32; ``sinks_rows [Hkv, rows]`` join the denominator."""
  top = jnp.max(lse, axis=2)
  if sinks_rows is not None:
    top = jnp.maximum(top, sinks_rows[None])
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  weights = jnp.exp(lse - top[:, :, None])
  total = jnp.sum(weights, axis=2)
  if sinks_rows is not None:
    total = total + jnp.exp(sinks_rows[None] - top)
  merged = jnp.sum(weights[..., None] * out, axis=2)
  return merged / jnp.where(total != 0, total, 1.0)[..., None]


def sink_rows(sinks, kv_heads: int, queries: int, rows: int):
  """sinks ``[H]`` -> ``[Hkv, rows]`` float32 in the packed row order
  (padding rows get -inf: no sink)."""
  if sinks is None:
    return None
  group = sinks.shape[0] // kv_heads
  per_head = sinks.astype(jnp.float32).reshape(kv_heads, 1, group)
  tiled = jnp.broadcast_to(per_head, (kv_heads, queries, group)).reshape(
      kv_heads, queries * group)
  return jnp.pad(tiled, ((0, 0), (0, rows - queries * group)),
                 constant_values=-jnp.inf)


def finish(out, lse, sinks, *, heads: int, queries: int, dtype,
           v_scale=None):
  """The kernels' epilogue: combine the splits with the sinks, scale by
  ``v_scale [Hkv]`` (8-bit values), unpack the rows, cast to ``dtype``."""
  kv_heads, rows = out.shape[1], out.shape[3]
  merged = combine(out, lse, sink_rows(sinks, kv_heads, queries, rows))
  if v_scale is not None:
    merged = merged * v_scale[None, :, None, None]
  return unpack_rows(merged, heads, queries).astype(dtype)


__all__ = ["round_up", "CacheLayout", "cache_layout", "pack_queries",
           "unpack_rows", "block_range", "split_range", "combine",
           "sink_rows", "finish"]
