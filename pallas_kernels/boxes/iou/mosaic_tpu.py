"""IoU-family kernels for TPU (Mosaic). Boxes are read as coordinate planes
``[4, P]``, a bitcast of XLA's TPU layout of ``[P, 4]``, in full ``[8, 128]``
vregs; pairwise ops compute ``[TN, TM]`` output tiles from boxes1 planes
transposed in VMEM and boxes2 planes repeated on sublanes. Structure:
docs/design/iou.md.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _compat, _cost
from pallas_kernels._compat import pl, pltpu
from . import _math

LANES = 128
COORDS = 4
GROUP = 8            # plane rows per inner step: one vreg per coordinate
FORWARD_BLOCK_ROWS = 1024
BACKWARD_BLOCK_ROWS = 512
PAIRWISE_TILE = (256, 1024)
VMEM_LIMIT_BYTES = 40 * 1024 * 1024


def _round_up(x, m):
  return -(-x // m) * m


def _block_boxes(num_boxes, block_rows):
  """Boxes per grid step: ``block_rows`` rows of 128, fewer for few boxes
  (a whole number of 1024-box groups either way)."""
  return min(block_rows * LANES, _round_up(num_boxes, GROUP * LANES))


def as_planes(boxes):
  """[P, 4] -> [4, P]: coordinate planes, a bitcast of XLA's TPU layout."""
  return boxes.T


def _widened(ref, scratch):
  """An f32 ref holding ref's block (strided access needs 32-bit data)."""
  if ref.dtype == jnp.float32:
    return ref
  scratch[...] = ref[...].astype(jnp.float32)
  return scratch


def _planes(ref, group):
  """Coordinate planes [8, 128] of boxes 1024 group .. 1024 group + 1023
  (sublane-strided loads of the (4, 128) tiles)."""
  start = pl.multiple_of(group * (GROUP * LANES), GROUP * LANES)
  return tuple(ref[c, pl.ds(start, GROUP * LANES)].reshape(GROUP, LANES)
               for c in range(COORDS))


def _store_planes(ref, group, planes):
  start = pl.multiple_of(group * (GROUP * LANES), GROUP * LANES)
  for c in range(COORDS):
    ref[c, pl.ds(start, GROUP * LANES)] = planes[c].reshape(GROUP * LANES)


def _widening_scratch(dtype, block):
  shape = (COORDS, block) if dtype != jnp.float32 else (8, LANES)
  return pltpu.VMEM(shape, jnp.float32)


def _forward_kernel(b1_ref, b2_ref, out_ref, w1_ref, w2_ref, *, kind, formula,
                    eps, box_format, as_loss, num_boxes, block, reduce):
  step = pl.program_id(0)
  b1 = _widened(b1_ref, w1_ref)
  b2 = _widened(b2_ref, w2_ref)

  def group_body(group, acc):
    value = _math.score_from_planes(kind, formula, eps, box_format,
                                    _planes(b1, group), _planes(b2, group))
    if as_loss:
      value = 1.0 - value
    if reduce:
      sub = jax.lax.broadcasted_iota(jnp.int32, (GROUP, LANES), 0)
      lane = jax.lax.broadcasted_iota(jnp.int32, (GROUP, LANES), 1)
      box = step * block + (group * GROUP + sub) * LANES + lane
      return acc + jnp.where(box < num_boxes, value, 0.0)
    out_ref[pl.ds(group * GROUP, GROUP), :] = value.astype(out_ref.dtype)
    return acc

  acc = jax.lax.fori_loop(0, block // (GROUP * LANES), group_body,
                          jnp.zeros((GROUP, LANES), jnp.float32))
  if reduce:
    out_ref[0] = acc


def _compiler_params():
  return _compat.tpu_compiler_params(dimension_semantics=("parallel",),
                                     vmem_limit_bytes=VMEM_LIMIT_BYTES)


