"""Flash-attention backward for Hopper GPUs: Pallas Mosaic GPU kernels.

Two kernels (no atomics), both recomputing ``P = exp2(S * scale2 - lse2)``:
``dkv`` (one CTA per kv head, 128-key tile and batch, streaming Q/dO blocks)
and ``dq`` (the forward's structure, streaming K/V). Above head_dim 128 the
two compute warpgroups split one block by role. Structure:
docs/design/attention.md.
"""
from __future__ import annotations

import functools
import math
import types

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _compat
from pallas_kernels.attention import mosaic_gpu as fwd

pl = _compat.pl
plgpu = fwd.plgpu

LOG2E = math.log2(math.e)
NEG_INF = float("-inf")
KEYS_PER_WG = 64  # one wgmma M tile per compute warpgroup
COMPUTE_WGS = 2
ROWS_PER_WG = 64  # query rows per compute warpgroup in the dq kernel
STAGES = 2
# Widest head_dim a warpgroup's float32 accumulators cover alone: the two
# 64 x head_dim dK and dV accumulators take head_dim registers per thread.
SPLIT_ABOVE = 128


def _nt_products(term_lists, shape, interpreting):
  """For each list of terms, the sum of lhs @ rhs.T over it in float32; a
  term is a pair of shared-memory refs (one head_dim chunk): wgmma on the
  GPU, plain dots in the interpreter."""
  if interpreting:
    dims_nt = (((1,), (1,)), ((), ()))
    return tuple(
        sum(lax.dot_general(a[...], b[...], dims_nt,
                            preferred_element_type=jnp.float32)
            for a, b in terms)
        for terms in term_lists)

  def products(*refs):
    for ref, terms in zip(refs, term_lists):
      for a, b in terms:
        plgpu.wgmma(ref, a, plgpu.transpose_ref(b, (1, 0)))
    return tuple(ref[...] for ref in refs)

  acc = plgpu.ACC(shape, jnp.float32)
  return pl.run_scoped(products, *[acc] * len(term_lists))


def _chunk(ref, index, split: int):
  """Chunk ``index`` of an SMEM tile stored as [chunk, rows, cols] when
  split; the tile itself (all of head_dim) when not."""
  return ref if split == 1 else ref.at[index]


