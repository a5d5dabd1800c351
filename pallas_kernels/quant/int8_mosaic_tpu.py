"""Mosaic TPU kernels: tiled int8 matmul with a fused dequantizing epilogue,
and one-pass row quantization (the dynamic mode's pre-pass). Grid (M/bm,
N/bn, K/bk), K innermost; the running sum stays in VMEM and no int32 matrix
reaches HBM. Structure: docs/design/int8.md.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _backend, _compat, _cost
from pallas_kernels._compat import pl, pltpu
from pallas_kernels.quant import int8_block_sizes as bs
from pallas_kernels.quant import operands, int8_quantize as quant

MiB = 1 << 20
QUANTIZE_VMEM_BUDGET = 8 * MiB


def _contraction(w_layout):
  return (((1,), (0 if w_layout == "kn" else 1,)), ((), ()))


def float_dot(x, w, w_layout):
  """x [bm, bk] times a w tile of x's dtype ([bk, bn], or [bn, bk] for
  "nk") with float32 sums; full precision for float32."""
  precision = (jax.lax.Precision.HIGHEST if x.dtype == jnp.float32
               else jax.lax.Precision.DEFAULT)
  return jax.lax.dot_general(x, w, _contraction(w_layout),
                             precision=precision,
                             preferred_element_type=jnp.float32)


def streamed_dot(x, w, w_layout):
  """bf16 x times a w tile of small integers (or fp8 values) in one bf16 MXU
  pass, exact: w goes in as float32, which Mosaic pushes as it widens it,
  with no VALU op to pack it to bf16 first."""
  return jax.lax.dot_general(x, w.astype(jnp.float32), _contraction(w_layout),
                             precision=jax.lax.Precision.DEFAULT,
                             preferred_element_type=jnp.float32)


def _dot(x, w, mode, w_layout, w_streamed=False):
  if mode == "weight_only":
    if w_streamed:
      return streamed_dot(x, w, w_layout)
    return float_dot(x, w.astype(x.dtype), w_layout)
  return jax.lax.dot_general(x, w, _contraction(w_layout),
                             preferred_element_type=jnp.int32)


def _int8_dot_via_bf16(x_ref, w_ref, w_layout):
  """x_ref @ w_ref (int8 tiles) as int32, through bf16 MXU products: K
  chunks of at most EXACT_F32_K products sum exactly in float32."""
  k = x_ref.shape[1]
  total = None
  for start in range(0, k, bs.EXACT_F32_K):
    chunk = pl.ds(start, min(bs.EXACT_F32_K, k - start))
    x = x_ref[:, chunk].astype(jnp.bfloat16)
    w = (w_ref[chunk, :] if w_layout == "kn" else w_ref[:, chunk])
    part = _dot(x, w.astype(jnp.bfloat16), "weight_only", w_layout)
    part = part.astype(jnp.int32)
    total = part if total is None else total + part
  return total


def _matmul_kernel(*refs, mode, nk, has_xs, has_ws, has_b, w_layout,
                   int8_via_bf16, w_streamed):
  x_ref, w_ref, xs_ref, ws_ref, b_ref, o_ref, refs = (
      operands.split_int8_kernel_refs(refs, has_xs=has_xs, has_ws=has_ws,
                                 has_b=has_b))
  acc_ref = refs.pop(0) if refs else None

  def part():
    if int8_via_bf16 and mode != "weight_only":
      return _int8_dot_via_bf16(x_ref, w_ref, w_layout)
    return _dot(x_ref[...], w_ref[...], mode, w_layout, w_streamed)

  def finish(acc):
    if mode == "raw":
      o_ref[...] = acc
    else:
      o_ref[...] = quant.epilogue_from_refs(acc, xs_ref, ws_ref, b_ref,
                                            o_ref.dtype)

  # Raw mode sums in the resident int32 output tile itself.
  accumulate_over_k(part, o_ref if mode == "raw" else acc_ref, nk, finish)


def accumulate_over_k(part, acc_ref, nk, finish):
  """Sums this K step's product ``part()`` into ``acc_ref`` over the grid's
  K axis (axis 2, ``nk`` steps) and calls ``finish(total)`` at the last
  step; a single step finishes ``part()`` with no accumulator. The product
  is formed inside each branch, so Mosaic adds the running sum into the
  matmul's result as it pops it (no second pass over the tile)."""
  if nk == 1:
    finish(part())
    return
  k = pl.program_id(2)

  @pl.when(k == 0)
  def _():
    acc_ref[...] = part()

  @pl.when(jnp.logical_and(k > 0, k < nk - 1))
  def _():
    acc_ref[...] += part()

  @pl.when(k == nk - 1)
  def _():
    finish(acc_ref[...] + part())


