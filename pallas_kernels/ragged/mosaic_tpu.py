"""Mosaic TPU ragged paged attention: work items over a paged KV cache.

The ragged token axis is cut (in XLA) into items of ``tq`` query tokens of one
sequence; grid ``(items, kv blocks)``, each step DMAs its block's pages into
one of two VMEM slots and runs the online softmax per kv head, masking only
blocks some query sees in part. By default sequences fall in two classes by
their query length, one launch each: decode-like ones (at most
``SMALL_ROWS // G`` tokens) in one-tile items, the others in items of
``LARGE_ROWS // G`` tokens. MLA reads one latent row per token. Structure:
docs/design/ragged_paged_attention.md.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _backend, _compat, _cost
from pallas_kernels._compat import pl, pltpu
from pallas_kernels.attention.mosaic_tpu import online_softmax_step
from pallas_kernels.ragged import reference as _ref

LANES = 128
_SQ = pl.Squeezed() if hasattr(pl, "Squeezed") else None
_NT = (((1,), (1,)), ((), ()))   # a @ b^T
# Bytes of one step's K and V pages in VMEM per generation (as decode's).
BLOCK_BYTES = {"v4": 1 << 20, "v5e": 2 << 20, "v5p": 2 << 20,
               "v6e": 4 << 20, "tpu7x": 4 << 20}
SCORE_BYTES = 1 << 20          # one step's float32 logits (rows x block)
ROWS = 128                     # rows per item of the single-class plan
# The default two classes' rows per item (tq * G): a sequence with at most
# SMALL_ROWS // G new tokens (decode, short speculative steps) is one item
# of one bf16 sublane tile; longer ones go in LARGE_ROWS-row items, which
# re-read the cache 1 / 4 as often as ROWS-row ones (bench/results, the
# design page's table).
SMALL_ROWS = 16
LARGE_ROWS = 512
SMEM_TABLE_BYTES = 512 << 10   # page table + metadata prefetched to SMEM
# The grid's parallel axis: core c runs items c, c + CORES, ... (v4/v5p
# megacore), each core writing the output of its items past the real ones
# to its own dummy block.
CORES = 2


@dataclasses.dataclass(frozen=True)
class Plan:
  tq: int            # query tokens per item
  rows: int          # tq * G padded to the sublane tile
  chunks: int        # pages per kv block
  block: int         # keys per kv block
  num_blocks: int    # kv blocks covering pages_per_seq
  items: int         # W, the static bound on work items
  # The class: sequences with min_q <= query length <= max_q (None: any).
  min_q: int = 1
  max_q: int | None = None


def _sublanes(itemsize: int) -> int:
  return 8 * max(1, 4 // itemsize)


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def supports(q, kv_pages, page_indices) -> str | None:
  """Why the kernel cannot run the call, else None."""
  if jnp.float16 in (q.dtype, kv_pages.dtype):
    return ("Mosaic cannot load float16 vectors on TPU v5e/v6e: use "
            "bfloat16 or float32")
  # The table, the lengths and at most T work items of 3 scalars.
  entries = page_indices.size + page_indices.shape[0] + 3 * q.shape[0]
  if entries * 4 > SMEM_TABLE_BYTES:
    return (f"the page table and metadata ({entries} int32) exceed the "
            f"{SMEM_TABLE_BYTES >> 10} KiB of SMEM they may use")
  return None


def hardware(kv_pages, target) -> str | None:
  """Why the chip's compiler cannot take the call (interpreters can)."""
  del target
  interleaved = kv_pages.ndim == 4   # MLA's [P, page_size, D] is not
  if (interleaved and kv_pages.dtype.itemsize != 4
      and _compat.JAX_VERSION < (0, 12)):
    return (f"a {kv_pages.dtype} cache needs jax >= 0.12: this jax's Mosaic "
            "has no strided loads of 16- or 8-bit data (the K and V heads "
            "are interleaved in a page)")
  if kv_pages.shape[-1] % 128 and _compat.JAX_VERSION < (0, 12):
    return (f"head_dim {kv_pages.shape[-1]} (not a multiple of 128) needs "
            "jax >= 0.12 for the page DMAs; this jax's Mosaic rejects them")
  return None


