"""Mosaic TPU decode attention: split-KV flash decoding over a contiguous
cache (pipelined blocks of one kv head per step) or a paged one (the
kernel's own page DMAs, every kv head per step); XLA merges the splits.
Structure: docs/design/decode.md, "decode/mosaic_tpu.py".
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
from pallas_kernels.decode import splits as _splits

LANES = 128
_SQ = pl.Squeezed() if hasattr(pl, "Squeezed") else None
_NT = (((1,), (1,)), ((), ()))   # a @ b^T
# Bytes of one K block in VMEM (V the same; paged: the block's pages of all
# kv heads): the step's DMA hides a grid step's fixed cost; v4 keeps 1 MiB of
# its 16 MiB VMEM (docs/design/decode.md, "Block bytes per generation").
BLOCK_BYTES = {"v4": 1 << 20, "v5e": 2 << 20, "v5p": 2 << 20,
               "v6e": 4 << 20, "tpu7x": 4 << 20}
# Bytes of one step's float32 logits (rows x block).
SCORE_BYTES = 1 << 20
# Pages per paged block: each is one unrolled K and one V DMA in the code.
MAX_PAGES_PER_BLOCK = 128
# SMEM bytes of the prefetched page table per launch.
PAGE_TABLE_BYTES = 256 << 10
# VMEM bytes per element of an 8-bit block's converted copy: float32, since
# Mosaic (libtpu of jax 0.7) widens float8 through it.
CONVERTED_ITEMSIZE = 4
# Parallel grid items (B * Hkv * splits) wanted: megacore chips share the
# parallel axes between two TensorCores.
PARALLEL_ITEMS = 8


@dataclasses.dataclass(frozen=True)
class Plan:
  """Static tiling of one call."""
  rows: int          # packed query rows, padded to the sublane tile
  block: int         # keys per step
  page_size: int     # rows per chunk (contiguous: the block)
  chunks: int        # pages per step (contiguous: 1)
  num_blocks: int    # blocks covering the capacity
  num_splits: int
  steps: int         # blocks per split
  paged: bool
  heads: int = 1     # kv heads per step (paged: all of them)


def supports(q, k_cache, page_table) -> str | None:
  """Why the kernel cannot run the call, else None."""
  if jnp.float16 in (q.dtype, k_cache.dtype):
    return ("Mosaic cannot load float16 vectors on TPU v5e/v6e: use "
            "bfloat16 or float32")
  if page_table is not None and page_table.shape[1] * 4 > PAGE_TABLE_BYTES:
    return (f"one sequence's page table ({page_table.shape[1]} pages) "
            f"exceeds the {PAGE_TABLE_BYTES >> 10} KiB of SMEM it may use")
  return None


def hardware(q, v_cache, page_table, target) -> str | None:
  """Why the chip's compiler cannot take the call (interpreters can)."""
  del target
  odd = [d for d in (q.shape[-1], v_cache.shape[-1]) if d % 128]
  if page_table is not None and odd and _compat.JAX_VERSION < (0, 12):
    return (f"paged caches with head_dim {odd[0]} (not a multiple of "
            "128) need jax >= 0.12 for the page DMAs; this jax's Mosaic "
            "rejects them")
  return None