def matmul(x2, w, x_scale, w_scale, bias, *, mode, out_dtype, block_sizes=None,
           generation=None, w_layout="kn", interpret=False):
  """The normalized operands (``operands.Int8MatmulCall``) -> [M, N] out_dtype
  for modes raw / dequant / dynamic / weight_only; w is [K, N], or [N, K]
  for w_layout "nk". ``generation`` picks the block-table row (None: the
  lowering target's, ``_backend.target()``); ``block_sizes`` overrides it.
  """
  kn = w_layout == "kn"
  if mode == "dynamic":
    x2, x_scale = quantize_rows(x2, interpret=interpret)
    mode = "dequant"
  m, k = x2.shape
  n = w.shape[1 if kn else 0]
  generation = generation or _backend.target().tpu_generation
  out_dtype = jnp.dtype(jnp.int32 if mode == "raw" else out_dtype)
  w_streamed = mode == "weight_only" and bs.weight_only_decode_streams(
      m, generation, x2.dtype)
  plan = bs.plan_tpu(m, k, n, x_bytes=x2.dtype.itemsize,
                     out_bytes=out_dtype.itemsize, mode=mode,
                     generation=generation, block_sizes=block_sizes,
                     w_streamed=w_streamed)
  if plan.k_padded != k:
    x2, w = pad_k(x2, w, plan.k_padded, w_layout)
  bm, bn = plan.bm, plan.bn
  nk = plan.k_padded // plan.bk

  operands = [x2, w]
  in_specs = x_and_w_specs(plan, w_layout)
  if x_scale is not None:
    operands.append(x_scale)
    in_specs.append(per_row_spec(bm))
  for row_vector in (w_scale, bias):
    if row_vector is not None:
      operands.append(row_vector)
      in_specs.append(per_column_spec(bn))
  scratch = []
  if mode != "raw" and nk > 1:
    acc_dtype = jnp.float32 if mode == "weight_only" else jnp.int32
    scratch.append(pltpu.VMEM((bm, bn), acc_dtype))

  kernel = functools.partial(
      _matmul_kernel, mode=mode, nk=nk, has_xs=x_scale is not None,
      has_ws=w_scale is not None, has_b=bias is not None, w_layout=w_layout,
      int8_via_bf16=not bs.int8_mxu(generation), w_streamed=w_streamed)
  return tiled_matmul_call(
      kernel, operands, in_specs, plan=plan, m=m, n=n, out_dtype=out_dtype,
      scratch=scratch, x_side_bytes=_cost.nbytes(x2, x_scale),
      w_side_bytes=_cost.nbytes(w, w_scale, bias),
      extra_flops=0 if mode == "raw" else 4 * m * n,
      name=f"int8_matmul_{mode}", interpret=interpret)


def pad_k(x2, w, k_padded, w_layout):
  """x2 [M, K] and w ([K, N], or [N, K] for "nk") zero-padded to K =
  ``k_padded``."""
  pad = (0, k_padded - x2.shape[1])
  x2 = jnp.pad(x2, ((0, 0), pad))
  w = jnp.pad(w, (pad, (0, 0)) if w_layout == "kn" else ((0, 0), pad))
  return x2, w


