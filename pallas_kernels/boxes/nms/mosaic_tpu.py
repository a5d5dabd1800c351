"""Greedy NMS for TPU (Mosaic): a bitonic score-sort kernel and a blocked NMS
kernel. Tiles of T sorted boxes run in order; each tile is tested against the
stored slabs of earlier tiles' kept boxes, then its own greedy chain is the
fixed point of ``k = alive & (k @ S == 0)`` (MXU matvecs). O(N) HBM, VMEM
independent of N. Structure: docs/design/nms.md.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _compat, _cost
from pallas_kernels._compat import pl, pltpu
from .reference import iou_exceeds

CLASS_ROW, FLAG_ROW = 5, 6
PLANES = 8
DEFAULT_TILE = 512
LANES = 128
SUB = 8  # boxes per IoU block row group (one sublane group)


@functools.lru_cache(maxsize=None)
def iou_test_flops() -> int:
  """Arithmetic of one box-pair suppression test (``iou_exceeds``, class and
  flag masks), counted from its jaxpr."""
  flops, _ = _cost.scalar_ops(lambda *v: iou_exceeds(v[:5], v[5:], 0.5), 10)
  return flops + 3


def _exceeds_block(col, rows, iou_threshold, use_classes):
  """(SUB, W) bool: box i of ``col`` (SUB, 8) suppresses box j of ``rows``
  (planes of (SUB, W), already broadcast over sublanes). No flag test:
  stored non-kept boxes are null boxes, and the within-tile chain ignores
  rows of non-alive boxes."""
  a = tuple(col[:, r:r + 1] for r in range(5))
  over = iou_exceeds(a, rows[:5], iou_threshold)
  if use_classes:
    a_cls = pltpu.bitcast(col[:, CLASS_ROW:CLASS_ROW + 1], jnp.int32)
    over = over & (a_cls == rows[CLASS_ROW])
  return over


def _row_planes(cur, use_classes):
  """The tile's boxes as (SUB, T) planes, broadcast once per tile rather than
  per 8-box group (the class plane as int32)."""
  shape = (SUB, cur.shape[1])
  planes = [jnp.broadcast_to(cur[r:r + 1, :], shape) for r in range(5)]
  if use_classes:
    planes.append(pltpu.bitcast(
        jnp.broadcast_to(cur[CLASS_ROW:CLASS_ROW + 1, :], shape), jnp.int32))
  return tuple(planes)


def _null_boxes(slab, keep):
  """``slab`` (8, T) with every box not in ``keep`` replaced by a null box
  (x1 = y1 = +inf, x2 = y2 = -inf, area 0): its intersection with any box is
  0, so its IoU is 0 or NaN and it never suppresses."""
  row_id = jax.lax.broadcasted_iota(jnp.int32, slab.shape, 0)
  null = jnp.where(row_id < 2, jnp.inf, jnp.where(row_id < 4, -jnp.inf, 0.0))
  return jnp.where(jnp.broadcast_to(keep, slab.shape) > 0, slab, null)


def _nms_kernel(rows_ref, keep_ref, store_ref, state_ref, dma_buf, col_buf,
                s_buf, sems, *, iou_threshold, max_output_size, tile,
                use_classes):
  b = pl.program_id(0)
  t = pl.program_id(1)

  @pl.when(t == 0)
  def _():
    state_ref[0] = 0  # kept so far
    state_ref[1] = 0  # stored slabs

  count = state_ref[0]

  @pl.when(count >= max_output_size)
  def _():
    keep_ref[...] = jnp.zeros(keep_ref.shape, jnp.int32)

  @pl.when(count < max_output_size)
  def _():
    cur = rows_ref[...]                                  # (8, T)
    alive = cur[FLAG_ROW:FLAG_ROW + 1, :] > 0            # (1, T)
    rows = _row_planes(cur, use_classes)

    # 1. Against the kept boxes of earlier tiles; slab s + 1 is fetched
    # into the other buffer while slab s is tested.
    stored = state_ref[1]

    def fetch(s):
      slot = s % 2
      return pltpu.make_async_copy(store_ref.at[b, s], dma_buf.at[slot],
                                   sems.at[slot])

    @pl.when(stored > 0)
    def _():
      fetch(0).start()

    def cross(s, acc):
      fetch(s).wait()

      @pl.when(s + 1 < stored)
      def _():
        fetch(s + 1).start()

      col_buf[...] = dma_buf[s % 2].T

      def group(g, acc):
        i0 = pl.multiple_of(g * SUB, SUB)
        over = _exceeds_block(col_buf[pl.ds(i0, SUB), :], rows,
                              iou_threshold, use_classes)
        # Vector loop carries must not be i1 in Mosaic: carry f32.
        return jnp.where(over, 1.0, acc)
      return jax.lax.fori_loop(0, tile // SUB, group, acc)

    sup = jax.lax.fori_loop(0, stored, cross,
                            jnp.zeros((SUB, tile), jnp.float32))
    alive = alive & (jnp.max(sup, axis=0, keepdims=True) == 0)

    # 2. The tile's own chain: S[i, j] for i < j, built 8 rows at a time.
    col_buf[...] = cur.T
    lane = jax.lax.broadcasted_iota(jnp.int32, (SUB, tile), 1)
    sub = jax.lax.broadcasted_iota(jnp.int32, (SUB, tile), 0)

    def build(g, carry):
      i0 = pl.multiple_of(g * SUB, SUB)
      block = _exceeds_block(col_buf[pl.ds(i0, SUB), :], rows, iou_threshold,
                             use_classes)
      block = block & (lane > sub + i0)
      s_buf[pl.ds(i0, SUB), :] = block.astype(jnp.float32)
      return carry

    jax.lax.fori_loop(0, tile // SUB, build, 0)
    alive_f = alive.astype(jnp.float32)

    def step(carry):
      k, _ = carry
      k8 = jnp.broadcast_to(k, (SUB, tile))
      hits = jnp.dot(k8, s_buf[...], preferred_element_type=jnp.float32)
      k_new = alive_f * (hits[0:1, :] == 0).astype(jnp.float32)
      changed = jnp.max(jnp.abs(k_new - k)) > 0
      return k_new, changed

    keep, _ = jax.lax.while_loop(lambda c: c[1], step,
                                 (alive_f, jnp.bool_(True)))
    keep_ref[...] = keep.astype(jnp.int32)
    kept = jnp.sum(keep).astype(jnp.int32)
    state_ref[0] = count + kept
    state_ref[1] = stored + jnp.where(kept > 0, 1, 0)

    # 3. Append the slab (non-kept boxes nulled) for later tiles.
    @pl.when(kept > 0)
    def _():
      dma_buf[0] = _null_boxes(cur, keep)
      copy = pltpu.make_async_copy(dma_buf.at[0], store_ref.at[b, stored],
                                   sems.at[0])
      copy.start()
      copy.wait()


def keep_mask(rows, *, iou_threshold, max_output_size, tile=DEFAULT_TILE,
              use_classes=True, interpret=None):
  """Keep mask int32 [B, Np] over sorted positions from planes [B, 8, Np]."""
  batch, planes, padded = rows.shape
  assert planes == PLANES and padded % tile == 0, rows.shape
  num_tiles = padded // tile
  kernel = functools.partial(_nms_kernel, iou_threshold=float(iou_threshold),
                             max_output_size=int(max_output_size), tile=tile,
                             use_classes=use_classes)
  out_shape = [jax.ShapeDtypeStruct((batch, 1, padded), jnp.int32),
               jax.ShapeDtypeStruct((batch, num_tiles, PLANES, tile),
                                    jnp.float32)]
  # Worst case, every tile keeps a box: N T within-tile IoU tests plus
  # N (N - T) / 2 cross-tile ones (``iou_test_flops`` each), two MXU
  # matvec rounds per tile; the store written and read back once per tile.
  tests = padded * tile + padded * (padded - tile) // 2
  flops = batch * (iou_test_flops() * tests + 4 * tile * padded)
  store = _cost.nbytes(out_shape[1])
  keep, _ = _compat.pallas_call(
      kernel,
      grid=(batch, num_tiles),
      in_specs=[pl.BlockSpec((None, PLANES, tile), lambda b, t: (b, 0, t))],
      out_specs=[pl.BlockSpec((None, 1, tile), lambda b, t: (b, 0, t)),
                 pl.BlockSpec(memory_space=pl.ANY)],
      out_shape=out_shape,
      scratch_shapes=[pltpu.SMEM((2,), jnp.int32),
                      pltpu.VMEM((2, PLANES, tile), jnp.float32),
                      pltpu.VMEM((tile, PLANES), jnp.float32),
                      pltpu.VMEM((tile, tile), jnp.float32),
                      pltpu.SemaphoreType.DMA((2,))],
      compiler_params=_compat.tpu_compiler_params(
          dimension_semantics=("parallel", "arbitrary")),
      interpret=interpret,
      cost_estimate=_cost.estimate(
          flops=flops, bytes_accessed=_cost.nbytes(rows, out_shape[0])
          + store * (1 + (num_tiles - 1) / 2)),
      name="nms_keep_mask",
  )(rows)
  return keep[:, 0, :]


# ------------------------------------------------------------------ score sort

CHUNK_ROWS = 8
CHUNK = CHUNK_ROWS * LANES      # keys per (8, 128) vreg chunk
SORT_MAX = 1 << 20              # 8 MiB of keys and indices in VMEM
INVALID_KEY = 0x7FFFFFFF        # unkeepable boxes and padding


def score_keys(scores, score_threshold=None):
  """int32 keys [..., N] whose ascending order is ``reference.sort_by_score``'s.
  Keepable scores map to the order-preserving integer of ``-score + 0.0`` (so
  0.0 and -0.0 tie); unkeepable ones to INVALID_KEY, above every keepable key.
  With the box index as tie-break the order is total."""
  scores = scores.astype(jnp.float32)
  valid = ~jnp.isnan(scores)
  if score_threshold is not None:
    valid = valid & (scores > score_threshold)
  bits = jax.lax.bitcast_convert_type(-scores + 0.0, jnp.int32)
  ordered = jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
  return jnp.where(valid, ordered, INVALID_KEY)


def sort_size(num_keys: int) -> int:
  """Keys the sort kernel holds: a power of two >= num_keys, >= CHUNK."""
  return max(CHUNK, 1 << max(0, num_keys - 1).bit_length())


def _first(ka, ia, kb, ib):
  """Whether (ka, ia) sorts before (kb, ib), lexicographically."""
  return (ka < kb) | ((ka == kb) & (ia < ib))


def _bit(x, log2):
  return (x >> log2) & 1


def _flipped(mask, flip):
  """mask where the int32 ``flip`` is 0, ~mask where it is 1 (in int32: Mosaic
  cannot select between boolean vectors)."""
  return (jnp.where(mask, 1, 0) ^ flip) == 1


def _partner(x, pos, distance):
  """x at chunk position pos ^ distance (distance a power of two < CHUNK). Both
  rotations are computed and the one whose rotated positions equal pos ^
  distance is taken, so no rotation direction is assumed."""
  axis, step, size = ((1, distance, LANES) if distance < LANES
                      else (0, distance // LANES, CHUNK_ROWS))
  source = pltpu.roll(pos, step, axis)
  take = source == (pos ^ distance)
  return jnp.where(take, pltpu.roll(x, step, axis),
                   pltpu.roll(x, size - step, axis))


def _exchange_in_chunk(keys, index, pos, first_pos, distance, log2_run):
  """One bitonic step within a chunk: partners at ``distance`` (< CHUNK).
  ``first_pos`` is the global position of the chunk's first key; a key keeps the
  smaller of the pair when its bit ``log2(distance)`` equals its bit
  ``log2_run`` (runs of 2^log2_run keys alternate direction)."""
  other_keys = _partner(keys, pos, distance)
  other_index = _partner(index, pos, distance)
  mine_first = _first(keys, index, other_keys, other_index)
  keep_max = (_bit(pos, distance.bit_length() - 1)
              ^ _bit(pos + first_pos, log2_run))
  take_mine = _flipped(mine_first, keep_max)
  return (jnp.where(take_mine, keys, other_keys),
          jnp.where(take_mine, index, other_index))


def _sort_kernel(keys_hbm, keys_out, order_out, key_buf, index_buf, sems, *,
                 size):
  b = pl.program_id(0)
  copy_in = pltpu.make_async_copy(keys_hbm.at[b], key_buf, sems.at[0])
  copy_in.start()
  chunks = size // CHUNK
  pos = (jax.lax.broadcasted_iota(jnp.int32, (CHUNK_ROWS, LANES), 0) * LANES
         + jax.lax.broadcasted_iota(jnp.int32, (CHUNK_ROWS, LANES), 1))
  copy_in.wait()

  def rows(c):
    return pl.ds(pl.multiple_of(c * CHUNK_ROWS, CHUNK_ROWS), CHUNK_ROWS)

  def in_chunk_steps(c, log2_runs, first_distance_log2, log2_run=None):
    keys, index = key_buf[rows(c)], index_buf[rows(c)]
    for run in log2_runs:
      for d in range(min(run, first_distance_log2 + 1) - 1, -1, -1):
        keys, index = _exchange_in_chunk(
            keys, index, pos, c * CHUNK, 1 << d,
            run if log2_run is None else log2_run)
    key_buf[rows(c)] = keys
    index_buf[rows(c)] = index

  # 1. Each chunk becomes a sorted run, ascending and descending alternately
  # (runs of 2, 4, ..., CHUNK keys).
  log2_chunk = CHUNK.bit_length() - 1

  def sort_chunk(c, carry):
    index_buf[rows(c)] = pos + c * CHUNK
    in_chunk_steps(c, range(1, log2_chunk + 1), log2_chunk)
    return carry

  jax.lax.fori_loop(0, chunks, sort_chunk, 0)

  # 2. Merge runs of 2^log2_run keys for log2_run > log2(CHUNK): steps at
  # distances of whole chunks swap chunk pairs, the last log2(CHUNK) steps
  # run within each chunk.
  def merge(level, carry):
    log2_run = level + log2_chunk + 1

    def across(step, carry):
      log2_apart = level - step          # partners 2^log2_apart chunks apart

      def pair(q, carry):
        lo = ((q >> log2_apart) << (log2_apart + 1)) + (
            q & ((1 << log2_apart) - 1))
        hi = lo + (1 << log2_apart)
        klo, ilo = key_buf[rows(lo)], index_buf[rows(lo)]
        khi, ihi = key_buf[rows(hi)], index_buf[rows(hi)]
        lo_first = _first(klo, ilo, khi, ihi)
        lo_gets_lo = _flipped(lo_first, _bit(pos + lo * CHUNK, log2_run))
        key_buf[rows(lo)] = jnp.where(lo_gets_lo, klo, khi)
        index_buf[rows(lo)] = jnp.where(lo_gets_lo, ilo, ihi)
        key_buf[rows(hi)] = jnp.where(lo_gets_lo, khi, klo)
        index_buf[rows(hi)] = jnp.where(lo_gets_lo, ihi, ilo)
        return carry

      return jax.lax.fori_loop(0, chunks // 2, pair, carry)

    jax.lax.fori_loop(0, level + 1, across, 0)

    def finish(c, carry):
      in_chunk_steps(c, [log2_chunk + 1], log2_chunk - 1, log2_run)
      return carry

    return jax.lax.fori_loop(0, chunks, finish, carry)

  jax.lax.fori_loop(0, chunks.bit_length() - 1, merge, 0)
  copies = [pltpu.make_async_copy(key_buf, keys_out.at[b], sems.at[0]),
            pltpu.make_async_copy(index_buf, order_out.at[b], sems.at[1])]
  for copy in copies:
    copy.start()
  for copy in copies:
    copy.wait()


def sort_keys(keys, interpret=None):
  """Sorts int32 ``keys`` [B, N] ascending with the index as tie-break.

  Bitonic sorting network over N padded to ``sort_size(N)`` with
  INVALID_KEY (after every key: padding indices are >= N), all in VMEM:
  each (8, 128) chunk is sorted in registers (partners by lane / sublane
  rotation), then runs are merged by swapping whole chunks and finishing
  each chunk in registers; O(N log^2 N) compares, one program per image.

  Returns (sorted keys, their indices), int32 [B, sort_size(N)].
  """
  batch, n = keys.shape
  size = sort_size(n)
  if size > SORT_MAX:
    raise ValueError(f"sort_keys: N = {n} keys need {size} VMEM slots, more "
                     f"than SORT_MAX = {SORT_MAX}")
  keys = jnp.pad(keys.astype(jnp.int32), ((0, 0), (0, size - n)),
                 constant_values=INVALID_KEY)
  keys = keys.reshape(batch, size // LANES, LANES)
  shape = jax.ShapeDtypeStruct(keys.shape, jnp.int32)
  log2 = size.bit_length() - 1
  compares = batch * size // 2 * log2 * (log2 + 1) // 2
  sorted_keys, order = _compat.pallas_call(
      functools.partial(_sort_kernel, size=size),
      grid=(batch,),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 2,
      out_shape=[shape, shape],
      scratch_shapes=[pltpu.VMEM(keys.shape[1:], jnp.int32),
                      pltpu.VMEM(keys.shape[1:], jnp.int32),
                      pltpu.SemaphoreType.DMA((2,))],
      compiler_params=_compat.tpu_compiler_params(
          dimension_semantics=("parallel",),
          vmem_limit_bytes=2 * 4 * size + (4 << 20)),
      interpret=interpret,
      cost_estimate=_cost.estimate(flops=8 * compares,
                                   bytes_accessed=3 * _cost.nbytes(shape)),
      name="nms_sort_keys",
  )(keys)
  return sorted_keys.reshape(batch, size), order.reshape(batch, size)