def _sublanes(itemsize: int) -> int:
  return 8 * max(1, 4 // itemsize)


def make_plan(batch, kv_heads, row_count, capacity, head_dim, itemsize, *,
              page_size=None, pages_per_seq=None, block_kv=None,
              num_splits=None, generation=None,
              compute_itemsize=None, value_dim=None) -> Plan:
  """Rows, block and splits of a call (``block_kv``/``num_splits``: override
  the defaults; a paged block is a whole number of pages). ``itemsize``:
  the cache's, ``compute_itemsize`` q's (default the cache's);
  ``value_dim``: v's head_dim (default ``head_dim``; a K and a V block
  together hold ``2 * BLOCK_BYTES``).
  ``generation``: whose ``BLOCK_BYTES`` (default: the lowering target's).
  An 8-bit block (``BLOCK_BYTES`` of DMA, twice the keys of a bfloat16
  one) also keeps its buffers, its converted copy and its logits within
  half the generation's VMEM (binds on v4's 16 MiB)."""
  generation = generation or _backend.target().tpu_generation
  block_bytes = BLOCK_BYTES.get(generation, BLOCK_BYTES["v5e"])
  compute_itemsize = compute_itemsize or itemsize
  heads = kv_heads if page_size is not None else 1
  rows = _splits.round_up(row_count, _sublanes(compute_itemsize))
  kv_lanes = _kv_lanes(head_dim, value_dim)   # a K and a V row
  by_bytes = min(2 * block_bytes // (heads * kv_lanes * itemsize),
                 SCORE_BYTES // (rows * 4))
  if compute_itemsize != itemsize:
    vmem = _backend.TPU_VMEM_BYTES.get(generation, 16 << 20)
    per_key = (heads * kv_lanes * 2 * itemsize
               + kv_lanes * CONVERTED_ITEMSIZE + 16 * rows)
    by_bytes = min(by_bytes, vmem // 2 // per_key)
  target = max(LANES, by_bytes // LANES * LANES)
  if block_kv is not None:
    target = block_kv
  if page_size is None:
    block = capacity if capacity <= target else target
    page, chunks = block, 1
  else:
    chunks = max(1, min(target // page_size, MAX_PAGES_PER_BLOCK,
                        pages_per_seq))
    page, block = page_size, chunks * page_size
  num_blocks = -(-capacity // block)
  if num_splits is None:
    # Paged: a sequence's splits run in order (one DMA chain), so one.
    num_splits = (1 if page_size is not None
                  else -(-PARALLEL_ITEMS // max(1, batch * kv_heads)))
  num_splits = max(1, min(num_splits, num_blocks))
  return Plan(rows=rows, block=block, page_size=page, chunks=chunks,
              num_blocks=num_blocks, num_splits=num_splits,
              steps=-(-num_blocks // num_splits),
              paged=page_size is not None, heads=heads)


def _kv_lanes(head_dim, value_dim=None) -> int:
  """Lanes of one K row plus one V row in VMEM."""
  return (_splits.round_up(head_dim, LANES)
          + _splits.round_up(value_dim or head_dim, LANES))


def vmem_bytes(plan: Plan, head_dim: int, itemsize: int,
               compute_itemsize=None, value_dim=None) -> int:
  """VMEM of one launch: double-buffered q, K/V and outputs, the scratch and
  the step's float32 temporaries (logits, probabilities, mask); an 8-bit
  cache adds its K/V block converted (``CONVERTED_ITEMSIZE``).
  ``compute_itemsize``: q's, default the cache's; ``value_dim``: v's
  head_dim, default ``head_dim``."""
  compute_itemsize = compute_itemsize or itemsize
  lanes = _splits.round_up(head_dim, LANES)
  v_lanes = _splits.round_up(value_dim or head_dim, LANES)
  kv_lanes = lanes + v_lanes
  kv = 2 * plan.heads * plan.block * kv_lanes * itemsize
  if compute_itemsize != itemsize:   # one head's block at a time
    kv += plan.block * kv_lanes * CONVERTED_ITEMSIZE
  q = 2 * plan.heads * plan.rows * lanes * compute_itemsize
  outs = 2 * plan.heads * plan.rows * (v_lanes + LANES) * 4
  scratch = plan.heads * plan.rows * (2 * LANES + v_lanes) * 4
  temps = 4 * plan.rows * _splits.round_up(plan.block, LANES) * 4
  return kv + q + outs + scratch + temps


def vmem_limit_bytes(plan: Plan, head_dim: int, itemsize: int,
                     compute_itemsize=None, value_dim=None) -> int:
  """The scoped VMEM a launch asks for: its ``vmem_bytes`` with a quarter to
  spare, at least 16 MiB (the smallest default scoped limit)."""
  need = vmem_bytes(plan, head_dim, itemsize, compute_itemsize,
                    value_dim) * 5 // 4
  return max(16 << 20, _splits.round_up(need, 1 << 20))


def cost(batch, kv_heads, plan: Plan, head_dim, itemsize, capacity=None,
         compute_itemsize=None, value_dim=None):
  """Work at full length (every key of ``capacity`` visible): flops,
  transcendentals and HBM bytes (K and V once at the cache's ``itemsize``,
  q at ``compute_itemsize``, the partial outputs of ``value_dim``, default
  ``head_dim``)."""
  value_dim = value_dim or head_dim
  capacity = plan.num_blocks * plan.block if capacity is None else capacity
  pairs = batch * kv_heads * plan.rows * capacity
  kv_bytes = (batch * kv_heads * capacity * (head_dim + value_dim)
              * itemsize)
  q_bytes = (batch * kv_heads * plan.rows * head_dim
             * (compute_itemsize or itemsize))
  out_bytes = (batch * kv_heads * plan.num_splits * plan.rows
               * (value_dim + LANES) * 4)
  return dict(flops=2 * pairs * (head_dim + value_dim),
              transcendentals=pairs,
              bytes_accessed=kv_bytes + q_bytes + out_bytes)


# ----------------------------------------------------------------- kernel --

def _kernel(*refs, plan: Plan, queries, group, window, sm_scale, cap,
            quantized):
  lengths_ref = refs[0]
  prefetched = 1 + plan.paged + quantized
  it = iter(refs[prefetched:])
  q_ref = next(it)
  kv_refs = [(next(it), next(it)) for _ in range(plan.chunks)]
  o_ref, lse_ref, m_ref, l_ref, acc_ref = it
  b, split, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  if quantized:  # the kv head's k_scale joins the logit scale
    sm_scale = sm_scale * refs[prefetched - 1][pl.program_id(1)]
  length = lengths_ref[b]
  start, per, hi = _splits.split_range(length, split, queries, window,
                                       plan.block, plan.num_splits)
  block = start + j
  base = length - queries          # position of the first query

  @pl.when(j == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  first_key = block * plan.block
  whole = first_key + plan.block - 1 <= base
  if window is not None:
    whole &= first_key >= length - 1 - window
  run = (j < per) & (block <= hi)

  for chunk, (k_ref, v_ref) in enumerate(kv_refs):
    key0 = first_key + chunk * plan.page_size

    def step(masked, k_ref=k_ref, v_ref=v_ref, key0=key0):
      q = q_ref[...]
      k, v = k_ref[...].astype(q.dtype), v_ref[...].astype(q.dtype)
      s = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32)
      s = s * sm_scale
      if cap is not None:
        s = cap * jnp.tanh(s / cap)
      if masked:
        cols = key0 + lax.broadcasted_iota(jnp.int32, s.shape, 1)
        rows = lax.broadcasted_iota(jnp.int32, s.shape, 0)
        visible = (rows >= (cols - base) * group) & (cols < length)
        if window is not None:
          visible &= rows < (cols + window - base + 1) * group
        s = jnp.where(visible, s, -jnp.inf)
        written = key0 + lax.broadcasted_iota(jnp.int32, v.shape, 0) < length
        v = jnp.where(written, v, jnp.zeros_like(v))
      online_softmax_step(s, v, m_ref, l_ref, acc_ref)

    chunk_run = run & (key0 < length) if chunk else run
    pl.when(chunk_run & whole)(lambda step=step: step(False))
    pl.when(chunk_run & jnp.logical_not(whole))(lambda step=step: step(True))

  @pl.when(j == plan.steps - 1)
  def _finish():
    l_rep = l_ref[...]
    has_keys = l_rep != 0
    safe = jnp.where(has_keys, l_rep, 1.0)
    o_ref[...] = jnp.where(has_keys[:, :1], acc_ref[...] / safe[:, :1], 0.0)
    lse_ref[...] = jnp.where(has_keys, m_ref[...] + jnp.log(safe), -jnp.inf)


def _shift_div(x, d: int):
  """x // d for x >= 0: a shift when d is a power of two (no scalar divide)."""
  if d & (d - 1) == 0:
    return lax.shift_right_logical(x, jnp.int32(d.bit_length() - 1))
  return lax.div(x, jnp.int32(d))


def _paged_kernel(*refs, plan: Plan, queries, group, window, sm_scale, cap,
                  quantized, pages_per_seq):
  """One step of the paged path: block ``block`` of every kv head of
  sequence b. Its pages arrive by DMAs this kernel issues one step ahead
  (one DMA per page and K/V: a page holds all kv heads)."""
  lengths_ref, pages_ref = refs[0], refs[1]
  prefetched = 2 + quantized
  (q_ref, k_hbm, v_hbm, o_ref, lse_ref, m_ref, l_ref, acc_ref, k_buf, v_buf,
   sems) = refs[prefetched:]
  b, split, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  page_size, chunks = plan.page_size, plan.chunks
  length = lengths_ref[b]
  first_key = jnp.int32(0)
  if window is not None:
    first_key = jnp.maximum(length - queries - window, 0)
  lo = _shift_div(first_key, plan.block)
  hi = _shift_div(length + (plan.block - 1), plan.block) - 1
  per = jnp.maximum(hi - lo + 1, 0)   # visible blocks
  if plan.num_splits > 1:
    per = lax.div(per + (plan.num_splits - 1), jnp.int32(plan.num_splits))
  block = lo + split * per + j
  run = (j < per) & (block <= hi)
  used_pages = _shift_div(length + (page_size - 1), page_size)
  table = b * pages_per_seq

  def copies(blk, slot, c):
    page = pages_ref[table + blk * chunks + c]   # clipped by the caller
    rows = pl.ds(pl.multiple_of(c * page_size, page_size), page_size)
    return [pltpu.make_async_copy(src.at[page], buf.at[slot, :, rows],
                                  sems.at[kv, slot])
            for kv, (src, buf) in enumerate(((k_hbm, k_buf), (v_hbm, v_buf)))]

  def loaded(blk):  # pages of block blk that hold keys below the length
    return jnp.minimum(used_pages - blk * chunks, chunks)

  def start(blk, slot):
    n = loaded(blk)

    @pl.when(n == chunks)
    def _whole():
      for c in range(chunks):
        for copy in copies(blk, slot, c):
          copy.start()

    @pl.when(n < chunks)
    def _part():
      def body(c, carry):
        for copy in copies(blk, slot, c):
          copy.start()
        return carry
      lax.fori_loop(0, n, body, 0)

  def wait(kv, buf, blk, slot):
    n = loaded(blk)
    sem = sems.at[kv, slot]

    @pl.when(n == chunks)
    def _whole():
      pltpu.make_async_copy(buf.at[slot], buf.at[slot], sem).wait()

    @pl.when(n < chunks)
    def _part():
      page = buf.at[slot, :, pl.ds(0, page_size)]

      def body(c, carry):
        pltpu.make_async_copy(page, page, sem).wait()
        return carry
      lax.fori_loop(0, n, body, 0)

  # The steps that run, in grid order, read blocks lo..hi: block i uses
  # buffer slot (i - lo) % 2, and each running step starts the next one's
  # DMAs.
  slot = lax.rem(block - lo, 2)

  @pl.when(run & (block == lo))
  def _first():
    start(block, slot)

  @pl.when(run & (block < hi))
  def _next():
    start(block + 1, 1 - slot)

  @pl.when(j == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  base = length - queries          # position of the first query
  key0 = block * plan.block
  whole = key0 + plan.block - 1 <= base
  if window is not None:
    whole &= key0 >= length - 1 - window

  def step(masked):
    wait(0, k_buf, block, slot)
    wait(1, v_buf, block, slot)
    if masked:  # also hides the rows of pages not loaded (garbage)
      shape = (plan.rows, plan.block)
      cols = key0 + lax.broadcasted_iota(jnp.int32, shape, 1)
      rows = lax.broadcasted_iota(jnp.int32, shape, 0)
      visible = (rows >= (cols - base) * group) & (cols < length)
      if window is not None:
        visible &= rows < (cols + window - base + 1) * group
      written = key0 + lax.broadcasted_iota(
          jnp.int32, (plan.block, 1), 0) < length
    for head in range(plan.heads):
      q = q_ref[head]
      scale = sm_scale * refs[2][head] if quantized else sm_scale
      k = k_buf[slot, head].astype(q.dtype)
      s = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32)
      s = s * scale
      if cap is not None:
        s = cap * jnp.tanh(s / cap)
      v = v_buf[slot, head].astype(q.dtype)
      if masked:
        s = jnp.where(visible, s, -jnp.inf)
        v = jnp.where(written, v, jnp.zeros_like(v))
      online_softmax_step(s, v, m_ref.at[head], l_ref.at[head],
                          acc_ref.at[head])

  pl.when(run & whole)(lambda: step(False))
  pl.when(run & jnp.logical_not(whole))(lambda: step(True))

  @pl.when(j == plan.steps - 1)
  def _finish():
    l_rep = l_ref[...]
    has_keys = l_rep != 0
    safe = jnp.where(has_keys, l_rep, 1.0)
    o_ref[...] = jnp.where(has_keys[..., :1], acc_ref[...] / safe[..., :1],
                           0.0)
    lse_ref[...] = jnp.where(has_keys, m_ref[...] + jnp.log(safe), -jnp.inf)


# -------------------------------------------------------------- host side --

def _visible_block(lengths_ref, b, split, j, plan, queries, window):
  """The block step j of split ``split`` reads: clamped into the split's
  run, so steps past it repeat the last index (no DMA)."""
  start, per, hi = _splits.split_range(lengths_ref[b], split, queries,
                                       window, plan.block, plan.num_splits)
  block = jnp.minimum(jnp.minimum(start + j, start + per - 1), hi)
  return jnp.clip(block, 0, plan.num_blocks - 1)


def decode(q, k_cache, v_cache, kv_lengths, sinks, page_table, k_scale=None,
           v_scale=None, *, sm_scale, logit_soft_cap, sliding_window,
           interpret, block_kv=None, num_splits=None):
  """``[B, H, T, Dv]`` in q's dtype (arguments as checked by the API, scales
  ``[Hkv]`` float32 with 8-bit caches; ``block_kv``/``num_splits``
  override the plan)."""
  kwargs = dict(sm_scale=sm_scale, logit_soft_cap=logit_soft_cap,
                sliding_window=sliding_window, interpret=interpret,
                block_kv=block_kv, num_splits=num_splits)
  scales = (k_scale, v_scale)
  if page_table is None:
    return _decode(q, k_cache, v_cache, kv_lengths, sinks, None, *scales,
                   **kwargs)
  per_launch = max(1, PAGE_TABLE_BYTES // (4 * page_table.shape[1]))
  parts = [_decode(q[b:b + per_launch], k_cache, v_cache,
                   kv_lengths[b:b + per_launch], sinks,
                   page_table[b:b + per_launch], *scales, **kwargs)
           for b in range(0, q.shape[0], per_launch)]
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)


def _decode(q, k_cache, v_cache, kv_lengths, sinks, page_table, k_scale,
            v_scale, *, sm_scale, logit_soft_cap, sliding_window, interpret,
            block_kv, num_splits):
  batch, heads, queries, head_dim = q.shape
  value_dim = v_cache.shape[3]
  kv_heads, group, itemsize, page_size, pages_per_seq, capacity = (
      _splits.cache_layout(q, k_cache, page_table))
  sizes = (itemsize, q.dtype.itemsize)
  paged = page_table is not None
  plan = make_plan(batch, kv_heads, queries * group, capacity, head_dim,
                   itemsize, page_size=page_size,
                   pages_per_seq=pages_per_seq, block_kv=block_kv,
                   num_splits=num_splits, compute_itemsize=sizes[1],
                   value_dim=value_dim)
  rows = _splits.pack_queries(q, kv_heads, plan.rows)
  window = sliding_window
  visible = functools.partial(_visible_block, plan=plan, queries=queries,
                              window=window)

  if paged:
    kv_specs = [pl.BlockSpec(memory_space=pl.ANY)] * 2
    kv_args = [k_cache, v_cache]
    # Clipped here (fused into the table's copy), not per DMA in the kernel.
    prefetch = [kv_lengths,
                jnp.clip(page_table, 0, k_cache.shape[0] - 1).reshape(-1)]
  else:
    def index(b, h, split, j, lengths_ref, *_):
      return b, h, visible(lengths_ref, b, split, j), 0
    kv_specs = [pl.BlockSpec((_SQ, _SQ, plan.block, dim), index)
                for dim in (head_dim, value_dim)]
    kv_args = [k_cache, v_cache]
    prefetch = [kv_lengths]
  if k_scale is not None:
    prefetch.append(k_scale)

  out_shape = [
      jax.ShapeDtypeStruct((batch, kv_heads, plan.num_splits, plan.rows,
                            value_dim), jnp.float32),
      jax.ShapeDtypeStruct((batch, kv_heads, plan.num_splits, plan.rows,
                            LANES), jnp.float32)]
  kw = dict(plan=plan, queries=queries, group=group, window=window,
            sm_scale=sm_scale, cap=logit_soft_cap,
            quantized=k_scale is not None)
  if paged:
    # All kv heads per step: a page's DMA brings every head. Two slots of
    # one block of K and V, filled by the kernel's own DMAs; the DMA chain
    # runs through a sequence's splits, so only the batch axis is parallel.
    heads_ = plan.heads
    q_spec = pl.BlockSpec((_SQ, heads_, plan.rows, head_dim),
                          lambda b, split, j, *_: (b, 0, 0, 0))
    out_specs = [
        pl.BlockSpec((_SQ, heads_, _SQ, plan.rows, value_dim),
                     lambda b, split, j, *_: (b, 0, split, 0, 0)),
        pl.BlockSpec((_SQ, heads_, _SQ, plan.rows, LANES),
                     lambda b, split, j, *_: (b, 0, split, 0, 0))]
    scratch = [pltpu.VMEM((heads_, plan.rows, LANES), jnp.float32),
               pltpu.VMEM((heads_, plan.rows, LANES), jnp.float32),
               pltpu.VMEM((heads_, plan.rows, value_dim), jnp.float32),
               pltpu.VMEM((2, heads_, plan.block, head_dim), k_cache.dtype),
               pltpu.VMEM((2, heads_, plan.block, value_dim), v_cache.dtype),
               pltpu.SemaphoreType.DMA((2, 2))]
    kernel = functools.partial(_paged_kernel, pages_per_seq=pages_per_seq,
                               **kw)
    grid = (batch, plan.num_splits, plan.steps)
    semantics = ("parallel", "arbitrary", "arbitrary")
  else:
    q_spec = pl.BlockSpec((_SQ, _SQ, plan.rows, head_dim),
                          lambda b, h, split, j, *_: (b, h, 0, 0))
    out_specs = [
        pl.BlockSpec((_SQ, _SQ, _SQ, plan.rows, value_dim),
                     lambda b, h, split, j, *_: (b, h, split, 0, 0)),
        pl.BlockSpec((_SQ, _SQ, _SQ, plan.rows, LANES),
                     lambda b, h, split, j, *_: (b, h, split, 0, 0))]
    scratch = [pltpu.VMEM((plan.rows, LANES), jnp.float32),
               pltpu.VMEM((plan.rows, LANES), jnp.float32),
               pltpu.VMEM((plan.rows, value_dim), jnp.float32)]
    kernel = functools.partial(_kernel, **kw)
    grid = (batch, kv_heads, plan.num_splits, plan.steps)
    semantics = ("parallel", "parallel", "parallel", "arbitrary")
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=len(prefetch), grid=grid,
      in_specs=[q_spec] + kv_specs, out_specs=out_specs,
      scratch_shapes=scratch)
  work = cost(batch, kv_heads, plan, head_dim, itemsize, capacity,
              compute_itemsize=sizes[1], value_dim=value_dim)
  out, lse = _compat.pallas_call(
      kernel, grid_spec=grid_spec, out_shape=out_shape,
      compiler_params=_compat.tpu_compiler_params(
          dimension_semantics=semantics,
          # The paged path's DMA addresses are clamped into range already.
          disable_bounds_checks=paged,
          vmem_limit_bytes=vmem_limit_bytes(plan, head_dim, *sizes,
                                            value_dim=value_dim)),
      interpret=interpret, cost_estimate=_cost.estimate(**work),
      name="decode_attention_paged" if paged else "decode_attention",
  )(*prefetch, rows, *kv_args)
  return _splits.finish(out, lse[..., 0], sinks, heads=heads,
                        queries=queries, dtype=q.dtype, v_scale=v_scale)
