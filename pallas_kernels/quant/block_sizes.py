"""Tiles for the quantized matmul kernels (int4, fp8, grouped int8): the int8
TPU table checked against a VMEM model of the weight conversion and group
tiles, and Triton tiles (powers of two, ``split_k`` for weight-only decode).
The VMEM model: docs/design/quantized.md.
"""
from __future__ import annotations

import dataclasses
import math

from pallas_kernels.quant import int8_block_sizes as int8_bs

BlockSizes = int8_bs.BlockSizes
TpuPlan = int8_bs.TpuPlan
round_up = int8_bs.round_up
pow2_at_least = int8_bs.pow2_at_least
# Generations whose MXU multiplies fp8 operands (others upcast to bf16).
FP8_MXU = frozenset({"tpu7x"})
# Quantized x with group scales: at most this many group dots per K tile
# (each is unrolled in the kernel).
MAX_GROUP_DOTS = 16


def fp8_mxu(generation: str | None) -> bool:
  return generation in FP8_MXU


def k_unit(group_size: int | None) -> int:
  """K tiles are multiples of this: lcm(128, 8 g) with groups (Mosaic wants
  the group scale tile's rows a multiple of 8)."""
  if group_size is None:
    return 128
  return math.lcm(128, 8 * group_size)


def tpu_vmem_bytes(bm, bk, bn, *, x_bytes, w_bits, out_bytes, compute_bytes,
                   accumulator, group_size=None, has_zero=False,
                   x_upcast=False, group_products=False):
  total = 2 * (bm * bk * x_bytes + bk * bn * w_bits // 8)
  total += bm * bn * 4 + (bm * bn * 4 if accumulator else 0)
  total += 2 * bm * bn * out_bytes
  if compute_bytes:  # the tile goes through float32 on its way
    total += bk * bn * (4 + compute_bytes)
  total += bm * bk * (4 + 2) if x_upcast else 0
  if group_size:
    rows = max(8, bk // group_size)
    if group_products:  # a group's product and its scaled copy; x scales
      total += 2 * bm * bn * 4 + 2 * bm * max(128, bk // group_size) * 4
    else:
      total += bk * bn * 4 * (2 if has_zero else 1)
    total += 2 * rows * max(bn, 128) * 4 * (2 if has_zero else 1)
  total += int8_bs.scale_bias_tile_bytes(bm, bn)
  return total


def plan_tpu(m, k, n, *, x_bytes, w_bits, out_bytes, compute_bytes,
             generation=None, group_size=None, has_zero=False,
             x_upcast=False, group_products=False,
             block_sizes: BlockSizes | None = None,
             w_streamed: bool = False) -> TpuPlan:
  """Tiles for an [m, k] x [k, n] problem, shrunk to the VMEM budget;
  ``group_products``: quantized x with group scales (a dot per group);
  ``w_streamed``: weight-only decode whose w is widened on its way into the
  MXU (``int8_bs.weight_only_decode_streams``: its tiles and budget, no
  converted copy)."""
  unit = k_unit(group_size)
  budget = None
  if w_streamed:
    compute_bytes = 0
    budget = int8_bs.INT8_X_INT8_VMEM[generation]

  def vmem(tm, tk, tn, nk):
    return tpu_vmem_bytes(tm, tk, tn, x_bytes=x_bytes, w_bits=w_bits,
                          out_bytes=out_bytes, compute_bytes=compute_bytes,
                          accumulator=nk > 1, group_size=group_size,
                          has_zero=has_zero, x_upcast=x_upcast,
                          group_products=group_products)

  def halve_largest(bm, bk, bn):
    """The largest tile dimension above its unit, halved (bk keeping the
    unit)."""
    size, which = max([(bk if bk > unit else 0, "k"),
                       (bn if bn > 128 else 0, "n"),
                       (bm if bm > 32 and m > 32 else 0, "m")])
    if size == 0:
      return None
    if which == "k":
      return bm, max(unit, bk // 2 // unit * unit), bn
    if which == "n":
      return bm, bk, bn // 2
    return int8_bs.halve_bm(bm, m), bk, bn

  if block_sizes is not None:
    tiles = int8_bs.check_tpu_block_sizes(
        block_sizes, m, k, n, k_unit=unit,
        k_unit_reason=f" (group_size={group_size})" if group_size else "")
    return int8_bs.fit_tpu_plan(m, k, n, tiles, k_unit=unit,
                                generation=generation, vmem_bytes=vmem,
                                vmem_budget=budget)
  if w_streamed:
    bm, bk, bn = int8_bs.WEIGHT_ONLY_DECODE_TILES[generation]
    bm = bm or m
  else:
    bm, bk, bn = int8_bs.table_tiles(m, generation)
  if group_products:  # each group is a dot of its own, unrolled per K tile
    bk = min(bk, max(unit, MAX_GROUP_DOTS * group_size))
  return int8_bs.fit_tpu_plan(m, k, n, (bm, max(unit, bk // unit * unit), bn),
                              k_unit=unit, generation=generation,
                              vmem_bytes=vmem, shrink=halve_largest,
                              vmem_budget=budget)


# ------------------------------------------------------------------- GPU

@dataclasses.dataclass(frozen=True)
class GpuPlan:
  bm: int
  bk: int
  bn: int
  num_warps: int
  num_stages: int
  split_k: int
  stream_w: bool = False


# bm, bk, bn, warps, stages per class of M (weight-only: w dominates).
GPU_TABLE = {
    "decode": (16, 128, 64, 4, 4),     # M <= 16
    "narrow": (64, 64, 64, 4, 4),      # M <= 64
    "small": (64, 64, 128, 4, 3),      # M <= 256
    "large": (128, 64, 128, 8, 3),
}
# int4 weight-only (H100 sweeps, docs/design/quantized.md): one row tile
# covers M up to 256, so w is decoded once, and the K split fills the GPU;
# up to "narrow" w streams (evict-first loads).
GPU_TABLE_INT4 = dict(
    GPU_TABLE,
    decode=(16, 64, 256, 4, 4),
    narrow=(64, 64, 128, 4, 4),
    small=(128, 64, 64, 4, 4),
)
GPU_INT4_OVER_128 = (256, 64, 64, 8, 3)  # int4, 128 < M <= 256
GPU_TABLE_FP8 = (128, 128, 128, 8, 3)  # fp8 x fp8 (dequant)
GPU_TARGET_PROGRAMS = 192
# The K split is a power of two up to this, each program keeping at least
# MIN_STEPS_PER_PROGRAM K steps.
GPU_MAX_SPLIT_K = 32
MIN_STEPS_PER_PROGRAM = 4


def gpu_class(m: int) -> str:
  if m <= 16:
    return "decode"
  if m <= 64:
    return "narrow"
  return "small" if m <= 256 else "large"


def split_k_to_fill(m, k, n, bm, bk, bn, target: int) -> int:
  """The smallest power-of-two K split that brings the programs of an
  [m, n] output in bm x bn tiles to ``target`` (GPU_MAX_SPLIT_K at most,
  each program MIN_STEPS_PER_PROGRAM K steps at least)."""
  programs = -(-m // bm) * -(-n // bn)
  steps = -(-k // bk)
  split = 1
  while (programs * split < target and split < GPU_MAX_SPLIT_K
         and steps // (2 * split) >= MIN_STEPS_PER_PROGRAM):
    split *= 2
  return split


def plan_gpu(m, k, n, *, mode, group_size=None, int4=False,
             block_sizes: BlockSizes | None = None) -> GpuPlan:
  """The Triton plan: powers of two >= 16; bk divides group_size."""
  if block_sizes is not None:
    int8_bs.check_gpu_block_sizes(block_sizes)
    bm, bk, bn = block_sizes.bm, block_sizes.bk, block_sizes.bn
    warps = block_sizes.num_warps or 4
    stages = block_sizes.num_stages or 3
    split = block_sizes.split_k or 1
    if group_size is not None and group_size % bk:
      raise ValueError(f"block_sizes.bk={bk} must divide group_size="
                       f"{group_size} on GPU (one scale row per K step)")
    if int4 and bn < 32:
      raise ValueError(f"block_sizes.bn={bn} must be >= 32 for int4 w on "
                       "GPU (16 bytes of two values each)")
    return GpuPlan(bm, bk, bn, warps, stages, split,
                   bool(block_sizes.stream_w))
  cls = gpu_class(m)
  table = GPU_TABLE_INT4 if int4 else GPU_TABLE
  bm, bk, bn, warps, stages = (
      GPU_TABLE_FP8 if mode == "dequant" else
      GPU_INT4_OVER_128 if int4 and cls == "small" and m > 128 else
      table[cls])
  bm, bk, bn = int8_bs.gpu_tiles_for_problem(bm, bk, bn, m, k, n)
  if int4:
    bn = max(bn, 32)
  if group_size is not None:
    while group_size % bk:
      bk //= 2
  split = 1
  stream = mode == "weight_only" and (cls == "decode" or int4
                                      and cls == "narrow")
  if stream or int4 and cls == "small":
    split = split_k_to_fill(m, k, n, bm, bk, bn, GPU_TARGET_PROGRAMS)
  return GpuPlan(bm, bk, bn, warps, stages, split, stream)