def _tile_shape(lead, rows: int, head_dim: int, split: int):
  """SMEM shape of [*lead, rows, head_dim] row blocks; split: [*lead,
  split, rows, head_dim // split], the chunks that ``_chunk`` picks."""
  if split == 1:
    return (*lead, rows, head_dim)
  return (*lead, split, rows, head_dim // split)


def _columns(ref, index, chunk: int, split: int):
  """``ref`` (a [..., rows, head_dim] row block) at its head_dim chunk
  ``index`` of ``chunk`` columns; the whole block when not split."""
  return ref if split == 1 else ref.at[:, pl.ds(index * chunk, chunk)]


def _load_row_blocks(blocks, slot, chunk: int, split: int):
  """TMA copies of (gmem row block, SMEM ring, barriers) triples into ring
  ``slot``, in ``split`` head_dim chunks with one barrier each."""
  for index in range(split):
    for block, smem, barrier in blocks:
      plgpu.copy_gmem_to_smem(_columns(block, index, chunk, split),
                              _chunk(smem.at[slot], index, split),
                              barrier.at[slot * split + index])


def _base2_logits(s, sm_scale, soft_cap):
  """(logits in base 2, tanh of the soft cap or None) from raw q.k scores."""
  if soft_cap is None:
    return s * (sm_scale * LOG2E), None
  t = jnp.tanh(s * (sm_scale / soft_cap))
  return t * (soft_cap * LOG2E), t


def _probs_and_dlogits(s, dp, t, lse2, delta, row_axis):
  """P and dS (through the soft cap's tanh) from base-2 logits ``s``; the
  per-query ``lse2`` and ``delta`` run along ``row_axis`` of ``s``."""
  p = jnp.exp2(s - lax.broadcast_in_dim(lse2, s.shape, [row_axis]))
  ds = p * (dp - lax.broadcast_in_dim(delta, s.shape, [row_axis]))
  if t is not None:
    ds = ds * (1.0 - t * t)
  return p, ds


MAX_HEAD_DIM = 256  # split in two halves of at most 128


def split_of(head_dim: int) -> int:
  """head_dim chunks per row block: above ``SPLIT_ABOVE`` the two compute
  warpgroups share one 64-row block and each accumulates one half of the
  head_dim (both compute the full S and dP)."""
  return 2 if head_dim > SPLIT_ABOVE else 1


def kernel_head_dim(head_dim: int) -> int | None:
  """The width the backward runs a head_dim at: a multiple of 16, and of 32
  when split (each half a multiple of 16); None outside 64..256."""
  width = fwd.kernel_head_dim(head_dim, MAX_HEAD_DIM)
  if width is not None and split_of(width) == 2:
    width = -(-width // 32) * 32
  return width


def block_size(head_dim: int) -> int:
  """Rows per ring slot (dk/dv: queries, dq: keys): 128 at head_dim 64; 64
  above, where 128 would need more registers than the compute warpgroups
  get."""
  return 128 if head_dim <= 64 else 64


def supports(q, k, v, q_segment_ids=None, bias=None,
             mask=None) -> str | None:
  """None when ``backward`` handles this call, else why not."""
  return (fwd.call_refusal("backward", q, k, v, q_segment_ids, bias,
                           MAX_HEAD_DIM)
          or fwd.mask_refusal("backward", mask))


def _q_ranges(col0, cols: int, block_q: int, band):
  """q block ranges for keys [col0, col0 + cols), see ``fwd._kv_ranges``. (lo,
  a, b, hi): blocks [lo, hi) hold some unmasked entry for some key; those in [a,
  b) are unmasked for every key. Padding needs no mask here."""
  nq = -(-band.lq // block_q)
  last_col = col0 + (cols - 1)
  off = band.offset
  if band.right is None:
    lo, a = jnp.int32(0), jnp.int32(0)
  else:
    lo = fwd._div_floor(col0 - (off + band.right), block_q)
    a = fwd._div_ceil(last_col - (off + band.right), block_q)
  if band.left is None:
    hi, b = jnp.int32(nq), jnp.int32(nq)
  else:
    hi = jnp.minimum(
        fwd._div_ceil(jnp.minimum(last_col, band.lk - 1)
                      + (band.left - off + 1), block_q), nq)
    b = jnp.minimum(fwd._div_floor(col0 + (band.left - off + 1), block_q), nq)
  lo = jnp.minimum(lo, hi)
  a = jnp.clip(a, lo, hi)
  b = jnp.clip(b, a, hi)
  return lo, a, b, hi


def _kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, mask_refs,
            dk_ref, dv_ref, scratch, *, walk, sm_scale, soft_cap, block_q,
            stages, group, split, tiles, interpreting):
  """dk/dv. Not split: K and V as [warpgroup, 64, head_dim], the Q and dO
  ring as [slot, rows, head_dim], each compute warpgroup on its own 64 keys;
  split: K and V as [half, 64, head_dim / 2] (the CTA's 64 keys), the ring
  as [slot, half, rows, head_dim / 2], P^T exchanged through ``p_smem``
  [slot, 64, rows] (``_dkv_roles``)."""
  (k_smem2, v_smem2, q_smem, do_smem, lse_smem, delta_smem,
   *p_smem), barriers = scratch
  (k_loaded, v_loaded, q_loaded, do_loaded, lse_loaded, delta_loaded,
   consumed, *p_ready) = barriers
  kv_head = lax.axis_index("heads")
  batch = lax.axis_index("batch")
  program = walk.open(mask_refs, lax.axis_index("kv_tiles"), tiles, False)
  tile, block_of = program.tile, program.block_of
  wg = lax.axis_index("wg")
  dtype = q_smem.dtype
  chunk = q_smem.shape[-1]
  bk = KEYS_PER_WG
  tile_k = bk * COMPUTE_WGS // split
  cta_col0 = tile * tile_k
  lo_u, hi_u = walk.cta_bounds(program, cta_col0, tile_k, block_q)
  blocks = hi_u - lo_u
  steps = blocks * group

  def slot_of(t):
    return lax.rem(t, jnp.int32(stages))

  @pl.when(wg < COMPUTE_WGS)
  def _compute():
    plgpu.set_max_registers(fwd.COMPUTE_REGISTERS, action="increase")
    if split > 1:
      _dkv_roles(
          types.SimpleNamespace(
              k_ref=k_ref, v_ref=v_ref, dk_ref=dk_ref, dv_ref=dv_ref,
              k_smem=k_smem2, v_smem=v_smem2, q_smem=q_smem, do_smem=do_smem,
              lse_smem=lse_smem, delta_smem=delta_smem, p_smem=p_smem[0],
              k_loaded=k_loaded, v_loaded=v_loaded, q_loaded=q_loaded,
              do_loaded=do_loaded, lse_loaded=lse_loaded,
              delta_loaded=delta_loaded, consumed=consumed,
              p_ready=p_ready[0]),
          program=program, walk=walk, batch=batch, kv_head=kv_head, wg=wg,
          col0=cta_col0, block_q=block_q, blocks=blocks, lo_u=lo_u,
          hi_u=hi_u, group=group, slot_of=slot_of, chunk=chunk, split=split,
          sm_scale=sm_scale, soft_cap=soft_cap, interpreting=interpreting)
      return
    k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
    col0 = cta_col0 + wg * bk
    rows = pl.ds(col0, bk)
    plgpu.copy_gmem_to_smem(k_ref.at[batch, kv_head, rows], k_smem,
                            k_loaded.at[wg])
    plgpu.copy_gmem_to_smem(v_ref.at[batch, kv_head, rows], v_smem,
                            v_loaded.at[wg])
    lo, a, b, hi = walk.bounds(program, col0, bk, block_q, lo_u, hi_u)
    layout = plgpu.Layout.WGMMA
    cast, iota, load_col, _ = fwd.register_tools((bk, block_q), 0,
                                                 interpreting)

    def wait_loaded(slot):
      for barrier in (q_loaded, do_loaded, lse_loaded, delta_loaded):
        plgpu.barrier_wait(barrier.at[slot])

    def skip(i, carry, g):
      slot = slot_of(g * blocks + (i - lo_u))
      wait_loaded(slot)
      plgpu.barrier_arrive(consumed.at[slot])
      return carry

    def step(i, carry, g, masked):
      dk, dv = carry
      slot = slot_of(g * blocks + (i - lo_u))
      q_slot, do_slot = q_smem.at[slot], do_smem.at[slot]
      wait_loaded(slot)
      s, dp = _nt_products([[(k_smem, q_slot)], [(v_smem, do_slot)]],
                           (bk, block_q), interpreting)
      lse2 = load_col(lse_smem.at[slot])
      delta = load_col(delta_smem.at[slot])
      s, t = _base2_logits(s, sm_scale, soft_cap)
      if masked:  # rows are keys, columns queries; padded keys need no mask
        s = walk.apply(program, s, block_of(i) * block_q + iota(1),
                       col0 + iota(0), i, wg * bk, interpreting,
                       check_length=False)
      p, ds = _probs_and_dlogits(s, dp, t, lse2, delta, row_axis=1)
      p16, ds16 = p.astype(dtype), ds.astype(dtype)
      if interpreting:
        dims_nn = (((1,), (0,)), ((), ()))
        dv = dv + lax.dot_general(p16, do_slot[...], dims_nn,
                                  preferred_element_type=jnp.float32)
        dk = dk + lax.dot_general(ds16, q_slot[...], dims_nn,
                                  preferred_element_type=jnp.float32)
      else:
        def dk_dv_products(refs):
          dk_ref, dv_ref = refs
          plgpu.wgmma(dv_ref, p16, do_slot)
          plgpu.wgmma(dk_ref, ds16, q_slot)

        dk, dv = pl.run_state(dk_dv_products)(
            (plgpu.ACC.init(dk), plgpu.ACC.init(dv)))
      plgpu.barrier_arrive(consumed.at[slot])
      return dk, dv

    zeros = cast(jnp.full((bk, chunk), 0.0, jnp.float32), layout)
    plgpu.barrier_wait(k_loaded.at[wg])
    plgpu.barrier_wait(v_loaded.at[wg])

    def head(g, carry):
      return fwd.band_loop(functools.partial(step, g=g),
                           functools.partial(skip, g=g),
                           (lo_u, lo, a, b, hi, hi_u), carry)

    dk, dv = lax.fori_loop(0, group, head, (zeros, zeros))
    k_smem[...] = (dk * sm_scale).astype(dtype)
    v_smem[...] = dv.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[batch, kv_head, rows])
    plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[batch, kv_head, rows])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == COMPUTE_WGS)
  def _memory():
    plgpu.set_max_registers(fwd.MEMORY_REGISTERS, action="decrease")

    def load(t, slot):
      g = lax.div(t, blocks)
      i = block_of(lo_u + lax.rem(t, blocks))
      h = kv_head * group + g
      rows = pl.ds(i * block_q, block_q)
      _load_row_blocks(((q_ref.at[batch, h, rows], q_smem, q_loaded),
                        (do_ref.at[batch, h, rows], do_smem, do_loaded)),
                       slot, chunk, split)
      for ref, smem, barrier in ((lse_ref, lse_smem, lse_loaded),
                                 (delta_ref, delta_smem, delta_loaded)):
        plgpu.copy_gmem_to_smem(ref.at[batch, h, rows], smem.at[slot],
                                barrier.at[slot])

    def refill(t, slot):
      plgpu.barrier_wait(consumed.at[slot])
      load(t, slot)

    fwd.stream_ring(jnp.int32(0), steps, stages, load, refill,
                    lambda slot: plgpu.barrier_wait(consumed.at[slot]))


