"""GPU (Triton-lowered Pallas) kernels for the IoU family.

On GPUs ``[P, 4]`` boxes are plain row-major, so each program loads a
contiguous ``[BLOCK, 4]`` tile (fully coalesced, vectorised 16-byte loads),
splits it into the four coordinate vectors with a select-and-sum over the
4-wide axis (register shuffles, no extra memory traffic), evaluates the
shared formula (``_math``) in float32 and writes ``[BLOCK]`` results. The
backward kernel rebuilds ``[BLOCK, 4]`` gradient tiles the same way and
stores them contiguously. Reduced losses write one partial sum per program
(no per-box output), and their backward reads one shared cotangent value.
Ragged ends are masked explicitly: Pallas' Triton lowering adds no bounds
check, so a plain ``ref[...] = x`` in the last, partial block writes past the
end of the array into whatever XLA placed next (this is what made a direct
``elementwise_vjp`` call at 3000 boxes disagree with the reference on the
H100 while other calls agreed: the forward kernel's unmasked 1-D store
corrupted a neighbouring buffer; which buffer depends on allocation order).
Every load and store of a partial block therefore carries a row mask. When
the boxes fill whole blocks the kernels use plain loads and stores: masked
loads everywhere cost 3-14% at 16M pairs on the H100 (0.340-0.357 / 0.80
ms forward / forward+backward against 0.329 / 0.703 ms unmasked).

Small reduced losses (``reduction="mean"/"sum"``, at most
``FUSED_MAX_BOXES`` boxes) use ``elementwise_value_and_grad``: one kernel
writes the per-program loss sums and both gradients for a unit cotangent,
so forward + backward is one kernel and one reduction (at these sizes the
launches, not the bytes, set the time).

With plain loads (whole blocks) the H100 runs 16M pairs at 81% of its
measured copy bandwidth, forward and forward+backward alike (0.25 / 0.66 ms).

Pairwise: each program computes a ``[tile_n, tile_m]`` output tile from a
``[tile_n, 4]`` and a ``[tile_m, 4]`` box tile and writes it once; whole
tiles are stored unmasked, ragged ones mask only the ragged dimension. The
4096 x 4096 matrix is 67 MB of float32 writes (~23 us at copy bandwidth)
but about 30 float32 operations per pair, and on the H100 the kernel time
is set by instructions per pair, not by bytes (below). The optimised HLO
is the one Triton call (no copies).
What matters is the tile's row count: each program unpacks its ``tile_m``
column boxes once, and with few rows that cost is spread over few pairs (a
2 x 512 tile takes 0.41 ms, 8 x 128 0.13 ms, 16 x 64 0.051 ms at the same
16 values per thread), while more than 32 values per thread are slow (128
x 128 / 4 warps: 1.1 ms; register spills, presumably). ``PAIRWISE_SUB_ROWS``
computes a tall tile in a loop of row groups (column boxes unpacked once
per program, few values live) and ``PAIRWISE_COLUMN_ACCESS="strided"``
reads coordinates straight into the broadcast layout (the default: 10%
faster than splitting a loaded [rows, 4] tile).

Sizes (H100, jax 0.11.2, device time from the profiler; ``bench_giou.py
--choose`` and the probes in ``giou-pairwise-probe-h100-*`` and
``giou-lean-probe-h100-*``): with the shared formula, 8 x 128 tiles / 4
warps / strided column reads took 40.9-41.0 us against 47.4 us for the jitted
XLA reference. Where that time went: only writing the matrix takes 22 us
(3.1 TB/s), the intersection areas 25, IoU without its division 25, IoU 32,
GIoU 41. The kernel is bound by instructions per pair (min/max/select run
at half rate), not bytes, so ``PAIRWISE_FORMULA="lean"`` evaluates IoU and
GIoU with one select per quotient instead of two
(``_math.pairwise_score_lean``): 35.3 us with 8 x 128 tiles / 2 warps,
bit-identical to the shared formula (1.36x the reference). Taking the hull
width from the box widths as well (``PAIRWISE_HULL_FROM_WIDTHS``) gives 32.5
us but can lose digits for inverted boxes, so it is off; a reciprocal
instead of the division (``PAIRWISE_DIVISION="rcp"``; measured with the
hull trick) 26.3-30.6 us, not full range (denominators above 2^126 give 0): opt-in.
Neither one division per pair nor ``div.full.f32`` spelled out helped
(Triton already divides that way). Elementwise: 1024 boxes per program, 256
below SMALL_BOXES.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _compat
from pallas_kernels._compat import pl
from . import _math

COORDS = 4
ELEMENTWISE_BLOCK = 1024
# Below SMALL_BOXES boxes the elementwise kernels use SMALL_BLOCK (smaller
# blocks: more programs for the SMs when there are few boxes): 256 was the
# fastest of 256/512/1024 at 1024 x 256 boxes on the H100 (bench_giou.py
# --choose: 2.64 / 5.49 us forward / value-and-grad against 2.98 / 6.26).
SMALL_BOXES = 1 << 20
SMALL_BLOCK = 256
FUSED_MAX_BOXES = 1 << 20
NUM_WARPS = 4


# How a [B, 4] box tile is split into coordinate vectors: "select" loads the
# tile and separates it in registers; "strided" loads each coordinate with a
# stride-4 access (same cache lines).
COLUMN_ACCESS = "select"


def _columns(ref, rows_left=None):
  """[B, 4] box block -> four [B] float32 coordinate vectors.

  With ``rows_left`` only the first rows_left rows are read (the others are
  zero boxes).
  """
  if COLUMN_ACCESS == "strided":
    return tuple(ref[:, c].astype(jnp.float32) for c in range(COORDS))
  if rows_left is None:
    tile = ref[...]
  else:
    from jax.experimental.pallas import triton as pltriton
    rows = jnp.arange(ref.shape[0])[:, None] < rows_left
    tile = pltriton.load(ref, mask=jnp.broadcast_to(rows, ref.shape), other=0)
  tile = tile.astype(jnp.float32)
  col = jnp.arange(COORDS)[None, :]
  return tuple(jnp.sum(jnp.where(col == c, tile, 0.0), axis=1)
               for c in range(COORDS))


# Ragged edges: on an H100 (jax 0.11.2) stores of a 2-D block that sticks
# out of the array were not masked (rows/columns past the end landed in
# neighbouring memory), while 1-D blocks and loads were fine. "mask" stores
# 2-D blocks with an explicit bounds mask; "pad" pads the inputs (and the
# pairwise output) to whole blocks instead, at the cost of copies.
RAGGED = "mask"


def _store_2d(ref, value, rows_left, cols_left=None):
  """ref[...] = value, masked to the first rows_left rows (and cols_left)."""
  value = value.astype(ref.dtype)
  if RAGGED != "mask":
    ref[...] = value
    return
  from jax.experimental.pallas import triton as pltriton
  rows = jnp.arange(value.shape[0])[:, None]
  cols = jnp.arange(value.shape[1])[None, :]
  mask = rows < rows_left
  if cols_left is not None:
    mask = jnp.logical_and(mask, cols < cols_left)
  pltriton.store(ref, value, mask=jnp.broadcast_to(mask, value.shape))


def _store_columns(ref, columns, rows_left):
  """Four [B] vectors -> the [B, 4] block ``ref`` (first rows_left rows)."""
  col = jnp.arange(COORDS)[None, :]
  out = jnp.zeros((columns[0].shape[0], COORDS), jnp.float32)
  for c, values in enumerate(columns):
    out = jnp.where(col == c, values[:, None], out)
  _store_2d(ref, out, rows_left)


def _block_for(num_boxes, block):
  if block:
    return block
  return SMALL_BLOCK if num_boxes < SMALL_BOXES else ELEMENTWISE_BLOCK


def _round_up(x, m):
  return -(-x // m) * m


def _params():
  return _compat.gpu_compiler_params(num_warps=NUM_WARPS, num_stages=1)


def _store_1d(ref, value, rows_left):
  """ref[...] = value for the first rows_left entries only."""
  from jax.experimental.pallas import triton as pltriton
  pltriton.store(ref, value.astype(ref.dtype),
                 mask=jnp.arange(value.shape[0]) < rows_left)


def _forward_kernel(b1_ref, b2_ref, out_ref, *, kind, formula, eps,
                    box_format, as_loss, num_boxes, block, reduce):
  rows_left = num_boxes - pl.program_id(0) * block
  # Whole blocks only (num_boxes % block == 0): plain loads and stores.
  ragged = num_boxes % block != 0
  load_rows = rows_left if ragged else None
  value = _math.score_from_planes(kind, formula, eps, box_format,
                                  _columns(b1_ref, load_rows),
                                  _columns(b2_ref, load_rows))
  if as_loss:
    value = 1.0 - value
  if reduce:
    out_ref[...] = jnp.sum(jnp.where(jnp.arange(block) < rows_left, value,
                                     0.0), keepdims=True)
  elif ragged:
    _store_1d(out_ref, value, rows_left)
  else:
    out_ref[...] = value.astype(out_ref.dtype)


def elementwise(boxes1, boxes2, *, kind, formula, eps, box_format,
                as_loss=False, reduce=False, out_dtype=jnp.float32,
                interpret=False, block=None):
  """Score (or 1 - score) of matching boxes: [P, 4] x [P, 4] -> [P].

  With ``reduce`` the result is the float32 sum over the P boxes instead.
  """
  num_boxes = boxes1.shape[0]
  block = _block_for(num_boxes, block)
  if num_boxes == 0:
    return (jnp.zeros((), jnp.float32) if reduce
            else jnp.zeros((0,), out_dtype))
  steps = pl.cdiv(num_boxes, block)
  box_spec = pl.BlockSpec((block, COORDS), lambda i: (i, 0))
  if reduce:
    out_shape = jax.ShapeDtypeStruct((steps,), jnp.float32)
    out_spec = pl.BlockSpec((1,), lambda i: (i,))
  else:
    out_shape = jax.ShapeDtypeStruct((num_boxes,), out_dtype)
    out_spec = pl.BlockSpec((block,), lambda i: (i,))
  kernel = functools.partial(
      _forward_kernel, kind=kind, formula=formula, eps=eps,
      box_format=box_format, as_loss=as_loss, num_boxes=num_boxes,
      block=block, reduce=reduce)
  out = pl.pallas_call(
      kernel, grid=(steps,), in_specs=[box_spec, box_spec],
      out_specs=out_spec, out_shape=out_shape,
      compiler_params=_params(), interpret=interpret,
  )(boxes1, boxes2)
  return jnp.sum(out) if reduce else out


def _backward_kernel(b1_ref, b2_ref, g_ref, d1_ref, d2_ref, *, kind, formula,
                     eps, box_format, block, shared_cotangent, num_boxes):
  rows_left = num_boxes - pl.program_id(0) * block
  ragged = num_boxes % block != 0  # else plain loads (whole blocks)
  planes1 = _columns(b1_ref, rows_left if ragged else None)
  planes2 = _columns(b2_ref, rows_left if ragged else None)
  if shared_cotangent:
    cot = jnp.broadcast_to(g_ref[...].astype(jnp.float32), (block,))
  elif not ragged:
    cot = g_ref[...].astype(jnp.float32)
  else:
    from jax.experimental.pallas import triton as pltriton
    cot = pltriton.load(g_ref, mask=jnp.arange(block) < rows_left,
                        other=0).astype(jnp.float32)
  grads1, grads2 = _math.score_vjp(kind, formula, eps, box_format,
                                   planes1, planes2, cot)
  _store_columns(d1_ref, grads1, rows_left)
  _store_columns(d2_ref, grads2, rows_left)


def elementwise_vjp(boxes1, boxes2, cotangent, *, kind, formula, eps,
                    box_format, shared_cotangent=False, interpret=False,
                    block=None):
  """Gradients of sum(cotangent * score) w.r.t. boxes1 and boxes2 ([P, 4])."""
  num_boxes = boxes1.shape[0]
  block = _block_for(num_boxes, block)
  if num_boxes == 0:
    return jnp.zeros_like(boxes1), jnp.zeros_like(boxes2)
  g = cotangent.astype(jnp.float32).reshape(-1)
  padded = _round_up(num_boxes, block) if RAGGED == "pad" else num_boxes
  if padded != num_boxes:
    pad = ((0, padded - num_boxes), (0, 0))
    boxes1, boxes2 = jnp.pad(boxes1, pad), jnp.pad(boxes2, pad)
    if not shared_cotangent:
      g = jnp.pad(g, (0, padded - num_boxes))
  steps = pl.cdiv(padded, block)
  box_spec = pl.BlockSpec((block, COORDS), lambda i: (i, 0))
  if shared_cotangent:
    g_spec = pl.BlockSpec((1,), lambda i: (0,))
  else:
    g_spec = pl.BlockSpec((block,), lambda i: (i,))
  kernel = functools.partial(
      _backward_kernel, kind=kind, formula=formula, eps=eps,
      box_format=box_format, block=block, shared_cotangent=shared_cotangent,
      num_boxes=num_boxes)
  d1, d2 = pl.pallas_call(
      kernel, grid=(steps,), in_specs=[box_spec, box_spec, g_spec],
      out_specs=[box_spec, box_spec],
      out_shape=[jax.ShapeDtypeStruct(boxes1.shape, boxes1.dtype),
                 jax.ShapeDtypeStruct(boxes2.shape, boxes2.dtype)],
      compiler_params=_params(), interpret=interpret,
  )(boxes1, boxes2, g)
  if padded != num_boxes:
    d1, d2 = d1[:num_boxes], d2[:num_boxes]
  return d1, d2


def _value_and_grad_kernel(b1_ref, b2_ref, sum_ref, d1_ref, d2_ref, *, kind,
                           formula, eps, box_format, as_loss, num_boxes,
                           block, grad_scale, value_scale):
  rows_left = num_boxes - pl.program_id(0) * block
  planes1 = _columns(b1_ref, rows_left)
  planes2 = _columns(b2_ref, rows_left)
  value = _math.score_from_planes(kind, formula, eps, box_format, planes1,
                                  planes2)
  if as_loss:
    value = 1.0 - value
  live = jnp.arange(block) < rows_left
  sum_ref[...] = value_scale * jnp.sum(jnp.where(live, value, 0.0),
                                      keepdims=True)
  cot = jnp.where(live, grad_scale, 0.0).astype(jnp.float32)
  grads1, grads2 = _math.score_vjp(kind, formula, eps, box_format,
                                   planes1, planes2, cot)
  _store_columns(d1_ref, grads1, rows_left)
  _store_columns(d2_ref, grads2, rows_left)


def elementwise_value_and_grad(boxes1, boxes2, *, kind, formula, eps,
                               box_format, as_loss, grad_scale,
                               value_scale=1.0, interpret=False, block=None):
  """(value_scale * sum of score or loss over P boxes, d/dboxes1, d/dboxes2).

  One kernel writes the scaled per-program sums and the gradients of
  ``grad_scale * sum(score)`` ([P, 4], the box dtype); one XLA reduction adds
  the sums (float32). Scaling inside the kernel (e.g. by 1 / P for a mean)
  keeps forward + backward at these two launches: a scalar multiply after
  the reduction is a third kernel on the GPU.
  """
  num_boxes = boxes1.shape[0]
  block = _block_for(num_boxes, block)
  steps = pl.cdiv(num_boxes, block)
  box_spec = pl.BlockSpec((block, COORDS), lambda i: (i, 0))
  kernel = functools.partial(
      _value_and_grad_kernel, kind=kind, formula=formula, eps=eps,
      box_format=box_format, as_loss=as_loss, num_boxes=num_boxes,
      block=block, grad_scale=float(grad_scale),
      value_scale=float(value_scale))
  sums, d1, d2 = pl.pallas_call(
      kernel, grid=(steps,), in_specs=[box_spec, box_spec],
      out_specs=[pl.BlockSpec((1,), lambda i: (i,)), box_spec, box_spec],
      out_shape=[jax.ShapeDtypeStruct((steps,), jnp.float32),
                 jax.ShapeDtypeStruct(boxes1.shape, boxes1.dtype),
                 jax.ShapeDtypeStruct(boxes2.shape, boxes2.dtype)],
      compiler_params=_params(), interpret=interpret,
  )(boxes1, boxes2)
  return jnp.sum(sums), d1, d2


# Pairwise kernel configuration (see the module docstring for the sweep).
# A program computes a [tile_n, tile_m] block of the matrix, PAIRWISE_SUB_ROWS
# rows at a time (a loop; None: all at once): the tile_m column boxes are
# unpacked once per program and reused for all tile_n rows, while only
# sub_rows x tile_m values are live in registers.
PAIRWISE_TILE = (8, 128)
PAIRWISE_SUB_ROWS = None
PAIRWISE_WARPS = 2
# How box coordinates are read: "select" loads [rows, 4] and splits it in
# registers; "strided" loads each coordinate with a stride-4 access, which
# lets Triton load straight into the layout the broadcast needs.
PAIRWISE_COLUMN_ACCESS = "strided"
# "exact": float32 division as written (Triton emits div.full.f32); "fast":
# PTX ``div.full.f32`` spelled out; "rcp" (lean formula only): numerator
# times PTX ``rcp.approx.ftz.f32`` (1 ulp; subnormal denominators count as
# zero). Interpret mode always divides exactly.
PAIRWISE_DIVISION = "exact"
# "lean": IoU and GIoU from ``_math.pairwise_score_lean`` (fewer
# instructions per pair); "shared": ``_math.score`` as the elementwise
# kernels. DIoU and CIoU always use the shared formula.
PAIRWISE_FORMULA = "lean"
# The lean formula's hull from the widths: 32.5 vs 35.3 us at 4096^2 on the
# H100, but inexact for inverted boxes (``_math.pairwise_score_lean``).
PAIRWISE_HULL_FROM_WIDTHS = False
# Which tiles consecutive programs take: "cols" walks along a row of tiles
# (neighbouring programs write neighbouring memory), "rows" down a column.
# Pallas' Triton lowering launches grid (b, p, q) as CUDA (x, y, z), and x
# varies fastest, then y.
PAIRWISE_GRID_ORDER = "cols"


def _fast_divide(num, den):
  """num / den via PTX div.full.f32 (Triton lowering only)."""
  from jax.experimental.pallas import triton as pltriton
  shape = jnp.broadcast_shapes(num.shape, den.shape)
  num = jnp.broadcast_to(num, shape).astype(jnp.float32)
  den = jnp.broadcast_to(den, shape).astype(jnp.float32)
  [out] = pltriton.elementwise_inline_asm(
      "div.full.f32 $0, $1, $2;", args=[num, den], constraints="=r,r,r",
      pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.float32)])
  return out


def _reciprocal_divide(num, den):
  """num * (1 / den) via PTX rcp.approx.ftz.f32 (1 ulp, Triton lowering only).

  Flushes subnormals: the caller treats |den| below the smallest normal
  float32 as zero.
  """
  from jax.experimental.pallas import triton as pltriton
  shape = jnp.broadcast_shapes(num.shape, den.shape)
  den = jnp.broadcast_to(den, shape).astype(jnp.float32)
  [inverse] = pltriton.elementwise_inline_asm(
      "rcp.approx.ftz.f32 $0, $1;", args=[den], constraints="=r,r", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.float32)])
  return num * inverse


_SMALLEST_NORMAL = float(jnp.finfo(jnp.float32).tiny)


def _pairwise_score_lean(kind, box1, box2, division):
  """``_math.pairwise_score_lean`` with this module's division choice."""
  if division == "rcp":  # subnormal denominators count as zero (flushed)
    return _math.pairwise_score_lean(
        kind, box1, box2, divide=_reciprocal_divide,
        is_zero=lambda den: jnp.abs(den) < _SMALLEST_NORMAL,
        hull_from_widths=PAIRWISE_HULL_FROM_WIDTHS)
  return _math.pairwise_score_lean(
      kind, box1, box2, divide=_fast_divide if division == "fast" else None,
      hull_from_widths=PAIRWISE_HULL_FROM_WIDTHS)


