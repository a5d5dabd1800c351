"""Tile sizes (boxes per tile) of the NMS kernels: TPU tiles (the (T, T)
suppression matrix in VMEM), the GPU bitmask design's mask rows, words,
chunks and scan warps, and the blocked design's register tiles. Why these
values: docs/design/nms.md.
"""
from __future__ import annotations

TPU_TILES = (128, 256, 512)
GPU_TILE = 128
GPU_NUM_WARPS = 8
GPU_BITMASK_MAX_BYTES = 256 << 20
MASK_ROWS = 32
MASK_CHUNK_ROWS = 4096
# Below SMALL_BOXES: chunks of this many rows whatever max_output_size (the
# early exit of smaller chunks saves less than their launches cost): one
# chunk up to 8k boxes (the "band" scan's A/Bs ran with it).
MASK_CHUNK_ROWS_SMALL = 8192
MASK_WORDS = 8
# Unrolled, overlapped chunks (max_output_size >= N, at most
# triton.STATIC_CHUNKS_MAX chunks): smaller, so chunk 0's unoverlapped mask
# is smaller and later masks are pruned sooner.
MASK_CHUNK_ROWS_OVERLAP = 2048
# Below SMALL_BOXES boxes: narrower mask programs (with few boxes, more of
# them hide latency better) and the scan's band form.
SMALL_BOXES = 16384
MASK_WORDS_SMALL = 2
MASK_WARPS = 4
SCAN_WARPS = None  # by row length: 1 warp below 512 words, else 4


def mask_chunk_rows(num_boxes: int) -> int:
  """Rows per mask chunk (capped by max_output_size from SMALL_BOXES on)."""
  return MASK_CHUNK_ROWS_SMALL if num_boxes < SMALL_BOXES else MASK_CHUNK_ROWS


def mask_words(num_boxes: int) -> int:
  """32-box column words per mask program for an image of num_boxes."""
  return MASK_WORDS_SMALL if num_boxes < SMALL_BOXES else MASK_WORDS


def tpu_tile(num_boxes: int) -> int:
  for tile in TPU_TILES:
    if num_boxes <= tile:
      return tile
  return TPU_TILES[-1]


def padded_size(num_boxes: int, tile: int) -> int:
  return max(1, -(-num_boxes // tile)) * tile