def _nn_accumulate(accs, lhs16, rhs, interpreting):
  """(acc_c + lhs16 @ chunk c of ``rhs`` for each c) in float32: the left
  operand in registers, the right one a shared-memory tile (one
  accumulator), or [chunk, rows, cols] (one per head_dim chunk)."""
  chunk = (lambda c: rhs) if len(accs) == 1 else (lambda c: rhs.at[c])
  if interpreting:
    dims_nn = (((1,), (0,)), ((), ()))
    return tuple(acc + lax.dot_general(lhs16, chunk(c)[...], dims_nn,
                                       preferred_element_type=jnp.float32)
                 for c, acc in enumerate(accs))

  def products(acc_refs):  # (chunks indexed here: run_state takes no
    for c, acc_ref in enumerate(acc_refs):  # constant indices from outside)
      plgpu.wgmma(acc_ref, lhs16, chunk(c))

  return pl.run_state(products)(tuple(plgpu.ACC.init(acc) for acc in accs))


def _share_probabilities(p, t, p_smem, p_ready, dtype):
  """Hands P (times 1 - tanh^2 under a soft cap: all that dS needs of the
  logits) to the other compute warpgroup through ``p_smem``."""
  p_smem[...] = (p if t is None else p * (1.0 - t * t)).astype(dtype)
  plgpu.barrier_arrive(p_ready)


