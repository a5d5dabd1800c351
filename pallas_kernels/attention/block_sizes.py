"""Block sizes for the Mosaic TPU flash-attention kernels: ``TABLE[generation]``
gives (block_q, block_kv) for the forward and the backward, multiples of 128,
shrunk for short sequences; ``block_sizes=`` overrides it. The table and why:
docs/design/attention.md.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

from pallas_kernels import _backend

LANES = 128
DEFAULT_GENERATION = _backend.DEFAULT_TPU_GENERATION

class Row(NamedTuple):
  """A table row: applies to head_dims up to ``head_dim`` (None: any), to
  ``mask`` calls ("full": no block-skipping mask, "masked": causal, window or
  ``mask``, "any") and sequences up to ``length`` (None: any)."""
  head_dim: int | None
  mask: str
  length: int | None
  fwd: tuple[int, int]
  bwd: tuple[int, int]


# generation -> rows, the first that applies wins. From python -m
# bench.tpu_search (bench/results/tpu-search-*), restricted to blocks whose
# VMEM fits float32 inputs with a bias: v5e, v6e, v5p at head_dim <= 128;
# v5e and v6e forward at 256. The others: docs/design/attention.md.
TABLE = {
    "v4": (Row(128, "any", None, (512, 512), (512, 512)),
           Row(None, "any", None, (512, 512), (256, 512))),
    "v5e": (Row(128, "masked", 2048, (512, 512), (512, 512)),
            Row(128, "full", None, (1024, 2048), (1024, 1024)),
            Row(None, "masked", 2048, (512, 512), (1024, 1024)),
            Row(None, "full", None, (2048, 1024), (1024, 1024)),
            Row(None, "any", None, (1024, 1024), (1024, 1024))),
    "v6e": (Row(None, "full", None, (2048, 1024), (1024, 1024)),
            Row(None, "any", None, (1024, 1024), (1024, 1024))),
    "v5p": (Row(128, "masked", 2048, (512, 512), (512, 512)),
            Row(128, "masked", None, (1024, 1024), (1024, 1024)),
            Row(128, "full", None, (512, 2048), (1024, 1024)),
            Row(None, "masked", 2048, (512, 512), (512, 1024)),
            Row(None, "any", None, (1024, 512), (512, 1024))),
    "tpu7x": (Row(None, "any", None, (1024, 512), (512, 1024)),),
}


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Query/key block sizes; None entries are taken from the table.
  ``block_q``/``block_kv`` apply to the forward kernel,
  ``block_q_bwd``/``block_kv_bwd`` to both backward kernels (dq and dk/dv); when
  only the forward ones are given the backward uses them too."""
  block_q: int | None = None
  block_kv: int | None = None
  block_q_bwd: int | None = None
  block_kv_bwd: int | None = None

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if value is None:
        continue
      if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"block_sizes.{field.name} must be an int, got "
                        f"{type(value).__name__}")
      if value <= 0 or value % LANES:
        raise ValueError(f"block_sizes.{field.name}={value} must be a positive "
                         f"multiple of {LANES}")


def as_block_sizes(value):
  """Normalizes the user's ``block_sizes=`` argument. Another backend's frozen
  block-size dataclass (``triton.GpuBlockSizes``) is passed through unchanged:
  the GPU kernel reads it, the TPU kernel uses its table instead."""
  if value is None or isinstance(value, BlockSizes):
    return value
  if (dataclasses.is_dataclass(value) and not isinstance(value, type)
      and type(value).__dataclass_params__.frozen):
    return value
  if isinstance(value, dict):
    unknown = set(value) - {f.name for f in dataclasses.fields(BlockSizes)}
    if unknown:
      raise ValueError(f"block_sizes: unknown keys {sorted(unknown)}")
    return BlockSizes(**value)
  if isinstance(value, (tuple, list)) and len(value) == 2:
    return BlockSizes(block_q=value[0], block_kv=value[1])
  raise TypeError("block_sizes must be None, a BlockSizes, a (block_q, "
                  f"block_kv) pair or a dict, got {value!r}")


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def fit_block(table_block: int, length: int) -> int:
  """Shrinks a block for short sequences so padding stays under 1/8."""
  block = min(table_block, _round_up(max(length, 1), LANES))
  while block > LANES and _round_up(length, block) - length > length / 8:
    block //= 2
  return max(LANES, block - block % LANES)


def padded_head_dim(head_dim: int) -> int:
  if head_dim == 64 or head_dim % LANES == 0:
    return head_dim
  return _round_up(head_dim, LANES)


@dataclasses.dataclass(frozen=True)
class ChosenBlocks:
  fwd_q: int
  fwd_kv: int
  bwd_q: int
  bwd_kv: int


def table_block_sizes(generation: str, head_dim: int, masked: bool = False,
                      length: int | None = None) -> BlockSizes:
  """The table's unshrunk blocks for a generation (e.g. to AOT-compile for v6e
  from a host whose default is v5e), a call with or without a block-skipping
  mask, and its longer sequence (None: long)."""
  kind = "masked" if masked else "full"
  for row in TABLE.get(generation, TABLE[DEFAULT_GENERATION]):
    if ((row.head_dim is None or head_dim <= row.head_dim)
        and row.mask in ("any", kind)
        and (row.length is None
             or (length is not None and length <= row.length))):
      break
  return BlockSizes(block_q=row.fwd[0], block_kv=row.fwd[1],
                    block_q_bwd=row.bwd[0], block_kv_bwd=row.bwd[1])


def choose(q_len: int, kv_len: int, head_dim: int,
           override: BlockSizes | None = None,
           generation: str | None = None, masked: bool = False) -> ChosenBlocks:
  """Block sizes for one problem: the table row of ``generation`` (default:
  the lowering target's, ``_backend.target()``), then the user's override;
  ``masked``: the call skips blocks (causal, window or ``mask``)."""
  table = table_block_sizes(generation or _backend.target().tpu_generation,
                            head_dim, masked, max(q_len, kv_len))
  if not isinstance(override, BlockSizes):
    override = BlockSizes()     # None, or another backend's block sizes
  fq = override.block_q or fit_block(table.block_q, q_len)
  fk = override.block_kv or fit_block(table.block_kv, kv_len)
  bq = override.block_q_bwd or (override.block_q
                                or fit_block(table.block_q_bwd, q_len))
  bk = override.block_kv_bwd or (override.block_kv
                                 or fit_block(table.block_kv_bwd, kv_len))
  return ChosenBlocks(fq, fk, bq, bk)
