"""Ragged paged attention for NVIDIA GPUs: Pallas with the Triton lowering.

The TPU kernel's work items, in two launches (short sequences in 16-row
blocks, the others in 128-row items); one program per (item, kv head, split)
walks the item's visible keys through the page table with the online softmax
in base 2; decode items may split their keys (flash decoding). MLA
(``latent_dim``): the H query heads split into ``mla_groups`` virtual kv
heads of at most MLA_HEADS heads (rows per token) that all read the same
latent row, one load of it serving as K (all D columns) and V (its first
``latent_dim``). Structure: docs/design/ragged_paged_attention.md.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _backend, _compat, _cost
from pallas_kernels.decode import splits as _splits
from pallas_kernels.decode import triton as _decode
from pallas_kernels.ragged import mosaic_tpu as _tpu
from pallas_kernels.ragged import reference as _ref

pl = _compat.pl

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
MIN_TILE = 16
SMALL_ROWS = 16     # rows of a short (decode) item
LARGE_ROWS = 128    # rows of a prefill item
PROGRAMS = 132      # one per SM of an H100/H200
# MLA: at most this many query heads per program. All H heads in one program
# (DeepSeek's 128) hold 128 x latent float32 accumulators and spill; groups
# of <= 32 re-read the shared latent row (from L2) once per group instead.
MLA_HEADS = 32


@dataclasses.dataclass(frozen=True)
class Tiles:
  """One launch's tiles: tokens and rows per item, keys per step."""
  tq: int
  rows: int
  block: int
  num_warps: int
  num_stages: int
  # Grid (Hkv, W, splits): the kv heads of an item run side by side, so
  # together they read its pages (K/V heads interleaved) whole.
  heads_first: bool = True


def _next_pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def supports(q, kv_pages, latent_dim=None) -> str | None:
  """Why the kernel cannot run the call, else None."""
  head_dim = q.shape[2]
  if head_dim % MIN_TILE:
    return (f"the Triton kernel needs head_dim a multiple of {MIN_TILE}, "
            f"got {head_dim}")
  if latent_dim is not None and latent_dim % MIN_TILE:
    return (f"the Triton kernel needs latent_dim a multiple of {MIN_TILE} "
            f"(V is a column tile of the row), got {latent_dim}")
  capability = _backend.target().gpu_capability
  if (kv_pages.dtype == jnp.float8_e4m3fn and capability
      and tuple(map(int, capability.split(".")[:2])) < (8, 9)):
    return (f"Triton supports float8_e4m3fn only on sm_89+ GPUs, this is "
            f"sm_{capability.replace('.', '')}")
  return None