def _dkv_roles(r, *, program, walk, batch, kv_head, wg, col0, block_q,
               blocks, lo_u, hi_u, group, slot_of, chunk, split, sm_scale,
               soft_cap, interpreting):
  """dk/dv above ``SPLIT_ABOVE`` on the CTA's 64 keys: warpgroup 0 forms P^T
  and accumulates dV, warpgroup 1 forms dP^T and dS^T and accumulates dK
  (P^T handed over through SMEM; each matmul runs once)."""
  bk = KEYS_PER_WG
  rows = pl.ds(col0, bk)
  dtype = r.q_smem.dtype
  cast, iota, load_col, _ = fwd.register_tools((bk, block_q), 0,
                                               interpreting)
  columns = functools.partial(_columns, chunk=chunk, split=split)
  bounds = (lo_u,) + walk.bounds(program, col0, bk, block_q, lo_u,
                                 hi_u) + (hi_u,)
  zeros = cast(jnp.full((bk, chunk), 0.0, jnp.float32), plgpu.Layout.WGMMA)

  def walk_heads(own, own_loaded, step, vectors_loaded):
    """Loads ``own`` (K or V) for this warpgroup, walks every query head's
    blocks with ``step(slot, i, accs, masked)`` and returns the
    accumulators; ``own`` then holds nothing this warpgroup still reads."""
    own_ref, own_smem = own
    for c in range(split):
      plgpu.copy_gmem_to_smem(
          columns(own_ref.at[batch, kv_head, rows], c), own_smem.at[c],
          own_loaded.at[c])

    def wait_loaded(slot):
      for c in range(split):
        plgpu.barrier_wait(r.q_loaded.at[slot * split + c])
        plgpu.barrier_wait(r.do_loaded.at[slot * split + c])
      plgpu.barrier_wait(vectors_loaded.at[slot])

    def skip(i, carry, g):
      slot = slot_of(g * blocks + (i - lo_u))
      wait_loaded(slot)
      plgpu.barrier_arrive(r.consumed.at[slot])
      return carry

    def run(i, accs, g, masked):
      slot = slot_of(g * blocks + (i - lo_u))
      wait_loaded(slot)
      accs = step(slot, i, accs, masked)
      plgpu.barrier_arrive(r.consumed.at[slot])
      return accs

    for c in range(split):
      plgpu.barrier_wait(own_loaded.at[c])

    def head(g, accs):
      return fwd.band_loop(functools.partial(run, g=g),
                           functools.partial(skip, g=g), bounds, accs)

    return lax.fori_loop(0, group, head, (zeros,) * split)

  def write(accs, smem, out_ref):
    for c in range(split):
      smem.at[c][...] = accs[c].astype(dtype)
    plgpu.commit_smem()
    for c in range(split):
      plgpu.copy_smem_to_gmem(smem.at[c],
                              columns(out_ref.at[batch, kv_head, rows], c))
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == 0)
  def _probabilities():
    def step(slot, i, dv, masked):
      q_slot = r.q_smem.at[slot]
      (s,) = _nt_products(
          [[(r.k_smem.at[c], q_slot.at[c]) for c in range(split)]],
          (bk, block_q), interpreting)
      lse2 = load_col(r.lse_smem.at[slot])
      s, t = _base2_logits(s, sm_scale, soft_cap)
      if masked:  # rows are keys, columns queries; padded keys need no mask
        s = walk.apply(program, s, program.block_of(i) * block_q + iota(1),
                       col0 + iota(0), i, 0, interpreting,
                       check_length=False)
      p = jnp.exp2(s - lax.broadcast_in_dim(lse2, s.shape, [1]))
      _share_probabilities(p, t, r.p_smem.at[slot], r.p_ready.at[slot],
                           dtype)
      do_slot = r.do_smem.at[slot]
      return _nn_accumulate(dv, p.astype(dtype), do_slot, interpreting)

    dv = walk_heads((r.k_ref, r.k_smem), r.k_loaded, step, r.lse_loaded)
    write(dv, r.k_smem, r.dv_ref)

  @pl.when(wg == 1)
  def _dlogits():
    def step(slot, i, dk, masked):
      del i, masked  # P arrives masked
      do_slot, q_slot = r.do_smem.at[slot], r.q_smem.at[slot]
      (dp,) = _nt_products(
          [[(r.v_smem.at[c], do_slot.at[c]) for c in range(split)]],
          (bk, block_q), interpreting)
      delta = load_col(r.delta_smem.at[slot])
      plgpu.barrier_wait(r.p_ready.at[slot])
      p = fwd.load_vector(r.p_smem.at[slot], plgpu.Layout.WGMMA,
                          interpreting).astype(jnp.float32)
      ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [1]))
      return _nn_accumulate(dk, ds.astype(dtype), q_slot, interpreting)

    dk = walk_heads((r.v_ref, r.v_smem), r.v_loaded, step, r.delta_loaded)
    write(tuple(x * sm_scale for x in dk), r.v_smem, r.dk_ref)