def _box_columns(ref, rows, start, rows_left, access):
  """Rows [start, start + rows) of a [R, 4] box ref -> four [rows] vectors.

  ``rows_left`` (None: all rows exist) masks rows past the array's end
  (read as zero boxes).
  """
  from jax.experimental.pallas import triton as pltriton
  window = pl.ds(start, rows)
  live = None if rows_left is None else jnp.arange(rows) < rows_left
  if access == "strided":
    if live is None:
      return tuple(ref[window, c].astype(jnp.float32) for c in range(COORDS))
    # (An array index: the interpreter's masked load wants shaped indices.)
    return tuple(pltriton.load(ref.at[window, jnp.int32(c)], mask=live,
                               other=0).astype(jnp.float32)
                 for c in range(COORDS))
  if live is None:
    tile = ref[window, :]
  else:
    tile = pltriton.load(ref.at[window, :],
                         mask=jnp.broadcast_to(live[:, None], (rows, COORDS)),
                         other=0)
  tile = tile.astype(jnp.float32)
  col = jnp.arange(COORDS)[None, :]
  return tuple(jnp.sum(jnp.where(col == c, tile, 0.0), axis=1)
               for c in range(COORDS))


def _pairwise_kernel(a_ref, b_ref, o_ref, *, kind, eps, n, m, tile_n, tile_m,
                     sub_rows, divide, division, formula, row_axis, access):
  rows_left = n - pl.program_id(row_axis) * tile_n
  cols_left = m - pl.program_id(3 - row_axis) * tile_m
  ragged_n, ragged_m = n % tile_n != 0, m % tile_m != 0
  b = tuple(col[None, :] for col in _box_columns(
      b_ref, tile_m, 0, cols_left if ragged_m else None, access))

  def rows_block(start):
    left = rows_left - start if ragged_n else None
    a = tuple(col[:, None] for col in _box_columns(
        a_ref, sub_rows, start, left, access))
    if formula == "lean" and kind in ("iou", "giou"):
      value = _pairwise_score_lean(kind, a, b, division)
    else:
      value = _math.score(kind, "pairwise", eps, a, b, divide=divide)
    value = value.astype(o_ref.dtype)
    window = (pl.ds(start, sub_rows), slice(None))
    if not (ragged_n or ragged_m) or RAGGED != "mask":
      # Whole tiles: a plain store (no mask arithmetic, widest vector stores).
      o_ref[window] = value
      return
    # Mask only the ragged dimensions (keeps the other one vectorised).
    from jax.experimental.pallas import triton as pltriton
    mask = jnp.ones(value.shape, jnp.bool_)
    if ragged_n:
      mask = jnp.logical_and(mask, jnp.arange(sub_rows)[:, None] < left)
    if ragged_m:
      mask = jnp.logical_and(mask, jnp.arange(tile_m)[None, :] < cols_left)
    pltriton.store(o_ref.at[window], value, mask=mask)

  if sub_rows == tile_n:
    rows_block(0)
  else:
    def body(step, carry):
      rows_block(pl.multiple_of(step * sub_rows, sub_rows))
      return carry
    jax.lax.fori_loop(0, tile_n // sub_rows, body, 0)


def pairwise(boxes1, boxes2, *, kind, eps, out_dtype, interpret=False,
             tile=None, sub_rows=None, num_warps=None, division=None,
             grid_order=None, column_access=None, formula=None):
  """[B, N, 4] x [B, M, 4] (xyxy) -> [B, N, M] in ``out_dtype``.

  The keyword options default to the module's ``PAIRWISE_*`` settings
  (``sub_rows`` to ``PAIRWISE_SUB_ROWS`` when ``tile`` is not given, else to
  the whole tile).
  """
  batch, n, _ = boxes1.shape
  m = boxes2.shape[1]
  if n == 0 or m == 0 or batch == 0:
    return jnp.zeros((batch, n, m), out_dtype)
  if tile is None:
    tile, sub_rows = PAIRWISE_TILE, sub_rows or PAIRWISE_SUB_ROWS
  tile_n, tile_m = tile
  sub_rows = min(sub_rows or tile_n, tile_n)
  if tile_n % sub_rows:
    raise ValueError(f"pairwise: tile rows {tile_n} are not a multiple of "
                     f"sub_rows {sub_rows}")
  # Few rows: a tile no taller than the (power-of-two rounded) row count.
  tile_n = min(tile_n, max(sub_rows, 1 << max(n - 1, 0).bit_length()))
  division = division or PAIRWISE_DIVISION
  grid_order = grid_order or PAIRWISE_GRID_ORDER
  n_out, m_out = n, m
  if RAGGED == "pad":
    n_out, m_out = _round_up(n, tile_n), _round_up(m, tile_m)
    boxes1 = jnp.pad(boxes1, ((0, 0), (0, n_out - n), (0, 0)))
    boxes2 = jnp.pad(boxes2, ((0, 0), (0, m_out - m), (0, 0)))
  formula = formula or PAIRWISE_FORMULA
  if division == "rcp" and formula != "lean":
    raise ValueError("pairwise: division='rcp' needs formula='lean'")
  if interpret:  # the interpreter divides exactly
    division = "exact"
  divide = _fast_divide if division == "fast" else None
  # Grid (batch, column tile, row tile) for "cols", else (batch, row tile,
  # column tile); row_axis is the grid axis of the row tiles.
  row_axis = 2 if grid_order == "cols" else 1
  steps_n, steps_m = pl.cdiv(n_out, tile_n), pl.cdiv(m_out, tile_m)
  if row_axis == 1:
    grid = (batch, steps_n, steps_m)
    def tile_ij(i, j):
      return i, j
  else:
    grid = (batch, steps_m, steps_n)
    def tile_ij(j, i):
      return i, j
  kernel = functools.partial(
      _pairwise_kernel, kind=kind, eps=eps, n=n_out, m=m_out, tile_n=tile_n,
      tile_m=tile_m, sub_rows=sub_rows, divide=divide, division=division,
      formula=formula, row_axis=row_axis,
      access=column_access or PAIRWISE_COLUMN_ACCESS)
  params = _compat.gpu_compiler_params(
      num_warps=num_warps or PAIRWISE_WARPS, num_stages=1)
  out = pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=[pl.BlockSpec((None, tile_n, COORDS),
                             lambda b_, p, q: (b_, tile_ij(p, q)[0], 0)),
                pl.BlockSpec((None, tile_m, COORDS),
                             lambda b_, p, q: (b_, tile_ij(p, q)[1], 0))],
      out_specs=pl.BlockSpec((None, tile_n, tile_m),
                             lambda b_, p, q: (b_,) + tile_ij(p, q)),
      out_shape=jax.ShapeDtypeStruct((batch, n_out, m_out), out_dtype),
      compiler_params=params, interpret=interpret,
  )(boxes1, boxes2)
  if (n_out, m_out) != (n, m):
    out = out[:, :n, :m]
  return out
