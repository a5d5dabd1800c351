"""Greedy NMS for NVIDIA GPUs (Pallas, Triton lowering); no host round trip.

Sorted boxes (rank sort, radix sort or XLA's, by N); a parallel kernel writes
the suppression bitmask and a per-image scan resolves the greedy chain word
by word, in row chunks; past the mask budget, the TPU's blocked algorithm.
IoU tests round explicitly (PTX ``.rn``), equal to the reference bit for
bit. Structure: docs/design/nms.md.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _compat
from pallas_kernels._compat import pl
from . import block_sizes
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
      pltriton.debug_barrier()
    return t + 1, count + jnp.sum(keep)

  def more(state):
    t, count = state
    return (t < num_tiles) & (count < max_output_size)

  _, count = jax.lax.while_loop(more, tile_step, (jnp.int32(0), jnp.int32(0)))
  count_ref[...] = jnp.full(count_ref.shape, count, jnp.int32)


def kept_positions(x1, y1, x2, y2, area, cls, flag, *, iou_threshold,
                   max_output_size, tile=DEFAULT_TILE, num_warps=8,
                   interpret=None):
  """Sorted positions of kept boxes [B, M] (garbage past count) and count [B].
  Inputs are [B, Np] planes in score order, Np a multiple of ``tile``."""
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
  outs = _compat.pallas_call(
      kernel,
      name="nms_kept_positions_gpu",
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
# A scan step keeping at most FEW_ROWS boxes ORs only their mask rows.
FEW_ROWS = 4
# Unrolled chunks (``static_chunks``) in the scalar scan form: from chunk 1
# on, one launch scans chunk c on program 0 while the other programs compute
# chunk c + 1's mask (``_overlap_kernel``). Chunk 0 runs alone: its scan
# removes most boxes, so chunk 1's mask is pruned by it.


# fl(inter / union) > t  <=>  inter / union > mid (round to nearest), and
# inter - mid * union = fma(-t, union, inter) - half_ulp * union, where the
# fma rounds once (monotone) and half_ulp * union is exact: so r1 > s and
# r1 < s decide; r1 == s (or union < 2^-80, NaN) falls back to div.rn.
_FMA_ASM = """{
  .reg .f32 inter, total, uni, nt, hu, tt, r1, s, q;
  .reg .pred gt, tie, slow;
  mul.rn.f32 inter, $1, $2;
  add.rn.f32 total, $3, $4;
  sub.rn.f32 uni, total, inter;
  mov.f32 nt, NEG_T;
  mov.f32 hu, HALF_ULP;
  mov.f32 tt, POS_T;
  fma.rn.f32 r1, nt, uni, inter;
  mul.rn.f32 s, uni, hu;
  setp.gt.f32 gt, r1, s;
  setp.eq.f32 tie, r1, s;
  setp.ltu.f32 slow, uni, 0f17800000;
  or.pred slow, slow, tie;
  selp.u32 $0, 1, 0, gt;
  @slow div.rn.f32 q, inter, uni;
  @slow setp.gt.f32 gt, q, tt;
  @slow selp.u32 $0, 1, 0, gt;
}"""


def _f32_hex(x):
  return "0f%08X" % int(np.float32(x).view(np.uint32))


def _fma_asm(iou_threshold):
  """The exact division-free test for this threshold, or None (use div)."""
  t = np.float32(iou_threshold)
  if not 2.0 ** -20 <= float(t) <= 2.0 ** 20:  # keeps half_ulp * union exact
    return None
  half_ulp = np.float32((float(np.nextafter(t, np.float32(np.inf)))
                         - float(t)) / 2)
  return (_FMA_ASM.replace("NEG_T", _f32_hex(-t))
          .replace("HALF_ULP", _f32_hex(half_ulp)).replace("POS_T", _f32_hex(t)))


def _exceeds_bits(a, b, iou_threshold, exact_ptx):
  """Like ``_exceeds`` (a as rows, b as columns); compiled, division-free
  (``_FMA_ASM``) for thresholds in [2^-20, 2^20]."""
  asm = _fma_asm(iou_threshold) if exact_ptx else None
  if asm is None:
    return _exceeds(a, b, iou_threshold, exact_ptx)
  ax1, ay1, ax2, ay2, aarea = (p[:, None] for p in a)
  bx1, by1, bx2, by2, barea = (p[None, :] for p in b)
  iw = jnp.maximum(jnp.minimum(ax2, bx2) - jnp.maximum(ax1, bx1), 0.0)
  ih = jnp.maximum(jnp.minimum(ay2, by2) - jnp.maximum(ay1, by1), 0.0)
  shape = iw.shape
  [hit] = pltriton.elementwise_inline_asm(
      asm, args=[iw, ih, jnp.broadcast_to(aarea, shape),
                 jnp.broadcast_to(barea, shape)],
      constraints="=r,r,r,r,r", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.int32)])
  return hit != 0


# Written (interpret mode only) where compiled kernels skip a mask word, so
# a scan that read one with effect would fail the tests.
SKIPPED_WORD = -1


def _mask_kernel(state_ref, removed_ref, x1, y1, x2, y2, area, cls, mask_ref,
                 band_ref=None, *, iou_threshold, rows, words, num_boxes,
                 max_output_size, exact_ptx, use_classes, tile=None,
                 chunk_start=None):
  """mask[r, w] bit c: box r suppresses box 32 * w + c (c > r, same class). Rows
  are the current chunk's (first row state[1]), columns absolute; words the scan
  cannot read with effect are skipped. ``band_ref``: the diagonal and next
  blocks, transposed (one box per lane). ``tile`` = (i, j): fill row block i,
  word block j of the chunk's mask (the overlapped form)."""
  if tile is None:
    i, j = pl.program_id(1), pl.program_id(2)
    out_rows, out_word = slice(None), 0
  else:
    i, j = tile
    out_rows, out_word = pl.ds(i * rows, rows), j * words
  # state_ref is None for a single chunk: it starts at row 0, nothing kept.
  if chunk_start is None:
    chunk_start = 0 if state_ref is None else state_ref[1]
  first_row = chunk_start + i * rows
  first_col = j * words * WORD
  first_word = j * words
  bit = jnp.left_shift(jnp.int32(1), jnp.arange(WORD, dtype=jnp.int32))
  skip = ((first_col + words * WORD <= first_row) | (first_col >= num_boxes)
          | (first_row >= num_boxes))
  if state_ref is not None:
    skip = skip | (state_ref[0] >= max_output_size)
  last_word = removed_ref.shape[0] - 1
  rows_dead = jnp.bool_(True)
  for k in range(rows // WORD):
    index = jnp.minimum(first_row // WORD + k, last_word)
    rows_dead = rows_dead & (removed_ref[index] == -1)
  skip = skip | rows_dead

  def hits(first, count, first_c):
    # [count, 32]: row box first + i suppresses column box first_c + c
    window, cols = pl.ds(first, count), pl.ds(first_c, WORD)
    a = tuple(r[window] for r in (x1, y1, x2, y2, area))
    b = tuple(r[cols] for r in (x1, y1, x2, y2, area))
    row_ids = first + jnp.arange(count, dtype=jnp.int32)
    col_ids = first_c + jnp.arange(WORD, dtype=jnp.int32)
    hit = (_exceeds_bits(a, b, iou_threshold, exact_ptx)
           & (col_ids[None, :] > row_ids[:, None]))
    if use_classes:
      hit = hit & (cls[window][:, None] == cls[cols][None, :])
    return hit

  def word(q):
    hit = hits(first_row, rows, first_col + q * WORD)
    return jnp.sum(jnp.where(hit, bit[None, :], 0), axis=1)

  if exact_ptx:
    def compute():
      for q in range(words):
        live = removed_ref[first_word + q] != -1

        @pl.when(live)
        def _(q=q):
          mask_ref[out_rows, out_word + q] = word(q)

    pl.when(jnp.logical_not(skip))(compute)
  else:
    # Interpret mode: conds would thread the whole output through both
    # branches; computing and selecting gives the same words, much faster.
    for q in range(words):
      live = jnp.logical_not(skip) & (removed_ref[first_word + q] != -1)
      mask_ref[out_rows, out_word + q] = jnp.where(live, word(q),
                                                   SKIPPED_WORD)
  if band_ref is None:
    return

  def transposed(k, col_word):
    # bits r over the 32 rows of this program's row word k, per column c
    hit = hits(first_row + k * WORD, WORD, col_word * WORD)
    return jnp.sum(jnp.where(hit, bit[:, None], 0), axis=0)

  for k in range(rows // WORD):
    row_word = first_row // WORD + k
    band_row = i * (rows // WORD) + k
    for half in (0, 1):
      col_word = row_word + half
      owned = (col_word >= first_word) & (col_word < first_word + words)
      col_word = jnp.minimum(col_word, last_word)
      live = (jnp.logical_not(skip) & owned
              & (removed_ref[col_word] != -1))
      target = (band_row, pl.ds(half * WORD, WORD))
      if exact_ptx:
        @pl.when(live)
        def _(k=k, col_word=col_word, target=target):
          band_ref[target] = transposed(k, col_word)
      else:
        value = jnp.where(live, transposed(k, col_word), SKIPPED_WORD)
        band_ref[target] = jnp.where(owned, value, band_ref[target])


def _scan_kernel(removed_ref, keep_ref, base_ref, state_ref, mask_ref,
                 band_ref, removed_out, keep_out, base_out, state_out, *,
                 chunk, num_words, max_output_size, interpret):
  """Greedy scan of one chunk's words, 32 boxes per step, one program/image:
  step w resolves word w's chain and ORs the kept boxes' mask rows into
  "removed"; base[w] is the kept count before word w. With ``band_ref`` the
  chain is a fixed point over lane ballots, else 32 scalar bit steps.
  """
  padded_words = removed_ref.shape[0]
  lanes = jnp.arange(padded_words, dtype=jnp.int32)
  # keep/base/state refs are None for a single chunk (nothing before it).
  chunk_start = 0 if state_ref is None else state_ref[1]
  first_word = chunk_start // WORD
  end_word = jnp.minimum(first_word + chunk // WORD, num_words)

  def word_of(vector, w):
    return jnp.sum(jnp.where(lanes == w, vector, 0))

  def bit_set(x, r):
    return jnp.bitwise_and(jnp.right_shift(x, r), 1) != 0

  def clamp(w):  # loads past the chunk stay inside it (values unused)
    return jnp.maximum(jnp.minimum(w, end_word - 1), first_word)

  def ahead(w):
    # Words w and w + 1 of word w's 32 rows.
    w = clamp(w)
    row0 = (w - first_word) * WORD
    nxt = jnp.minimum(w + 1, padded_words - 1)
    return (tuple(mask_ref[row0 + r, w] for r in range(WORD))
            + tuple(mask_ref[row0 + r, nxt] for r in range(WORD)))

  def load_row(row, pred):  # mask row `row`, or zeros where not pred
    if interpret:
      return jnp.where(pred, mask_ref[row, :], 0)
    return pltriton.load(mask_ref.at[row],
                         mask=jnp.broadcast_to(pred, (padded_words,)),
                         other=0)

  def or_kept_rows(alive, row0, acc):
    def rows(acc):  # predicated loads: all in flight at once
      for r in range(WORD):
        acc = acc | load_row(row0 + r, bit_set(alive, r))
      return acc

    def few(acc):  # the lowest FEW_ROWS kept boxes' rows: fewer loads
      bits = alive
      for _ in range(FEW_ROWS):
        low = bits & -bits
        r = (WORD - 1 - jax.lax.clz(low)) & (WORD - 1)  # 31 if none left
        acc = acc | load_row(row0 + r, low != 0)
        bits = bits ^ low
      return acc

    def some(acc):  # nested conds: lax.switch's clamp fails Triton's verifier
      return jax.lax.cond(jax.lax.population_count(alive) <= FEW_ROWS,
                          few, rows, acc)

    return jax.lax.cond(alive != 0, some, lambda a: a, acc)

  def record(w, alive, keep, base, count):
    """Word w's kept bits: (OR of the kept rows' masks, keep, base, count)."""
    rows = or_kept_rows(alive, (w - first_word) * WORD,
                        jnp.zeros((padded_words,), jnp.int32))
    return (rows, jnp.where(lanes == w, alive, keep),
            jnp.where(lanes == w, count, base),
            count + jax.lax.population_count(alive))

  def step_scalar(state):
    w, count, removed, keep, base, pending, removed_w = state[:7]
    loaded = state[7:]
    diag, next_col = loaded[:WORD], loaded[WORD:]
    upcoming = ahead(w + 1)  # independent of this step: overlaps it
    alive = ~removed_w
    for r in range(WORD):  # the word's own greedy chain
      alive = jnp.where(bit_set(alive, r), alive & ~diag[r], alive)
    removed = removed | pending  # rows kept one step ago have landed
    removed_next = word_of(removed, w + 1)
    for r in range(WORD):
      removed_next = removed_next | jnp.where(bit_set(alive, r),
                                              next_col[r], 0)
    pending, keep, base, count = record(w, alive, keep, base, count)
    return (w + 1, count, removed, keep, base, pending,
            removed_next) + tuple(upcoming)

  lanes32 = jnp.arange(WORD, dtype=jnp.int32)
  lane_bits = jnp.left_shift(jnp.int32(1), lanes32)

  def ballot(pred):  # the word whose bit c is pred at lane c
    return jnp.sum(jnp.where(pred, lane_bits, 0))

  def band_of(w):
    local = clamp(w) - first_word
    return (band_ref[local, pl.ds(0, WORD)],
            band_ref[local, pl.ds(WORD, WORD)])

  def band_resolve(alive0, diag_t):
    candidate = bit_set(alive0, lanes32)

    def settle(k):
      return ballot(candidate & ((diag_t & k) == 0))

    first = settle(alive0)
    k, _ = jax.lax.while_loop(lambda c: c[0] != c[1],
                              lambda c: (settle(c[0]), c[0]),
                              (settle(first), first))
    return k

  def step_band(state):
    w, count, removed, keep, base, pending, removed_w, diag_t, next_t = state
    upcoming = band_of(w + 1)  # independent of this step: overlaps it
    alive = jax.lax.cond(removed_w != -1,
                         lambda a: band_resolve(a, diag_t), lambda a: 0 * a,
                         ~removed_w)
    removed = removed | pending  # rows kept one step ago have landed
    removed_next = word_of(removed, w + 1) | ballot((next_t & alive) != 0)
    pending, keep, base, count = record(w, alive, keep, base, count)
    return (w + 1, count, removed, keep, base, pending,
            removed_next) + tuple(upcoming)

  def more(state):
    w, count = state[:2]
    return (w < end_word) & (count < max_output_size)

  removed = removed_ref[...]
  zeros = jnp.zeros((padded_words,), jnp.int32)
  if state_ref is None:
    init = (jnp.int32(0), jnp.int32(0), removed, zeros, zeros)
  else:
    init = (first_word, state_ref[0], removed, keep_ref[...], base_ref[...])
  init = init + (zeros, word_of(removed, first_word))
  if band_ref is not None:
    final = jax.lax.while_loop(more, step_band, init + band_of(first_word))
  else:
    final = jax.lax.while_loop(more, step_scalar, init + ahead(first_word))
  count, keep, base = final[1], final[3], final[4]
  if removed_out is not None:
    removed_out[...] = final[2] | final[5]
  keep_out[...] = keep
  base_out[...] = base
  slots = jnp.arange(state_out.shape[0], dtype=jnp.int32)
  state_out[...] = jnp.where(slots == 0, count,
                             jnp.where(slots == 1, chunk_start + chunk, 0))


def _overlap_kernel(state_ref, removed_ref, keep_ref, base_ref, mask_ref,
                    x1, y1, x2, y2, area, cls, next_mask_ref, removed_out,
                    keep_out, base_out, state_out, *, scan_kernel,
                    mask_kernel, chunk, tiles_j):
  """Program 0: scan this chunk; program 1 + t: tile t of the next chunk's
  mask (from the removed words before this scan: it skips less, never
  wrongly, so any schedule is correct)."""
  p = pl.program_id(1)
  next_start = state_ref[1] + chunk  # dynamic: one kernel for every chunk

  @pl.when(p == 0)
  def _():
    scan_kernel(removed_ref, keep_ref, base_ref, state_ref, mask_ref, None,
                removed_out, keep_out, base_out, state_out)

  @pl.when(p > 0)
  def _():
    t = p - 1
    mask_kernel(state_ref, removed_ref, x1, y1, x2, y2, area, cls,
                next_mask_ref, tile=(t // tiles_j, t % tiles_j),
                chunk_start=next_start)


def _next_pow2(x):
  return 1 << max(0, (int(x) - 1).bit_length())


def bitmask_layout(batch, num_boxes, *, rows=64, words=4, chunk_rows=4096,
                   max_bytes=256 << 20):
  """(padded words, rows per chunk, chunks, mask bytes) of the bitmask design.
  The mask of one chunk of rows is [B, chunk, padded_words] int32; the chunk
  shrinks so that it stays within ``max_bytes``; None when even ``rows`` rows do
  not fit."""
  num_words = -(-num_boxes // WORD)
  padded_words = max(_next_pow2(num_words), words)
  padded_rows = -(-num_boxes // rows) * rows
  by_budget = max_bytes // (batch * padded_words * 4) // rows * rows
  chunk = min(-(-chunk_rows // rows) * rows, padded_rows, by_budget)
  if chunk < rows:
    return None
  chunks = -(-padded_rows // chunk)
  return padded_words, chunk, chunks, batch * chunk * padded_words * 4


def chunk_rows_for(max_output_size, chunk_rows):
  """Rows per chunk: smaller when few boxes are wanted (earlier exit)."""
  return min(chunk_rows, max(2048, _next_pow2(16 * max(max_output_size, 1))))


def keep_words_bitmask(planes, cls, flags, *, iou_threshold, max_output_size,
                       rows=64, words=4, mask_warps=4, scan_warps=None,
                       chunk_rows=4096, max_bytes=256 << 20, use_classes=True,
                       band=None, interpret=None):
  """Kept boxes over sorted positions via the chunked bitmask design. ``planes``
  [B, 5, N] (x1, y1, x2, y2, area), ``cls``/``flags`` [B, N]. Returns (keep
  words [B, W] int32: bit c of word w = position 32 w + c is kept; base [B, W]:
  kept count before word w; count [B], which may pass max_output_size within the
  last word). ``band``: the scan's form (None: the band form below
  ``block_sizes.SMALL_BOXES`` boxes)."""
  batch, _, n = planes.shape
  layout = bitmask_layout(batch, n, rows=rows, words=words,
                          chunk_rows=chunk_rows, max_bytes=max_bytes)
  assert layout is not None, (batch, n, max_bytes)
  padded_words, chunk, num_chunks, _ = layout
  num_words = -(-n // WORD)
  cols = padded_words * WORD
  padded = max(chunk * num_chunks, cols)
  if scan_warps is None:  # H100: one warp is fastest until rows get long
    scan_warps = 1 if padded_words < 512 else 4

  def pad(x, size):
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - n)])

  box_planes = [pad(planes[:, r], padded) for r in range(5)]
  box_cls = pad(cls, padded)
  flags = pad(flags, cols)

  shifts = jnp.arange(WORD, dtype=jnp.uint32)
  flag_bits = (flags.reshape(batch, padded_words, WORD).astype(jnp.uint32)
               << shifts)
  valid_words = jax.lax.bitcast_convert_type(
      jnp.sum(flag_bits, axis=-1, dtype=jnp.uint32), jnp.int32)
  words_spec = pl.BlockSpec((None, padded_words), lambda b: (b, 0))
  state_spec = pl.BlockSpec((None, 16), lambda b: (b, 0))
  plane_spec = pl.BlockSpec((None, padded), lambda b, i, j: (b, 0))
  mask_kernel = functools.partial(
      _mask_kernel, iou_threshold=float(iou_threshold), rows=rows,
      words=words, num_boxes=n, max_output_size=int(max_output_size),
      exact_ptx=not interpret, use_classes=use_classes)
  use_band = n < block_sizes.SMALL_BOXES if band is None else band
  scan_kernel = functools.partial(
      _scan_kernel, chunk=chunk, num_words=num_words,
      max_output_size=int(max_output_size), interpret=interpret)
  words_shape = jax.ShapeDtypeStruct((batch, padded_words), jnp.int32)

  mask_grid = (batch, chunk // rows, padded_words // words)
  mask_out_spec = pl.BlockSpec((None, rows, words), lambda b, i, j: (b, i, j))
  mask_out_shape = jax.ShapeDtypeStruct((batch, chunk, padded_words),
                                        jnp.int32)
  band_shape = jax.ShapeDtypeStruct((batch, chunk // WORD, 2 * WORD),
                                    jnp.int32)
  if use_band:  # the whole band block per image: programs write their parts
    mask_out_spec = [mask_out_spec, pl.BlockSpec(
        (None, chunk // WORD, 2 * WORD), lambda b, i, j: (b, 0, 0))]
    mask_out_shape = [mask_out_shape, band_shape]
  mask_params = dict(
      grid=mask_grid, out_specs=mask_out_spec, out_shape=mask_out_shape,
      compiler_params=_compat.gpu_compiler_params(num_warps=mask_warps,
                                                  num_stages=1),
      interpret=interpret, name="nms_iou_mask_gpu")
  scan_params = dict(
      grid=(batch,),
      compiler_params=_compat.gpu_compiler_params(num_warps=scan_warps,
                                                  num_stages=1),
      interpret=interpret, name="nms_keep_scan_gpu")
  mask_spec = pl.BlockSpec((None, chunk, padded_words), lambda b: (b, 0, 0))
  band_spec = pl.BlockSpec((None, chunk // WORD, 2 * WORD),
                           lambda b: (b, 0, 0))

  def split(mask_out):  # (mask, band or None) and the scan's input specs
    if use_band:
      return tuple(mask_out), [mask_spec, band_spec]
    return (mask_out, None), [mask_spec]
  removed_spec = pl.BlockSpec((None, padded_words), lambda b, i, j: (b, 0))
  state_shape = jax.ShapeDtypeStruct((batch, 16), jnp.int32)
  removed = ~valid_words

  if num_chunks == 1:  # no chunk state: fewer launches for small N
    def mask_first(removed_ref, *refs):
      mask_kernel(None, removed_ref, *refs)

    def scan_first(removed_ref, mask_ref, *refs):
      band_ref = refs[0] if use_band else None
      keep_out, base_out, state_out = refs[-3:]
      scan_kernel(removed_ref, None, None, None, mask_ref, band_ref, None,
                  keep_out, base_out, state_out)

    (mask, band), specs = split(_compat.pallas_call(
        mask_first, in_specs=[removed_spec] + [plane_spec] * 6,
        **mask_params)(removed, *box_planes, box_cls))
    keep, base, state = _compat.pallas_call(
        scan_first, in_specs=[words_spec] + specs,
        out_specs=[words_spec, words_spec, state_spec],
        out_shape=[words_shape] * 2 + [state_shape], **scan_params)(
            removed, mask, *([band] if use_band else []))
    return keep, base, state[:, 0]

  def scan_chunk(removed_ref, keep_ref, base_ref, state_ref, mask_ref,
                 *refs):
    band_ref = refs[0] if use_band else None
    scan_kernel(removed_ref, keep_ref, base_ref, state_ref, mask_ref,
                band_ref, *refs[-4:])

  def one_chunk(carry):
    removed, keep, base, state = carry
    (mask, band), specs = split(_compat.pallas_call(
        mask_kernel,
        in_specs=([pl.BlockSpec((None, 16), lambda b, i, j: (b, 0)),
                   removed_spec] + [plane_spec] * 6),
        **mask_params)(state, removed, *box_planes, box_cls))
    return tuple(_compat.pallas_call(
        scan_chunk,
        in_specs=[words_spec] * 3 + [state_spec] + specs,
        out_specs=[words_spec] * 3 + [state_spec],
        out_shape=[words_shape] * 3 + [state_shape], **scan_params)(
            removed, keep, base, state, mask, *([band] if use_band else [])))

  zeros = jnp.zeros((batch, padded_words), jnp.int32)
  carry = (removed, zeros, zeros, jnp.zeros((batch, 16), jnp.int32))
  static = static_chunks(num_chunks, n, max_output_size)
  if static and not use_band:
    return _overlapped_chunks(
        carry, mask_kernel, scan_chunk, mask_params, scan_params, box_planes,
        box_cls, chunk=chunk, num_chunks=num_chunks, words=words,
        num_words=num_words, padded_words=padded_words, padded=padded,
        scan_kernel=scan_kernel)
  if static:
    # No loop: an XLA while loop copies its predicate to the host every
    # iteration (a sync); chunks past max_output_size exit at once instead.
    for _ in range(num_chunks):
      carry = one_chunk(carry)
  else:
    def more(carry):
      state = carry[3]
      return (state[0, 1] < n) & jnp.any(state[:, 0] < max_output_size)

    carry = jax.lax.while_loop(more, one_chunk, carry)
  _, keep, base, state = carry
  return keep, base, state[:, 0]


def _overlapped_chunks(carry, mask_kernel, scan_chunk, mask_params,
                       scan_params, box_planes, box_cls, *, chunk, num_chunks,
                       words, num_words, padded_words, padded, scan_kernel):
  """Unrolled chunks; from chunk 1 on, chunk c's scan and chunk c + 1's mask
  in one launch (chunk 0: mask and scan launches in turn)."""
  removed, keep, base, state = carry
  batch = removed.shape[0]
  words_spec = pl.BlockSpec((None, padded_words), lambda b, p: (b, 0))
  state_spec = pl.BlockSpec((None, 16), lambda b, p: (b, 0))
  plane_spec = pl.BlockSpec((None, padded), lambda b, p: (b, 0))
  mask_spec = pl.BlockSpec((None, chunk, padded_words), lambda b, p: (b, 0, 0))
  words_shape = jax.ShapeDtypeStruct((batch, padded_words), jnp.int32)
  state_shape = jax.ShapeDtypeStruct((batch, 16), jnp.int32)
  mask_shape = jax.ShapeDtypeStruct((batch, chunk, padded_words), jnp.int32)

  def mask_call(state, removed):
    return _compat.pallas_call(
        mask_kernel,
        in_specs=([pl.BlockSpec((None, 16), lambda b, i, j: (b, 0)),
                   pl.BlockSpec((None, padded_words), lambda b, i, j: (b, 0))]
                  + [pl.BlockSpec((None, padded), lambda b, i, j: (b, 0))]
                  * 6),
        **mask_params)(state, removed, *box_planes, box_cls)

  mask = mask_call(state, removed)
  tiles_j = -(-num_words // words)
  num_tiles = mask_params["grid"][1] * tiles_j
  for c in range(num_chunks):
    if c == 0 or c + 1 == num_chunks:
      removed, keep, base, state = _compat.pallas_call(
          scan_chunk,
          in_specs=[pl.BlockSpec((None, padded_words), lambda b: (b, 0))] * 3
          + [pl.BlockSpec((None, 16), lambda b: (b, 0)),
             pl.BlockSpec((None, chunk, padded_words), lambda b: (b, 0, 0))],
          out_specs=[pl.BlockSpec((None, padded_words), lambda b: (b, 0))] * 3
          + [pl.BlockSpec((None, 16), lambda b: (b, 0))],
          out_shape=[words_shape] * 3 + [state_shape], **scan_params)(
              removed, keep, base, state, mask)
      if c + 1 < num_chunks:  # state[1] is now chunk c + 1's first row
        mask = mask_call(state, removed)
      continue
    kernel = functools.partial(
        _overlap_kernel, scan_kernel=scan_kernel, mask_kernel=mask_kernel,
        chunk=chunk, tiles_j=tiles_j)
    mask, removed, keep, base, state = _compat.pallas_call(
        kernel, grid=(batch, 1 + num_tiles),
        in_specs=[state_spec] + [words_spec] * 3 + [mask_spec]
        + [plane_spec] * 6,
        out_specs=[mask_spec] + [words_spec] * 3 + [state_spec],
        out_shape=[mask_shape] + [words_shape] * 3 + [state_shape],
        compiler_params=scan_params["compiler_params"],
        interpret=scan_params["interpret"], name="nms_keep_scan_and_mask_gpu")(
            state, removed, keep, base, mask, *box_planes, box_cls)
  return keep, base, state[:, 0]


# Chunks unrolled in the graph (no device->host sync per chunk) when every
# chunk must run anyway (max_output_size >= N) or there are few of them.
STATIC_CHUNKS_FEW = 3
STATIC_CHUNKS_MAX = 10  # 20k boxes in 2048-row chunks (overlapped)


def static_chunks(num_chunks, num_boxes, max_output_size):
  """Whether the chunk loop is unrolled (else a while loop that exits early)."""
  if num_chunks > STATIC_CHUNKS_MAX:
    return False
  return max_output_size >= num_boxes or num_chunks <= STATIC_CHUNKS_FEW


def words_to_indices(keep, base, count, order, max_output_size):
  """Keep words -> (original indices [B, M] padded with -1, count [B]). Slot of
  kept position 32 w + c = base[w] + kept bits of word w below c: elementwise,
  then one scatter."""
  batch, n = order.shape
  shifts = jnp.arange(WORD, dtype=jnp.int32)
  word = keep[..., None]
  kept = jnp.bitwise_and(jnp.right_shift(word, shifts), 1) != 0
  below = jax.lax.population_count(
      jnp.bitwise_and(word, jnp.left_shift(1, shifts) - 1))
  slot = (base[..., None] + below).reshape(batch, -1)[:, :n]
  kept = kept.reshape(batch, -1)[:, :n]
  target = jnp.where(kept & (slot < max_output_size), slot, max_output_size)

  def place(target, order):
    out = jnp.full((max_output_size,), -1, jnp.int32)
    return out.at[target].set(order, mode="drop")

  indices = jax.vmap(place)(target, order)
  return indices, jnp.minimum(count, max_output_size).astype(jnp.int32)


# --------------------------------------------------------------------------
# Score order by ranks: below RANK_SORT_MAX boxes one parallel kernel counts,
# for every box, the boxes that precede it (higher score, or equal score and
# lower index); order[rank] = box is then one scatter. N^2 comparisons, but
# spread over the whole chip faster than XLA's multi-pass sort at small N.

RANK_SORT_MAX = 8192
RANK_ROWS = 8      # boxes ranked per program (small: more programs)
RANK_COLS = 1024   # boxes compared per loop step (few steps: each waits
                   # for its load)


def _rank_kernel(key_ref, rank_ref, *, cols, padded):
  i = pl.program_id(1)
  rows = rank_ref.shape[0]
  mine = key_ref[pl.ds(i * rows, rows)]
  my_ids = i * rows + jnp.arange(rows, dtype=jnp.int32)

  def body(j, count):
    start = pl.multiple_of(j * cols, cols)
    theirs = key_ref[pl.ds(start, cols)]
    their_ids = start + jnp.arange(cols, dtype=jnp.int32)
    first = ((theirs[None, :] < mine[:, None])
             | ((theirs[None, :] == mine[:, None])
                & (their_ids[None, :] < my_ids[:, None])))
    return count + jnp.sum(first.astype(jnp.int32), axis=1)

  rank_ref[...] = jax.lax.fori_loop(0, padded // cols, body,
                                    jnp.zeros((rows,), jnp.int32))


# From RANK_SORT_MAX to RADIX_SORT_MAX boxes: uint32 keys, which XLA hands to
# CUB's radix sort (it does so only for integer keys with a plain comparator
# and, for one row, from ~22000 elements: xla/service/gpu/transforms/
# sort_rewriter.cc; hence the padding to RADIX_SORT_MIN). Above: XLA's sort.
RADIX_SORT_MIN = 22528
RADIX_SORT_MAX = 32768


def _sort_keys(scores, score_threshold):
  """(keepable [B, N], ascending sort key): -score (+0.0 for -0.0), +inf
  for boxes that can never be kept (NaN, or score <= score_threshold)."""
  scores = scores.astype(jnp.float32)
  valid = ~jnp.isnan(scores)
  if score_threshold is not None:
    valid = valid & (scores > score_threshold)
  return valid, jnp.where(valid, -scores + 0.0, jnp.inf)


def radix_order(scores, score_threshold=None):
  """(order, valid) as ``reference.sort_by_score``, by a uint32-key sort. The
  key maps -score (+0.0 for -0.0; +inf for unkeepable boxes) to uint32
  monotonically; the radix sort is stable, so ties go by index."""
  batch, n = scores.shape
  valid, key = _sort_keys(scores, score_threshold)
  bits = jax.lax.bitcast_convert_type(key, jnp.uint32)
  negative = jnp.right_shift(bits, jnp.uint32(31)) != 0
  key = jnp.where(negative, ~bits, bits | jnp.uint32(1 << 31))
  size = max(n, RADIX_SORT_MIN) if batch == 1 else n  # see RADIX_SORT_MIN
  # Padding keys (all ones) sort after every real key (+inf: 0xFF800000).
  key = jnp.pad(key, ((0, 0), (0, size - n)),
                constant_values=np.uint32(0xFFFFFFFF))
  ids = jnp.broadcast_to(jnp.arange(size, dtype=jnp.uint32), (batch, size))
  _, order = jax.lax.sort((key, ids), dimension=1, is_stable=True, num_keys=1)
  order = order[:, :n].astype(jnp.int32)
  return order, jnp.take_along_axis(valid, order, axis=1)


def rank_order(scores, score_threshold=None, *, interpret=None):
  """(order [B, N], valid in that order [B, N]) as ``reference.sort_by_score``.
  Keys: -score (+0.0 for -0.0), +inf for unkeepable boxes; ties and the
  infinities go by index, which is the stable sort's order."""
  batch, n = scores.shape
  valid, key = _sort_keys(scores, score_threshold)
  padded = -(-n // RANK_COLS) * RANK_COLS
  key = jnp.pad(key, ((0, 0), (0, padded - n)), constant_values=jnp.inf)
  kernel = functools.partial(_rank_kernel, cols=RANK_COLS, padded=padded)
  rank = _compat.pallas_call(
      kernel, grid=(batch, padded // RANK_ROWS),
      in_specs=[pl.BlockSpec((None, padded), lambda b, i: (b, 0))],
      out_specs=pl.BlockSpec((None, RANK_ROWS), lambda b, i: (b, i)),
      out_shape=jax.ShapeDtypeStruct((batch, padded), jnp.int32),
      compiler_params=_compat.gpu_compiler_params(num_warps=4, num_stages=1),
      interpret=interpret, name="nms_rank_gpu")(key)[:, :n]
  # Padding ranks last (inf keys, higher ids): real boxes hold ranks 0..n-1.
  ids = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (batch, n))
  order = jax.vmap(lambda r, i: jnp.zeros((n,), jnp.int32).at[r].set(
      i, unique_indices=True))(rank, ids)
  return order, jnp.take_along_axis(valid, order, axis=1)
