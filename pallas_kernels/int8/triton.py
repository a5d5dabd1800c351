"""GPU (Triton-lowered Pallas) int8 matmul with the same semantics as the TPU one.

Grid (M/bm, N/bn, split_k); each program walks K in a ``fori_loop`` (Triton
software-pipelines it, ``num_stages`` deep): int8 x int8 -> int32 dots on the
tensor cores (``jnp.dot(..., preferred_element_type=jnp.int32)``), or for
weight-only mode the int8 w tile upcast to x's dtype in registers, then a
float32-accumulating dot. The epilogue (x_scale [bm, 1], w_scale [1, bn],
bias [1, bn], cast) runs on the accumulator in registers before the single
store, so no int32 matrix is written to HBM.

Program order (``group_m`` > 1): one flat program axis walks the output in
bands of group_m row tiles, down a band's rows for one column tile before
the next, so the ~132 programs resident together share their x rows and w
columns in L2 (the plain order streams all of x once per column pair).

Weight layout. Hopper's wgmma takes 8-bit operands only K-major, so with
``w_kmajor`` the wrapper hands the kernel w.T ([N, K], one transpose of w
per call, ``transpose``) and the kernel contracts both operands' last
dimension; without it the kernel reads w [K, N] directly, and Triton turns
each int8 tile through shared memory (int8 MMA at ~105 TOP/s). The
transpose of an 8192^2 int8 w costs 104 us (~1.3 TB/s, XLA's or the
``packed`` Pallas kernel here: both tie), ~9% of the 8192^3 product.

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

Weight-only decode (M <= 64; w8a16) is bound by streaming the int8 w once:
K N bytes, half of bf16's. Switches (BlockSizes / GpuPlan):
  swap_ab    the tile is computed as (w_tile @ x_tile.T).T, so the upcast
             w is the tensor cores' left operand (straight from registers)
             and bn fills their M; best at M = 128, 10-60% slower at 16.
  stream_w   w tiles are loaded with evict_first (read once; x, which every
             column tile re-reads, stays in L2).
  stagger_k  column tile j walks its K blocks from block j % nk on, so the
             programs running together read different parts of x and of
             w's rows (an option; not yet measured on a GPU).
The table (block_sizes.GPU_TABLE_WEIGHT_ONLY_NK, w [N, K]) takes bk 256,
bn 64, no split where N / 64 gives >= 192 column tiles (about 1.5 per SM,
all resident at once), else bn 32 and split K up to that many programs.

Measured on an H100 (jax 0.11.2, triton 3.6; ratios peer time / ours; JAX
programs of R calls with the host's sync hidden; one run each):
  bench/results/int8_matmul-h100-2026-11-22.json (this session):
  M = 16    weight-only, w [N, K]: 31.8 / 32.8 us (K, N = 4096/14336 /
            14336/4096) = 1.85 / 1.79 TB/s of w: 1.53x / 1.40x torch bf16
            (48.7 / 45.8 us), 1.56x / 1.49x XLA bf16, 1.15x / 1.05x XLA's
            own fused w8a16. w [K, N]: 36.0 / 36.5 us (1.35x / 1.26x torch
            bf16). Last session (w [K, N] only): 54 / 45 us.
  M = 128   weight-only, w [N, K]: 52.9 / 61.0 us: 0.90x / 0.89x torch bf16
            (0.93x / 0.97x XLA bf16); w [K, N] 65.1 / 64.5 us (0.73x /
            0.85x). 1.5x over bf16 is out of reach here: the product is
            15 GFLOP, ~19 us at the bf16 peak, beside streaming w (~20 us).
  M = 2048  fused int8 (x, w int8, scales, bias -> bf16), w [N, K]: 293 /
            317 us (K, N = 14336/4096 / 4096/14336): 1.05x / 0.99x torch
            bf16, 1.16x / 1.12x XLA bf16, 6.6x / 6.1x torch._int_mm;
            w [K, N] (transpose per call) 322 / 365 us (0.95x / 0.86x).
  8192^3    (int8_matmul_square-h100-*, last session; these kernels are
            unchanged) fused 1093 us = 1.28x torch bf16 (1.21x XLA int8,
            7.7x torch._int_mm), w [N, K] 1113 us (1.25x); raw [N, K]
            1083 us (1.29x). Grouped order (group_m 16) gave 5-7%.
Tried and dropped (bench/results/int8_matmul_sweep-h100-* and
int8_matmul_decode_sweep-h100-*): upcasting w as int16 column pairs and
swap_ab with w [K, N] were 5-60% slower for weight-only at M = 16;
int8_via_bf16 lost at every shape; a Pallas transpose turning int8 tiles
(128 us) lost to XLA's; a finer K split where the column tiles alone fill
the GPU (M = 16, N = 14336: split 2, 44 us vs 34) and bk 512 or 64.

Mosaic GPU kernel for weight-only decode (mosaic_gpu.py: TMA ring filled by
a memory warpgroup, int8 w converted to bf16 in registers as the wgmma's
left operand, the epilogue fused where K is not split, x tiles multicast to
CTA pairs at M > 64): on a Hopper GPU ``matmul`` runs it for weight-only
calls with w [N, K], bf16 x and M in block_sizes.GPU_WEIGHT_ONLY_MOSAIC_AUTO_M
(65..128: 43.0 / 44.1 us at M = 128, 1.27x / 1.41x this Triton kernel,
1.11x / 1.24x torch bf16; bench/results/int8_matmul_128-h100-*), or
wherever it applies with PALLAS_KERNELS_INT8_GPU_WEIGHT_ONLY=mosaic
("triton": never). Interpret mode always runs the Triton kernel.
Latest M = 16 run (int8_matmul_16-h100-2026-11-23, stop 13; the bench
now times the steady-state slope, which no longer counts each sample's one
program dispatch and wait, ~5 us per call before): this kernel 24.8 / 25.4
us = 1.92x / 1.74x torch bf16 (47.7 / 44.0 us), 1.69x / 1.67x XLA bf16;
the kernels alone (profiler) 25.4 / 25.3 us against cuBLAS's 46.0 / 42.7
us (1.81x / 1.69x), i.e. w streams at 2.3 TB/s, about what cuBLAS reaches
reading the same 58.7 MB as bf16 (24.2 us at 16 x 4096 x 7168).
Tried there without gain: w pre-tiled so each [bn, bk] tile is contiguous,
and a PTX bit-trick int8 -> bf16 upcast instead of Triton's conversion
(int8_matmul_upcast_delay_probe).

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
from pallas_kernels.int8 import operands, quant


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
  if mode == "raw":
    o_ref[...] = acc
  elif split:  # scaled float32 partial sum; the bias is added after the sum
    o_ref[...] = quant.epilogue(
        acc, None if xs_ref is None else xs_ref[...],
        None if ws_ref is None else ws_ref[...], None, jnp.float32)
  else:
    o_ref[...] = quant.epilogue(
        acc, None if xs_ref is None else xs_ref[...],
        None if ws_ref is None else ws_ref[...],
        None if b_ref is None else b_ref[...], o_ref.dtype)


def _pad_to(a, shape, value=0):
  pads = [(0, t - s) for s, t in zip(a.shape, shape)]
  if all(p == (0, 0) for p in pads):
    return a
  return jnp.pad(a, pads, constant_values=value)


def _tile_order(ni, nj, group_m):
  """(grid, tile(p, q) -> (i, j)): the output tile each program computes.

  group_m > 1 launches one flat program axis in bands: consecutive programs
  walk down group_m row tiles of one column tile, then the next column tile,
  so the programs resident together share their x rows and w columns in L2.
  """
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


def matmul(x2, w, x_scale, w_scale, bias, *, mode, out_dtype, block_sizes=None,
           w_layout="kn", interpret=False):
  """[M, K] x [K, N] (w [N, K] for w_layout "nk": read K-major as it is, no
  transpose) for modes raw / dequant / dynamic / weight_only."""
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
  if x_scale is not None:
    operands.append(_pad_to(x_scale, (mp, 1), 1))
    in_specs.append(pl.BlockSpec((bm, 1), lambda p, q, s: (tile(p, q)[0], 0)))
  fused_bias = bias if split == 1 else None
  for row_vector in (w_scale, fused_bias):
    if row_vector is not None:
      operands.append(_pad_to(row_vector, (1, np_)))
      in_specs.append(pl.BlockSpec((1, bn),
                                   lambda p, q, s: (0, tile(p, q)[1])))
  kernel = functools.partial(
      _matmul_kernel, mode=mode, nk=kp // bk // split, bk=bk,
      has_xs=x_scale is not None, has_ws=w_scale is not None,
      has_b=fused_bias is not None, w_kmajor=w_kmajor, split=split > 1,
      swap_ab=plan.swap_ab, stream_w=plan.stream_w)
  if split == 1:
    out_spec = pl.BlockSpec((bm, bn), lambda p, q, s: tile(p, q))
    out_struct = jax.ShapeDtypeStruct((mp, np_), out_dtype)
  else:
    out_spec = pl.BlockSpec((None, bm, bn), lambda p, q, s: (s, *tile(p, q)))
    out_struct = jax.ShapeDtypeStruct(
        (split, mp, np_), jnp.int32 if mode == "raw" else jnp.float32)
  out = pl.pallas_call(
      kernel,
      grid=(*grid, split),
      in_specs=in_specs,
      out_specs=out_spec,
      out_shape=out_struct,
      compiler_params=_compat.gpu_compiler_params(
          num_warps=plan.num_warps, num_stages=plan.num_stages),
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
