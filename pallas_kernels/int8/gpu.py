"""GPU (Triton-lowered Pallas) int8 matmul with the same semantics as the TPU one.

Grid (M/bm, N/bn); each program walks K in a ``fori_loop`` (Triton
software-pipelines it, ``num_stages`` deep): int8 x int8 -> int32 dots on the
tensor cores (``jnp.dot(..., preferred_element_type=jnp.int32)``), or for
weight-only mode the int8 w tile upcast to x's dtype in registers, then a
float32-accumulating dot. The epilogue (x_scale [bm, 1], w_scale [1, bn],
bias [1, bn], cast) runs on the accumulator in registers before the single
store, so no int32 matrix is written to HBM.

Weight layout. Hopper's wgmma takes 8-bit operands only K-major, so with
``w_kmajor`` the wrapper hands the kernel w.T ([N, K], one XLA transpose of
w per call) and the kernel contracts both operands' last dimension; without
it the kernel reads w [K, N] directly. The block-size table says which
layout each shape class uses (measured on an H100, see the bench).

bf16 tensor cores for int8 (``int8_via_bf16``, for memory-bound shapes
whose w stays [K, N]): each tile's x and w are upcast to bfloat16 (exact for
int8), multiplied with float32 accumulation and the tile's sum converted to
int32 before it joins the int32 accumulator. Exact: a tile sums at most
bk <= 1024 products of magnitude <= 2**14, so every partial sum is an integer
below 2**24 that float32 holds exactly. It runs at the bf16 rate, which
memory-bound shapes do not reach, and needs no transpose of w.

Split K (``split_k`` > 1, for small M where M/bm x N/bn programs cannot
fill the GPU): a third grid axis gives each program 1/split_k of K; it
writes its scaled float32 partial sum (int32 in raw mode), and one XLA pass
sums the split_k partials, adds the bias and casts. The partials are
split_k x M x N (small for the decode shapes it is meant for); the float
result may differ from the unsplit one by a few roundings.

Measured on an H100 (bench/results/int8_matmul-h100-2026-11-22.json, jax
0.11.2, triton 3.6; ratios are peer time / ours):
  8192^3       fused bf16 1.21 ms = 908 TOP/s: 6.96x torch._int_mm, 1.32x XLA
               int8, 1.17x torch bf16 (target 1.25x: missed), 1.28x XLA bf16
  2048x4096x14336  fused 0.38 ms: 5.05x torch._int_mm, 1.88x XLA int8,
               0.83x torch bf16, 1.13x XLA bf16
  M = 128      fused 0.41-0.48x torch bf16: the per-call transpose of w (~35
               us) and too few programs dominate
  M = 16       fused 0.74-0.81x torch bf16, 0.81-0.89x XLA int8; weight-only
               0.69-0.73x torch bf16 (target 1.5x: missed): these memory-bound
               shapes reach ~1 TB/s of the 3.35 TB/s HBM
The K-major switch was worth 3-9x at M >= 128 (int8 MMA with w [K, N] runs
at ~105 TOP/s); int8_via_bf16 lost at every shape and is off by default.

Triton needs power-of-two tiles, so M, N and K are zero-padded to tile
multiples (a copy of x and/or w when a dimension is not a multiple: the LLM
shapes in the bench need none). The w8a8 dynamic pre-pass (row quantization)
uses XLA here, which fuses it into one kernel on GPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _compat
from pallas_kernels._compat import pl
from pallas_kernels.int8 import block_sizes as bs
from pallas_kernels.int8 import reference


def _matmul_kernel(*refs, mode, nk, bk, has_xs, has_ws, has_b, w_kmajor,
                   split, via_bf16):
  x_ref, w_ref, xs_ref, ws_ref, b_ref, o_ref, refs = (
      reference.split_kernel_refs(refs, has_xs=has_xs, has_ws=has_ws,
                                  has_b=has_b))
  bm, bn = o_ref.shape[-2:]
  weight_only = mode == "weight_only"
  acc_dtype = jnp.float32 if weight_only else jnp.int32
  first = pl.program_id(2) * nk if split else 0

  def step(kk, acc):
    start = pl.multiple_of((first + kk) * bk, bk)
    x = x_ref[:, pl.ds(start, bk)]
    if w_kmajor:  # w is [N, K]: contract both operands' last dimension
      w = w_ref[:, pl.ds(start, bk)]
      dims = (((1,), (1,)), ((), ()))
    else:
      w = w_ref[pl.ds(start, bk), :]
      dims = (((1,), (0,)), ((), ()))
    if weight_only:
      precision = (jax.lax.Precision.HIGHEST if x.dtype == jnp.float32
                   else jax.lax.Precision.DEFAULT)
      return acc + jax.lax.dot_general(x, w.astype(x.dtype), dims,
                                       precision=precision,
                                       preferred_element_type=jnp.float32)
    if via_bf16:  # exact: each tile's sum stays within float32's 2**24
      part = jax.lax.dot_general(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                                 dims, preferred_element_type=jnp.float32)
      return acc + part.astype(jnp.int32)
    return acc + jax.lax.dot_general(x, w, dims,
                                     preferred_element_type=jnp.int32)

  acc = jax.lax.fori_loop(0, nk, step, jnp.zeros((bm, bn), acc_dtype))
  if mode == "raw":
    o_ref[...] = acc
  elif split:  # scaled float32 partial sum; the bias is added after the sum
    o_ref[...] = reference.epilogue(
        acc, None if xs_ref is None else xs_ref[...],
        None if ws_ref is None else ws_ref[...], None, jnp.float32)
  else:
    o_ref[...] = reference.epilogue(
        acc, None if xs_ref is None else xs_ref[...],
        None if ws_ref is None else ws_ref[...],
        None if b_ref is None else b_ref[...], o_ref.dtype)


def _pad_to(a, shape, value=0):
  pads = [(0, t - s) for s, t in zip(a.shape, shape)]
  if all(p == (0, 0) for p in pads):
    return a
  return jnp.pad(a, pads, constant_values=value)


def matmul(x2, w, x_scale, w_scale, bias, *, mode, out_dtype, block_sizes=None,
           interpret=False):
  """[M, K] x [K, N] for modes raw / dequant / dynamic / weight_only."""
  if mode == "dynamic":
    x2, x_scale = reference.quantize_xla(x2, axis=-1)
    mode = "dequant"
  m, k = x2.shape
  n = w.shape[1]
  out_dtype = jnp.dtype(jnp.int32 if mode == "raw" else out_dtype)
  bm, bk, bn, warps, stages, w_kmajor, split, via_bf16 = bs.plan_gpu(
      m, k, n, mode=mode, block_sizes=block_sizes)
  mp, kp, np_ = (bs.round_up(m, bm), bs.round_up(k, bk * split),
                 bs.round_up(n, bn))
  operands = [_pad_to(x2, (mp, kp))]
  in_specs = [pl.BlockSpec((bm, kp), lambda i, j, s: (i, 0))]
  if w_kmajor:
    operands.append(_pad_to(w.T, (np_, kp)))
    in_specs.append(pl.BlockSpec((bn, kp), lambda i, j, s: (j, 0)))
  else:
    operands.append(_pad_to(w, (kp, np_)))
    in_specs.append(pl.BlockSpec((kp, bn), lambda i, j, s: (0, j)))
  if x_scale is not None:
    operands.append(_pad_to(x_scale, (mp, 1), 1))
    in_specs.append(pl.BlockSpec((bm, 1), lambda i, j, s: (i, 0)))
  fused_bias = bias if split == 1 else None
  for row_vector in (w_scale, fused_bias):
    if row_vector is not None:
      operands.append(_pad_to(row_vector, (1, np_)))
      in_specs.append(pl.BlockSpec((1, bn), lambda i, j, s: (0, j)))
  kernel = functools.partial(
      _matmul_kernel, mode=mode, nk=kp // bk // split, bk=bk,
      has_xs=x_scale is not None, has_ws=w_scale is not None,
      has_b=fused_bias is not None, w_kmajor=w_kmajor, split=split > 1,
      via_bf16=via_bf16 and mode != "weight_only")
  if split == 1:
    out_spec = pl.BlockSpec((bm, bn), lambda i, j, s: (i, j))
    out_struct = jax.ShapeDtypeStruct((mp, np_), out_dtype)
  else:
    out_spec = pl.BlockSpec((None, bm, bn), lambda i, j, s: (s, i, j))
    out_struct = jax.ShapeDtypeStruct(
        (split, mp, np_), jnp.int32 if mode == "raw" else jnp.float32)
  out = pl.pallas_call(
      kernel,
      grid=(mp // bm, np_ // bn, split),
      in_specs=in_specs,
      out_specs=out_spec,
      out_shape=out_struct,
      compiler_params=_compat.gpu_compiler_params(num_warps=warps,
                                                  num_stages=stages),
      interpret=interpret,
  )(*operands)
  if split > 1:
    out = out.sum(axis=0)
    if mode != "raw":
      if bias is not None:
        out = out + _pad_to(bias, (1, np_))
      out = out.astype(out_dtype)
  if (mp, np_) != (m, n):
    out = out[:m, :n]
  return out
