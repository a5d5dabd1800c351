"""Decode attention for NVIDIA GPUs: split-KV (flash decoding) in Pallas with
the Triton lowering, one program per (sequence, kv head, split) reading the
cache in place, the merge of the splits fused into the same launch.
Structure: docs/design/decode.md, "decode/triton.py".
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _backend, _compat, _cost
from pallas_kernels.decode import splits as _splits

pl = _compat.pl

LOG2E = math.log2(math.e)
MIN_TILE = 16          # smallest dimension of a Triton dot
TILE_BYTES = 32 << 10  # bytes of one K tile (registers/shared memory)
MERGE_ELEMENTS = 8192  # float32 partial outputs merged per step
PROGRAMS = 132         # one per SM of an H100
NUM_WARPS = 4
NUM_STAGES = 3


def _pow2(n: int) -> bool:
  return n >= MIN_TILE and not n & (n - 1)


def head_dim_pieces(head_dim: int) -> tuple[tuple[int, int], ...]:
  """(start, width) column pieces of head_dim, powers of two >= MIN_TILE,
  largest first (96 -> (0, 64), (64, 32)): Triton tiles need power-of-two
  sizes, so a head_dim on the 16 grid is read and summed piece by piece."""
  pieces, start = [], 0
  for bit in reversed(range(head_dim.bit_length())):
    width = 1 << bit
    if head_dim - start >= width >= MIN_TILE:
      pieces.append((start, width))
      start += width
  return tuple(pieces)


def _next_pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def _floor_pow2(n: int) -> int:
  return 1 << (max(1, n).bit_length() - 1)


def supports(q, k_cache, v_cache, page_table) -> str | None:
  """Why the kernel cannot run the call, else None."""
  for name, head_dim in (("head_dim", q.shape[3]),
                         ("v_cache's head_dim", v_cache.shape[3])):
    if head_dim % MIN_TILE:
      return (f"the Triton decode kernel reads the cache in place and needs "
              f"{name} a multiple of {MIN_TILE}, got {head_dim}")
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
  return _floor_pow2(-(-PROGRAMS // max(1, batch * kv_heads)))


def block_rows(capacity: int, head_dim: int, itemsize: int,
               page_size: int | None, programs: int = 1) -> int:
  """Keys per loop step: a power of two of about TILE_BYTES that fits in the
  cache. With pages, a whole number of pages: one page when ``programs``
  (``B * Hkv``) already fill the GPU; otherwise (split-KV, about one
  program per SM, whose own loads in flight set the speed) at least the
  contiguous tile and up to 4 pages, at most twice the tile."""
  rows = max(MIN_TILE, min(128, _floor_pow2(TILE_BYTES
                                            // (head_dim * itemsize))))
  while rows > MIN_TILE and rows > capacity:
    rows //= 2
  if page_size is None:
    return rows
  if programs >= PROGRAMS:
    return page_size
  block = max(page_size, rows, min(4 * page_size, 2 * rows))
  while block > page_size and block > capacity:
    block //= 2
  return block


def _attend(lengths_ref, q_ref, k_ref, v_ref, pages_ref, sm_scale, *,
            queries, row_count, window, cap, block, num_splits, paged,
            capacity):
  """This program's run of blocks: (acc, m, l) of the online softmax (acc
  unnormalized, one per piece of v's head_dim; m in base-2 logits) for the
  padded rows."""
  b, split = pl.program_id(0), pl.program_id(2)
  length = lengths_ref[b]
  start, per, hi = _splits.split_range(length, split, queries, window, block,
                                       num_splits)
  end = jnp.minimum(start + per, hi + 1)
  base = length - queries
  rows_n, head_dim = q_ref.shape
  pieces = head_dim_pieces(head_dim)
  v_pieces = head_dim_pieces(v_ref.shape[-1])
  qs = [plgpu.load(q_ref.at[:, pl.ds(start, width)],
                   mask=lax.broadcasted_iota(jnp.int32, (rows_n, width), 0)
                   < row_count, other=0)
        for start, width in pieces]
  # float32 inputs get float32 products (the GPU's default would be TF32).
  precision = (lax.Precision.HIGHEST if qs[0].dtype == jnp.float32
               else None)
  # A step's pieces of rows: one contiguous run, or its pages.
  piece_rows = k_ref.shape[1] if paged else block
  # Row r's query index: r % T (g-major rows).
  query = lax.broadcasted_iota(jnp.int32, (rows_n, piece_rows), 0)
  if queries > 1:
    query = lax.rem(query, jnp.int32(queries))
  else:
    query = jnp.zeros_like(query)
  key_iota = lax.broadcasted_iota(jnp.int32, (rows_n, piece_rows), 1)
  value_iota = lax.broadcasted_iota(jnp.int32, (piece_rows, 1), 0)

  def row_pieces(c):
    """(index of the rows in k_ref/v_ref, position of the first) per piece
    of block c."""
    if not paged:
      # The last block ends at the cache's end; rows before c * block were
      # the previous block's (masked below).
      first = jnp.minimum(c * block, capacity - block)
      return [((pl.ds(first, block),), first)]
    out = []
    for j in range(block // piece_rows):
      entry = jnp.minimum(c * (block // piece_rows) + j,
                          pages_ref.shape[0] - 1)
      page = jnp.clip(pages_ref[entry], 0, k_ref.shape[0] - 1)
      out.append(((page, slice(None)), c * block + j * piece_rows))
    return out

  def body(c, carry):
    accs, m_prev, l_prev = carry
    pieces_at = row_pieces(c)
    scores = []
    for rows_at, first in pieces_at:
      ks = [k_ref[rows_at + (pl.ds(start, width),)].astype(qs[0].dtype)
            for start, width in pieces]
      qk = sum(lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                               precision=precision,
                               preferred_element_type=jnp.float32)
               for q, k in zip(qs, ks))
      if cap is None:
        s = qk * (sm_scale * LOG2E)
      else:
        s = cap * LOG2E * jnp.tanh(qk * (sm_scale / cap))
      cols = first + key_iota
      visible = (cols >= c * block) & (cols < length) & (query >= cols - base)
      if window is not None:
        visible &= query <= cols + window - base
      scores.append(jnp.where(visible, s, -jnp.inf))
    m_next = m_prev
    for s in scores:
      m_next = jnp.maximum(m_next, jnp.max(s, axis=1))
    m_shift = jnp.where(m_next == -jnp.inf, 0.0, m_next)
    alpha = jnp.exp2(m_prev - m_shift)
    l_next = l_prev * alpha
    new_accs = [acc * alpha[:, None] for acc in accs]
    for (rows_at, first), s in zip(pieces_at, scores):
      p = jnp.exp2(s - m_shift[:, None])
      l_next += jnp.sum(p, axis=1)
      p = p.astype(qs[0].dtype)
      value_cols = first + value_iota
      live_values = (value_cols >= c * block) & (value_cols < length)
      for i, (start, width) in enumerate(v_pieces):
        v = v_ref[rows_at + (pl.ds(start, width),)].astype(qs[0].dtype)
        v = jnp.where(live_values, v, jnp.zeros_like(v))
        new_accs[i] += lax.dot_general(
            p, v, (((1,), (0,)), ((), ())), precision=precision,
            preferred_element_type=jnp.float32)
    return tuple(new_accs), m_next, l_next

  carry = (tuple(jnp.zeros((rows_n, width), jnp.float32)
                 for _, width in v_pieces),
           jnp.full((rows_n,), -jnp.inf, jnp.float32),
           jnp.zeros((rows_n,), jnp.float32))
  return lax.fori_loop(start, end, body, carry)


def _finish(accs, m, l, sink_ref, v_scale, row_count):
  """The output rows (per head_dim piece) from the softmax state over all
  keys (m base 2, accs unnormalized): the sinks join the denominator,
  v_scale multiplies."""
  if sink_ref is not None:
    rows = lax.broadcasted_iota(jnp.int32, m.shape, 0)
    sink = plgpu.load(sink_ref.at[pl.ds(0, m.shape[0])], mask=rows < row_count,
                      other=-jnp.inf) * LOG2E
    top = jnp.maximum(m, sink)
    top = jnp.where(top == -jnp.inf, 0.0, top)
    scale = jnp.exp2(m - top)
    accs = [acc * scale[:, None] for acc in accs]
    l = l * scale + jnp.exp2(sink - top)
  outs = [acc / jnp.where(l == 0.0, 1.0, l)[:, None] for acc in accs]
  return outs if v_scale is None else [out * v_scale for out in outs]


def _kernel(lengths_ref, q_ref, k_ref, v_ref, *rest, queries, row_count,
            merged_rows, window, sm_scale, cap, block, num_splits, paged, capacity,
            quantized, sinks, interpret):
  rest = list(rest)
  pages_ref = rest.pop(0) if paged else None
  k_scale_ref = rest.pop(0) if quantized else None
  v_scale_ref = rest.pop(0) if quantized else None
  sink_ref = rest.pop(0) if sinks else None
  if num_splits > 1:
    tickets_in_ref = rest.pop(0)
  o_ref = rest.pop(0)
  h = pl.program_id(1)
  v_scale = None
  if quantized:  # the kv head's k_scale joins the logit scale
    sm_scale = sm_scale * k_scale_ref[h]
    v_scale = v_scale_ref[h]
  accs, m, l = _attend(
      lengths_ref, q_ref, k_ref, v_ref, pages_ref, sm_scale, queries=queries,
      row_count=row_count, window=window, cap=cap, block=block,
      num_splits=num_splits, paged=paged, capacity=capacity)
  pieces = head_dim_pieces(v_ref.shape[-1])
  if num_splits == 1:
    outs = _finish(accs, m, l, sink_ref, v_scale, row_count)
    _store_pieces(o_ref, outs, pieces, row_count)
    return
  del tickets_in_ref  # aliased to tickets_ref
  part_o_ref, part_lse_ref, tickets_ref = rest
  split = pl.program_id(2)
  empty = l == 0.0
  rows = lax.broadcasted_iota(jnp.int32, m.shape, 0)
  _store_pieces(part_o_ref,
                [acc / jnp.where(empty, 1.0, l)[:, None] for acc in accs],
                pieces, merged_rows, lead=(split,))
  plgpu.store(part_lse_ref.at[split],
              jnp.where(empty, -jnp.inf, m + jnp.log2(l)),
              mask=rows < merged_rows)
  if not interpret:  # every thread's stores before the ticket's release
    plgpu.debug_barrier()
  ticket = plgpu.atomic_add(tickets_ref, (pl.program_id(0) * pl.num_programs(1)
                                          + h,), jnp.ones((), jnp.int32))

  @pl.when(ticket == num_splits - 1)
  def _merge():
    _merge_splits(part_o_ref, part_lse_ref, o_ref, sink_ref, v_scale,
                  row_count=row_count, merged_rows=merged_rows,
                  num_splits=num_splits)


def _store_pieces(ref, pieces_out, pieces, row_count, lead=()):
  """Stores the head_dim pieces of rows ``< row_count`` into
  ``ref[*lead]`` [rows, head_dim] (cast to its dtype)."""
  for out, (start, width) in zip(pieces_out, pieces):
    rows = lax.broadcasted_iota(jnp.int32, out.shape, 0)
    plgpu.store(ref.at[lead + (pl.ds(0, out.shape[0]), pl.ds(start, width))],
                out.astype(ref.dtype), mask=rows < row_count)


def _merge_splits(part_o_ref, part_lse_ref, o_ref, sink_ref, v_scale, *,
                  row_count, merged_rows, num_splits):
  """The last program of a (b, hk): merges the splits' (out, lse) (the
  first ``merged_rows`` rows) in steps of ``chunk`` splits, with loads that
  bypass L1 (other SMs wrote them)."""
  head_dim = part_o_ref.shape[2]
  pieces = head_dim_pieces(head_dim)
  chunk = min(num_splits, _floor_pow2(MERGE_ELEMENTS // (merged_rows
                                                         * head_dim)))
  top = jnp.full((merged_rows,), -jnp.inf, jnp.float32)
  total = jnp.zeros((merged_rows,), jnp.float32)
  accs = [jnp.zeros((merged_rows, width), jnp.float32) for _, width in pieces]
  for first in range(0, num_splits, chunk):
    lse = plgpu.load(
        part_lse_ref.at[pl.ds(first, chunk), pl.ds(0, merged_rows)],
        volatile=True)
    new_top = jnp.maximum(top, jnp.max(lse, axis=0))
    shift = jnp.where(new_top == -jnp.inf, 0.0, new_top)
    weights = jnp.exp2(lse - shift[None, :])
    alpha = jnp.exp2(top - shift)
    total = total * alpha + jnp.sum(weights, axis=0)
    for i, (start, width) in enumerate(pieces):
      out = plgpu.load(
          part_o_ref.at[pl.ds(first, chunk), pl.ds(0, merged_rows),
                        pl.ds(start, width)], volatile=True)
      accs[i] = (accs[i] * alpha[:, None]
                 + jnp.sum(weights[:, :, None] * out, axis=0))
    top = new_top
  outs = _finish(accs, top, total, sink_ref, v_scale, row_count)
  _store_pieces(o_ref, outs, pieces, row_count)


def decode(q, k_cache, v_cache, kv_lengths, sinks, page_table, k_scale=None,
           v_scale=None, *, sm_scale, logit_soft_cap, sliding_window,
           interpret, block_kv=None, num_splits=None, num_warps=NUM_WARPS,
           num_stages=NUM_STAGES):
  """``[B, H, T, Dv]`` in q's dtype (arguments as checked by the API and
  ``supports``, scales ``[Hkv]`` float32 with 8-bit caches;
  ``block_kv`` (keys per step; paged: a multiple of the page size) and
  ``num_splits`` override the defaults;
  a split count is rounded down to a power of two)."""
  batch, heads, queries, head_dim = q.shape
  value_dim = v_cache.shape[3]
  paged = page_table is not None
  if not paged and k_cache.shape[2] < MIN_TILE:  # tiny: pad it to one tile
    pad = ((0, 0), (0, 0), (0, MIN_TILE - k_cache.shape[2]), (0, 0))
    k_cache, v_cache = jnp.pad(k_cache, pad), jnp.pad(v_cache, pad)
  kv_heads, group, itemsize, page_size, _, capacity = _splits.cache_layout(
      q, k_cache, page_table)
  block = block_kv or block_rows(capacity, max(head_dim, value_dim),
                                 itemsize, page_size,
                                 programs=batch * kv_heads)
  if paged and (block % page_size or not _pow2(block)):
    raise ValueError(f"block_kv={block} must be a power-of-two multiple of "
                     f"the page size {page_size}")
  num_blocks = -(-capacity // block)
  if num_splits is None:
    num_splits = default_splits(batch, kv_heads)
  num_splits = _floor_pow2(min(num_splits, num_blocks))
  row_count = queries * group
  rows = max(MIN_TILE, _next_pow2(row_count))
  merged_rows = _next_pow2(row_count)
  grouped = q.reshape(batch, kv_heads, row_count, head_dim)  # g-major rows

  index_map = lambda b, h, s: (0,)  # noqa: E731
  head_block = lambda b, h, s: (b, h, 0, 0)  # noqa: E731
  in_specs = [pl.BlockSpec((batch,), index_map),
              pl.BlockSpec((None, None, rows, head_dim), head_block)]
  for dim in (head_dim, value_dim):
    if paged:
      in_specs.append(pl.BlockSpec((k_cache.shape[0], None, page_size, dim),
                                   lambda b, h, s: (0, h, 0, 0)))
    else:
      in_specs.append(pl.BlockSpec((None, None, capacity, dim), head_block))
  operands = [kv_lengths, grouped, k_cache, v_cache]
  if paged:
    in_specs.append(pl.BlockSpec((None, page_table.shape[1]),
                                 lambda b, h, s: (b, 0)))
    operands.append(page_table)
  if k_scale is not None:
    in_specs += [pl.BlockSpec((kv_heads,), index_map)] * 2
    operands += [k_scale, v_scale]
  if sinks is not None:
    sink_rows = jnp.repeat(sinks.astype(jnp.float32).reshape(kv_heads, group),
                           queries, axis=1)
    in_specs.append(pl.BlockSpec((None, rows), lambda b, h, s: (h, 0)))
    operands.append(sink_rows)
  out_shape = [jax.ShapeDtypeStruct(grouped.shape[:3] + (value_dim,),
                                    q.dtype)]
  out_specs = [pl.BlockSpec((None, None, rows, value_dim), head_block)]
  aliases = {}
  if num_splits > 1:
    tickets = batch * kv_heads
    aliases = {len(operands): 3}
    in_specs.append(pl.BlockSpec((tickets,), index_map))
    operands.append(jnp.zeros((tickets,), jnp.int32))
    out_shape += [
        jax.ShapeDtypeStruct((batch, kv_heads, num_splits, merged_rows,
                              value_dim), jnp.float32),
        jax.ShapeDtypeStruct((batch, kv_heads, num_splits, merged_rows),
                             jnp.float32),
        jax.ShapeDtypeStruct((tickets,), jnp.int32)]
    out_specs += [
        pl.BlockSpec((None, None, num_splits, rows, value_dim),
                     lambda b, h, s: (b, h, 0, 0, 0)),
        pl.BlockSpec((None, None, num_splits, rows),
                     lambda b, h, s: (b, h, 0, 0)),
        pl.BlockSpec((tickets,), index_map)]
  kernel = functools.partial(
      _kernel, queries=queries, row_count=row_count, merged_rows=merged_rows,
      window=sliding_window,
      sm_scale=sm_scale, cap=logit_soft_cap, block=block,
      num_splits=num_splits, paged=paged, capacity=capacity,
      quantized=k_scale is not None, sinks=sinks is not None,
      interpret=interpret)
  pairs = batch * kv_heads * rows * capacity
  outs = _compat.pallas_call(
      kernel,
      grid=(batch, kv_heads, num_splits),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      input_output_aliases=aliases,
      compiler_params=_compat.gpu_compiler_params(num_warps=num_warps,
                                                  num_stages=num_stages),
      interpret=interpret,
      cost_estimate=_cost.estimate(
          flops=2 * pairs * (head_dim + value_dim), transcendentals=pairs,
          bytes_accessed=(batch * kv_heads * capacity * (head_dim + value_dim)
                          * itemsize + _cost.nbytes(grouped)
                          + _cost.nbytes(out_shape[0]))),
      name="decode_attention_gpu",
  )(*operands)
  return outs[0].reshape(q.shape[:3] + (value_dim,))
