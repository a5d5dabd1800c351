"""Tile sizes (boxes per tile) of the NMS kernels.

TPU: the (T, T) float32 suppression matrix lives in VMEM (T = 512: 1 MiB) and
an (8, T) IoU block is T / 128 vregs; T is the smallest of 128/256/512 that
holds the whole image, else 512 (fewer stored slabs to revisit, matvec
still a single MXU pass per 128 rows).

GPU, bitmask design (used while a mask chunk fits GPU_BITMASK_MAX_BYTES):
the mask kernel's program covers MASK_ROWS boxes x MASK_WORDS words (32
boxes each); rows go in chunks of MASK_CHUNK_ROWS; the scan kernel runs
SCAN_WARPS warps per image (None: by row length). Measured on H100 at
N = 20k (bench/results/nms-h100-2026-11-22.json, "tune"): 32 rows x 8 words
was fastest (0.79 / 2.21 ms for max_output_size 128 / N against 1.07 / 2.94
ms for 64 x 4); 4096-row chunks beat 16384 (later early exit); 2048 was
5-10% faster than 4096 at 64 x 4 but was not tried with 32 x 8.
GPU, blocked O(N)-memory design (fallback past the budget): a (T, T)
register tile per thread block; in a first H100 sweep T = 128 with 8 warps
beat T = 64 / 4 warps and T = 256 / 8 or 16 warps (6.1 vs 6.9-24 ms at
N = 5k, 41 vs 58-143 ms at N = 20k, max_output_size = N).
"""
from __future__ import annotations

TPU_TILES = (128, 256, 512)
GPU_TILE = 128
GPU_NUM_WARPS = 8
GPU_BITMASK_MAX_BYTES = 256 << 20
MASK_ROWS = 32
MASK_CHUNK_ROWS = 4096
MASK_WORDS = 8
MASK_WARPS = 4
SCAN_WARPS = None  # by row length: 1 warp below 512 words, else 4


def tpu_tile(num_boxes: int) -> int:
  for tile in TPU_TILES:
    if num_boxes <= tile:
      return tile
  return TPU_TILES[-1]


def padded_size(num_boxes: int, tile: int) -> int:
  return max(1, -(-num_boxes // tile)) * tile
