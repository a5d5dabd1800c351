"""Block sizes for the int8 matmul kernels, per TPU generation and shape class
("decode" M <= 128, "medium" M <= 1024, "large"): (bm, bk, bn) clamped to the
problem and shrunk to the generation's VMEM budget; ``GPU_TABLE*`` for
Triton. The VMEM model, the tables and why: docs/design/int8.md.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp

MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes for ``int8_matmul(block_sizes=...)``. The x tile is bm x bk, the
  w tile bk x bn, the output tile bm x bn. TPU: bm a multiple of 32, bk and bn
  of 128 (unless the whole dimension); GPU (Triton): powers of two >= 16. The
  other fields are Triton options, None taking the table's value."""
  bm: int
  bk: int
  bn: int
  num_warps: int | None = None
  num_stages: int | None = None
  w_kmajor: bool | None = None   # GPU: feed the kernel w.T (see triton.py)
  split_k: int | None = None     # GPU: K split over this many programs
  group_m: int | None = None     # GPU: row tiles per band of program order
  swap_ab: bool | None = None    # GPU weight-only: compute (w @ x.T).T
  stream_w: bool | None = None   # GPU: load w tiles with evict_first

  def __post_init__(self):
    for name in ("bm", "bk", "bn"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"block_sizes.{name}={value!r} must be a positive int")


# (bm, bk, bn) per generation and shape class; bm None means "all of M".
TPU_TABLE = {
    "v5e": {"decode": (None, 2048, 2048), "medium": (256, 1024, 2048),
            "large": (1024, 1024, 1024)},
    "v6e": {"decode": (None, 4096, 2048), "medium": (512, 1024, 2048),
            "large": (2048, 1024, 1024)},
    "v5p": {"decode": (None, 2048, 2048), "medium": (256, 1024, 2048),
            "large": (1024, 512, 1024)},
    "tpu7x": {"decode": (None, 4096, 2048), "medium": (256, 1024, 2048),
              "large": (1024, 512, 1024)},
    "v4": {"decode": (None, 1024, 1024), "medium": (256, 1024, 1024),
           "large": (512, 1024, 1024)},
    "default": {"decode": (None, 1024, 1024), "medium": (256, 1024, 1024),
                "large": (512, 1024, 1024)},
}
TPU_VMEM = {  # (bytes a config may use, vmem_limit_bytes passed to Mosaic)
    "v5e": (28 * MiB, 48 * MiB), "v6e": (40 * MiB, 64 * MiB),
    "v5p": (28 * MiB, 48 * MiB), "tpu7x": (28 * MiB, 48 * MiB),
    "v4": (12 * MiB, 16 * MiB), "default": (12 * MiB, 16 * MiB),
}
# int8 x int8 modes (raw, dequant, dynamic) where the MXU takes int8: all of
# K = 4096 in one step for large M and a 4096 x 4096 weight per core for
# decode; fewer grid steps issue fewer bundles (docs/design/int8.md, "Fewer,
# larger steps"). Other modes and generations use TPU_TABLE and TPU_VMEM
# (weight-only decode: WEIGHT_ONLY_DECODE_TILES).
# Medium shapes keep TPU_TABLE's tiles.
INT8_X_INT8_TABLE = {
    gen: {**TPU_TABLE[gen], **rows} for gen, rows in {
        "v5e": {"decode": (None, 4096, 4096), "large": (2048, 4096, 1024)},
        "v6e": {"decode": (None, 4096, 4096), "large": (2048, 4096, 1024)},
        "v5p": {"decode": (None, 4096, 2048), "large": (1024, 4096, 1024)},
        "tpu7x": {"decode": (None, 4096, 2048), "large": (1024, 4096, 1024)},
    }.items()}
INT8_X_INT8_VMEM = {
    "v5e": (52 * MiB, 64 * MiB), "v6e": (52 * MiB, 64 * MiB),
    "v5p": (32 * MiB, 48 * MiB), "tpu7x": (32 * MiB, 48 * MiB),
}
# Weight-only decode (M <= 128) with bf16 x, per-channel int8 or fp8 w: the
# kernel widens w to float32 on its way into the MXU (no converted copy in
# VMEM), so one step takes the whole weight per core, as INT8_X_INT8_TABLE's
# decode rows, under INT8_X_INT8_VMEM (docs/design/quantized.md,
# "Weight-only decode on the TPU").
WEIGHT_ONLY_DECODE_TILES = {
    gen: rows["decode"] for gen, rows in INT8_X_INT8_TABLE.items()}