def _dq_roles(r, *, program, walk, batch, head, wg, row0, block_k, lo_u,
              hi_u, slot_of, chunk, split, sm_scale, soft_cap, interpreting):
  """dq above ``SPLIT_ABOVE`` on the CTA's 64 rows: warpgroup 0 forms P and
  hands it over through SMEM, warpgroup 1 forms dP and dS and accumulates
  dQ (each matmul runs once)."""
  bq = ROWS_PER_WG
  rows = pl.ds(row0, bq)
  dtype = r.q_smem.dtype
  cast, iota, load_row, _ = fwd.register_tools((bq, block_k), 1,
                                               interpreting)
  columns = functools.partial(_columns, chunk=chunk, split=split)
  bounds = (lo_u,) + walk.bounds(program, row0, bq, block_k, lo_u,
                                 hi_u) + (hi_u,)

  def walk_blocks(own, vector, ring_loaded, step, carry):
    """Loads ``own`` (Q or dO, both halves, barriers 0 and 1) and ``vector``
    (lse or delta, barrier 2) for this warpgroup and walks the tile's key
    blocks with ``step(slot, c, vector, carry, masked)``, waiting for
    ``ring_loaded`` (K, or K and V) of each."""
    (own_ref, own_smem), (vector_ref, vector_smem) = own, vector
    for c in range(split):
      plgpu.copy_gmem_to_smem(columns(own_ref.at[batch, head, rows], c),
                              own_smem.at[c], r.rows_loaded.at[4 * wg + c])
    plgpu.copy_gmem_to_smem(vector_ref.at[batch, head, rows], vector_smem,
                            r.rows_loaded.at[4 * wg + 2])

    def wait_loaded(slot):
      for barrier in ring_loaded:
        for c in range(split):
          plgpu.barrier_wait(barrier.at[slot * split + c])

    def skip(c, carry):
      slot = slot_of(c)
      wait_loaded(slot)
      plgpu.barrier_arrive(r.consumed.at[slot])
      return carry

    def run(c, carry, masked):
      slot = slot_of(c)
      wait_loaded(slot)
      carry = step(slot, c, row_vector, carry, masked)
      plgpu.barrier_arrive(r.consumed.at[slot])
      return carry

    for i in range(3):
      plgpu.barrier_wait(r.rows_loaded.at[4 * wg + i])
    row_vector = load_row(vector_smem)
    return fwd.band_loop(run, skip, bounds, carry)

  @pl.when(wg == 0)
  def _probabilities():
    def step(slot, c, lse2, carry, masked):
      k_slot = r.k_smem.at[slot]
      (s,) = _nt_products(
          [[(r.q_smem.at[i], k_slot.at[i]) for i in range(split)]],
          (bq, block_k), interpreting)
      s, t = _base2_logits(s, sm_scale, soft_cap)
      if masked:
        s = walk.apply(program, s, row0 + iota(0),
                       program.block_of(c) * block_k + iota(1), c, 0,
                       interpreting)
      p = jnp.exp2(s - lax.broadcast_in_dim(lse2, s.shape, [0]))
      _share_probabilities(p, t, r.p_smem.at[slot], r.p_ready.at[slot],
                           dtype)
      return carry

    walk_blocks((r.q_ref, r.q_smem), (r.lse_ref, r.lse_smem),
                (r.k_loaded,), step, None)

  @pl.when(wg == 1)
  def _dlogits():
    def step(slot, c, delta, dq, masked):
      del c, masked  # P arrives masked
      k_slot, v_slot = r.k_smem.at[slot], r.v_smem.at[slot]
      (dp,) = _nt_products(
          [[(r.do_smem.at[i], v_slot.at[i]) for i in range(split)]],
          (bq, block_k), interpreting)
      plgpu.barrier_wait(r.p_ready.at[slot])
      p = fwd.load_vector(r.p_smem.at[slot], plgpu.Layout.WGMMA,
                          interpreting).astype(jnp.float32)
      ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))
      return _nn_accumulate(dq, ds.astype(dtype), k_slot, interpreting)

    zeros = cast(jnp.full((bq, chunk), 0.0, jnp.float32), plgpu.Layout.WGMMA)
    dq = walk_blocks((r.do_ref, r.do_smem), (r.delta_ref, r.delta_smem),
                     (r.k_loaded, r.v_loaded), step, (zeros,) * split)
    for i in range(split):  # dO is no longer read
      r.do_smem.at[i][...] = (dq[i] * sm_scale).astype(dtype)
    plgpu.commit_smem()
    for i in range(split):
      plgpu.copy_smem_to_gmem(r.do_smem.at[i],
                              columns(r.dq_ref.at[batch, head, rows], i))
    plgpu.wait_smem_to_gmem(0)


def _row_inputs(lse, delta, lq, lq_pad):
  """(lse2, delta) [B, H, lq_pad] float32: base-2 lse with +inf for empty and
  padded rows (their P is then exactly 0), delta padded with zeros."""
  lse = lse[:, :, :lq].astype(jnp.float32)
  lse2 = jnp.where(lse == NEG_INF, jnp.inf, lse * LOG2E)
  if lq_pad != lq:
    lse2 = jnp.pad(lse2, ((0, 0), (0, 0), (0, lq_pad - lq)),
                   constant_values=jnp.inf)
  delta = fwd._pad_axis(delta[:, :, :lq].astype(jnp.float32), 2, lq_pad)
  return lse2, delta


