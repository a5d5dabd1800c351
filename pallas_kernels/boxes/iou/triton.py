"""IoU-family kernels for NVIDIA GPUs (Pallas, Triton lowering). Elementwise
ops and losses load coalesced ``[block, 4]`` tiles and split the coordinates
in registers; pairwise ops compute one ``tile_n x tile_m`` tile per program
from stride-4 loads. Partial blocks use masked loads and stores (the Triton
lowering has no bounds checks). Structure: docs/design/iou.md.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _compat, _cost
from pallas_kernels._compat import pl
from . import _math

COORDS = 4
# Boxes per elementwise program: SMALL_BLOCK below SMALL_BOXES boxes (more
# programs for the SMs), else ELEMENTWISE_BLOCK.
ELEMENTWISE_BLOCK = 1024
SMALL_BOXES = 1 << 20
SMALL_BLOCK = 256
NUM_WARPS = 4
PAIRWISE_TILE = (8, 128)
PAIRWISE_WARPS = 2


def _block_for(num_boxes, block):
  if block:
    return block
  return SMALL_BLOCK if num_boxes < SMALL_BOXES else ELEMENTWISE_BLOCK


def _params(num_warps=NUM_WARPS):
  return _compat.gpu_compiler_params(num_warps=num_warps, num_stages=1)


def _columns(ref, rows_left=None):
  """[B, 4] box block -> four [B] float32 coordinate vectors. With ``rows_left``
  only the first rows_left rows are read (the others are zero boxes)."""
  if rows_left is None:
    tile = ref[...]
  else:
    rows = jnp.arange(ref.shape[0])[:, None] < rows_left
    tile = pltriton.load(ref, mask=jnp.broadcast_to(rows, ref.shape), other=0)
  tile = tile.astype(jnp.float32)
  col = jnp.arange(COORDS)[None, :]
  return tuple(jnp.sum(jnp.where(col == c, tile, 0.0), axis=1)
               for c in range(COORDS))


def _store_columns(ref, columns, rows_left):
  """Four [B] vectors -> the [B, 4] block ``ref`` (first rows_left rows)."""
  col = jnp.arange(COORDS)[None, :]
  out = jnp.zeros((columns[0].shape[0], COORDS), jnp.float32)
  for c, values in enumerate(columns):
    out = jnp.where(col == c, values[:, None], out)
  rows = jnp.arange(out.shape[0])[:, None] < rows_left
  pltriton.store(ref, out.astype(ref.dtype),
                 mask=jnp.broadcast_to(rows, out.shape))


def _forward_kernel(b1_ref, b2_ref, out_ref, *, kind, formula, eps,
                    box_format, as_loss, num_boxes, block, reduce):
  rows_left = num_boxes - pl.program_id(0) * block
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
    pltriton.store(out_ref, value.astype(out_ref.dtype),
                   mask=jnp.arange(block) < rows_left)
  else:
    out_ref[...] = value.astype(out_ref.dtype)


def elementwise(boxes1, boxes2, *, kind, formula, eps, box_format,
                as_loss=False, reduce=False, out_dtype=jnp.float32,
                interpret=None, block=None):
  """Score (or 1 - score) of matching boxes: [P, 4] x [P, 4] -> [P]. With
  ``reduce`` the result is the float32 sum over the P boxes instead."""
  num_boxes = boxes1.shape[0]
  block = _block_for(num_boxes, block)
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
  flops, transcendentals = _math.ops_per_box(kind, formula, eps, box_format)
  out = _compat.pallas_call(
      kernel, grid=(steps,), in_specs=[box_spec, box_spec],
      out_specs=out_spec, out_shape=out_shape,
      compiler_params=_params(), interpret=interpret,
      cost_estimate=_cost.estimate(
          flops=num_boxes * flops, transcendentals=num_boxes * transcendentals,
          bytes_accessed=_cost.nbytes(boxes1, boxes2, out_shape)),
      name=f"{kind}_{'loss' if as_loss else 'score'}"
           f"{'_sum' if reduce else ''}_gpu",
  )(boxes1, boxes2)
  return jnp.sum(out) if reduce else out


def _backward_kernel(b1_ref, b2_ref, g_ref, d1_ref, d2_ref, *, kind, formula,
                     eps, box_format, block, shared_cotangent, num_boxes):
  rows_left = num_boxes - pl.program_id(0) * block
  ragged = num_boxes % block != 0
  planes1 = _columns(b1_ref, rows_left if ragged else None)
  planes2 = _columns(b2_ref, rows_left if ragged else None)
  if shared_cotangent:
    cot = jnp.broadcast_to(g_ref[...].astype(jnp.float32), (block,))
  elif not ragged:
    cot = g_ref[...].astype(jnp.float32)
  else:
    cot = pltriton.load(g_ref, mask=jnp.arange(block) < rows_left,
                        other=0).astype(jnp.float32)
  grads1, grads2 = _math.score_vjp(kind, formula, eps, box_format,
                                   planes1, planes2, cot)
  _store_columns(d1_ref, grads1, rows_left)
  _store_columns(d2_ref, grads2, rows_left)


def elementwise_vjp(boxes1, boxes2, cotangent, *, kind, formula, eps,
                    box_format, shared_cotangent=False, interpret=None,
                    block=None):
  """Gradients of sum(cotangent * score) w.r.t. boxes1 and boxes2 ([P, 4]).
  ``cotangent`` is [P], or with ``shared_cotangent`` shape (1,): one value for
  all boxes."""
  num_boxes = boxes1.shape[0]
  block = _block_for(num_boxes, block)
  box_spec = pl.BlockSpec((block, COORDS), lambda i: (i, 0))
  if shared_cotangent:
    g_spec = pl.BlockSpec((1,), lambda i: (0,))
  else:
    g_spec = pl.BlockSpec((block,), lambda i: (i,))
  kernel = functools.partial(
      _backward_kernel, kind=kind, formula=formula, eps=eps,
      box_format=box_format, block=block, shared_cotangent=shared_cotangent,
      num_boxes=num_boxes)
  out_shape = [jax.ShapeDtypeStruct(boxes1.shape, boxes1.dtype),
               jax.ShapeDtypeStruct(boxes2.shape, boxes2.dtype)]
  g = cotangent.astype(jnp.float32).reshape(-1)
  flops, transcendentals = _math.ops_per_box(kind, formula, eps, box_format,
                                             backward=True)
  return _compat.pallas_call(
      kernel, grid=(pl.cdiv(num_boxes, block),),
      in_specs=[box_spec, box_spec, g_spec],
      out_specs=[box_spec, box_spec],
      out_shape=out_shape,
      compiler_params=_params(), interpret=interpret,
      cost_estimate=_cost.estimate(
          flops=num_boxes * flops, transcendentals=num_boxes * transcendentals,
          bytes_accessed=_cost.nbytes(boxes1, boxes2, g, *out_shape)),
      name=f"{kind}_grad_gpu",
  )(boxes1, boxes2, g)


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
                               value_scale=1.0, interpret=None, block=None):
  """(value_scale * sum of score or loss over P boxes, d/dboxes1, d/dboxes2).
  One kernel writes the scaled per-program sums and the gradients of
  ``grad_scale * sum(score)`` ([P, 4], the box dtype); one XLA reduction adds
  the sums (float32). Scaling inside the kernel (e.g. by 1 / P for a mean) saves
  a third launch."""
  num_boxes = boxes1.shape[0]
  block = _block_for(num_boxes, block)
  steps = pl.cdiv(num_boxes, block)
  box_spec = pl.BlockSpec((block, COORDS), lambda i: (i, 0))
  kernel = functools.partial(
      _value_and_grad_kernel, kind=kind, formula=formula, eps=eps,
      box_format=box_format, as_loss=as_loss, num_boxes=num_boxes,
      block=block, grad_scale=float(grad_scale),
      value_scale=float(value_scale))
  out_shape = [jax.ShapeDtypeStruct((steps,), jnp.float32),
               jax.ShapeDtypeStruct(boxes1.shape, boxes1.dtype),
               jax.ShapeDtypeStruct(boxes2.shape, boxes2.dtype)]
  fwd = _math.ops_per_box(kind, formula, eps, box_format)
  bwd = _math.ops_per_box(kind, formula, eps, box_format, backward=True)
  sums, d1, d2 = _compat.pallas_call(
      kernel, grid=(steps,), in_specs=[box_spec, box_spec],
      out_specs=[pl.BlockSpec((1,), lambda i: (i,)), box_spec, box_spec],
      out_shape=out_shape,
      compiler_params=_params(), interpret=interpret,
      cost_estimate=_cost.estimate(
          flops=num_boxes * (fwd[0] + bwd[0]),
          transcendentals=num_boxes * (fwd[1] + bwd[1]),
          bytes_accessed=_cost.nbytes(boxes1, boxes2, *out_shape)),
      name=f"{kind}_{'loss' if as_loss else 'score'}_value_and_grad_gpu",
  )(boxes1, boxes2)
  return jnp.sum(sums), d1, d2


def _box_columns(ref, rows, rows_left):
  """The [rows, 4] box block ``ref`` -> four [rows] float32 vectors, each
  read with a stride-4 load; ``rows_left`` (None: all rows exist) masks rows
  past the array's end (read as zero boxes)."""
  if rows_left is None:
    return tuple(ref[:, c].astype(jnp.float32) for c in range(COORDS))
  live = jnp.arange(rows) < rows_left
  # (An array index: the interpreter's masked load wants shaped indices.)
  return tuple(pltriton.load(ref.at[:, jnp.int32(c)], mask=live,
                             other=0).astype(jnp.float32)
               for c in range(COORDS))


