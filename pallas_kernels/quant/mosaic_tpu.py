"""Mosaic TPU kernel: matmul of int4 / fp8 / grouped int8 weights.

Grid (M/bm, N/bn, K/bk), K innermost and "arbitrary", M and N "parallel"
(megacore chips split them); the running float32 sum lives in VMEM and the
epilogue (x_scale [bm, 1], w_scale [1, bn], bias [1, bn], cast) runs at the
last K step, as in the int8 kernel (``int8.mosaic_tpu``), which serves the
int8 x int8 modes and per-channel int8 weight-only calls itself.

Each step converts the w tile in VMEM:
  weight-only, per channel: w -> x's dtype (int4, int8 and both fp8 formats
    are exact in bf16), one MXU dot, w_scale in the epilogue;
  weight-only, grouped (w [K, N]): w -> float32, minus the zero and times
    the scale of its group (the [bk/g, bn] scale tile broadcast along
    sublanes to [bk, bn]), rounded to x's dtype, one MXU dot at full depth
    (no per-group dots of depth g);
  fp8 x fp8: native fp8 MXU operands on tpu7x; elsewhere (no fp8 MXU) both
    tiles are upcast to bf16 (exact; products exact in float32).
int4 tiles are read as jnp.int4 refs (Mosaic packs them two per byte).
K is zero-padded (x, w and the group scale rows) when it exceeds the K tile
and is not a multiple of the tile unit; M and N edges need no padding.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _backend, _compat, _cost
from pallas_kernels._compat import pl, pltpu
from pallas_kernels.int8 import quant as int8_quant
from pallas_kernels.quant import block_sizes as bs
from pallas_kernels.quant import formats, operands, reference


def _expand_rows(a, rows, cols):
  """[G, cols] -> [rows, cols], each row repeated rows // G times."""
  groups = a.shape[0]
  return jnp.broadcast_to(a[:, None, :],
                          (groups, rows // groups, cols)).reshape(rows, cols)


def _kernel(*refs, nk, has_xs, has_ws, has_zero, has_b, w_layout, grouped,
            compute_dtype, x_upcast):
  x_ref, w_ref, xs_ref, ws_ref, z_ref, b_ref, o_ref, rest = (
      operands.split_kernel_refs(refs, has_xs=has_xs, has_ws=has_ws,
                                 has_zero=has_zero, has_b=has_b))
  acc_ref = rest[0] if rest else None
  x = x_ref[...]
  w = w_ref[...]
  if x_upcast:
    x = x.astype(jnp.float32).astype(compute_dtype)
  if grouped:
    rows, cols = w.shape
    wf = w.astype(jnp.float32)
    if has_zero:
      wf = wf - _expand_rows(z_ref[...], rows, cols)
    w = (wf * _expand_rows(ws_ref[...], rows, cols)).astype(compute_dtype)
  elif compute_dtype is not None:
    w = w.astype(jnp.float32).astype(compute_dtype)
  dims = (((1,), (0 if w_layout == "kn" else 1,)), ((), ()))
  precision = (jax.lax.Precision.HIGHEST if x.dtype == jnp.float32
               else jax.lax.Precision.DEFAULT)
  part = jax.lax.dot_general(x, w, dims, precision=precision,
                             preferred_element_type=jnp.float32)

  def finish(acc):
    o_ref[...] = int8_quant.epilogue_from_refs(
        acc, xs_ref, None if grouped else ws_ref, b_ref, o_ref.dtype)

  if nk == 1:
    finish(part)
    return
  k = pl.program_id(2)

  @pl.when(k == 0)
  def _():
    acc_ref[...] = part

  @pl.when(jnp.logical_and(k > 0, k < nk - 1))
  def _():
    acc_ref[...] += part

  @pl.when(k == nk - 1)
  def _():
    finish(acc_ref[...] + part)


def supports(w, group_size, w_layout) -> str | None:
  """Why this kernel cannot take the call, else None."""
  if group_size is not None and w_layout == "nk":
    return ("group scales with w [N, K] (weight_layout='nk'): the TPU kernel "
            "reads group scales along w's rows, so it takes w [K, N]")
  if group_size is not None and group_size % 8:
    return (f"group_size={group_size} is not a multiple of 8 (the TPU "
            "sublane tile)")
  return None


def matmul(x2, w, x_scale, w_scale, w_zero, bias, *, mode, out_dtype,
           w_layout="kn", group_size=None, block_sizes=None, generation=None,
           interpret=False):
  """The normalized operands (``operands.MatmulCall``) of a weight-only call
  or an fp8 x fp8 (dequant / dynamic) call -> [M, N] out_dtype."""
  kn = w_layout == "kn"
  fmt = formats.format_of(w.dtype)
  if mode == "dynamic":  # float x quantized per row into w's format
    x2, x_scale = reference.quantize_groups(x2, fmt, 1, None, True)
    mode = "dequant"
  generation = generation or _backend.target().tpu_generation
  m, k = x2.shape
  n = w.shape[1 if kn else 0]
  native = (mode == "dequant" and x2.dtype == w.dtype
            and bs.fp8_mxu(generation))
  if mode == "weight_only":
    compute_dtype = x2.dtype
  else:
    compute_dtype = None if native else jnp.dtype(jnp.bfloat16)
  x_upcast = mode == "dequant" and not native
  grouped = group_size is not None
  out_dtype = jnp.dtype(out_dtype)
  w_bits = 4 if fmt.name == "int4" else 8
  plan = bs.plan_tpu(
      m, k, n, x_bytes=x2.dtype.itemsize, w_bits=w_bits,
      out_bytes=out_dtype.itemsize,
      compute_bytes=0 if compute_dtype is None else compute_dtype.itemsize,
      generation=generation, group_size=group_size,
      has_zero=w_zero is not None, x_upcast=x_upcast, block_sizes=block_sizes)
  if plan.k_padded != k:
    pad = plan.k_padded - k
    x2 = jnp.pad(x2, ((0, 0), (0, pad)))
    w = jnp.pad(w, ((0, pad), (0, 0)) if kn else ((0, 0), (0, pad)))
    if grouped:
      rows = ((0, pad // group_size), (0, 0))
      w_scale = jnp.pad(w_scale, rows)
      w_zero = None if w_zero is None else jnp.pad(w_zero, rows)
  bm, bk, bn = plan.bm, plan.bk, plan.bn
  nk = plan.k_padded // bk
  grid = (pl.cdiv(m, bm), pl.cdiv(n, bn), nk)

  arrays = [x2, w]
  in_specs = [pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
              pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j)) if kn else
              pl.BlockSpec((bn, bk), lambda i, j, kk: (j, kk))]
  if x_scale is not None:
    arrays.append(x_scale)
    in_specs.append(pl.BlockSpec((bm, 1), lambda i, j, kk: (i, 0)))
  if grouped:
    group_rows = bk // group_size
    for table in (w_scale, w_zero):
      if table is not None:
        arrays.append(table)
        in_specs.append(pl.BlockSpec((group_rows, bn),
                                     lambda i, j, kk: (kk, j)))
  elif w_scale is not None:
    arrays.append(w_scale)
    in_specs.append(pl.BlockSpec((1, bn), lambda i, j, kk: (0, j)))
  if bias is not None:
    arrays.append(bias)
    in_specs.append(pl.BlockSpec((1, bn), lambda i, j, kk: (0, j)))

  kernel = functools.partial(
      _kernel, nk=nk, has_xs=x_scale is not None, has_ws=w_scale is not None,
      has_zero=w_zero is not None, has_b=bias is not None, w_layout=w_layout,
      grouped=grouped, compute_dtype=compute_dtype, x_upcast=x_upcast)
  out_shape = jax.ShapeDtypeStruct((m, n), out_dtype)
  grid_m, grid_n = grid[0], grid[1]
  w_bytes = w.size * w_bits // 8
  bytes_accessed = (grid_n * _cost.nbytes(x2, x_scale)
                    + grid_m * (w_bytes + _cost.nbytes(w_scale, w_zero, bias))
                    + _cost.nbytes(out_shape))
  # Dequantizing a w tile: convert, (subtract,) multiply per value and row
  # tile.
  dequant = grid_m * w.size * (3 if grouped else 1)
  name = f"quantized_matmul_{mode}_{fmt.name}" + ("_grouped" if grouped
                                                   else "")
  return _compat.pallas_call(
      kernel,
      grid=grid,
      in_specs=in_specs,
      out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
      out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)] if nk > 1 else [],
      compiler_params=_compat.tpu_compiler_params(
          dimension_semantics=("parallel", "parallel", "arbitrary"),
          vmem_limit_bytes=plan.vmem_limit_bytes),
      interpret=interpret,
      cost_estimate=_cost.estimate(
          flops=2 * m * n * plan.k_padded + dequant + 4 * m * n,
          bytes_accessed=bytes_accessed),
      name=name,
  )(*arrays)