def make_plans(tokens, heads, kv_heads, head_dim, max_seqs, page_size,
               pages_per_seq, q_itemsize, kv_itemsize, *,
               num_queries_per_block=None, num_kv_pages_per_block=None,
               generation=None, channels=None,
               value_dim=None) -> tuple[Plan, ...]:
  """One Plan per launch: with ``num_queries_per_block`` one class of
  items of that many tokens; by default two: sequences of at most
  ``ts = SMALL_ROWS // G`` tokens in one item each, the longer ones in
  items of ``LARGE_ROWS // G`` tokens, fewer where that would take more
  than half the chip's VMEM (a class with no room for a sequence of its
  lengths in ``tokens`` is left out). ``value_dim``: MLA's latent width."""
  args = (tokens, heads, kv_heads, head_dim, max_seqs, page_size,
          pages_per_seq, q_itemsize, kv_itemsize)
  kw = dict(num_kv_pages_per_block=num_kv_pages_per_block,
            generation=generation, channels=channels)
  if num_queries_per_block is not None:
    return (make_plan(*args, num_queries_per_block=num_queries_per_block,
                      **kw),)
  group = heads // kv_heads
  small_tq = max(1, SMALL_ROWS // group)
  if tokens <= small_tq:
    return (make_plan(*args, num_queries_per_block=small_tq, **kw),)
  small = make_plan(*args, num_queries_per_block=small_tq, max_q=small_tq,
                    **kw)
  # At most T // (ts + 1) sequences have more than ts tokens.
  seqs = min(max_seqs, tokens // (small_tq + 1))
  generation = generation or _backend.target().tpu_generation
  budget = _backend.TPU_VMEM_BYTES.get(generation, 16 << 20) // 2
  sizes = (kv_heads, head_dim, q_itemsize, kv_itemsize,
           channels or 2 * kv_heads, value_dim)
  rows = LARGE_ROWS
  while True:   # halved until its VMEM takes at most half the chip's
    large = make_plan(*args, num_queries_per_block=max(1, rows // group),
                      min_q=small_tq + 1, seqs=seqs, **kw)
    if rows <= SMALL_ROWS or vmem_bytes(large, *sizes) * 5 // 4 <= budget:
      break
    rows //= 2
  if large.tq <= small_tq:
    return (make_plan(*args, num_queries_per_block=small_tq, **kw),)
  return small, large


def make_plan(tokens, heads, kv_heads, head_dim, max_seqs, page_size,
              pages_per_seq, q_itemsize, kv_itemsize, *,
              num_queries_per_block=None, num_kv_pages_per_block=None,
              generation=None, channels=None, min_q=1, max_q=None,
              seqs=None) -> Plan:
  """One launch's plan. ``channels``: cache rows per token (2 Hkv; MLA's
  shared row 1); ``min_q``, ``max_q``: its class of query lengths, of at
  most ``seqs`` sequences (default min(max_seqs, tokens))."""
  channels = channels or 2 * kv_heads
  group = heads // kv_heads
  tq = num_queries_per_block or max(1, ROWS // group)
  tq = max(1, min(tq, max(tokens, 1)))
  rows = _round_up(tq * group, _sublanes(q_itemsize))
  if num_kv_pages_per_block is None:
    generation = generation or _backend.target().tpu_generation
    block_bytes = BLOCK_BYTES.get(generation, BLOCK_BYTES["v5e"])
    lanes = _round_up(head_dim, LANES)
    keys = min(block_bytes // (channels * lanes * kv_itemsize),
               SCORE_BYTES // (rows * 4))
    chunks = max(1, keys // page_size)
  else:
    chunks = num_kv_pages_per_block
  chunks = max(1, min(chunks, pages_per_seq))
  seqs = min(max_seqs, tokens) if seqs is None else seqs
  if max_q is not None and max_q <= tq:
    items = seqs                  # one item per sequence
  else:
    items = (tokens + seqs * (tq - 1)) // tq
  return Plan(tq=tq, rows=rows, chunks=chunks, block=chunks * page_size,
              num_blocks=-(-pages_per_seq // chunks),
              items=_round_up(max(items, 1), CORES),
              min_q=min_q, max_q=max_q)


def vmem_bytes(plan: Plan, kv_heads, head_dim, q_itemsize, kv_itemsize,
               channels=None, value_dim=None):
  """Double-buffered q and out, the K/V slots, the float32 state and the
  step's temporaries (logits, probabilities, mask)."""
  channels = channels or 2 * kv_heads
  lanes = _round_up(head_dim, LANES)
  v_lanes = _round_up(value_dim or head_dim, LANES)
  qo = 2 * kv_heads * plan.rows * (lanes + v_lanes) * q_itemsize
  kv = 2 * channels * plan.block * lanes * kv_itemsize
  if kv_itemsize != q_itemsize:   # one head's K and V converted at a time
    kv += 2 * plan.block * lanes * 4
  state = kv_heads * plan.rows * (2 * LANES + v_lanes) * 4
  temps = 4 * plan.rows * _round_up(plan.block, LANES) * 4
  return qo + kv + state + temps


# ----------------------------------------------------------------- kernel --

def item_keys(seq_ref, pos_ref, nq_ref, lens_ref, w, window):
  """Work item ``w``: its sequence, first query position, query count and
  sequence length, and the first and last key any of its queries sees
  (``live``: it sees one)."""
  seq, pos0, nq = seq_ref[w], pos_ref[w], nq_ref[w]
  length = lens_ref[seq]
  last = jnp.minimum(length, pos0 + nq) - 1
  first = jnp.int32(0)
  if window is not None:
    first = jnp.maximum(pos0 - (window - 1), 0)
  return seq, pos0, nq, length, first, last, (nq > 0) & (last >= first)


def _kernel(seq_ref, pos_ref, nq_ref, lens_ref, table_ref, q_ref, kv_hbm,
            *refs, plan: Plan, group, kv_heads, page_size, pages_per_seq,
            window, sm_scale, cap, v_scale, sinks, latent):
  sinks_ref = refs[0] if sinks else None
  o_ref, m_ref, l_ref, acc_ref, buf, sems = refs[sinks:]
  w = pl.program_id(1) * CORES + pl.program_id(0)
  j = pl.program_id(2)
  seq, pos0, nq, length, first, last, live = item_keys(
      seq_ref, pos_ref, nq_ref, lens_ref, w, window)
  lo = lax.div(first, jnp.int32(plan.block))
  hi = lax.div(jnp.maximum(last, 0), jnp.int32(plan.block))
  blk = lo + j
  run = live & (blk <= hi)
  slot = lax.rem(j, 2)
  used_pages = lax.div(length + (page_size - 1), jnp.int32(page_size))
  channels = 1 if latent else 2 * kv_heads

  def loaded(b):  # pages of block b holding keys below the length
    return jnp.clip(used_pages - b * plan.chunks, 0, plan.chunks)

  def copy(page, c, ch, s):
    size = page_size * channels
    at = s * (plan.block * channels) + c * size
    return pltpu.make_async_copy(
        kv_hbm.at[page], buf.at[pl.ds(pl.multiple_of(at, size), size)],
        sems.at[s])

  def start(b, s):
    base = seq * pages_per_seq + b * plan.chunks

    def body(c, carry):
      copy(table_ref[base + c], c, 0, s).start()
      return carry
    lax.fori_loop(0, loaded(b), body, 0)

  def wait(b, s):
    n = loaded(b)

    @pl.when(n == plan.chunks)
    def _whole():   # one wait for the slot's bytes
      whole = buf.at[pl.ds(0, plan.block * channels)]
      pltpu.make_async_copy(whole, whole, sems.at[s]).wait()

    @pl.when(n < plan.chunks)
    def _part():
      def body(c, carry):
        copy(0, 0, 0, s).wait()
        return carry
      lax.fori_loop(0, n, body, 0)

  @pl.when((j == 0) & (nq > 0))
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  @pl.when(run & (j == 0))
  def _first():
    start(blk, slot)

  @pl.when(run & (blk < hi))
  def _next():
    start(blk + 1, 1 - slot)

  key0 = blk * plan.block
  whole = (key0 + plan.block - 1 <= pos0) & (key0 + plan.block <= length)
  if window is not None:
    whole &= key0 > pos0 + nq - 1 - window

  def step(masked, sl):
    wait(blk, sl)
    if masked:
      shape = (plan.rows, plan.block)
      cols = key0 + lax.broadcasted_iota(jnp.int32, shape, 1)
      r = lax.broadcasted_iota(jnp.int32, shape, 0)
      # Row r is token r // G at position pos0 + r // G.
      visible = (r >= (cols - pos0) * group) & (cols < length)
      if window is not None:
        visible &= r < (cols + window - pos0) * group
      written = key0 + lax.broadcasted_iota(
          jnp.int32, (plan.block, 1), 0) < length
    for h in range(kv_heads):
      q = q_ref[h]
      if latent:  # MLA: one row per key; V is its first `latent` lanes
        k = buf[pl.ds(sl * plan.block, plan.block)].astype(q.dtype)
        v = k[:, :latent]
      else:
        # Keys of head h are rows 2h, 2h + C, ... of the slot (a static
        # start: Mosaic's strided loads of packed types need one).
        at = sl * plan.block * channels + 2 * h
        k = buf[pl.ds(at, plan.block, stride=channels)]
        v = buf[pl.ds(at + 1, plan.block, stride=channels)]
        k, v = k.astype(q.dtype), v.astype(q.dtype)
      s = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32)
      s = s * sm_scale
      if cap is not None:
        s = cap * jnp.tanh(s / cap)
      if masked:
        s = jnp.where(visible, s, -jnp.inf)
        v = jnp.where(written, v, jnp.zeros_like(v))
      online_softmax_step(s, v, m_ref.at[h], l_ref.at[h], acc_ref.at[h])

  for sl in (0, 1):
    here = run & (slot == sl)
    pl.when(here & whole)(functools.partial(step, False, sl))
    pl.when(here & jnp.logical_not(whole))(functools.partial(step, True, sl))

  @pl.when((j == plan.num_blocks - 1) & (nq > 0))
  def _finish():   # (items past the real ones share a dummy output block)
    l = l_ref[...]
    has_keys = l[..., :1] != 0
    scale = 1.0 if v_scale is None else v_scale
    acc = acc_ref[...]
    if sinks:  # exp(sink) joins the denominator
      m, sink = m_ref[...], sinks_ref[...]
      top = jnp.maximum(m, sink)
      keep = jnp.exp(m - top)
      l = l * keep + jnp.exp(sink - top)
      acc = acc * keep[..., :1]
    out = acc * (scale / jnp.where(has_keys, l[..., :1], 1.0))
    o_ref[...] = jnp.where(has_keys, out, 0.0).astype(o_ref.dtype)


# -------------------------------------------------------------- host side --

def work_items(bounds, kv_lens, plan: Plan):
  """Per item (sequence, position of its first query, query count) [W]
  int32 each, per sequence its first item [S], and per item its first
  query's offset in its sequence [W]. Only sequences of the plan's class
  have items; items past theirs have no queries."""
  s = bounds.shape[0] - 1
  qlens = bounds[1:] - bounds[:-1]
  member = qlens >= plan.min_q
  if plan.max_q is not None:
    member &= qlens <= plan.max_q
  counts = jnp.where(member, -(-qlens // plan.tq), 0)
  ends = jnp.cumsum(counts)
  starts = ends - counts
  w = jnp.arange(plan.items, dtype=jnp.int32)
  seq = jnp.minimum(jnp.searchsorted(ends, w, side="right"), s - 1)
  seq = seq.astype(jnp.int32)
  qoff = (w - starts[seq]) * plan.tq
  nq = jnp.where(w < ends[-1], jnp.clip(qlens[seq] - qoff, 0, plan.tq), 0)
  pos0 = kv_lens[seq] - qlens[seq] + qoff
  return seq, pos0.astype(jnp.int32), nq.astype(jnp.int32), starts, qoff


def ragged(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
           sinks=None, *, sm_scale, sliding_window, soft_cap, k_scale, v_scale,
           num_queries_per_block, num_kv_pages_per_block, vmem_limit_bytes,
           interpret, latent_dim=None):
  """[T, H, Dv] in q's dtype (arguments as checked by the API).

  ``kv_pages`` [P, page_size, 2 Hkv, D] (Dv = D), or with ``latent_dim``
  MLA's [P, page_size, D]: one kv head, K the whole row, V its first
  ``latent_dim`` lanes (Dv), one DMA'd row serving both. One launch per
  class of ``make_plans``; each token's output comes from its sequence's
  class."""
  tokens, heads, head_dim = q.shape
  num_pages, page_size = kv_pages.shape[:2]
  combined = 1 if latent_dim else kv_pages.shape[2]
  kv_heads = 1 if latent_dim else combined // 2
  value_dim = latent_dim or head_dim
  max_seqs, pages_per_seq = page_indices.shape
  plans = make_plans(tokens, heads, kv_heads, head_dim, max_seqs, page_size,
                     pages_per_seq, q.dtype.itemsize, kv_pages.dtype.itemsize,
                     num_queries_per_block=num_queries_per_block,
                     num_kv_pages_per_block=num_kv_pages_per_block,
                     channels=combined, value_dim=value_dim)
  bounds = _ref.seq_bounds(cu_q_lens, num_seqs, tokens)
  lens = jnp.clip(kv_lens.astype(jnp.int32), 0, pages_per_seq * page_size)
  table = jnp.clip(page_indices, 0, num_pages - 1).reshape(-1)
  kv_flat = kv_pages.reshape(num_pages, page_size * combined, head_dim)
  owner = _ref.token_seqs(bounds, tokens)
  live = owner < max_seqs
  owner = jnp.minimum(owner, max_seqs - 1)
  rel = jnp.arange(tokens, dtype=jnp.int32) - bounds[owner]
  qlens = (bounds[1:] - bounds[:-1])[owner]
  out = jnp.zeros((tokens, heads, value_dim), q.dtype)
  # (Each class launches even without sequences: a lax.cond skipping it
  # would hide its kernel from bench.tpu's walk, which does not follow
  # conditionals; such a launch runs its items' empty steps, no DMA.)
  for plan in plans:
    seq, pos0, nq, first_item, qoff = work_items(bounds, lens, plan)
    res = _launch(plan, q, kv_flat, bounds, lens, table, seq, pos0, nq, qoff,
                  sinks, kv_heads=kv_heads, combined=combined,
                  value_dim=value_dim, page_size=page_size,
                  max_seqs=max_seqs, kv_dtype=kv_pages.dtype,
                  sm_scale=sm_scale, sliding_window=sliding_window,
                  soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale,
                  vmem_limit_bytes=vmem_limit_bytes, interpret=interpret,
                  latent_dim=latent_dim)
    # Token t of sequence i is row (t - c_i) % tq of item
    # first_item[i] + (t - c_i) // tq.
    tq = plan.tq
    src = (first_item[owner] + rel // tq) * tq + rel % tq
    src = jnp.clip(src, 0, res.shape[0] - 1)
    mine = live & (qlens >= plan.min_q)
    if plan.max_q is not None:
      mine &= qlens <= plan.max_q
    out = jnp.where(mine[:, None, None], res[src], out)
  return out


def _launch(plan: Plan, q, kv_flat, bounds, lens, table, seq, pos0, nq, qoff,
            sinks, *, kv_heads, combined, value_dim, page_size, max_seqs,
            kv_dtype, sm_scale, sliding_window, soft_cap, k_scale, v_scale,
            vmem_limit_bytes, interpret, latent_dim):
  """One class's pallas_call: [(W + CORES) tq, H, Dv], row ``w tq + t``
  token t of item w."""
  tokens, heads, head_dim = q.shape
  pages_per_seq = table.shape[0] // max_seqs
  group = heads // kv_heads
  tq, w_items = plan.tq, plan.items
  # Gather each item's queries: [W, tq, H, D] -> [W, Hkv, tq * G, D]
  # (whole token rows: XLA's gather of single head rows is slower). Rows
  # past an item's tokens hold other tokens, not zeros: rows are
  # independent and theirs are never read back.
  r = jnp.arange(tq, dtype=jnp.int32)
  idx = jnp.clip((bounds[seq] + qoff)[:, None] + r, 0, tokens - 1)
  qi = q[idx].reshape(w_items, tq, kv_heads, group, head_dim)
  qi = qi.transpose(0, 2, 1, 3, 4).reshape(w_items, kv_heads, tq * group,
                                           head_dim)
  if plan.rows > tq * group:
    qi = jnp.pad(qi, ((0, 0), (0, 0), (0, plan.rows - tq * group), (0, 0)))

  scale = sm_scale * (1.0 if k_scale is None else k_scale)
  kernel = functools.partial(
      _kernel, plan=plan, group=group, kv_heads=kv_heads, page_size=page_size,
      pages_per_seq=pages_per_seq, window=sliding_window, sm_scale=scale,
      cap=soft_cap, v_scale=v_scale, sinks=sinks is not None,
      latent=latent_dim)
  # Items past the real ones (nq = 0) read q's block c (fetched once) and
  # write core c's dummy output block W + c: no DMA per item.
  def q_block(c, i, j, seq_ref, pos_ref, nq_ref, *_):
    w = i * CORES + c
    return jnp.where(nq_ref[w] > 0, w, c), 0, 0, 0

  def out_block(c, i, j, seq_ref, pos_ref, nq_ref, *_):
    w = i * CORES + c
    return jnp.where(nq_ref[w] > 0, w, w_items + c), 0, 0, 0

  spec = pl.BlockSpec((_SQ, kv_heads, plan.rows, head_dim), q_block)
  out_spec = pl.BlockSpec((_SQ, kv_heads, plan.rows, value_dim), out_block)
  in_specs = [spec, pl.BlockSpec(memory_space=pl.ANY)]
  extra = []
  if sinks is not None:   # [Hkv, rows, 128]: row r holds head r % G's sink
    rows_sink = sinks.astype(jnp.float32).reshape(kv_heads, 1, group)
    rows_sink = jnp.tile(rows_sink, (1, tq, 1)).reshape(kv_heads, tq * group)
    rows_sink = jnp.pad(rows_sink, ((0, 0), (0, plan.rows - tq * group)))
    extra = [jnp.broadcast_to(rows_sink[..., None],
                              (kv_heads, plan.rows, LANES))]
    in_specs.append(pl.BlockSpec((kv_heads, plan.rows, LANES),
                                 lambda c, i, j, *_: (0, 0, 0)))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=5,
      grid=(CORES, w_items // CORES, plan.num_blocks),
      in_specs=in_specs, out_specs=out_spec,
      scratch_shapes=[
          pltpu.VMEM((kv_heads, plan.rows, LANES), jnp.float32),
          pltpu.VMEM((kv_heads, plan.rows, LANES), jnp.float32),
          pltpu.VMEM((kv_heads, plan.rows, value_dim), jnp.float32),
          pltpu.VMEM((2 * plan.block * combined, head_dim), kv_dtype),
          pltpu.SemaphoreType.DMA((2,))])
  sizes = (kv_heads, head_dim, q.dtype.itemsize, kv_dtype.itemsize,
           combined, value_dim)
  if vmem_limit_bytes is None:
    need = vmem_bytes(plan, *sizes) * 5 // 4
    vmem_limit_bytes = max(16 << 20, _round_up(need, 1 << 20))
  pairs = w_items * heads * tq * pages_per_seq * page_size
  work = dict(flops=2 * pairs * (head_dim + value_dim), transcendentals=pairs,
              bytes_accessed=(max_seqs * pages_per_seq * page_size * combined
                              * head_dim * kv_dtype.itemsize
                              + qi.size * q.dtype.itemsize
                              + qi.size // head_dim * value_dim
                              * q.dtype.itemsize))
  out = _compat.pallas_call(
      kernel, grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct(
          (w_items + CORES,) + qi.shape[1:3] + (value_dim,), q.dtype),
      compiler_params=_compat.tpu_compiler_params(
          # Items are independent (each item's DMA chain is its own); a
          # core's items run in order (its dummy block is written by one
          # run of steps).
          dimension_semantics=("parallel", "arbitrary", "arbitrary"),
          disable_bounds_checks=True,   # page ids clipped above
          vmem_limit_bytes=vmem_limit_bytes),
      interpret=interpret, cost_estimate=_cost.estimate(**work),
      name="mla_ragged_paged_attention" if latent_dim
      else "ragged_paged_attention",
  )(seq, pos0, nq, lens, table, qi, kv_flat, *extra)
  if plan.rows > tq * group:
    out = out[:, :, :tq * group]
  out = out.reshape(w_items + CORES, kv_heads, tq, group, value_dim)
  return out.transpose(0, 2, 1, 3, 4).reshape((w_items + CORES) * tq,
                                              heads, value_dim)