def elementwise(boxes1, boxes2, *, kind, formula, eps, box_format,
                as_loss=False, reduce=False, out_dtype=jnp.float32,
                interpret=None, block_rows=FORWARD_BLOCK_ROWS):
  """Score (or 1 - score) of matching boxes: [P, 4] x [P, 4] -> [P]. With
  ``reduce`` the result is the float32 sum over the P boxes instead."""
  num_boxes = boxes1.shape[0]
  block = _block_boxes(num_boxes, block_rows)
  x1, x2 = as_planes(boxes1), as_planes(boxes2)
  steps = pl.cdiv(num_boxes, block)
  in_spec = pl.BlockSpec((COORDS, block), lambda i: (0, i))
  if reduce:
    out_shape = jax.ShapeDtypeStruct((steps, GROUP, LANES), jnp.float32)
    out_spec = pl.BlockSpec((1, GROUP, LANES), lambda i: (i, 0, 0))
  else:
    # [rows, 128] row-major is [P] padded to whole rows; XLA's TPU layout
    # pads [P] to 1024 anyway, so dropping the padding is a bitcast.
    out_shape = jax.ShapeDtypeStruct((pl.cdiv(num_boxes, LANES), LANES),
                                     out_dtype)
    out_spec = pl.BlockSpec((block // LANES, LANES), lambda i: (i, 0))
  kernel = functools.partial(
      _forward_kernel, kind=kind, formula=formula, eps=eps,
      box_format=box_format, as_loss=as_loss, num_boxes=num_boxes,
      block=block, reduce=reduce)
  flops, transcendentals = _math.ops_per_box(kind, formula, eps, box_format)
  out = _compat.pallas_call(
      kernel,
      grid=(steps,),
      in_specs=[in_spec, in_spec],
      out_specs=out_spec,
      out_shape=out_shape,
      scratch_shapes=[_widening_scratch(x1.dtype, block),
                      _widening_scratch(x2.dtype, block)],
      compiler_params=_compiler_params(),
      interpret=interpret,
      cost_estimate=_cost.estimate(
          flops=num_boxes * (flops + (1 if as_loss else 0)
                             + (2 if reduce else 0)),
          transcendentals=num_boxes * transcendentals,
          bytes_accessed=_cost.nbytes(x1, x2, out_shape)),
      name=f"{kind}_{'loss' if as_loss else 'score'}"
           f"{'_sum' if reduce else ''}",
  )(x1, x2)
  if reduce:
    return jnp.sum(out)
  return out.reshape(-1)[:num_boxes]


def _backward_kernel(b1_ref, b2_ref, g_ref, d1_ref, d2_ref, w1_ref, w2_ref,
                     *, kind, formula, eps, box_format, block,
                     scalar_cotangent):
  b1 = _widened(b1_ref, w1_ref)
  b2 = _widened(b2_ref, w2_ref)
  # Gradients go straight to f32 outputs, else to the widening scratch
  # (each group overwrites only the boxes it has just read).
  o1 = d1_ref if d1_ref.dtype == jnp.float32 else b1
  o2 = d2_ref if d2_ref.dtype == jnp.float32 else b2
  scale = g_ref[0] if scalar_cotangent else None

  def group_body(group, carry):
    planes1 = _planes(b1, group)
    planes2 = _planes(b2, group)
    if scalar_cotangent:
      cot = jnp.full((GROUP, LANES), scale, jnp.float32)
    else:
      cot = g_ref[pl.ds(group * GROUP, GROUP), :]
    grads1, grads2 = _math.score_vjp(kind, formula, eps, box_format,
                                     planes1, planes2, cot)
    _store_planes(o1, group, grads1)
    _store_planes(o2, group, grads2)
    return carry

  jax.lax.fori_loop(0, block // (GROUP * LANES), group_body, 0)
  if o1 is not d1_ref:
    d1_ref[...] = o1[...].astype(d1_ref.dtype)
  if o2 is not d2_ref:
    d2_ref[...] = o2[...].astype(d2_ref.dtype)


def elementwise_vjp(boxes1, boxes2, cotangent, *, kind, formula, eps,
                    box_format, shared_cotangent=False, interpret=None,
                    block_rows=BACKWARD_BLOCK_ROWS):
  """Gradients of sum(cotangent * score) w.r.t. boxes1 and boxes2 ([P, 4]).
  ``cotangent`` is [P] float32, or with ``shared_cotangent`` shape (1,): one
  value for all boxes (reduced losses: no cotangent traffic at all)."""
  num_boxes = boxes1.shape[0]
  block = _block_boxes(num_boxes, block_rows)
  x1, x2 = as_planes(boxes1), as_planes(boxes2)
  steps = pl.cdiv(num_boxes, block)
  box_spec = pl.BlockSpec((COORDS, block), lambda i: (0, i))
  if shared_cotangent:
    g = cotangent.astype(jnp.float32).reshape(1)
    g_spec = pl.BlockSpec(memory_space=pltpu.SMEM)
  else:
    rows = pl.cdiv(num_boxes, LANES)
    g = cotangent.astype(jnp.float32).reshape(-1)
    if rows * LANES != num_boxes:  # 4 bytes per box; the boxes are not copied
      g = jnp.pad(g, (0, rows * LANES - num_boxes))
    g = g.reshape(rows, LANES)
    g_spec = pl.BlockSpec((block // LANES, LANES), lambda i: (i, 0))
  kernel = functools.partial(
      _backward_kernel, kind=kind, formula=formula, eps=eps,
      box_format=box_format, block=block, scalar_cotangent=shared_cotangent)
  out_shape = [jax.ShapeDtypeStruct(x1.shape, boxes1.dtype),
               jax.ShapeDtypeStruct(x2.shape, boxes2.dtype)]
  flops, transcendentals = _math.ops_per_box(kind, formula, eps, box_format,
                                             backward=True)
  d1, d2 = _compat.pallas_call(
      kernel,
      grid=(steps,),
      in_specs=[box_spec, box_spec, g_spec],
      out_specs=[box_spec, box_spec],
      out_shape=out_shape,
      scratch_shapes=[_widening_scratch(x1.dtype, block),
                      _widening_scratch(x2.dtype, block)],
      compiler_params=_compiler_params(),
      interpret=interpret,
      cost_estimate=_cost.estimate(
          flops=num_boxes * flops, transcendentals=num_boxes * transcendentals,
          bytes_accessed=_cost.nbytes(x1, x2, g, *out_shape)),
      name=f"{kind}_grad",
  )(x1, x2, g)
  return d1.T, d2.T


def _box_term_rows(kind):
  """Which of ``box_terms``' area, centre x, centre y, aspect angle the
  pairwise kernel precomputes per box of boxes1 for ``kind``. IoU's area
  alone is recomputed per row group instead: three multiplies and
  subtracts cost less than broadcasting one more column (v6e)."""
  centre = kind in ("diou", "ciou")
  return (kind != "iou", centre, centre, kind == "ciou")


def _pairwise_kernel(a_ref, b_ref, o_ref, planes_ref, a_cols_ref, *, kind,
                     eps, tile_n, tile_m, unroll):
  # boxes1 arrive as coordinate planes (4, TN): their per-box terms are
  # computed there, lane-dense, then one transpose per step puts each box's
  # coordinates and terms along a row, ready to broadcast across lanes.
  a = a_ref[...]
  planes_ref[0:COORDS, :] = a
  terms = _math.box_terms(kind, tuple(a[c:c + 1] for c in range(COORDS)))
  used = [t for t, read in zip(terms[2:], _box_term_rows(kind)) if read]
  for row, term in enumerate(used, COORDS):
    planes_ref[row:row + 1, :] = term
  a_cols_ref[...] = planes_ref[...].T
  # boxes2 rows arrive repeated on 8 sublanes: plain [8, 128] loads, made
  # once per step with their per-box terms (areas, centres, angles).
  columns = []
  for j in range(tile_m // LANES):
    b = tuple(b_ref[pl.ds(c * GROUP, GROUP), pl.ds(j * LANES, LANES)]
              for c in range(COORDS))
    columns.append((b, _math.box_terms(kind, b)))

  def group_body(group, carry):
    rows = pl.ds(pl.multiple_of(group * GROUP, GROUP), GROUP)
    a = a_cols_ref[rows, :]
    values = iter([jnp.broadcast_to(a[:, c:c + 1], (GROUP, LANES))
                   for c in range(a.shape[1])])
    a_cols = tuple(next(values) for _ in range(COORDS))
    if kind == "iou":
      a_terms = _math.box_terms(kind, a_cols)
    else:
      a_terms = (None, None) + tuple(next(values) if read else None
                                     for read in _box_term_rows(kind))
    for j, (b, b_terms) in enumerate(columns):
      value = _math.pairwise_score_lean(kind, a_cols, b, a_terms, b_terms,
                                        eps)
      o_ref[rows, pl.ds(j * LANES, LANES)] = value.astype(o_ref.dtype)
    return carry

  # Compiled: unrolled whole, so the scheduler interleaves the row groups'
  # independent chains (docs/design/iou.md, "TPU bundles"). Interpreted, the
  # same loop rolled (the interpreter only compiles a larger program).
  jax.lax.fori_loop(0, tile_n // GROUP, group_body, 0, unroll=unroll)


def pairwise(boxes1, boxes2, *, kind, eps, out_dtype, interpret=None,
             tile=PAIRWISE_TILE):
  """[B, N, 4] x [B, M, 4] (xyxy, float32) -> [B, N, M] in ``out_dtype``. The
  exact [B, N, M] is written: edge tiles are partial blocks (Pallas drops their
  out-of-bounds rows and lanes), nothing is padded or sliced."""
  batch, n, _ = boxes1.shape
  m = boxes2.shape[1]
  tile_n = min(tile[0], _round_up(n, LANES))
  tile_m = min(tile[1], _round_up(m, LANES))
  grid_n, grid_m = pl.cdiv(n, tile_n), pl.cdiv(m, tile_m)
  a = jnp.swapaxes(boxes1, 1, 2)  # [B, 4, N]: a bitcast on TPU
  b = jnp.repeat(jnp.swapaxes(boxes2, 1, 2), GROUP, axis=1)  # [B, 32, M]
  kernel = functools.partial(_pairwise_kernel, kind=kind, eps=eps,
                             tile_n=tile_n, tile_m=tile_m,
                             unroll=interpret in (None, False))
  out_shape = jax.ShapeDtypeStruct((batch, n, m), out_dtype)
  rows = COORDS + sum(_box_term_rows(kind))  # coordinates and terms per box
  flops, transcendentals = _math.ops_per_pair(kind, eps)
  pairs = batch * grid_n * tile_n * grid_m * tile_m
  return _compat.pallas_call(
      kernel,
      grid=(batch, grid_n, grid_m),
      in_specs=[pl.BlockSpec((None, COORDS, tile_n),
                             lambda b_, i, j: (b_, 0, i)),
                pl.BlockSpec((None, COORDS * GROUP, tile_m),
                             lambda b_, i, j: (b_, 0, j))],
      out_specs=pl.BlockSpec((None, tile_n, tile_m),
                             lambda b_, i, j: (b_, i, j)),
      out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM((rows, tile_n), jnp.float32),
                      pltpu.VMEM((tile_n, rows), jnp.float32)],
      compiler_params=_compat.tpu_compiler_params(
          dimension_semantics=("parallel", "parallel", "parallel")),
      interpret=interpret,
      # boxes2 blocks are re-read for every row tile of boxes1.
      cost_estimate=_cost.estimate(
          flops=pairs * flops, transcendentals=pairs * transcendentals,
          bytes_accessed=_cost.nbytes(a, out_shape) + grid_n * _cost.nbytes(b)),
      name=f"pairwise_{kind}",
  )(a, b)