def x_and_w_specs(plan, w_layout):
  """[BlockSpec of the x tile, of the w tile] over the (i, j, kk) grid."""
  bm, bk, bn = plan.bm, plan.bk, plan.bn
  w_spec = (pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j))
            if w_layout == "kn" else
            pl.BlockSpec((bn, bk), lambda i, j, kk: (j, kk)))
  return [pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)), w_spec]


def per_row_spec(bm):
  """BlockSpec of an [M, 1] operand (x_scale) over the (i, j, kk) grid."""
  return pl.BlockSpec((bm, 1), lambda i, j, kk: (i, 0))


def per_column_spec(bn):
  """BlockSpec of a [1, N] operand (w_scale, bias) over the (i, j, kk) grid."""
  return pl.BlockSpec((1, bn), lambda i, j, kk: (0, j))


def tiled_matmul_call(kernel, operands, in_specs, *, plan, m, n, out_dtype,
                      scratch, x_side_bytes, w_side_bytes, extra_flops, name,
                      interpret):
  """``kernel`` over the (M/bm, N/bn, K/bk) grid of ``plan`` (K last and
  "arbitrary"), writing [M, N] ``out_dtype`` in [bm, bn] tiles. The cost
  estimate counts ``x_side_bytes`` once per column tile, ``w_side_bytes``
  once per row tile and ``extra_flops`` beyond the dot's."""
  bm, bn = plan.bm, plan.bn
  grid = (pl.cdiv(m, bm), pl.cdiv(n, bn), plan.k_padded // plan.bk)
  out_shape = jax.ShapeDtypeStruct((m, n), out_dtype)
  grid_m, grid_n = grid[0], grid[1]
  # x is streamed once per column tile, w once per row tile.
  bytes_accessed = (grid_n * x_side_bytes + grid_m * w_side_bytes
                    + _cost.nbytes(out_shape))
  return _compat.pallas_call(
      kernel,
      grid=grid,
      in_specs=in_specs,
      out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
      out_shape=out_shape,
      scratch_shapes=scratch,
      compiler_params=_compat.tpu_compiler_params(
          dimension_semantics=("parallel", "parallel", "arbitrary"),
          vmem_limit_bytes=plan.vmem_limit_bytes),
      interpret=interpret,
      cost_estimate=_cost.estimate(
          flops=2 * m * n * plan.k_padded + extra_flops,
          bytes_accessed=bytes_accessed),
      name=name,
  )(*operands)


QUANTIZE_ROWS = 32  # one int8 (32, 128) tile row; 8 and 16 do not lower
QUANTIZE_LANES = 128  # columns per register-resident chunk
# Adding 1.5 * 2^23 to |c| <= 2^22 rounds c to an integer n, half to even
# (the float32 spacing there is 1); the sum's bits are 0x4B400000 + n, whose
# low byte is n as an int8.
_ROUNDER = 1.5 * 2**23
_ABS_MASK = 0x7FFFFFFF
_INF_BITS = 0x7F800000


def _column_chunks(k, width):
  return [(start, min(width, k - start)) for start in range(0, k, width)]


def _row_amax(x_ref, rows, chunks):
  """``quant.amax`` over axis 1 of x_ref[rows] ([R, 1]), from |x|'s bit
  patterns: for non-negative floats integer order is float order and NaNs
  sort above inf, so one integer max per element finds both the largest
  magnitude and any NaN. Chunks combine elementwise first; the cross-lane
  reductions run in float32 (older Mosaic reduces no int32 across lanes):
  the largest non-NaN magnitude, and a NaN flag."""
  partial = {}
  for start, width in chunks:
    x = x_ref[rows, pl.ds(start, width)].astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(x, jnp.int32) & _ABS_MASK
    partial[width] = (bits if width not in partial
                      else jnp.maximum(partial[width], bits))
  def lane_max(v):
    return functools.reduce(jnp.maximum, [jnp.max(p, axis=1, keepdims=True)
                                          for p in v])
  largest = lane_max([jax.lax.bitcast_convert_type(
      jnp.minimum(p, _INF_BITS), jnp.float32) for p in partial.values()])
  has_nan = lane_max([(p > _INF_BITS).astype(jnp.float32)
                      for p in partial.values()])
  return jnp.where(has_nan > 0, jnp.float32(jnp.nan), largest)


def _round_to_int8(x, inverse_scale):
  """``quant.round_to_int8(x, scale)`` given 1 / scale, bit for bit:
  clipped before rounding (the same for integer bounds), NaN -> 0, rounded
  by adding ``_ROUNDER``, and the int8 cut from the sum's bits (no
  floor/ceil/convert sequence)."""
  c = jnp.clip(x * inverse_scale, -quant.INT8_MAX, quant.INT8_MAX)
  c = jnp.where(jnp.isnan(c), 0.0, c)
  bits = jax.lax.bitcast_convert_type(c + jnp.float32(_ROUNDER), jnp.int32)
  return bits.astype(jnp.int8)


def _quantize_kernel(x_ref, q_ref, s_ref, *, rows, unroll):
  # ``rows`` rows at a time, both passes over register-sized column chunks
  # (no block-wide float32 temporaries), the row slices unrolled so that one
  # slice's reduction overlaps its neighbours' work (interpreted: rolled, a
  # smaller program): docs/design/int8.md, "quantize_int8 on the TPU". x is
  # widened twice: cheaper than storing it.
  chunks = _column_chunks(x_ref.shape[1], QUANTIZE_LANES)

  def body(i, carry):
    r = pl.ds(pl.multiple_of(i * rows, rows), rows)
    scale = quant.scale_from_amax(_row_amax(x_ref, r, chunks))
    inverse_scale = 1 / scale
    for start, width in chunks:
      cols = pl.ds(start, width)
      q_ref[r, cols] = _round_to_int8(
          x_ref[r, cols].astype(jnp.float32), inverse_scale)
    s_ref[r, :] = scale
    return carry

  jax.lax.fori_loop(0, x_ref.shape[0] // rows, body, 0, unroll=unroll)


def quantize_rows_block(m: int, k: int, in_bytes: int) -> int | None:
  """Rows per block so a [bm, K] block fits the budget; None if none fits."""
  # Double-buffered input and int8 output, plus slack for float32 work.
  per_row = k * (2 * in_bytes + 2 + 8) + 2 * 128 * 4
  rows = QUANTIZE_VMEM_BUDGET // per_row
  if m <= rows:
    return m
  rows = min(rows, 512) // 32 * 32
  return rows or None


def quantize_rows(x2, *, interpret=False):
  """Per-row int8 quantization of [M, K] float x: (int8 [M, K], f32 [M, 1])."""
  m, k = x2.shape
  bm = quantize_rows_block(m, k, x2.dtype.itemsize)
  if bm is None or m == 0 or k == 0:
    return quant.quantize(x2, axis=-1)
  out_shape = [jax.ShapeDtypeStruct((m, k), jnp.int8),
               jax.ShapeDtypeStruct((m, 1), jnp.float32)]
  rows = QUANTIZE_ROWS if bm % QUANTIZE_ROWS == 0 else bm
  return _compat.pallas_call(
      functools.partial(_quantize_kernel, rows=rows, unroll=not interpret),
      grid=(pl.cdiv(m, bm),),
      in_specs=[pl.BlockSpec((bm, k), lambda i: (i, 0))],
      out_specs=[pl.BlockSpec((bm, k), lambda i: (i, 0)),
                 pl.BlockSpec((bm, 1), lambda i: (i, 0))],
      out_shape=out_shape,
      compiler_params=_compat.tpu_compiler_params(
          dimension_semantics=("parallel",),
          vmem_limit_bytes=2 * QUANTIZE_VMEM_BUDGET),
      interpret=interpret,
      # |x|, the row max, x / scale, round and clip: about 5 flops per value.
      cost_estimate=_cost.estimate(
          flops=5 * m * k, bytes_accessed=_cost.nbytes(x2, *out_shape)),
      name="quantize_int8_rows",
  )(x2)