TPU_GENERATIONS = ("v4", "v5e", "v5p", "v6e", "tpu7x")
# Generations whose MXU takes int8 operands; the others run int8 modes
# through bf16 (exact: docs/design/int8.md, "v4").
INT8_MXU = frozenset({"v5e", "v5p", "v6e", "tpu7x"})
# Most int8 x int8 products a float32 sum may hold and stay exact.
EXACT_F32_K = 1024

DECODE_MAX_M = 128
MEDIUM_MAX_M = 1024

# GPU (Triton) configs per shape class of M, for int8 x and for weight-only
# (float x), from H100 sweeps (docs/design/int8.md). split_k 0: automatic,
# enough programs to fill the GPU (GPU_TARGET_PROGRAMS).
GPU_TABLE = {
    "decode": BlockSizes(16, 256, 128, 4, 4, w_kmajor=False, split_k=0,
                         group_m=1),
    "medium": BlockSizes(128, 128, 128, 4, 4, w_kmajor=True, split_k=1,
                         group_m=8),
    "large": BlockSizes(128, 128, 256, 8, 3, w_kmajor=True, split_k=1,
                        group_m=16),
}
GPU_TABLE_WEIGHT_ONLY = {  # the [K, N] weight layout
    "decode": BlockSizes(16, 64, 128, 4, 6, w_kmajor=False, split_k=0,
                         group_m=1, stream_w=True),
    # 16 < M <= 64: one row tile covers M, so w streams once.
    "narrow": BlockSizes(64, 128, 64, 4, 4, w_kmajor=False, split_k=0,
                         group_m=8),
    "small": BlockSizes(64, 128, 64, 4, 4, w_kmajor=False, split_k=1,
                        group_m=8),
    "medium": BlockSizes(128, 64, 128, 4, 3, w_kmajor=False, split_k=1,
                         group_m=8),
    "large": BlockSizes(128, 64, 128, 8, 3, w_kmajor=False, split_k=1,
                        group_m=8),
}
# Weight-only with w stored [N, K] (K-major tiles, no transpose): its own
# decode, narrow and small tiles; medium and large as for [K, N].
GPU_TABLE_WEIGHT_ONLY_NK = dict(
    GPU_TABLE_WEIGHT_ONLY,
    decode=BlockSizes(16, 256, 64, 8, 4, w_kmajor=False, split_k=0, group_m=1,
                      stream_w=True),
    narrow=BlockSizes(64, 128, 64, 4, 3, w_kmajor=False, split_k=0,
                      group_m=8),
    small=BlockSizes(128, 128, 64, 4, 3, w_kmajor=False, split_k=0, group_m=1,
                     swap_ab=True, stream_w=True))
# Weight-only decode is bound by streaming w: the automatic split aims at
# this many programs (about 1.5 per SM, all resident at once), and for w
# [N, K] bn first narrows (down to 32, with at most 4 warps) while the column
# tiles alone number fewer.
GPU_WEIGHT_ONLY_TARGET_PROGRAMS = {"decode": 192, "small": 112}
GPU_WEIGHT_ONLY_SMALL_MAX_M = 256
# Weight-only calls with bf16 x and M in this range (inclusive) run the
# Mosaic GPU kernel on a Hopper GPU, w in either layout; below it the Triton
# kernel is as fast or faster for int8 w, not for float8 w (its float8
# conversion is slower), so float8 w takes it at every M
# (docs/design/int8.md, docs/design/quantized.md). Weight-only classes:
# "decode" up to GPU_WEIGHT_ONLY_DECODE_MAX_M, "narrow" up to
# GPU_DECODE_MAX_M.
GPU_WEIGHT_ONLY_MOSAIC_AUTO_M = (17, 256)
GPU_WEIGHT_ONLY_MOSAIC_AUTO_M_FLOAT8 = (1, 256)
# int4 w (group scales or per channel): w [N, K] at every M; w [K, N], whose
# conversion goes through shared memory, from M = 33 (below it the Triton
# kernel is faster; bench/results/quantized_matmul-int4-mgpu-*).
GPU_WEIGHT_ONLY_MOSAIC_AUTO_M_INT4 = {"nk": (1, 256), "kn": (33, 256)}
GPU_WEIGHT_ONLY_DECODE_MAX_M = 16
GPU_DECODE_MAX_M = 64
GPU_MEDIUM_MAX_M = 2048
GPU_TARGET_PROGRAMS = 264


class GpuPlan(NamedTuple):
  bm: int
  bk: int
  bn: int
  num_warps: int
  num_stages: int
  w_kmajor: bool
  split_k: int
  group_m: int
  swap_ab: bool = False
  stream_w: bool = False


