"""Greedy NMS for NVIDIA GPUs (Pallas, Triton lowering); no host round trip.

Two designs; ``api`` takes the bitmask one whenever its mask chunk fits the
byte budget (``block_sizes.GPU_BITMASK_MAX_BYTES``, i.e. for any realistic N),
else the blocked one.

Bitmask design (chunked, parallel + scan). Boxes arrive sorted by score.
* Mask kernel, fully parallel: program (b, i, j) compares rows
  ``MASK_ROWS`` boxes against ``32 * MASK_WORDS`` columns and writes
  mask[r, w] = the 32 bits "box r suppresses box 32w + c" (c > r, same class,
  IoU > threshold). Blocks below the diagonal, padding columns, and all work
  once ``max_output_size`` boxes are kept are skipped.
* Scan kernel, one program per image: walks the words in order; for word w
  it takes the "removed" bits of its 32 boxes, resolves their own chain with
  32 scalar bit steps on the diagonal words, then ORs the rows of the boxes
  it kept into "removed" (only kept rows are read). Stops at
  ``max_output_size`` kept.
* Rows are processed in chunks of ``MASK_CHUNK_ROWS`` (shrunk to fit the
  budget): mask chunk c, then scan chunk c, carrying removed/keep/count on
  device. Scratch memory is chunk * N / 8 bytes: linear in N for a fixed
  chunk, and a small chunk lets a small ``max_output_size`` stop early
  (later chunks' mask programs see the count and exit).
Work: N^2 / 2 IoUs in parallel (fewer with early exit) plus N / 32 scan
steps and K row ORs of N / 32 words for K kept boxes.

Blocked design (one program per image, O(N) memory, no scratch), the
algorithm of the TPU kernel (see ``mosaic_tpu``) in registers:
* tiles of T boxes in order, a ``while`` loop that stops at
  ``max_output_size`` kept;
* kept boxes are appended compactly to per-image buffers; a new tile is
  checked against them T at a time with (T, T) IoU blocks;
* the tile's own chain is the fixed point of k = alive & ~any_i(k_i & S[i, j])
  with S the strict upper-triangular suppression matrix;
* compaction without scatters: ranks are masked column sums of the "i < j"
  matrix and slot r gathers the box of rank r with a masked row sum; a
  barrier separates these global writes from the next tile's reads.
It uses one SM per image, so it is the slow fallback.

Exactness: the IoU is computed with explicitly rounded PTX (``mul.rn``,
``add.rn``, ``sub.rn``, ``div.rn``), so neither fused multiply-adds nor
Triton's approximate f32 division change it: results equal the float32
reference bit for bit. In interpret mode plain jnp arithmetic (the
reference formula) is used.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _compat
from pallas_kernels._compat import pl
from .reference import iou_exceeds

DEFAULT_TILE = 128
NUM_PLANES = 7  # x1, y1, x2, y2, area, class (int32), flag (int32)

_IOU_ASM = """{
  .reg .f32 inter, total, uni;
  mul.rn.f32 inter, $1, $2;
  add.rn.f32 total, $3, $4;
  sub.rn.f32 uni, total, inter;
  div.rn.f32 $0, inter, uni;
}"""


def _exceeds(a, b, iou_threshold, exact_ptx):
  """IoU(a_i, b_j) > threshold for a as columns, b as rows: (Ta, Tb) bool."""
  a = tuple(p[:, None] for p in a)
  b = tuple(p[None, :] for p in b)
  if not exact_ptx:
    return iou_exceeds(a, b, iou_threshold)
  from jax.experimental.pallas import triton as pltriton
  ax1, ay1, ax2, ay2, aarea = a
  bx1, by1, bx2, by2, barea = b
  iw = jnp.maximum(jnp.minimum(ax2, bx2) - jnp.maximum(ax1, bx1), 0.0)
  ih = jnp.maximum(jnp.minimum(ay2, by2) - jnp.maximum(ay1, by1), 0.0)
  shape = iw.shape
  args = [iw, ih, jnp.broadcast_to(aarea, shape), jnp.broadcast_to(barea, shape)]
  [iou] = pltriton.elementwise_inline_asm(
      _IOU_ASM, args=args, constraints="=r,r,r,r,r", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.float32)])
  return iou > iou_threshold


def _nms_kernel(x1_ref, y1_ref, x2_ref, y2_ref, area_ref, cls_ref, flag_ref,
                pos_ref, kx1_ref, ky1_ref, kx2_ref, ky2_ref, karea_ref,
                kcls_ref, count_ref, *, iou_threshold, max_output_size, tile,
                num_tiles, exact_ptx):
  lanes = jnp.arange(tile, dtype=jnp.int32)
  before = lanes[:, None] < lanes[None, :]              # [i, j]: i < j
  exceeds = functools.partial(_exceeds, iou_threshold=iou_threshold,
                              exact_ptx=exact_ptx)

  def tile_step(state):
    t, count = state
    base = pl.multiple_of(t * tile, tile)
    window = pl.ds(base, tile)
    box = tuple(r[window] for r in (x1_ref, y1_ref, x2_ref, y2_ref, area_ref))
    cls = cls_ref[window]
    alive = flag_ref[window] > 0

    # Against the boxes kept by earlier tiles, T at a time.
    def cross(c, sup):
      off = c * tile
      chunk = pl.ds(off, tile)
      kept = tuple(r[chunk] for r in (kx1_ref, ky1_ref, kx2_ref, ky2_ref,
                                       karea_ref))
      live = (off + lanes) < count
      hit = (exceeds(kept, box) & (kcls_ref[chunk][:, None] == cls[None, :])
             & live[:, None])
      return jnp.maximum(sup, jnp.max(hit.astype(jnp.int32), axis=0))

    chunks = (count + tile - 1) // tile
    sup = jax.lax.fori_loop(0, chunks, cross, jnp.zeros((tile,), jnp.int32))
    alive = alive & (sup == 0)

    # The tile's own chain as a fixed point.
    s = exceeds(box, box) & (cls[:, None] == cls[None, :]) & before

    def settle(carry):
      k, _ = carry
      hits = jnp.max((s & (k[:, None] > 0)).astype(jnp.int32), axis=0)
      k_new = (alive & (hits == 0)).astype(jnp.int32)
      return k_new, jnp.max(jnp.abs(k_new - k)) > 0

    keep, _ = jax.lax.while_loop(lambda c: c[1], settle,
                                 (alive.astype(jnp.int32), jnp.bool_(True)))

    # Compact the kept boxes to slots count, count + 1, ...
    rank = jnp.sum(jnp.where(before & (keep[:, None] > 0), 1, 0), axis=0)
    select = (rank[None, :] == lanes[:, None]) & (keep[None, :] > 0)  # [r, j]

    def gather(values):
      return jnp.sum(jnp.where(select, values[None, :], 0).astype(values.dtype),
                     axis=1)

    dest = pl.ds(count, tile)
    for src, dst in zip(box, (kx1_ref, ky1_ref, kx2_ref, ky2_ref, karea_ref)):
      dst[dest] = gather(src)
    kcls_ref[dest] = gather(cls)
    pos_ref[dest] = gather(base + lanes)
    if exact_ptx:  # the interpreter has no threads to order
      from jax.experimental.pallas import triton as pltriton
      pltriton.debug_barrier()
    return t + 1, count + jnp.sum(keep)

  def more(state):
    t, count = state
    return (t < num_tiles) & (count < max_output_size)

  _, count = jax.lax.while_loop(more, tile_step, (jnp.int32(0), jnp.int32(0)))
  count_ref[...] = jnp.full(count_ref.shape, count, jnp.int32)


def kept_positions(x1, y1, x2, y2, area, cls, flag, *, iou_threshold,
                   max_output_size, tile=DEFAULT_TILE, num_warps=8,
                   interpret=False):
  """Sorted positions of kept boxes [B, M] (garbage past count) and count [B].

  Inputs are [B, Np] planes in score order, Np a multiple of ``tile``.
  """
  batch, padded = x1.shape
  assert padded % tile == 0 and padded > 0, x1.shape
  num_tiles = padded // tile
  capacity = -(-max_output_size // tile) * tile + tile
  kernel = functools.partial(
      _nms_kernel, iou_threshold=float(iou_threshold),
      max_output_size=int(max_output_size), tile=tile, num_tiles=num_tiles,
      exact_ptx=not interpret)
  plane = pl.BlockSpec((None, padded), lambda b: (b, 0))
  buf = pl.BlockSpec((None, capacity), lambda b: (b, 0))
  f32 = lambda: jax.ShapeDtypeStruct((batch, capacity), jnp.float32)
  i32 = lambda: jax.ShapeDtypeStruct((batch, capacity), jnp.int32)
  outs = pl.pallas_call(
      kernel,
      grid=(batch,),
      in_specs=[plane] * NUM_PLANES,
      out_specs=[buf] * 7 + [pl.BlockSpec((None, 16), lambda b: (b, 0))],
      out_shape=[i32(), f32(), f32(), f32(), f32(), f32(), i32(),
                 jax.ShapeDtypeStruct((batch, 16), jnp.int32)],
      compiler_params=_compat.gpu_compiler_params(num_warps=num_warps,
                                                  num_stages=1),
      interpret=interpret,
  )(x1, y1, x2, y2, area, cls, flag)
  pos, count = outs[0], outs[-1][:, 0]
  return pos[:, :max_output_size], count


# --------------------------------------------------------------------------
# Bitmask design: a parallel mask kernel and a scan kernel, chunked by rows.

WORD = 32  # boxes per mask word


def _mask_kernel(count_ref, rx1, ry1, rx2, ry2, rarea, rcls, cx1, cy1, cx2,
                 cy2, carea, ccls, mask_ref, *, iou_threshold, rows, words,
                 chunk_start, num_boxes, max_output_size, exact_ptx):
  """mask[r, w] bit c: box r suppresses box 32 * w + c (c > r, same class)."""
  i = pl.program_id(1)
  j = pl.program_id(2)
  first_row = chunk_start + i * rows
  row_ids = first_row + jnp.arange(rows, dtype=jnp.int32)
  first_col = j * words * WORD
  bit = jnp.left_shift(jnp.int32(1), jnp.arange(WORD, dtype=jnp.int32))
  # Nothing to compute when every column precedes every row or is padding,
  # or when earlier chunks already kept max_output_size boxes.
  skip = ((first_col + words * WORD <= first_row) | (first_col >= num_boxes)
          | (count_ref[0] >= max_output_size))

  def zeros():
    for q in range(words):
      mask_ref[:, q] = jnp.zeros((rows,), jnp.int32)

  def compute():
    a = tuple(r[...] for r in (rx1, ry1, rx2, ry2, rarea))
    a_cls = rcls[...]
    for q in range(words):
      cols = pl.ds(first_col + q * WORD, WORD)
      col_ids = first_col + q * WORD + jnp.arange(WORD, dtype=jnp.int32)
      b = tuple(r[cols] for r in (cx1, cy1, cx2, cy2, carea))
      hit = (_exceeds(a, b, iou_threshold, exact_ptx)
             & (a_cls[:, None] == ccls[cols][None, :])
             & (col_ids[None, :] > row_ids[:, None]))
      mask_ref[:, q] = jnp.sum(jnp.where(hit, bit[None, :], 0), axis=1)

  if exact_ptx:
    jax.lax.cond(skip, zeros, compute)
  else:
    # Interpret mode: a cond would thread the whole output through both
    # branches; computing and masking is the same answer, much faster.
    compute()
    for q in range(words):
      mask_ref[:, q] = jnp.where(skip, 0, mask_ref[:, q])


def _scan_kernel(removed_ref, keep_ref, count_ref, mask_ref, removed_out,
                 keep_out, count_out, *, first_word, end_word,
                 max_output_size, unrolled):
  """Greedy scan of one chunk's words, 32 boxes per step, one program/image."""
  padded_words = removed_ref.shape[0]
  lanes = jnp.arange(padded_words, dtype=jnp.int32)

  def step(state):
    w, count, removed, keep = state
    alive = jnp.sum(jnp.where(lanes == w, ~removed, 0))
    row0 = (w - first_word) * WORD
    acc = jnp.zeros((padded_words,), jnp.int32)
    if unrolled:  # the compiled kernel: straight-line code, kept rows only
      diag = [mask_ref[row0 + r, w] for r in range(WORD)]
      for r in range(WORD):  # the word's own greedy chain, scalar bit ops
        is_alive = jnp.bitwise_and(jnp.right_shift(alive, r), 1) != 0
        alive = jnp.where(is_alive, alive & ~diag[r], alive)
      for r in range(WORD):  # only kept boxes' rows are read
        kept_r = jnp.bitwise_and(jnp.right_shift(alive, r), 1) != 0
        acc = jax.lax.cond(kept_r, lambda a, r=r: a | mask_ref[row0 + r, :],
                           lambda a: a, acc)
    else:  # interpret mode: the same steps as loops (fast to interpret)
      def chain(r, alive):
        is_alive = jnp.bitwise_and(jnp.right_shift(alive, r), 1) != 0
        return jnp.where(is_alive, alive & ~mask_ref[row0 + r, w], alive)

      alive = jax.lax.fori_loop(0, WORD, chain, alive)

      def gather(r, acc):
        kept_r = jnp.bitwise_and(jnp.right_shift(alive, r), 1) != 0
        return jnp.where(kept_r, acc | mask_ref[row0 + r, :], acc)

      acc = jax.lax.fori_loop(0, WORD, gather, acc)
    keep = jnp.where(lanes == w, alive, keep)
    count = count + jax.lax.population_count(alive)
    return w + 1, count, removed | acc, keep

  def more(state):
    w, count, _, _ = state
    return (w < end_word) & (count < max_output_size)

  _, count, removed, keep = jax.lax.while_loop(
      more, step, (jnp.int32(first_word), count_ref[0], removed_ref[...],
                   keep_ref[...]))
  removed_out[...] = removed
  keep_out[...] = keep
  count_out[...] = jnp.full(count_out.shape, count, jnp.int32)