def _prepared(kernel, arrays, q_multiple, k_multiple, causal, window_left,
              window_right, interpret, mask):
  """Checks a backward call and pads it: ((q, k, v, d_out, lse2, delta),
  band, interpret params) with q rows a multiple of ``q_multiple`` and keys
  of ``k_multiple``."""
  q, k, v, d_out, lse, delta = arrays
  reason = supports(q, k, v, mask=mask)
  if reason is None and kernel_head_dim(q.shape[-1]) != q.shape[-1]:
    reason = (f"the kernels run head dims that are multiples of 16 (of 32 "
              f"above {SPLIT_ABOVE}), got {q.shape[-1]} (backward pads the "
              "others)")
  if reason:
    raise ValueError(f"mosaic_gpu_bwd.{kernel}: unsupported call: {reason}")
  if interpret is True:
    interpret = fwd.interpret_params()
  lq, lk = q.shape[2], k.shape[2]
  band = fwd._band(lq, lk, causal, window_left, window_right)
  lq_pad = -(-lq // q_multiple) * q_multiple
  lk_pad = -(-lk // k_multiple) * k_multiple
  lse2, delta = _row_inputs(lse, delta, lq, lq_pad)
  padded = (fwd._pad_axis(q, 2, lq_pad), fwd._pad_axis(k, 2, lk_pad),
            fwd._pad_axis(v, 2, lk_pad),
            fwd._pad_axis(d_out.astype(q.dtype), 2, lq_pad), lse2, delta)
  return padded, band, interpret


def _kernel_statics(walk, sm_scale, logit_soft_cap, group, interpreting):
  """The static arguments both backward kernels take."""
  return dict(
      walk=walk, sm_scale=float(sm_scale),
      soft_cap=None if logit_soft_cap is None else float(logit_soft_cap),
      stages=STAGES, group=group, interpreting=interpreting)


def _launch(body, scratch, barriers, out_type, grid, grid_names, interpret,
            args, mask_arrays):
  """``plgpu.kernel`` of ``body(*input refs, (table ref, tiles ref) (None
  where absent), *output refs, (scratch refs, barrier refs))`` with two
  compute warpgroups and a memory one."""
  n_scratch, n_in, n_mask = len(scratch), len(args), len(mask_arrays)

  def entry(*refs):
    mask_refs = refs[n_in:n_in + n_mask] + (None,) * (2 - n_mask)
    refs = refs[:n_in] + (mask_refs,) + refs[n_in + n_mask:]
    pl.run_scoped(
        lambda *scoped: body(*refs, (scoped[:n_scratch], scoped[n_scratch:])),
        *scratch, *barriers, collective_axes="wg")

  kwargs = {"interpret": interpret} if interpret else {}
  return plgpu.kernel(
      entry, out_type=out_type, grid=grid, grid_names=grid_names,
      num_threads=COMPUTE_WGS + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True), **kwargs,
  )(*args, *mask_arrays)


def dkv(q, k, v, d_out, lse, delta, *, sm_scale, causal, window_left,
        window_right, logit_soft_cap, interpret=False, mask=None):
  """(dk, dv) [B, Hk, Lk, D] for the attention forward's (out, lse). ``lse`` [B,
  H, Lq] natural-log (-inf for empty rows); ``delta`` [B, H, Lq] = rowsum(dO *
  O) - d_lse, both float32 (longer arrays, padded rows beyond ``q.shape[2]``,
  are cut). Raises ValueError where ``supports`` declines. ``interpret``: False
  on a GPU or ``InterpretGPUParams``; True picks the default interpreter
  parameters. ``mask``: a static mask shared by every head, or None."""
  batch, heads, lq, head_dim = q.shape
  kv_heads, lk = k.shape[1], k.shape[2]
  group = heads // kv_heads
  bq = block_size(head_dim)
  split = split_of(head_dim)
  tile_k = KEYS_PER_WG * COMPUTE_WGS // split
  (q, k, v, d_out, lse2, delta), band, interpret = _prepared(
      "dkv", (q, k, v, d_out, lse, delta), bq, tile_k, causal, window_left,
      window_right, interpret, mask)
  lk_pad = k.shape[2]
  mask_arrays = [] if mask is None else [
      jnp.asarray(x) for x in fwd.mask_tables(
          mask, lq, lk, tile_k, bq, lk_pad, q.shape[2], kv_major=True)
      if x is not None]
  walk = fwd.TileWalk(band, _q_ranges, mask, fwd.table_width(mask_arrays))
  dtype = q.dtype
  stages = STAGES
  groups = () if split > 1 else (COMPUTE_WGS,)  # one row block when split

  scratch = (
      fwd.tile_smem(_tile_shape(groups, KEYS_PER_WG, head_dim, split), dtype),
      fwd.tile_smem(_tile_shape(groups, KEYS_PER_WG, head_dim, split), dtype),
      fwd.tile_smem(_tile_shape((stages,), bq, head_dim, split), dtype),
      fwd.tile_smem(_tile_shape((stages,), bq, head_dim, split), dtype),
      plgpu.SMEM((stages, bq), jnp.float32),
      plgpu.SMEM((stages, bq), jnp.float32),
  ) + ((fwd.tile_smem((stages, KEYS_PER_WG, bq), dtype),)  # P^T handed over
       if split > 1 else ())
  barriers = (
      plgpu.Barrier(num_barriers=COMPUTE_WGS),  # k loaded (wg, or chunk)
      plgpu.Barrier(num_barriers=COMPUTE_WGS),  # v loaded
      plgpu.Barrier(num_barriers=stages * split),  # q loaded
      plgpu.Barrier(num_barriers=stages * split),  # dO loaded
      plgpu.Barrier(num_barriers=stages),  # lse loaded
      plgpu.Barrier(num_barriers=stages),  # delta loaded
      plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
  ) + ((plgpu.Barrier(num_barriers=stages),)  # P^T ready
       if split > 1 else ())
  body = functools.partial(
      _kernel, block_q=bq, split=split, tiles=lk_pad // tile_k,
      **_kernel_statics(walk, sm_scale, logit_soft_cap, group,
                        bool(interpret)))
  kv_type = jax.ShapeDtypeStruct((batch, kv_heads, lk_pad, head_dim), dtype)
  dk, dv = _launch(body, scratch, barriers, (kv_type, kv_type),
                   (kv_heads, lk_pad // tile_k, batch),
                   ("heads", "kv_tiles", "batch"), interpret,
                   (q, k, v, d_out, lse2, delta), mask_arrays)
  if lk_pad != lk:
    dk, dv = dk[:, :, :lk], dv[:, :, :lk]
  return dk, dv


# -------------------------------------------------------------- dq kernel --


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, mask_refs,
               dq_ref, scratch, *, walk, sm_scale, soft_cap, block_k, stages,
               group, nq, reverse_q, split, interpreting):
  """dq. Not split: Q and dO as [warpgroup, 64, head_dim], the K and V ring
  as [slot, keys, head_dim], each compute warpgroup on its own 64 rows;
  split: Q and dO as [half, 64, head_dim / 2] (the CTA's 64 rows), the ring
  as [slot, half, keys, head_dim / 2], P exchanged through ``p_smem``
  [slot, 64, keys] (``_dq_roles``)."""
  (q_smem2, do_smem2, lse_smem2, delta_smem2, k_smem, v_smem,
   *p_smem), barriers = scratch
  (rows_loaded, k_loaded, v_loaded, consumed, *p_ready) = barriers
  batch, head, wg = (lax.axis_index("batch"), lax.axis_index("heads"),
                     lax.axis_index("wg"))
  program = walk.open(mask_refs, lax.axis_index("q_tiles"), nq, reverse_q)
  tile, block_of = program.tile, program.block_of
  dtype = q_smem2.dtype
  chunk = q_smem2.shape[-1]
  bq = ROWS_PER_WG
  tile_q = bq * COMPUTE_WGS // split
  cta_row0 = tile * tile_q
  lo_u, hi_u = walk.cta_bounds(program, cta_row0, tile_q, block_k)

  def slot_of(c):
    return lax.rem(c - lo_u, jnp.int32(stages))

  @pl.when(wg < COMPUTE_WGS)
  def _compute():
    plgpu.set_max_registers(fwd.COMPUTE_REGISTERS, action="increase")
    if split > 1:
      _dq_roles(
          types.SimpleNamespace(
              q_ref=q_ref, do_ref=do_ref, lse_ref=lse_ref,
              delta_ref=delta_ref, dq_ref=dq_ref, q_smem=q_smem2,
              do_smem=do_smem2, lse_smem=lse_smem2.at[0],
              delta_smem=delta_smem2.at[0], k_smem=k_smem, v_smem=v_smem,
              p_smem=p_smem[0], rows_loaded=rows_loaded, k_loaded=k_loaded,
              v_loaded=v_loaded, consumed=consumed, p_ready=p_ready[0]),
          program=program, walk=walk, batch=batch, head=head, wg=wg,
          row0=cta_row0, block_k=block_k, lo_u=lo_u, hi_u=hi_u,
          slot_of=slot_of, chunk=chunk, split=split, sm_scale=sm_scale,
          soft_cap=soft_cap, interpreting=interpreting)
      return
    q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
    lse_smem, delta_smem = lse_smem2.at[wg], delta_smem2.at[wg]
    row0 = cta_row0 + wg * bq
    rows = pl.ds(row0, bq)
    for i, (ref, smem) in enumerate(((q_ref, q_smem), (do_ref, do_smem),
                                     (lse_ref, lse_smem),
                                     (delta_ref, delta_smem))):
      plgpu.copy_gmem_to_smem(ref.at[batch, head, rows], smem,
                              rows_loaded.at[wg * 4 + i])
    lo, a, b, hi = walk.bounds(program, row0, bq, block_k, lo_u, hi_u)
    layout = plgpu.Layout.WGMMA
    cast, iota, load_row, _ = fwd.register_tools((bq, block_k), 1,
                                                 interpreting)

    def wait_kv(slot):
      plgpu.barrier_wait(k_loaded.at[slot])
      plgpu.barrier_wait(v_loaded.at[slot])

    def skip(c, carry):
      slot = slot_of(c)
      wait_kv(slot)
      plgpu.barrier_arrive(consumed.at[slot])
      return carry

    def step(c, dq, masked):
      slot = slot_of(c)
      k_slot, v_slot = k_smem.at[slot], v_smem.at[slot]
      wait_kv(slot)
      s, dp = _nt_products([[(q_smem, k_slot)], [(do_smem, v_slot)]],
                           (bq, block_k), interpreting)
      s, t = _base2_logits(s, sm_scale, soft_cap)
      if masked:
        s = walk.apply(program, s, row0 + iota(0),
                       block_of(c) * block_k + iota(1), c, wg * bq,
                       interpreting)
      _, ds = _probs_and_dlogits(s, dp, t, lse2, delta, row_axis=0)
      (dq,) = _nn_accumulate((dq,), ds.astype(dtype), k_slot, interpreting)
      plgpu.barrier_arrive(consumed.at[slot])
      return dq

    for i in range(4):
      plgpu.barrier_wait(rows_loaded.at[wg * 4 + i])
    lse2 = load_row(lse_smem)
    delta = load_row(delta_smem)
    dq = cast(jnp.full((bq, chunk), 0.0, jnp.float32), layout)
    dq = fwd.band_loop(step, skip, (lo_u, lo, a, b, hi, hi_u), dq)
    q_smem[...] = (dq * sm_scale).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[batch, head, rows])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == COMPUTE_WGS)
  def _memory():
    plgpu.set_max_registers(fwd.MEMORY_REGISTERS, action="decrease")
    kv_head = lax.div(head, jnp.int32(group))

    def load(c, slot):
      rows = pl.ds(block_of(c) * block_k, block_k)
      _load_row_blocks(((k_ref.at[batch, kv_head, rows], k_smem, k_loaded),
                        (v_ref.at[batch, kv_head, rows], v_smem, v_loaded)),
                       slot, chunk, split)

    def refill(c, slot):
      plgpu.barrier_wait(consumed.at[slot])
      load(c, slot)

    fwd.stream_ring(lo_u, hi_u, stages, load, refill,
                    lambda slot: plgpu.barrier_wait(consumed.at[slot]))


