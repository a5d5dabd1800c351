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

Pairwise: each program computes a ``[BN, BM]`` output tile from a
``[BN, 4]`` and a ``[BM, 4]`` box tile; the output is written once.

Block sizes (swept on an H100, jax 0.11.2): elementwise 1024 boxes / 4
warps (512..2048 and 8 warps within 10%); pairwise 32 x 128 / 4 warps
(0.13 ms at 4096 x 4096; 64 x 128: 0.20 ms; 128 x 128: 1.1 ms).
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
FUSED_MAX_BOXES = 1 << 20
PAIRWISE_TILE = (32, 128)
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
                interpret=False, block=ELEMENTWISE_BLOCK):
  """Score (or 1 - score) of matching boxes: [P, 4] x [P, 4] -> [P].

  With ``reduce`` the result is the float32 sum over the P boxes instead.
  """
  num_boxes = boxes1.shape[0]
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
                    block=ELEMENTWISE_BLOCK):
  """Gradients of sum(cotangent * score) w.r.t. boxes1 and boxes2 ([P, 4])."""
  num_boxes = boxes1.shape[0]
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
                           block, grad_scale):
  rows_left = num_boxes - pl.program_id(0) * block
  planes1 = _columns(b1_ref, rows_left)
  planes2 = _columns(b2_ref, rows_left)
  value = _math.score_from_planes(kind, formula, eps, box_format, planes1,
                                  planes2)
  if as_loss:
    value = 1.0 - value
  live = jnp.arange(block) < rows_left
  sum_ref[...] = jnp.sum(jnp.where(live, value, 0.0), keepdims=True)
  cot = jnp.where(live, grad_scale, 0.0).astype(jnp.float32)
  grads1, grads2 = _math.score_vjp(kind, formula, eps, box_format,
                                   planes1, planes2, cot)
  _store_columns(d1_ref, grads1, rows_left)
  _store_columns(d2_ref, grads2, rows_left)


def elementwise_value_and_grad(boxes1, boxes2, *, kind, formula, eps,
                               box_format, as_loss, grad_scale,
                               interpret=False, block=ELEMENTWISE_BLOCK):
  """(sum of score or loss over P boxes, d/dboxes1, d/dboxes2) in one kernel.

  The gradients are those of ``grad_scale * sum(score)`` ([P, 4], the box
  dtype); the sum is float32.
  """
  num_boxes = boxes1.shape[0]
  steps = pl.cdiv(num_boxes, block)
  box_spec = pl.BlockSpec((block, COORDS), lambda i: (i, 0))
  kernel = functools.partial(
      _value_and_grad_kernel, kind=kind, formula=formula, eps=eps,
      box_format=box_format, as_loss=as_loss, num_boxes=num_boxes,
      block=block, grad_scale=float(grad_scale))
  sums, d1, d2 = pl.pallas_call(
      kernel, grid=(steps,), in_specs=[box_spec, box_spec],
      out_specs=[pl.BlockSpec((1,), lambda i: (i,)), box_spec, box_spec],
      out_shape=[jax.ShapeDtypeStruct((steps,), jnp.float32),
                 jax.ShapeDtypeStruct(boxes1.shape, boxes1.dtype),
                 jax.ShapeDtypeStruct(boxes2.shape, boxes2.dtype)],
      compiler_params=_params(), interpret=interpret,
  )(boxes1, boxes2)
  return jnp.sum(sums), d1, d2


def _pairwise_kernel(a_ref, b_ref, o_ref, *, kind, eps, n, m, tile_n, tile_m):
  a = tuple(col[:, None] for col in _columns(
      a_ref, n - pl.program_id(1) * tile_n if n % tile_n else None))
  b = tuple(col[None, :] for col in _columns(
      b_ref, m - pl.program_id(2) * tile_m if m % tile_m else None))
  value = _math.score(kind, "pairwise", eps, a, b)
  _store_2d(o_ref, value, n - pl.program_id(1) * tile_n,
            m - pl.program_id(2) * tile_m)


def pairwise(boxes1, boxes2, *, kind, eps, out_dtype, interpret=False,
             tile=PAIRWISE_TILE):
  """[B, N, 4] x [B, M, 4] (xyxy) -> [B, N, M] in ``out_dtype``."""
  batch, n, _ = boxes1.shape
  m = boxes2.shape[1]
  if n == 0 or m == 0 or batch == 0:
    return jnp.zeros((batch, n, m), out_dtype)
  tile_n, tile_m = tile
  n_out, m_out = n, m
  if RAGGED == "pad":
    n_out, m_out = _round_up(n, tile_n), _round_up(m, tile_m)
    boxes1 = jnp.pad(boxes1, ((0, 0), (0, n_out - n), (0, 0)))
    boxes2 = jnp.pad(boxes2, ((0, 0), (0, m_out - m), (0, 0)))
  kernel = functools.partial(_pairwise_kernel, kind=kind, eps=eps, n=n_out,
                             m=m_out, tile_n=tile_n, tile_m=tile_m)
  out = pl.pallas_call(
      kernel,
      grid=(batch, pl.cdiv(n_out, tile_n), pl.cdiv(m_out, tile_m)),
      in_specs=[pl.BlockSpec((None, tile_n, COORDS),
                             lambda b_, i, j: (b_, i, 0)),
                pl.BlockSpec((None, tile_m, COORDS),
                             lambda b_, i, j: (b_, j, 0))],
      out_specs=pl.BlockSpec((None, tile_n, tile_m),
                             lambda b_, i, j: (b_, i, j)),
      out_shape=jax.ShapeDtypeStruct((batch, n_out, m_out), out_dtype),
      compiler_params=_params(), interpret=interpret,
  )(boxes1, boxes2)
  if (n_out, m_out) != (n, m):
    out = out[:, :n, :m]
  return out
