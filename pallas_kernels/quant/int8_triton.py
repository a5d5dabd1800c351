"""int8 matmul for NVIDIA GPUs: Pallas lowered through Triton.

Grid (M/bm, N/bn, split_k); each program walks its K range in a pipelined
``fori_loop`` of int8 tensor-core dots (or upcast weight-only dots) and runs
the epilogue before its one store. ``GpuPlan`` switches (group_m, split_k,
swap_ab, stream_w): docs/design/int8.md.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _compat, _cost
from pallas_kernels._compat import pl
from pallas_kernels.quant import int8_block_sizes as bs
from pallas_kernels.quant import int8_operands as operands, int8_quantize as quant


def _matmul_kernel(*refs, mode, nk, bk, has_xs, has_ws, has_b, w_kmajor,
                   split, swap_ab=False, stream_w=False):
  x_ref, w_ref, xs_ref, ws_ref, b_ref, o_ref, refs = (
      operands.split_kernel_refs(refs, has_xs=has_xs, has_ws=has_ws,
                                 has_b=has_b))
  bm, bn = o_ref.shape[-2:]
  weight_only = mode == "weight_only"
  acc_dtype = jnp.float32 if weight_only else jnp.int32
  first = pl.program_id(2) * nk if split else 0
  dims = (((1,), (1,)), ((), ())) if w_kmajor else (((1,), (0,)), ((), ()))
  # swap_ab: w is the left operand (w tile [bn, bk] @ x tile.T), so the
  # tensor cores take the upcast w from registers and bn fills their M.
  swapped_dims = (((1 if w_kmajor else 0,), (1,)), ((), ()))

  def load_w(window):
    if stream_w:  # read once: keep x and the partials in L2 instead
      from jax.experimental.pallas import triton as pltriton
      return pltriton.load(w_ref.at[window], eviction_policy="evict_first")
    return w_ref[window]

  def step(kk, acc):
    start = pl.multiple_of((first + kk) * bk, bk)
    x = x_ref[:, pl.ds(start, bk)]
    if w_kmajor:  # w is [N, K]: contract both operands' last dimension
      w = load_w((slice(None), pl.ds(start, bk)))
    else:
      w = load_w((pl.ds(start, bk), slice(None)))
    if weight_only:
      precision = (jax.lax.Precision.HIGHEST if x.dtype == jnp.float32
                   else jax.lax.Precision.DEFAULT)
      if swap_ab:
        return acc + jax.lax.dot_general(w.astype(x.dtype), x, swapped_dims,
                                         precision=precision,
                                         preferred_element_type=jnp.float32)
      return acc + jax.lax.dot_general(x, w.astype(x.dtype), dims,
                                       precision=precision,
                                       preferred_element_type=jnp.float32)
    return acc + jax.lax.dot_general(x, w, dims,
                                     preferred_element_type=jnp.int32)

  acc_shape = (bn, bm) if swap_ab else (bm, bn)
  acc = jax.lax.fori_loop(0, nk, step, jnp.zeros(acc_shape, acc_dtype))
  if swap_ab:
    acc = acc.T
  if mode == "raw" or split:  # split K: the epilogue follows the sum
    o_ref[...] = acc
  else:
    o_ref[...] = quant.epilogue_from_refs(acc, xs_ref, ws_ref, b_ref,
                                          o_ref.dtype)


def _pad_to(a, shape, value=0):
  pads = [(0, t - s) for s, t in zip(a.shape, shape)]
  if all(p == (0, 0) for p in pads):
    return a
  return jnp.pad(a, pads, constant_values=value)


def _tile_order(ni, nj, group_m):
  """(grid, tile(p, q) -> (i, j)): the output tile each program computes.
  group_m > 1 launches one flat program axis in bands: consecutive programs walk
  down group_m row tiles of one column tile, then the next column tile, so the
  programs resident together share their x rows and w columns in L2."""
  if group_m <= 1 or ni == 1:
    return (ni, nj), lambda p, q: (p, q)
  per_band = group_m * nj

  def tile(p, q):
    del q
    band = p // per_band
    first = band * group_m
    rows = jnp.minimum(ni - first, group_m)
    local = p % per_band
    return first + local % rows, local // rows

  return (ni * nj, 1), tile


def split_k_call(kernel, operands, in_specs, *, grid, tile, plan, padded,
                 out_dtype, partial_dtype, x_side, w_side, name, interpret):
  """The Triton matmuls' launch over ``(*grid, split)``: program (p, q, s)
  writes the [bm, bn] output tile ``tile(p, q)`` of the padded [mp, np]
  result (``padded`` = (mp, kp, np)); with a K split (``plan.split_k`` > 1)
  each part writes its own ``partial_dtype`` partial product and the parts
  are summed (exact for int32). The cost counts each program streaming its
  x rows (``x_side`` arrays) and w columns (``w_side``) once."""
  mp, kp, np_ = padded
  bm, bn, split = plan.bm, plan.bn, plan.split_k
  if split == 1:
    out_spec = pl.BlockSpec((bm, bn), lambda p, q, s: tile(p, q))
    out_struct = jax.ShapeDtypeStruct((mp, np_), out_dtype)
  else:
    out_spec = pl.BlockSpec((None, bm, bn), lambda p, q, s: (s, *tile(p, q)))
    out_struct = jax.ShapeDtypeStruct((split, mp, np_), partial_dtype)
  bytes_accessed = ((np_ // bn) * _cost.nbytes(*x_side)
                    + (mp // bm) * _cost.nbytes(*w_side)
                    + _cost.nbytes(out_struct))
  out = _compat.pallas_call(
      kernel,
      grid=(*grid, split),
      in_specs=in_specs,
      out_specs=out_spec,
      out_shape=out_struct,
      compiler_params=_compat.gpu_compiler_params(
          num_warps=plan.num_warps, num_stages=plan.num_stages),
      interpret=interpret,
      cost_estimate=_cost.estimate(flops=2 * mp * np_ * kp,
                                   bytes_accessed=bytes_accessed),
      name=name,
  )(*operands)
  return out.sum(axis=0) if split > 1 else out


def matmul(x2, w, x_scale, w_scale, bias, *, mode, out_dtype, block_sizes=None,
           w_layout="kn", interpret=False):
  """The normalized operands (``operands.MatmulCall``) -> [M, N] out_dtype
  for modes raw / dequant / dynamic / weight_only; w is [K, N], or [N, K]
  for w_layout "nk". ``block_sizes`` (``BlockSizes``) overrides the table.
  ``interpret``: run in Pallas' generic interpreter."""
  if mode == "dynamic":
    x2, x_scale = quant.quantize(x2, axis=-1)
    mode = "dequant"
  m, k = x2.shape
  n = w.shape[1 if w_layout == "kn" else 0]
  out_dtype = jnp.dtype(jnp.int32 if mode == "raw" else out_dtype)
  plan = bs.plan_gpu(m, k, n, mode=mode, block_sizes=block_sizes,
                     w_layout=w_layout)
  w_kmajor = plan.w_kmajor or w_layout == "nk"
  bm, bk, bn, split = plan.bm, plan.bk, plan.bn, plan.split_k
  mp, kp, np_ = (bs.round_up(m, bm), bs.round_up(k, bk * split),
                 bs.round_up(n, bn))
  grid, tile = _tile_order(mp // bm, np_ // bn, plan.group_m)
  operands = [_pad_to(x2, (mp, kp))]
  in_specs = [pl.BlockSpec((bm, kp), lambda p, q, s: (tile(p, q)[0], 0))]
  if w_layout == "nk":
    operands.append(_pad_to(w, (np_, kp)))
    in_specs.append(pl.BlockSpec((bn, kp), lambda p, q, s: (tile(p, q)[1], 0)))
  elif w_kmajor:
    operands.append(_pad_to(w, (kp, np_)).T)  # K-major for the int8 MMA
    in_specs.append(pl.BlockSpec((bn, kp), lambda p, q, s: (tile(p, q)[1], 0)))
  else:
    operands.append(_pad_to(w, (kp, np_)))
    in_specs.append(pl.BlockSpec((kp, bn), lambda p, q, s: (0, tile(p, q)[1])))
  # Split K: the programs write partial accumulators, the epilogue follows
  # their sum.
  fused = (x_scale, w_scale, bias) if split == 1 else (None, None, None)
  if fused[0] is not None:
    operands.append(_pad_to(fused[0], (mp, 1), 1))
    in_specs.append(pl.BlockSpec((bm, 1), lambda p, q, s: (tile(p, q)[0], 0)))
  for row_vector in fused[1:]:
    if row_vector is not None:
      operands.append(_pad_to(row_vector, (1, np_)))
      in_specs.append(pl.BlockSpec((1, bn),
                                   lambda p, q, s: (0, tile(p, q)[1])))
  kernel = functools.partial(
      _matmul_kernel, mode=mode, nk=kp // bk // split, bk=bk,
      has_xs=fused[0] is not None, has_ws=fused[1] is not None,
      has_b=fused[2] is not None, w_kmajor=w_kmajor, split=split > 1,
      swap_ab=plan.swap_ab, stream_w=plan.stream_w)
  out = split_k_call(
      kernel, operands, in_specs, grid=grid, tile=tile, plan=plan,
      padded=(mp, kp, np_), out_dtype=out_dtype,
      partial_dtype=jnp.float32 if mode == "weight_only" else jnp.int32,
      x_side=(operands[0], fused[0]), w_side=(operands[1], *fused[1:]),
      name=f"int8_matmul_{mode}_gpu", interpret=interpret)[:m, :n]
  if split > 1 and mode != "raw":
    out = quant.epilogue(out, x_scale, w_scale, bias, out_dtype)
  return out