def gpu_weight_only_mosaic_m(w_dtype, w_layout="nk") -> tuple[int, int]:
  """The M range in which weight-only calls with this w dtype take the
  Mosaic GPU kernel."""
  if jnp.dtype(w_dtype) == jnp.dtype(jnp.int8):
    return GPU_WEIGHT_ONLY_MOSAIC_AUTO_M
  if jnp.dtype(w_dtype) == jnp.dtype(jnp.int4):
    return GPU_WEIGHT_ONLY_MOSAIC_AUTO_M_INT4[w_layout]
  return GPU_WEIGHT_ONLY_MOSAIC_AUTO_M_FLOAT8


def shape_class(m: int) -> str:
  if m <= DECODE_MAX_M:
    return "decode"
  return "medium" if m <= MEDIUM_MAX_M else "large"


def gpu_shape_class(m: int) -> str:
  if m <= GPU_DECODE_MAX_M:
    return "decode"
  return "medium" if m <= GPU_MEDIUM_MAX_M else "large"


def round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def largest_divisor_tile(dim: int, target: int, unit: int) -> int:
  """Largest multiple of ``unit`` <= target dividing ``dim`` (a unit multiple)."""
  units = dim // unit
  best = 1
  for d in range(1, min(units, target // unit) + 1):
    if units % d == 0:
      best = d
  return best * unit


def int8_mxu(generation: str | None) -> bool:
  """Whether ``generation``'s MXU multiplies int8 (unknown: assume so)."""
  return generation not in TPU_TABLE or generation in INT8_MXU


def scale_bias_tile_bytes(bm: int, bn: int) -> int:
  """VMEM of the double-buffered x_scale, w_scale and bias tiles (padded to
  (8, 128))."""
  return 2 * (max(bm, 8) * 128 * 4 + 2 * 8 * max(bn, 128) * 4)


def tpu_vmem_bytes(bm, bk, bn, *, x_bytes, out_bytes, accumulator, weight_only,
                   int8_via_bf16=False, w_streamed=False):
  """``w_streamed``: weight-only w widened on its way into the MXU (no
  converted copy)."""
  total = 2 * (bm * bk * x_bytes + bk * bn * 1)
  total += (bm + bn) * min(bk, EXACT_F32_K) * 2 if int8_via_bf16 else 0
  total += bm * bn * 4                      # dot result
  total += bm * bn * 4 if accumulator else 0
  total += 2 * bm * bn * out_bytes
  total += bk * bn * x_bytes if weight_only and not w_streamed else 0
  total += scale_bias_tile_bytes(bm, bn)
  return total


@dataclasses.dataclass(frozen=True)
class TpuPlan:
  bm: int
  bk: int
  bn: int
  k_padded: int
  vmem_bytes: int
  vmem_limit_bytes: int


def check_tpu_block_sizes(block_sizes: BlockSizes, m, k, n, *, k_unit=128,
                          k_unit_reason="") -> tuple[int, int, int]:
  """(bm, bk, bn) of user ``block_sizes``: each a multiple of its TPU unit
  (bm 32, bk ``k_unit``, bn 128) unless it covers its whole dimension;
  ``k_unit_reason`` ends bk's error message."""
  bm, bk, bn = block_sizes.bm, block_sizes.bk, block_sizes.bn
  for name, value, dim, unit in (("bm", bm, m, 32), ("bk", bk, k, k_unit),
                                 ("bn", bn, n, 128)):
    if value < dim and value % unit:
      raise ValueError(f"block_sizes.{name}={value} must be a multiple of "
                       f"{unit} on TPU" + (k_unit_reason if name == "bk"
                                           else ""))
  return bm, bk, bn


def table_tiles(m: int, generation: str | None,
                table=TPU_TABLE) -> tuple[int, int, int]:
  """(bm, bk, bn) of ``table`` for ``generation`` and m's shape class."""
  gen = generation if generation in table else "default"
  bm, bk, bn = table[gen][shape_class(m)]
  return bm or m, bk, bn


def int8_x_int8_tables(mode: str, generation: str | None) -> bool:
  """Whether ``mode`` on ``generation`` plans from ``INT8_X_INT8_TABLE`` and
  ``INT8_X_INT8_VMEM``."""
  return mode != "weight_only" and generation in INT8_X_INT8_TABLE


def weight_only_decode_streams(m: int, generation: str | None,
                               x_dtype) -> bool:
  """Whether a weight-only call with per-channel 8-bit w plans from
  ``WEIGHT_ONLY_DECODE_TILES`` and streams w into the MXU as float32."""
  return (shape_class(m) == "decode" and generation in WEIGHT_ONLY_DECODE_TILES
          and jnp.dtype(x_dtype) == jnp.dtype(jnp.bfloat16))


def tpu_vmem_budget(generation: str | None,
                    mode: str = "weight_only") -> tuple[int, int]:
  """(bytes a config may use, vmem_limit_bytes) of ``mode`` on
  ``generation``."""
  if int8_x_int8_tables(mode, generation):
    return INT8_X_INT8_VMEM[generation]
  return TPU_VMEM.get(generation or "default", TPU_VMEM["default"])


def k_tiling(k: int, bk: int, unit: int) -> tuple[int, int]:
  """(K tile, padded K). All of K when it fits ``bk``; else the largest
  multiple of ``unit`` <= bk that divides K rounded up to ``unit``, or bk
  with K padded to a multiple of it when that divisor is under bk / 4."""
  if k <= bk:
    return k, k
  k_padded = round_up(k, unit)
  tk = largest_divisor_tile(k_padded, bk, unit)
  if tk * 4 < bk:  # a poor divisor: pad K to a multiple of the tile
    return bk, round_up(k, bk)
  return tk, k_padded


def halve_bm(bm: int, m: int) -> int:
  return max(32, round_up(min(bm, m) // 2, 32))


def fit_tpu_plan(m, k, n, tiles, *, k_unit, generation, vmem_bytes,
                 shrink=None, vmem_budget=None) -> TpuPlan:
  """The plan of (bm, bk, bn) ``tiles`` on an [m, k] x [k, n] problem: tiles
  clamped to the problem (N tiles dividing N where one is at least half
  the tile), K tiled by ``k_tiling``. While ``vmem_bytes(tm, tk, tn,
  k_steps)`` exceeds the budget (``vmem_budget``, default the generation's
  ``TPU_VMEM``), ``shrink(bm, bk, bn)`` gives smaller tiles (None, or no
  ``shrink``: keep these). The VMEM limit covers the plan's bytes with 25%
  to spare."""
  budget, limit = vmem_budget or tpu_vmem_budget(generation)
  bm, bk, bn = tiles
  while True:
    tm = m if m <= bm else bm
    tn = n if n <= bn else prefer_divisor(n, bn)
    tk, k_padded = k_tiling(k, bk, k_unit)
    used = vmem_bytes(tm, tk, tn, k_padded // tk)
    if used <= budget or shrink is None:
      break
    smaller = shrink(bm, bk, bn)
    if smaller is None:
      break
    bm, bk, bn = smaller
  limit = max(limit, round_up(int(used * 1.25), MiB))
  return TpuPlan(tm, tk, tn, k_padded, used, limit)


def plan_tpu(m, k, n, *, x_bytes, out_bytes, mode, generation=None,
             block_sizes: BlockSizes | None = None,
             w_streamed: bool = False) -> TpuPlan:
  """Tiles for an [m, k] x [k, n] problem: the shape class's row, clamped to
  the problem and shrunk to the VMEM budget. ``w_streamed``: weight-only
  decode per ``weight_only_decode_streams``."""
  weight_only = mode == "weight_only"
  accumulating_in_scratch = mode != "raw"
  int8_via_bf16 = not weight_only and not int8_mxu(generation)

  def vmem(bm_, bk_, bn_, nk_):
    return tpu_vmem_bytes(bm_, bk_, bn_, x_bytes=x_bytes, out_bytes=out_bytes,
                          accumulator=accumulating_in_scratch and nk_ > 1,
                          weight_only=weight_only, int8_via_bf16=int8_via_bf16,
                          w_streamed=w_streamed)

  def halve_largest(bm, bk, bn):
    """The largest tile dimension that can still shrink, halved."""
    size, which = max([(bk, "k"), (bn, "n"), (bm if m > 32 else 0, "m")])
    if size <= 128 and which != "m" or size == 0:
      return None
    if which == "k":
      return bm, bk // 2, bn
    if which == "n":
      return bm, bk, bn // 2
    return halve_bm(bm, m), bk, bn

  budget = (INT8_X_INT8_VMEM[generation] if w_streamed
            else tpu_vmem_budget(generation, mode))
  if block_sizes is not None:
    return fit_tpu_plan(m, k, n, check_tpu_block_sizes(block_sizes, m, k, n),
                        k_unit=128, generation=generation, vmem_bytes=vmem,
                        vmem_budget=budget)
  if w_streamed:
    tiles = WEIGHT_ONLY_DECODE_TILES[generation]
    tiles = (tiles[0] or m,) + tiles[1:]
  else:
    tiles = table_tiles(m, generation, INT8_X_INT8_TABLE
                        if int8_x_int8_tables(mode, generation) else TPU_TABLE)
  return fit_tpu_plan(m, k, n, tiles, k_unit=128, generation=generation,
                      vmem_bytes=vmem, shrink=halve_largest,
                      vmem_budget=budget)


def prefer_divisor(dim: int, target: int) -> int:
  """A tile <= target dividing dim if one is at least half the target."""
  if dim % 128 == 0:
    tile = largest_divisor_tile(dim, target, 128)
    if tile * 2 >= target:
      return tile
  return target


def _pow2_at_most(x: int) -> int:
  p = 1
  while p * 2 <= x:
    p *= 2
  return p


def pow2_at_least(x: int) -> int:
  p = 1
  while p < x:
    p *= 2
  return p


def check_gpu_block_sizes(block_sizes: BlockSizes) -> None:
  for name in ("bm", "bk", "bn"):
    value = getattr(block_sizes, name)
    if value < 16 or value & (value - 1):
      raise ValueError(f"block_sizes.{name}={value} must be a power of two "
                       ">= 16 on GPU (a Triton requirement)")


def gpu_tiles_for_problem(bm, bk, bn, m, k, n) -> tuple[int, int, int]:
  """Table tiles shrunk towards a small problem: powers of two, bm and bn
  at least 16 and bk at least 32 (Triton dots need 16)."""
  return (min(bm, max(16, pow2_at_least(m))),
          min(bk, max(32, pow2_at_least(k))),
          min(bn, max(16, pow2_at_least(n))))


def clamp_split_k(split: int, k: int, bk: int) -> int:
  """Never split K finer than one tile per program."""
  return max(1, min(split, -(-k // bk)))


def split_k_to_fill(m, k, n, bm, bk, bn, target: int) -> int:
  """The K split (a power of two up to 8) that brings the programs of an
  [m, n] output in bm x bn tiles to ``target``, clamped to K's tiles."""
  programs = -(-m // bm) * -(-n // bn)
  split = 1
  while programs * split < target and split < 8:
    split *= 2
  return clamp_split_k(split, k, bk)


def _weight_only_class(m: int) -> str:
  if m <= GPU_WEIGHT_ONLY_DECODE_MAX_M:
    return "decode"
  if m <= GPU_DECODE_MAX_M:
    return "narrow"
  cls = gpu_shape_class(m)
  return "small" if cls == "medium" and m <= GPU_WEIGHT_ONLY_SMALL_MAX_M else cls


def plan_gpu(m, k, n, *, mode, block_sizes: BlockSizes | None = None,
             w_layout: str = "kn") -> GpuPlan:
  """The Triton plan for an [m, k] x [k, n] problem (tiles powers of two)."""
  target = GPU_TARGET_PROGRAMS
  if block_sizes is not None:
    check_gpu_block_sizes(block_sizes)
    cfg = block_sizes
    bm, bk, bn = cfg.bm, cfg.bk, cfg.bn
  else:
    if mode == "weight_only":
      cls = _weight_only_class(m)
      table = (GPU_TABLE_WEIGHT_ONLY_NK if w_layout == "nk"
               else GPU_TABLE_WEIGHT_ONLY)
      cfg = table.get(cls, GPU_TABLE_WEIGHT_ONLY["medium"])
      target = GPU_WEIGHT_ONLY_TARGET_PROGRAMS.get(cls, target)
    else:
      cfg = GPU_TABLE[gpu_shape_class(m)]
    bm, bk, bn = gpu_tiles_for_problem(cfg.bm, cfg.bk, cfg.bn, m, k, n)
    if (mode == "weight_only" and w_layout == "nk" and cls == "decode"
        and not cfg.swap_ab):
      while bn > 32 and -(-n // bn) < target:
        bn //= 2
      if bn < cfg.bn:
        cfg = dataclasses.replace(cfg, num_warps=min(cfg.num_warps or 4, 4))
  warps = cfg.num_warps or 4
  stages = cfg.num_stages or 3
  kmajor = bool(cfg.w_kmajor)
  split = 1 if cfg.split_k is None else cfg.split_k
  group_m = max(1, cfg.group_m or 1)
  if split == 0:  # auto: enough programs to fill ~132 SMs
    split = split_k_to_fill(m, k, n, bm, bk, bn, target)
  split = clamp_split_k(split, k, bk)
  return GpuPlan(bm, bk, bn, warps, stages, kmajor, split, group_m,
                 bool(cfg.swap_ab) and mode == "weight_only",
                 bool(cfg.stream_w))
