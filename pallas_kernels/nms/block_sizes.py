"""Tile sizes (boxes per tile) of the NMS kernels.

TPU: the (T, T) float32 suppression matrix lives in VMEM (T = 512: 1 MiB) and
an (8, T) IoU block is T / 128 vregs; T is the smallest of 128/256/512 that
holds the whole image, else 512 (fewer stored slabs to revisit, matvec
still a single MXU pass per 128 rows).

GPU, bitmask design (used while a mask chunk fits GPU_BITMASK_MAX_BYTES):
the mask kernel's program covers MASK_ROWS boxes x MASK_WORDS words (32
boxes each); rows go in chunks of MASK_CHUNK_ROWS; the scan kernel runs
SCAN_WARPS warps per image (None: by row length).
GPU, blocked O(N)-memory design (larger N): a (T, T) register tile per
thread block; T = 128 with 8 warps was fastest on H100 (bench/results).
"""
from __future__ import annotations

TPU_TILES = (128, 256, 512)
GPU_TILE = 128
GPU_NUM_WARPS = 8
GPU_BITMASK_MAX_BYTES = 256 << 20
MASK_ROWS = 64
MASK_CHUNK_ROWS = 4096
MASK_WORDS = 4
MASK_WARPS = 4
SCAN_WARPS = None  # by row length: 1 warp below 512 words, else 4


def tpu_tile(num_boxes: int) -> int:
  for tile in TPU_TILES:
    if num_boxes <= tile:
      return tile
  return TPU_TILES[-1]


def padded_size(num_boxes: int, tile: int) -> int:
  return max(1, -(-num_boxes // tile)) * tile