def _next_pow2(x):
  return 1 << max(0, (int(x) - 1).bit_length())


def bitmask_layout(batch, num_boxes, *, rows=64, words=4, chunk_rows=4096,
                   max_bytes=256 << 20):
  """(padded words, rows per chunk, chunks, mask bytes) of the bitmask design.

  The mask of one chunk of rows is [B, chunk, padded_words] int32; the chunk
  shrinks so that it stays within ``max_bytes``; None when even ``rows``
  rows do not fit.
  """
  num_words = -(-num_boxes // WORD)
  padded_words = max(_next_pow2(num_words), words)
  padded_rows = -(-num_boxes // rows) * rows
  by_budget = max_bytes // (batch * padded_words * 4) // rows * rows
  chunk = min(-(-chunk_rows // rows) * rows, padded_rows, by_budget)
  if chunk < rows:
    return None
  chunks = -(-padded_rows // chunk)
  return padded_words, chunk, chunks, batch * chunk * padded_words * 4


def keep_words_bitmask(planes, cls, flags, *, iou_threshold, max_output_size,
                       rows=64, words=4, mask_warps=4, scan_warps=None,
                       chunk_rows=4096, max_bytes=256 << 20, interpret=False):
  """Keep mask over sorted positions [B, N] via the chunked bitmask design.

  ``planes`` [B, 5, N] (x1, y1, x2, y2, area), ``cls``/``flags`` [B, N].
  """
  batch, _, n = planes.shape
  layout = bitmask_layout(batch, n, rows=rows, words=words,
                          chunk_rows=chunk_rows, max_bytes=max_bytes)
  assert layout is not None, (batch, n, max_bytes)
  padded_words, chunk, num_chunks, _ = layout
  num_words = -(-n // WORD)
  cols = padded_words * WORD
  if scan_warps is None:  # H100: one warp is fastest until rows get long
    scan_warps = 1 if padded_words < 512 else 4

  def pad(x, size):
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - n)])

  row_planes = [pad(planes[:, r], chunk * num_chunks) for r in range(5)]
  row_cls = pad(cls, chunk * num_chunks)
  col_planes = [pad(planes[:, r], cols) for r in range(5)]
  col_cls = pad(cls, cols)
  flags = pad(flags, cols)

  shifts = jnp.arange(WORD, dtype=jnp.uint32)
  flag_bits = (flags.reshape(batch, padded_words, WORD).astype(jnp.uint32)
               << shifts)
  valid_words = jax.lax.bitcast_convert_type(
      jnp.sum(flag_bits, axis=-1, dtype=jnp.uint32), jnp.int32)
  removed = ~valid_words
  keep = jnp.zeros((batch, padded_words), jnp.int32)
  count = jnp.zeros((batch, 16), jnp.int32)
  words_spec = pl.BlockSpec((None, padded_words), lambda b: (b, 0))
  count_spec = pl.BlockSpec((None, 16), lambda b: (b, 0))
  blocks_per_chunk = chunk // rows

  for c in range(num_chunks):  # static: no host round trip between chunks
    first_word = c * chunk // WORD
    end_word = min((c + 1) * chunk // WORD, num_words)
    if first_word >= end_word:
      break
    kernel = functools.partial(
        _mask_kernel, iou_threshold=float(iou_threshold), rows=rows,
        words=words, chunk_start=c * chunk, num_boxes=n,
        max_output_size=int(max_output_size), exact_ptx=not interpret)
    row_spec = pl.BlockSpec(
        (None, rows), lambda b, i, j, c=c: (b, c * blocks_per_chunk + i))
    col_spec = pl.BlockSpec((None, cols), lambda b, i, j: (b, 0))
    mask = pl.pallas_call(
        kernel,
        grid=(batch, blocks_per_chunk, padded_words // words),
        in_specs=([pl.BlockSpec((None, 16), lambda b, i, j: (b, 0))]
                  + [row_spec] * 6 + [col_spec] * 6),
        out_specs=pl.BlockSpec((None, rows, words), lambda b, i, j: (b, i, j)),
        out_shape=jax.ShapeDtypeStruct((batch, chunk, padded_words),
                                       jnp.int32),
        compiler_params=_compat.gpu_compiler_params(num_warps=mask_warps,
                                                    num_stages=1),
        interpret=interpret,
    )(count, *row_planes, row_cls, *col_planes, col_cls)
    removed, keep, count = pl.pallas_call(
        functools.partial(_scan_kernel, first_word=first_word,
                          end_word=end_word,
                          max_output_size=int(max_output_size),
                          unrolled=not interpret),
        grid=(batch,),
        in_specs=[words_spec, words_spec, count_spec,
                  pl.BlockSpec((None, chunk, padded_words),
                               lambda b: (b, 0, 0))],
        out_specs=[words_spec, words_spec, count_spec],
        out_shape=[jax.ShapeDtypeStruct((batch, padded_words), jnp.int32)] * 2
        + [jax.ShapeDtypeStruct((batch, 16), jnp.int32)],
        compiler_params=_compat.gpu_compiler_params(num_warps=scan_warps,
                                                    num_stages=1),
        interpret=interpret,
    )(removed, keep, count, mask)

  bits = jnp.right_shift(
      jax.lax.bitcast_convert_type(keep, jnp.uint32)[..., None], shifts) & 1
  return bits.reshape(batch, cols)[:, :n].astype(jnp.int32)