def delta_of(out, d_out, d_lse=None):
  """rowsum(dO * O) - d_lse in float32: [B, H, Lq]."""
  delta = jnp.einsum("bhqd,bhqd->bhq", out.astype(jnp.float32),
                     d_out.astype(jnp.float32))
  return delta if d_lse is None else delta - d_lse.astype(jnp.float32)


def dq(q, k, v, d_out, lse, delta, *, sm_scale, causal, window_left,
       window_right, logit_soft_cap, interpret=False, mask=None):
  """dq [B, H, Lq, D]; arguments as for ``dkv``."""
  batch, heads, lq, head_dim = q.shape
  kv_heads, lk = k.shape[1], k.shape[2]
  group = heads // kv_heads
  block_k, stages = block_size(head_dim), STAGES
  split = split_of(head_dim)
  tile_q = ROWS_PER_WG * COMPUTE_WGS // split
  (q, k, v, d_out, lse2, delta), band, interpret = _prepared(
      "dq", (q, k, v, d_out, lse, delta), tile_q, block_k, causal,
      window_left, window_right, interpret, mask)
  lq_pad = q.shape[2]
  mask_arrays = [] if mask is None else [
      jnp.asarray(x) for x in fwd.mask_tables(
          mask, lq, lk, tile_q, block_k, lq_pad, k.shape[2]) if x is not None]
  walk = fwd.TileWalk(band, fwd._kv_ranges, mask,
                      fwd.table_width(mask_arrays))
  dtype = q.dtype
  nq = lq_pad // tile_q
  groups = () if split > 1 else (COMPUTE_WGS,)  # one row block when split

  scratch = (
      fwd.tile_smem(_tile_shape(groups, ROWS_PER_WG, head_dim, split), dtype),
      fwd.tile_smem(_tile_shape(groups, ROWS_PER_WG, head_dim, split), dtype),
      plgpu.SMEM((COMPUTE_WGS, ROWS_PER_WG), jnp.float32),
      plgpu.SMEM((COMPUTE_WGS, ROWS_PER_WG), jnp.float32),
      fwd.tile_smem(_tile_shape((stages,), block_k, head_dim, split), dtype),
      fwd.tile_smem(_tile_shape((stages,), block_k, head_dim, split), dtype),
  ) + ((fwd.tile_smem((stages, ROWS_PER_WG, block_k), dtype),)  # P handed over
       if split > 1 else ())
  barriers = (
      # q, dO, lse, delta of each warpgroup (split: its Q or dO halves, then
      # its lse or delta)
      plgpu.Barrier(num_barriers=4 * COMPUTE_WGS),
      plgpu.Barrier(num_barriers=stages * split),  # k loaded
      plgpu.Barrier(num_barriers=stages * split),  # v loaded
      plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
  ) + ((plgpu.Barrier(num_barriers=stages),)  # P ready
       if split > 1 else ())
  body = functools.partial(
      _dq_kernel, block_k=block_k, nq=nq, split=split,
      reverse_q=band.right is not None and band.left is None,
      **_kernel_statics(walk, sm_scale, logit_soft_cap, group,
                        bool(interpret)))
  out = _launch(
      body, scratch, barriers,
      jax.ShapeDtypeStruct((batch, heads, lq_pad, head_dim), dtype),
      (heads, nq, batch), ("heads", "q_tiles", "batch"), interpret,
      (q, k, v, d_out, lse2, delta), mask_arrays)
  return out[:, :, :lq] if lq_pad != lq else out


def backward(q, k, v, q_segment_ids, kv_segment_ids, bias, out, lse, d_out,
             d_lse, *, sm_scale, causal, window_left, window_right,
             logit_soft_cap, interpret, mask=None):
  """(dq, dk, dv, None): ``attention.triton.backward``'s contract for the
  calls ``supports`` accepts (no bias, no segment ids)."""
  del kv_segment_ids
  reason = supports(q, k, v, q_segment_ids, bias, mask)
  if reason:
    raise ValueError(f"mosaic_gpu_bwd.backward: unsupported call: {reason}")
  kwargs = dict(sm_scale=sm_scale, causal=causal, window_left=window_left,
                window_right=window_right, logit_soft_cap=logit_soft_cap,
                interpret=interpret, mask=mask)
  delta = delta_of(out, d_out, d_lse)

  def run(q, k, v, d_out):
    dk, dv = dkv(q, k, v, d_out, lse, delta, **kwargs)
    return dq(q, k, v, d_out, lse, delta, **kwargs), dk, dv
  dq_, dk, dv = fwd.with_padded_head_dim(
      run, (q, k, v, d_out), kernel_head_dim(q.shape[-1]),
      lambda grads, d: tuple(g[..., :d] for g in grads))
  return dq_, dk, dv, None