def mla_groups(heads: int) -> int:
  """MLA's virtual kv heads: the fewest n dividing H with H / n <=
  MLA_HEADS (H <= MLA_HEADS: 1, all heads in one program)."""
  return next(n for n in range(1, heads + 1)
              if heads % n == 0 and heads // n <= MLA_HEADS)


def tiles(group: int, head_dim: int, num_queries_per_block=None,
          num_kv_pages_per_block=None, page_size=1):
  """(short, long) Tiles; short is None when num_queries_per_block is
  given (one class of items, that many tokens each)."""
  wide = head_dim > 128
  def block(default):
    if num_kv_pages_per_block is None:
      return default
    return max(MIN_TILE, _next_pow2(num_kv_pages_per_block * page_size))
  if num_queries_per_block is not None:
    # At most LARGE_ROWS rows (registers): fewer tokens per item.
    tq = max(1, min(num_queries_per_block, LARGE_ROWS // group))
    rows = max(MIN_TILE, _next_pow2(tq * group))
    return None, Tiles(tq, rows, block(64), 4 if rows <= 64 else 8,
                       2 if wide else 3)
  small_rows = max(SMALL_ROWS, _next_pow2(group))
  short = Tiles(max(1, small_rows // group), small_rows,
                block(32 if wide else 64), 4, 3)
  large_rows = max(LARGE_ROWS, small_rows)
  # 4 warps on narrow heads (docs/design/ragged_paged_attention.md).
  long = Tiles(max(1, large_rows // group), large_rows,
               block(32 if wide else 64), 8 if wide else 4,
               2 if wide else 3)
  return short, long


def row_pieces(head_dim: int, value_dim: int):
  """(K pieces, V pieces) of a row whose V is its first value_dim columns:
  V's pieces then the rest's, so V's are a prefix of K's (MLA reuses the
  loaded K tiles as V)."""
  v = _decode.head_dim_pieces(value_dim)
  rest = tuple((value_dim + s, w)
               for s, w in _decode.head_dim_pieces(head_dim - value_dim))
  return v + rest, v


def _kernel(seq_ref, pos_ref, nq_ref, lens_ref, table_ref, q_ref, k_ref,
            *rest, group, block, page_size, pages_per_seq, window,
            sm_scale, cap, v_scale, sinks, num_splits, heads_first,
            latent):
  rest = list(rest)
  v_ref = None if latent else rest.pop(0)
  sink_ref = rest.pop(0) if sinks else None
  w, split = pl.program_id(1 if heads_first else 0), pl.program_id(2)
  seq, pos0, nq, length, first, last, live = _tpu.item_keys(
      seq_ref, pos_ref, nq_ref, lens_ref, w, window)
  lo = lax.div(first, jnp.int32(block))
  count = jnp.where(live, lax.div(jnp.maximum(last, 0), jnp.int32(block))
                    - lo + 1, 0)
  per = lax.div(count + (num_splits - 1), jnp.int32(num_splits))
  start = lo + split * per
  end = jnp.minimum(start + per, lo + count)

  rows_n, head_dim = q_ref.shape
  if latent:
    pieces, v_pieces = row_pieces(head_dim, latent)
  else:
    pieces = v_pieces = _decode.head_dim_pieces(head_dim)
  qs = [q_ref[:, pl.ds(s, width)] for s, width in pieces]
  dtype = qs[0].dtype
  rows = lax.broadcasted_iota(jnp.int32, (rows_n, block), 0)
  key_iota = lax.broadcasted_iota(jnp.int32, (rows_n, block), 1)
  slot_iota = lax.broadcasted_iota(jnp.int32, (block,), 0)
  value_iota = lax.broadcasted_iota(jnp.int32, (block, 1), 0)
  base = seq * pages_per_seq

  def body(b, carry, masked):
    accs, m_prev, l_prev = carry
    key0 = b * block
    keys = key0 + slot_iota
    entry = base + jnp.minimum(lax.div(keys, jnp.int32(page_size)),
                               pages_per_seq - 1)
    slots = table_ref[entry] * page_size + lax.rem(keys,
                                                   jnp.int32(page_size))
    ks = [k_ref[slots, pl.ds(s, width)].astype(dtype) for s, width in pieces]
    qk = sum(lax.dot_general(
        q, k, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32) for q, k in zip(qs, ks))
    if cap is None:
      s = qk * (sm_scale * LOG2E)
    else:
      s = cap * LOG2E * jnp.tanh(qk * (sm_scale / cap))
    if masked:
      cols = key0 + key_iota
      visible = (cols < length) & (rows >= (cols - pos0) * group)
      if window is not None:
        visible &= rows < (cols + window - pos0) * group
      s = jnp.where(visible, s, -jnp.inf)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    m_shift = jnp.where(m_next == -jnp.inf, 0.0, m_next)
    alpha = jnp.exp2(m_prev - m_shift)
    p = jnp.exp2(s - m_shift[:, None])
    l_next = l_prev * alpha + jnp.sum(p, axis=1)
    p = p.astype(dtype)
    new = []
    for i, (acc, (s0, width)) in enumerate(zip(accs, v_pieces)):
      # MLA: V's pieces are the first K tiles (one load of the row).
      v = ks[i] if latent else v_ref[slots, pl.ds(s0, width)].astype(dtype)
      if masked:
        v = jnp.where(key0 + value_iota < length, v, jnp.zeros_like(v))
      new.append(acc * alpha[:, None] + lax.dot_general(
          p, v, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST,
          preferred_element_type=jnp.float32))
    return tuple(new), m_next, l_next

  # Blocks every row sees whole (no mask): [whole_lo, whole_hi); the
  # masked ones before (window edge) and after (diagonal, length).
  whole_lo = jnp.int32(0)
  if window is not None:
    edge = jnp.maximum(pos0 + nq - window, 0)
    whole_lo = lax.div(edge + (block - 1), jnp.int32(block))
  whole_hi = lax.div(jnp.minimum(pos0 + 1, length), jnp.int32(block))
  a = jnp.clip(whole_lo, start, end)
  b = jnp.clip(whole_hi, a, end)
  carry = (tuple(jnp.zeros((rows_n, width), jnp.float32)
                 for _, width in v_pieces),
           jnp.full((rows_n,), -jnp.inf, jnp.float32),
           jnp.zeros((rows_n,), jnp.float32))
  masked = functools.partial(body, masked=True)
  carry = lax.fori_loop(start, a, masked, carry)
  carry = lax.fori_loop(a, b, functools.partial(body, masked=False), carry)
  accs, m, l = lax.fori_loop(b, end, masked, carry)

  if num_splits == 1:
    o_ref, = rest
    if sinks:   # exp(sink) joins the denominator
      sink = sink_ref[...] * LOG2E
      top = jnp.maximum(m, sink)
      top = jnp.where(top == -jnp.inf, 0.0, top)
      keep = jnp.exp2(m - top)
      accs = [acc * keep[:, None] for acc in accs]
      l = l * keep + jnp.exp2(sink - top)
    scale = 1.0 if v_scale is None else v_scale
    inv = scale / jnp.where(l == 0.0, 1.0, l)
    for acc, (s0, width) in zip(accs, v_pieces):
      o_ref[:, pl.ds(s0, width)] = (acc * inv[:, None]).astype(o_ref.dtype)
    return
  part_o_ref, part_lse_ref = rest
  empty = l == 0.0
  inv = 1.0 / jnp.where(empty, 1.0, l)
  for acc, (s0, width) in zip(accs, v_pieces):
    part_o_ref[:, pl.ds(s0, width)] = acc * inv[:, None]
  part_lse_ref[...] = jnp.where(empty, -jnp.inf, (m + jnp.log2(l)) * LN2)


def _launch(t: Tiles, items: int, num_splits: int, qi, pool, seq, pos0, nq,
            lens, table, sink_rows, *, group, page_size, pages_per_seq,
            window, sm_scale, cap, v_scale, interpret, latent=None):
  """One class's pallas_call: [W, Hkv, rows, Dv] in q's dtype, or with
  splits the (out, lse) partials [W, Hkv, splits, rows(, Dv)] float32.
  ``pool`` [slots, 2 Hkv, D] (K, V interleaved), or with ``latent``
  [slots, 1, D] rows whose first ``latent`` columns are V, read by every
  (virtual) kv head h."""
  kv_heads, head_dim = qi.shape[1], qi.shape[3]
  value_dim = latent or head_dim
  slots = pool.shape[0]
  if t.heads_first and items > 65535:   # CUDA's grid y limit
    t = dataclasses.replace(t, heads_first=False)
  order = (lambda f: lambda h, w, s: f(w, h, s)) if t.heads_first else (
      lambda f: f)
  full = lambda n: pl.BlockSpec((n,), order(lambda w, h, s: (0,)))  # noqa
  in_specs = [full(items), full(items), full(items), full(lens.shape[0]),
              full(table.shape[0]),
              pl.BlockSpec((None, None, t.rows, head_dim),
                           order(lambda w, h, s: (w, h, 0, 0))),
              pl.BlockSpec((slots, None, head_dim),
                           order(lambda w, h, s: (0, 0 if latent else 2 * h,
                                                  0)))]
  operands = [seq, pos0, nq, lens, table, qi, pool]   # MLA: the one row
  if not latent:   # V from its own head; MLA's is in the row already read
    in_specs.append(pl.BlockSpec((slots, None, head_dim),
                                 order(lambda w, h, s: (0, 2 * h + 1, 0))))
    operands.append(pool)
  if sink_rows is not None:
    in_specs.append(pl.BlockSpec((None, t.rows),
                                 order(lambda w, h, s: (h, 0))))
    operands.append(sink_rows)
  if num_splits == 1:
    out_shape = jax.ShapeDtypeStruct(qi.shape[:3] + (value_dim,), qi.dtype)
    out_specs = pl.BlockSpec((None, None, t.rows, value_dim),
                             order(lambda w, h, s: (w, h, 0, 0)))
  else:
    out_shape = (
        jax.ShapeDtypeStruct((items, kv_heads, num_splits, t.rows,
                              value_dim), jnp.float32),
        jax.ShapeDtypeStruct((items, kv_heads, num_splits, t.rows),
                             jnp.float32))
    out_specs = (pl.BlockSpec((None, None, None, t.rows, value_dim),
                              order(lambda w, h, s: (w, h, s, 0, 0))),
                 pl.BlockSpec((None, None, None, t.rows),
                              order(lambda w, h, s: (w, h, s, 0))))
  grid = ((kv_heads, items, num_splits) if t.heads_first
          else (items, kv_heads, num_splits))
  kernel = functools.partial(
      _kernel, group=group, block=t.block, page_size=page_size,
      pages_per_seq=pages_per_seq, window=window, sm_scale=sm_scale, cap=cap,
      v_scale=v_scale, sinks=sink_rows is not None, num_splits=num_splits,
      heads_first=t.heads_first, latent=latent)
  keys = items * pages_per_seq * page_size
  pairs = keys * kv_heads * t.rows
  rows_read = 1 if latent else 2 * kv_heads
  return _compat.pallas_call(
      kernel, grid=grid, in_specs=in_specs,
      out_specs=out_specs, out_shape=out_shape,
      compiler_params=_compat.gpu_compiler_params(
          num_warps=t.num_warps, num_stages=t.num_stages),
      interpret=interpret,
      cost_estimate=_cost.estimate(
          flops=2 * pairs * (head_dim + value_dim), transcendentals=pairs,
          bytes_accessed=(rows_read * keys * head_dim * pool.dtype.itemsize
                          + _cost.nbytes(qi) * (head_dim + value_dim)
                          // head_dim)),
      name=("mla_ragged_paged_attention_gpu" if latent
            else "ragged_paged_attention_gpu"),
  )(*operands)


def ragged(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
           sinks=None, *, sm_scale, sliding_window, soft_cap, k_scale, v_scale,
           num_queries_per_block, num_kv_pages_per_block, vmem_limit_bytes,
           interpret, tiles_override=None, num_splits=None, latent_dim=None):
  """[T, H, Dv] in q's dtype (arguments as checked by the API).
  ``kv_pages`` [P, page_size, 2 Hkv, D] (Dv = D), or with ``latent_dim``
  MLA's [P, page_size, D] rows: one kv head for all H (split into
  ``mla_groups(H)`` virtual ones, one program each), V the first
  ``latent_dim`` columns (Dv). ``tiles_override`` (short, long) and
  ``num_splits`` (short items) are for tuning."""
  del vmem_limit_bytes
  tokens, heads, head_dim = q.shape
  if latent_dim:
    kv_pages = kv_pages[:, :, None, :]   # one "head": the row
  num_pages, page_size, combined, _ = kv_pages.shape
  kv_heads = mla_groups(heads) if latent_dim else combined // 2
  value_dim = latent_dim or head_dim
  group = heads // kv_heads
  max_seqs, pages_per_seq = page_indices.shape
  short, long = tiles_override or tiles(
      group, head_dim, num_queries_per_block, num_kv_pages_per_block,
      page_size)
  bounds = _ref.seq_bounds(cu_q_lens, num_seqs, tokens)
  lens = jnp.clip(kv_lens.astype(jnp.int32), 0, pages_per_seq * page_size)
  table = jnp.clip(page_indices, 0, num_pages - 1).reshape(-1)
  pool = kv_pages.reshape(num_pages * page_size, combined, head_dim)
  qlens = bounds[1:] - bounds[:-1]
  owner = _ref.token_seqs(bounds, tokens)
  live = owner < max_seqs
  owner = jnp.minimum(owner, max_seqs - 1)
  rel = jnp.arange(tokens, dtype=jnp.int32) - bounds[owner]
  scale = sm_scale * (1.0 if k_scale is None else k_scale)
  common = dict(group=group, page_size=page_size, pages_per_seq=pages_per_seq,
                window=sliding_window, sm_scale=scale, cap=soft_cap,
                interpret=interpret, latent=latent_dim)

  classes = []   # (tiles, in class [S], static item bound)
  if short is None:
    classes.append((long, jnp.ones_like(qlens, bool),
                    (tokens + min(max_seqs, tokens) * (long.tq - 1))
                    // long.tq))
  else:
    small = qlens <= short.tq
    classes.append((short, small, min(max_seqs, tokens)))
    # A long sequence has more than short.tq tokens.
    n_long = min(max_seqs, tokens // (short.tq + 1))
    classes.append((long, ~small,
                    (tokens + n_long * (long.tq - 1)) // long.tq))

  out = jnp.zeros((tokens, heads, value_dim), q.dtype)
  for t, member, items in classes:
    if items <= 0:
      continue
    class_lens = jnp.where(member, qlens, 0)
    class_bounds = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                                    jnp.cumsum(class_lens).astype(jnp.int32)])
    plan = _tpu.Plan(tq=t.tq, rows=t.rows, chunks=0, block=t.block,
                     num_blocks=0, items=items)
    seq, pos0, nq, first_item, qoff = _tpu.work_items(class_bounds, lens,
                                                      plan)
    # Gather each item's queries: [W, tq, H, D] -> [W, Hkv, tq * G, D].
    r = jnp.arange(t.tq, dtype=jnp.int32)
    idx = (bounds[seq] + qoff)[:, None] + r
    rows_live = r[None] < nq[:, None]
    qi = jnp.where(rows_live[..., None, None],
                   q[jnp.clip(idx, 0, tokens - 1)], jnp.zeros((), q.dtype))
    qi = qi.reshape(items, t.tq, kv_heads, group, head_dim)
    qi = qi.transpose(0, 2, 1, 3, 4).reshape(items, kv_heads, t.tq * group,
                                             head_dim)
    qi = jnp.pad(qi, ((0, 0), (0, 0), (0, t.rows - t.tq * group), (0, 0)))
    sink_rows = _splits.sink_rows(sinks, kv_heads, t.tq, t.rows)
    splits = 1
    if t is short:
      splits = num_splits or _decode.default_splits(items, kv_heads)
      splits = max(1, min(splits, -(-pages_per_seq * page_size // t.block)))
    res = _launch(t, items, splits, qi, pool, seq, pos0, nq, lens, table,
                  sink_rows, v_scale=v_scale, **common)
    if splits > 1:
      res = _splits.combine(res[0], res[1], sink_rows)
      if v_scale is not None:
        res = res * v_scale
      res = res.astype(q.dtype)
    # Scatter back: token t of sequence i is row (t - c_i) % tq of item
    # first_item[i] + (t - c_i) // tq.
    res = res[:, :, :t.tq * group].reshape(items, kv_heads, t.tq, group,
                                           value_dim)
    res = res.transpose(0, 2, 1, 3, 4).reshape(items * t.tq, heads,
                                               value_dim)
    src = (first_item[owner] + rel // t.tq) * t.tq + rel % t.tq
    src = jnp.clip(src, 0, items * t.tq - 1)
    mine = live & member[owner]
    out = jnp.where(mine[:, None, None], res[src], out)
  return out
