"""Tile sizes (boxes per tile) of the NMS kernels.

TPU: the (T, T) float32 suppression matrix lives in VMEM (T = 512: 1 MiB) and
an (8, T) IoU block is T / 128 vregs; T is the smallest of 128/256/512 that
holds the whole image, else 512 (fewer stored slabs to revisit, matvec
still a single MXU pass per 128 rows).

GPU, bitmask design (used while a mask chunk fits GPU_BITMASK_MAX_BYTES):
the mask kernel's program covers MASK_ROWS boxes x mask_words(N) words (32
boxes each); rows go in chunks of MASK_CHUNK_ROWS (2048 when
max_output_size <= 128, see triton.chunk_rows_for; below SMALL_BOXES chunks of
MASK_CHUNK_ROWS_SMALL rows whatever max_output_size); the scan kernel runs
SCAN_WARPS warps per image (None: by row length). Measured on H100 at
N = 20k (an earlier run's "tune", in the git history of
bench/results/nms-h100-2026-11-22.json): 32 rows x 8 words was fastest
(0.79 / 2.21 ms for max_output_size 128 / N against 1.07 / 2.94 ms for
64 x 4); 4096-row chunks beat 16384 (later early exit). Below SMALL_BOXES
the 32 x 256 programs are too few to fill the chip (at 1k: 128 programs,
15 us for 0.5M IoUs), so MASK_WORDS_SMALL is narrower; its value is the
faster by device time in an earlier ``--tune-small`` run (2 words, 73 /
448 us at 1k / 5k against 80 / 461 us for 8). One 8192-row chunk at 5k
(max_output_size = N) beat two of 4096 with the same scan form (312 against
360 us of device time, bench/results/nms-scan-tune-h100-2026-11-22.json);
the committed rows (bench/results/nms-h100-2026-11-22.json) ran with 8192.
From SMALL_BOXES on, 2048 / 3072 / 8192-row chunks and 2 / 8 scan warps
did not beat 4096 rows and 4 warps at 20k
(bench/results/nms-forms-sizes-h100-2026-11-22.json); with the overlapped
scan / next mask launches (stop 11) 2048-row chunks did
(MASK_CHUNK_ROWS_OVERLAP, for max_output_size >= N and at most
triton.STATIC_CHUNKS_MAX chunks).
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
# Below SMALL_BOXES: chunks of this many rows whatever max_output_size (the
# early exit of smaller chunks saves less than their launches cost): one
# chunk up to 8k boxes (the "band" scan's A/Bs ran with it).
MASK_CHUNK_ROWS_SMALL = 8192
MASK_WORDS = 8
# Unrolled, overlapped chunks (triton.OVERLAP, max_output_size >= N, at most
# triton.STATIC_CHUNKS_MAX chunks): smaller chunks, so chunk 0's unoverlapped
# mask is smaller and later masks are pruned sooner. H100, 20k boxes,
# max_output_size = N (bench/results/nms-20k-h100-2026-11-23.json, "pick"):
# 903 / 1438 us of device time at threshold 0.1 / 0.5 against 973 / 1501
# with 4096-row chunks (and 1003 / 1673 without the overlap).
MASK_CHUNK_ROWS_OVERLAP = 2048
# Below SMALL_BOXES boxes the mask has few 32 x 256 programs per SM, so
# narrower programs (more of them) hide latency better.
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
