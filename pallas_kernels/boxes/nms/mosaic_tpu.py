"""Blocked greedy NMS for TPU (Mosaic): O(N) HBM, VMEM bounded independent of N.

The wrapper sorts boxes by score (XLA) and lays them out as planes
``rows[B, 8, Np]`` float32: x1, y1, x2, y2, area, class id (int32 bits),
keepable flag (1/0), zero; Np pads N to the tile size T with unkeepable
boxes. Grid ``(B, Np // T)``: images "parallel" (megacore chips split them),
tiles "arbitrary" (in order on one core, sharing SMEM state). Per tile:

1. Cross-tile suppression: every earlier tile that kept a box was appended
   to an HBM store (output ``store``) as its (8, T) slab with the flag
   replaced by its keep mask. Each stored slab is DMA'd into VMEM,
   transposed to (T, 8), and (8, T) IoU blocks of its boxes against the
   tile's row vectors are or-reduced (non-kept boxes have flag 0).
2. Within-tile chain: S[i, j] = (i < j) & same class & IoU > threshold goes
   to a (T, T) VMEM scratch; the greedy keep vector is the unique fixed
   point of k = alive & (k @ S == 0) (S is acyclic), reached from k = alive
   after (longest suppression chain + 1) MXU matvecs.
3. The keep mask is written; a non-empty slab is appended to the store; the
   kept count lives in SMEM. Once ``max_output_size`` boxes are kept, later
   tiles skip all compute.

Cost: about (stored slabs + 1) * N * T IoU tests, N^2 / 2 at worst. VMEM at
T = 512: about 1.35 MiB whatever N (mostly the (T, T) matrix). HBM: the
planes and the store (32 bytes per box each) and a 4-byte keep mask.
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
SUB = 8  # boxes per IoU block row group (one sublane group)


@functools.lru_cache(maxsize=None)
def iou_test_flops() -> int:
  """Arithmetic of one box-pair suppression test (``iou_exceeds``, class and
  flag masks), counted from its jaxpr."""
  flops, _ = _cost.scalar_ops(lambda *v: iou_exceeds(v[:5], v[5:], 0.5), 10)
  return flops + 3


def _exceeds_block(col, row, iou_threshold):
  """(SUB, T) bool: box i of ``col`` (SUB, 8) suppresses box j of ``row`` (8, T)."""
  a = tuple(col[:, r:r + 1] for r in range(5))
  b = tuple(row[r:r + 1, :] for r in range(5))
  over = iou_exceeds(a, b, iou_threshold)
  a_cls = pltpu.bitcast(col[:, CLASS_ROW:CLASS_ROW + 1], jnp.int32)
  b_cls = pltpu.bitcast(row[CLASS_ROW:CLASS_ROW + 1, :], jnp.int32)
  return over & (a_cls == b_cls) & (col[:, FLAG_ROW:FLAG_ROW + 1] > 0)


def _nms_kernel(rows_ref, keep_ref, store_ref, state_ref, dma_buf, col_buf,
                s_buf, sem, *, iou_threshold, max_output_size, tile):
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

    def suppressed_by_col_buf(row, extra=None):
      """Or over col_buf's boxes of 'suppresses'; ``extra(i0)`` masks more."""
      def body(g, acc):
        i0 = pl.multiple_of(g * SUB, SUB)
        block = _exceeds_block(col_buf[pl.ds(i0, SUB), :], row, iou_threshold)
        if extra is not None:
          block = block & extra(i0)
        # Vector loop carries must not be i1 in Mosaic: accumulate as f32.
        return jnp.maximum(acc, block.astype(jnp.float32))
      acc = jax.lax.fori_loop(0, tile // SUB, body,
                              jnp.zeros((SUB, tile), jnp.float32))
      return jnp.max(acc, axis=0, keepdims=True)

    # 1. Against the kept boxes of earlier tiles.
    def cross(s, sup):
      copy = pltpu.make_async_copy(store_ref.at[b, s], dma_buf, sem)
      copy.start()
      copy.wait()
      col_buf[...] = dma_buf[...].T
      return jnp.maximum(sup, suppressed_by_col_buf(cur))

    sup = jax.lax.fori_loop(0, state_ref[1], cross,
                            jnp.zeros((1, tile), jnp.float32))
    alive = alive & (sup == 0)

    # 2. The tile's own chain: S[i, j] for i < j, built 8 rows at a time.
    col_buf[...] = cur.T
    lane = jax.lax.broadcasted_iota(jnp.int32, (SUB, tile), 1)
    sub = jax.lax.broadcasted_iota(jnp.int32, (SUB, tile), 0)

    def build(g, carry):
      i0 = pl.multiple_of(g * SUB, SUB)
      block = _exceeds_block(col_buf[pl.ds(i0, SUB), :], cur, iou_threshold)
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

    # 3. Append the slab (flag := keep) for later tiles.
    @pl.when(kept > 0)
    def _():
      row_id = jax.lax.broadcasted_iota(jnp.int32, (PLANES, tile), 0)
      dma_buf[...] = jnp.where(row_id == FLAG_ROW,
                               jnp.broadcast_to(keep, (PLANES, tile)), cur)
      slot = state_ref[1]
      copy = pltpu.make_async_copy(dma_buf, store_ref.at[b, slot], sem)
      copy.start()
      copy.wait()
      state_ref[1] = slot + 1


def keep_mask(rows, *, iou_threshold, max_output_size, tile=DEFAULT_TILE,
              interpret=None):
  """Keep mask int32 [B, Np] over sorted positions from planes [B, 8, Np]."""
  batch, planes, padded = rows.shape
  assert planes == PLANES and padded % tile == 0, rows.shape
  num_tiles = padded // tile
  kernel = functools.partial(_nms_kernel, iou_threshold=float(iou_threshold),
                             max_output_size=int(max_output_size), tile=tile)
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
                      pltpu.VMEM((PLANES, tile), jnp.float32),
                      pltpu.VMEM((tile, PLANES), jnp.float32),
                      pltpu.VMEM((tile, tile), jnp.float32),
                      pltpu.SemaphoreType.DMA(())],
      compiler_params=_compat.tpu_compiler_params(
          dimension_semantics=("parallel", "arbitrary")),
      interpret=interpret,
      cost_estimate=_cost.estimate(
          flops=flops, bytes_accessed=_cost.nbytes(rows, out_shape[0])
          + store * (1 + (num_tiles - 1) / 2)),
      name="nms_keep_mask",
  )(rows)
  return keep[:, 0, :]