def _pairwise_kernel(a_ref, b_ref, o_ref, *, kind, eps, n, m, tile_n, tile_m):
  rows_left = n - pl.program_id(2) * tile_n
  cols_left = m - pl.program_id(1) * tile_m
  ragged_n, ragged_m = n % tile_n != 0, m % tile_m != 0
  a = tuple(col[:, None] for col in _box_columns(
      a_ref, tile_n, rows_left if ragged_n else None))
  b = tuple(col[None, :] for col in _box_columns(
      b_ref, tile_m, cols_left if ragged_m else None))
  if kind in ("iou", "giou"):
    value = _math.pairwise_score_lean(kind, a, b)
  else:
    value = _math.score(kind, "pairwise", eps, a, b)
  value = value.astype(o_ref.dtype)
  if not (ragged_n or ragged_m):
    o_ref[...] = value  # whole tiles: plain, widest vector stores
    return
  mask = jnp.ones(value.shape, jnp.bool_)
  if ragged_n:
    mask = jnp.logical_and(mask, jnp.arange(tile_n)[:, None] < rows_left)
  if ragged_m:
    mask = jnp.logical_and(mask, jnp.arange(tile_m)[None, :] < cols_left)
  pltriton.store(o_ref, value, mask=mask)


def pairwise(boxes1, boxes2, *, kind, eps, out_dtype, interpret=None,
             tile=PAIRWISE_TILE):
  """[B, N, 4] x [B, M, 4] (xyxy) -> [B, N, M] in ``out_dtype``. ``tile``:
  (rows, columns) of the output tile one program computes."""
  batch, n, _ = boxes1.shape
  m = boxes2.shape[1]
  tile_n, tile_m = tile
  kernel = functools.partial(_pairwise_kernel, kind=kind, eps=eps, n=n, m=m,
                             tile_n=tile_n, tile_m=tile_m)
  # Grid (batch, column tile, row tile), launched as CUDA (x, y, z) with x
  # varying fastest: consecutive programs of an image take neighbouring
  # column tiles, i.e. write neighbouring memory.
  out_shape = jax.ShapeDtypeStruct((batch, n, m), out_dtype)
  flops, transcendentals = _math.ops_per_pair(kind, eps)
  return _compat.pallas_call(
      kernel,
      grid=(batch, pl.cdiv(m, tile_m), pl.cdiv(n, tile_n)),
      in_specs=[pl.BlockSpec((None, tile_n, COORDS),
                             lambda b_, j, i: (b_, i, 0)),
                pl.BlockSpec((None, tile_m, COORDS),
                             lambda b_, j, i: (b_, j, 0))],
      out_specs=pl.BlockSpec((None, tile_n, tile_m),
                             lambda b_, j, i: (b_, i, j)),
      out_shape=out_shape,
      compiler_params=_params(PAIRWISE_WARPS), interpret=interpret,
      # boxes2 tiles are re-read for every row tile of boxes1.
      cost_estimate=_cost.estimate(
          flops=batch * n * m * flops, transcendentals=batch * n * m
          * transcendentals, bytes_accessed=_cost.nbytes(boxes1, out_shape)
          + pl.cdiv(n, tile_n) * _cost.nbytes(boxes2)),
      name=f"pairwise_{kind}_gpu",
  )(boxes1, boxes2)
