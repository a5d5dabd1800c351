"""Static attention masks for ``flash_attention(..., mask=...)``: ``Causal``,
``Local``, ``ChunkedCausal``, ``PrefixLM``, ``Dense``, combined with ``&`` and
``|``.
Positions are ends-aligned (query ``i`` at ``i + kv_len - q_len``). Each mask
gives ``allowed(p, j)`` elementwise and ``block_bounds`` per block, which may
err only towards "partial" (costs time, never correctness).
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Sequence

import numpy as np

_OP = "flash_attention"


class Mask:
  """Base class: combinators and the interface the kernels use."""

  def __and__(self, other):
    return And(self, _as_mask(other, "&"))

  def __or__(self, other):
    return Or(self, _as_mask(other, "|"))

  @property
  def formula(self) -> bool:
    """Whether ``allowed`` can be evaluated from positions alone."""
    return True

  def allowed(self, pos, col):
    """Elementwise rule: query position ``pos`` may attend key ``col``."""
    raise NotImplementedError

  def block_bounds(self, pos_lo, pos_hi, col_lo, col_hi):
    """(some allowed, every allowed) for the rectangles ``pos_lo <= p <=
    pos_hi``, ``col_lo <= j <= col_hi`` (NumPy integer arrays, broadcast)."""
    raise NotImplementedError

  def check(self, q_len: int, kv_len: int) -> None:
    """Raises ValueError if the mask cannot apply to these lengths."""


def _as_mask(x, op):
  if not isinstance(x, Mask):
    raise TypeError(f"{_OP}: cannot combine a mask with {type(x).__name__} "
                    f"using {op!r}; both sides must be masks from "
                    "pallas_kernels.attention.masks")
  return x


def _check_int(name, value, minimum, allow_none=False):
  if value is None and allow_none:
    return None
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{_OP}: {name} must be an int, got {value!r}")
  if value < minimum:
    raise ValueError(f"{_OP}: {name} must be >= {minimum}, got {value}")
  return int(value)


@dataclasses.dataclass(frozen=True)
class Causal(Mask):
  """``j <= p``: a query sees itself and the past."""

  def allowed(self, pos, col):
    return col <= pos

  def block_bounds(self, pos_lo, pos_hi, col_lo, col_hi):
    return col_lo <= pos_hi, col_hi <= pos_lo


@dataclasses.dataclass(frozen=True)
class Local(Mask):
  """``p - left <= j <= p + right``; None leaves that side unbounded."""
  left: int | None
  right: int | None = 0

  def __post_init__(self):
    _check_int("Local.left", self.left, 0, allow_none=True)
    _check_int("Local.right", self.right, 0, allow_none=True)

  def allowed(self, pos, col):
    ok = True
    if self.left is not None:
      ok = col >= pos - self.left
    if self.right is not None:
      ok = (col <= pos + self.right) & ok
    return ok

  def block_bounds(self, pos_lo, pos_hi, col_lo, col_hi):
    some = every = True
    if self.left is not None:
      some = col_hi >= pos_lo - self.left
      every = col_lo >= pos_hi - self.left
    if self.right is not None:
      some = (col_lo <= pos_hi + self.right) & some
      every = (col_hi <= pos_lo + self.right) & every
    return some, every


def _floordiv(x, size):
  """Floor division that also lowers inside kernels (operands clamped >= 0:
  the negative positions it meets are masked by causality anyway)."""
  if isinstance(x, np.ndarray) or np.isscalar(x):
    return np.floor_divide(np.maximum(x, 0), size)
  import jax.numpy as jnp
  from jax import lax
  return lax.div(jnp.maximum(x, 0), jnp.int32(size))


@dataclasses.dataclass(frozen=True)
class ChunkedCausal(Mask):
  """Causal within chunks of ``chunk_size`` positions (local attention in
  chunks): ``j <= p`` and both in the same chunk."""
  chunk_size: int

  def __post_init__(self):
    _check_int("ChunkedCausal.chunk_size", self.chunk_size, 1)

  def allowed(self, pos, col):
    return ((col <= pos)
            & (_floordiv(pos, self.chunk_size) == _floordiv(col,
                                                            self.chunk_size)))

  def block_bounds(self, pos_lo, pos_hi, col_lo, col_hi):
    size = self.chunk_size
    p_first, p_last = np.floor_divide(pos_lo, size), np.floor_divide(pos_hi,
                                                                     size)
    c_first, c_last = np.floor_divide(col_lo, size), np.floor_divide(col_hi,
                                                                     size)
    some = (col_lo <= pos_hi) & (p_first <= c_last) & (c_first <= p_last)
    every = ((col_hi <= pos_lo) & (p_first == p_last) & (c_first == c_last)
             & (p_first == c_first) & (pos_lo >= 0))
    return some, every


@dataclasses.dataclass(frozen=True)
class PrefixLM(Mask):
  """Keys before ``prefix_length`` are seen by every query; after it,
  causal: ``j < prefix_length or j <= p``."""
  prefix_length: int

  def __post_init__(self):
    _check_int("PrefixLM.prefix_length", self.prefix_length, 0)

  def allowed(self, pos, col):
    return (col < self.prefix_length) | (col <= pos)

  def block_bounds(self, pos_lo, pos_hi, col_lo, col_hi):
    some = (col_lo < self.prefix_length) | (col_lo <= pos_hi)
    every = (col_hi < self.prefix_length) | (col_hi <= pos_lo)
    return some, every


class Dense(Mask):
  """An explicit bool ``[q_len, kv_len]`` matrix (True = attend), concrete
  at trace time (NumPy or a non-traced jax array)."""

  def __init__(self, array):
    try:
      values = np.asarray(array)
    except Exception as e:  # a tracer: the mask must be static
      raise TypeError(
          f"{_OP}: Dense mask must be a concrete array known at trace time "
          "(masks are static); for data-dependent masks use segment_ids or "
          f"bias ({type(e).__name__})") from None
    if values.ndim != 2:
      raise ValueError(f"{_OP}: Dense mask must be 2-D [q_len, kv_len], got "
                       f"shape {values.shape}")
    if values.dtype != np.bool_:
      raise TypeError(f"{_OP}: Dense mask must be boolean, got {values.dtype}")
    self.array = np.ascontiguousarray(values)
    self.array.flags.writeable = False
    self._key = (values.shape,
                 hashlib.sha1(np.packbits(values).tobytes()).hexdigest())

  def __eq__(self, other):
    return isinstance(other, Dense) and self._key == other._key

  def __hash__(self):
    return hash(self._key)

  def __repr__(self):
    return f"Dense(shape={self.array.shape}, allowed={int(self.array.sum())})"

  @property
  def formula(self):
    return False

  def check(self, q_len, kv_len):
    if self.array.shape != (q_len, kv_len):
      raise ValueError(f"{_OP}: Dense mask has shape {self.array.shape}, the "
                       f"call needs [q_len, kv_len] = {(q_len, kv_len)}")


@dataclasses.dataclass(frozen=True)
class _Combined(Mask):
  """Two masks joined elementwise by ``join`` (``&`` or ``|``)."""
  a: Mask
  b: Mask

  @staticmethod
  def join(x, y):
    raise NotImplementedError

  @property
  def formula(self):
    return self.a.formula and self.b.formula

  def allowed(self, pos, col):
    return self.join(self.a.allowed(pos, col), self.b.allowed(pos, col))

  def block_bounds(self, *bounds):
    # Exact for "every" under &, and for "some" under |; the other answer
    # errs the allowed way ("some" too often, "every" too rarely).
    some_a, every_a = self.a.block_bounds(*bounds)
    some_b, every_b = self.b.block_bounds(*bounds)
    return self.join(some_a, some_b), self.join(every_a, every_b)

  def check(self, q_len, kv_len):
    self.a.check(q_len, kv_len)
    self.b.check(q_len, kv_len)


class And(_Combined):
  """Both masks allow the pair."""

  @staticmethod
  def join(x, y):
    return x & y


class Or(_Combined):
  """Either mask allows the pair."""

  @staticmethod
  def join(x, y):
    return x | y


# ------------------------------------------------- masks at other places --

def _where(cond, a, b):
  if isinstance(cond, np.ndarray) or np.isscalar(cond):
    return np.where(cond, a, b)
  import jax.numpy as jnp
  return jnp.where(cond, a, b)


def _global_pieces(lo, hi, starts, piece):
  """For each piece of a placement: (whether [lo, hi] meets it, its part of
  [lo, hi] in global positions)."""
  for p, start in enumerate(starts):
    first = p * piece
    last = first + piece - 1 if p < len(starts) - 1 else np.iinfo(np.int64).max
    a, b = np.maximum(lo, first), np.minimum(hi, last)
    yield a <= b, a + (start - first), b + (start - first)


@dataclasses.dataclass(frozen=True)
class Placed(Mask):
  """A formula mask evaluated at the global positions of a block pair cut out
  of a longer call (ring attention's shard pairs): local index ``x`` maps to
  ``starts[x // piece] + x % piece``. Built by :func:`place`; equal ``key``
  (per piece pair: empty, full or normalized starts) means an equal mask."""
  base: Mask
  q_starts: tuple[int, ...] = dataclasses.field(compare=False)
  kv_starts: tuple[int, ...] = dataclasses.field(compare=False)
  q_piece: int
  kv_piece: int
  key: tuple

  @property
  def local_offset(self) -> int:
    """The block's own kv_len - q_len (its query positions' offset)."""
    return len(self.kv_starts) * self.kv_piece - len(self.q_starts) * (
        self.q_piece)

  @staticmethod
  def _to_global(x, starts, piece):
    out = x + starts[0]
    for p in range(1, len(starts)):
      out = _where(x >= p * piece, x + (starts[p] - p * piece), out)
    return out

  def allowed(self, pos, col):
    return self.base.allowed(
        self._to_global(pos - self.local_offset, self.q_starts, self.q_piece),
        self._to_global(col, self.kv_starts, self.kv_piece))

  def block_bounds(self, pos_lo, pos_hi, col_lo, col_hi):
    some, every = np.bool_(False), np.bool_(True)
    rows = (pos_lo - self.local_offset, pos_hi - self.local_offset)
    for q_meets, p_lo, p_hi in _global_pieces(*rows, self.q_starts,
                                              self.q_piece):
      for kv_meets, c_lo, c_hi in _global_pieces(col_lo, col_hi,
                                                 self.kv_starts,
                                                 self.kv_piece):
        live = q_meets & kv_meets
        some_p, every_p = self.base.block_bounds(p_lo, p_hi, c_lo, c_hi)
        some = some | (live & some_p)
        every = every & (~live | every_p)
    return some, every


def shift_period(mask: Mask) -> int | None:
  """A period ``t`` such that shifting both positions by a multiple of ``t``
  leaves the mask unchanged (``allowed(p + t, j + t) == allowed(p, j)`` for
  ``p, j >= 0``), or None if there is none."""
  if isinstance(mask, (Causal, Local)):
    return 1
  if isinstance(mask, ChunkedCausal):
    return mask.chunk_size
  return None


def place(mask: Mask, q_starts, kv_starts, q_piece: int,
          kv_piece: int | None = None, offset: int = 0) -> Mask:
  """``mask`` (query positions = indices + ``offset``) at the block pair whose
  queries are pieces of ``q_piece`` starting at ``q_starts`` and keys pieces
  of ``kv_piece`` at ``kv_starts``. ``Dense`` masks are sliced; periodic
  leaves move to their smallest equivalent starts, so equal blocks compare
  equal."""
  kv_piece = q_piece if kv_piece is None else kv_piece
  q_starts, kv_starts = tuple(map(int, q_starts)), tuple(map(int, kv_starts))
  if isinstance(mask, Dense):
    rows = np.concatenate([np.arange(s, s + q_piece) for s in q_starts])
    cols = np.concatenate([np.arange(s, s + kv_piece) for s in kv_starts])
    return Dense(mask.array[np.ix_(rows, cols)])
  if isinstance(mask, _Combined):
    return type(mask)(
        place(mask.a, q_starts, kv_starts, q_piece, kv_piece, offset),
        place(mask.b, q_starts, kv_starts, q_piece, kv_piece, offset))
  if isinstance(mask, PrefixLM) and min(kv_starts) >= mask.prefix_length:
    mask = Causal()   # no key of the pair lies in the prefix
  period = shift_period(mask)
  q_positions = tuple(s + offset for s in q_starts)
  key = []
  for q_pos in q_positions:
    for kv_start in kv_starts:
      some, every = mask.block_bounds(q_pos, q_pos + q_piece - 1, kv_start,
                                      kv_start + kv_piece - 1)
      # The period holds for non-negative positions only.
      shift = 0 if period is None else (max(min(q_pos, kv_start), 0)
                                        // period * period)
      key.append(0 if not some else 2 if every else
                 (q_pos - shift, kv_start - shift))
  local_offset = len(kv_starts) * kv_piece - len(q_starts) * q_piece
  if (period is not None and len(key) == 1 and kv_starts[0] % period == 0
      and q_positions[0] - kv_starts[0] == local_offset):
    # The pair sits on the (ends-aligned) diagonal of its own block: the
    # mask as it is. Negative local positions meet only masks whose
    # causality empties them in both places (``_floordiv``).
    return mask
  return Placed(mask, q_positions, kv_starts, q_piece, kv_piece, tuple(key))


# --------------------------------------------------- evaluation on a grid --

def dense(mask: Mask, q_len: int, kv_len: int) -> np.ndarray:
  """bool ``[q_len, kv_len]``: the mask evaluated on every pair (NumPy)."""
  if isinstance(mask, Dense):
    return mask.array
  if isinstance(mask, (And, Or)) and not mask.formula:
    a, b = dense(mask.a, q_len, kv_len), dense(mask.b, q_len, kv_len)
    return (a & b) if isinstance(mask, And) else (a | b)
  pos = np.arange(q_len)[:, None] + (kv_len - q_len)
  col = np.arange(kv_len)[None, :]
  return np.broadcast_to(mask.allowed(pos, col), (q_len, kv_len))


def block_classes(mask: Mask, q_len: int, kv_len: int, block_q: int,
                  block_kv: int) -> np.ndarray:
  """int8 ``[num_q_blocks, num_kv_blocks]``: 0 empty, 1 partial, 2 full. Blocks
  cover the sequences rounded up to their block sizes; padded keys count as
  masked (a block holding some is never full), padded queries are ignored (their
  rows are dropped)."""
  num_q, num_kv = -(-q_len // block_q), -(-kv_len // block_kv)
  q_lo = np.arange(num_q) * block_q
  q_hi = np.minimum(q_lo + block_q, q_len) - 1
  col_lo = np.arange(num_kv) * block_kv
  col_hi = np.minimum(col_lo + block_kv, kv_len) - 1
  if mask.formula:
    offset = kv_len - q_len
    some, every = mask.block_bounds((q_lo + offset)[:, None],
                                    (q_hi + offset)[:, None], col_lo[None, :],
                                    col_hi[None, :])
    some = np.broadcast_to(some, (num_q, num_kv))
    every = np.broadcast_to(every, (num_q, num_kv))
  else:
    values = np.zeros((num_q * block_q, num_kv * block_kv), bool)
    values[:q_len, :kv_len] = dense(mask, q_len, kv_len)
    blocks = values.reshape(num_q, block_q, num_kv, block_kv)
    some = blocks.any(axis=(1, 3))
    full_rows = np.zeros((num_q * block_q,), bool)
    full_rows[q_len:] = True      # padded queries never make a block partial
    blocks = (values | full_rows[:, None]).reshape(num_q, block_q, num_kv,
                                                   block_kv)
    every = blocks.all(axis=(1, 3)) & some
  every = every & (col_lo + block_kv <= kv_len)[None, :]
  return np.where(every, 2, np.where(some, 1, 0)).astype(np.int8)


def per_head(mask, heads: int) -> tuple[Mask, ...] | Mask:
  """A mask, or a tuple of one mask per query head (checked)."""
  if isinstance(mask, Mask):
    return mask
  if isinstance(mask, (list, tuple)):
    if len(mask) != heads:
      raise ValueError(f"{_OP}: a per-head mask list must have one mask per "
                       f"query head ({heads}), got {len(mask)}")
    for m in mask:
      _as_mask(m, "a per-head list")
    if all(m == mask[0] for m in mask):
      return mask[0]
    return tuple(mask)
  raise TypeError(f"{_OP}: mask must be a mask from "
                  "pallas_kernels.attention.masks or a list of them (one per "
                  f"query head), got {type(mask).__name__}")


def check(mask: Mask | Sequence[Mask], q_len: int, kv_len: int) -> None:
  for m in (mask if isinstance(mask, tuple) else (mask,)):
    m.check(q_len, kv_len)


# ------------------------------------------------------------ block tables --

def _compress(classes: np.ndarray):
  """Rows of block classes -> (partial count, total count, index table,
  dense-tile index table), each row's partial blocks first, then its full
  ones; a row's unused tail repeats its last entry (no new DMA)."""
  rows = classes.reshape(-1, classes.shape[-1])
  partial, full = rows == 1, rows == 2
  n_partial = partial.sum(axis=1)
  n_total = n_partial + full.sum(axis=1)
  width = max(1, int(n_total.max(initial=0)))
  cols = np.arange(rows.shape[1])
  # Sort keys: partial blocks first, then full, then empty; stable in col.
  key = np.where(partial, 0, np.where(full, 1, 2)) * rows.shape[1] + cols
  order = np.argsort(key, axis=1, kind="stable")[:, :width]
  steps = np.arange(width)[None, :]
  last = np.maximum(n_total - 1, 0)[:, None]
  index = np.take_along_axis(order, np.minimum(steps, last), axis=1)
  last_partial = np.maximum(n_partial - 1, 0)[:, None]
  dense_index = np.take_along_axis(order, np.minimum(steps, last_partial),
                                   axis=1)
  shape = classes.shape[:-1]
  return (n_partial.reshape(shape).astype(np.int32),
          n_total.reshape(shape).astype(np.int32),
          index.reshape(shape + (width,)).astype(np.int32),
          dense_index.reshape(shape + (width,)).astype(np.int32))


@dataclasses.dataclass(frozen=True)
class BlockTables:
  """A mask laid out for block-sparse kernels (NumPy, built at trace time):
  block ``classes`` (0 empty, 1 partial, 2 full) and query-major ``kv_*`` /
  key-major ``q_*`` tables listing each row's blocks, partial ones first.
  ``formula`` or, without one, ``dense`` int8 holds the elements. Layout:
  docs/design/attention.md."""
  q_len: int
  kv_len: int
  block_q: int
  block_kv: int
  classes: np.ndarray
  kv_partial: np.ndarray
  kv_total: np.ndarray
  kv_index: np.ndarray
  kv_dense_index: np.ndarray
  q_partial: np.ndarray
  q_total: np.ndarray
  q_index: np.ndarray
  q_dense_index: np.ndarray
  formula: Mask | None
  dense: np.ndarray | None

  @property
  def per_head(self) -> bool:
    return self.classes.shape[0] > 1

  @property
  def max_kv(self) -> int:
    return self.kv_index.shape[-1]

  @property
  def max_q(self) -> int:
    return self.q_index.shape[-1]

  def visited_blocks(self, heads: int) -> int:
    """(q block, kv block) pairs computed over ``heads`` query heads."""
    visited = int(np.sum(self.classes > 0))
    return visited if self.per_head else visited * heads


# A per-head or dense mask is materialised as int8 [heads, q_len, kv_len].
MAX_DENSE_BYTES = 1 << 30


def block_tables(mask, q_len: int, kv_len: int, block_q: int,
                 block_kv: int, q_pad: int | None = None,
                 kv_pad: int | None = None) -> BlockTables:
  """``BlockTables`` of a mask (or per-head tuple) for these blocks, over
  sequences padded to ``q_pad``/``kv_pad`` (default: to the blocks; extra
  blocks are empty)."""
  heads = mask if isinstance(mask, tuple) else (mask,)
  formula = heads[0] if len(heads) == 1 and heads[0].formula else None
  classes = np.stack([block_classes(m, q_len, kv_len, block_q, block_kv)
                      for m in heads])
  num_q = -(-(q_pad or q_len) // block_q)
  num_kv = -(-(kv_pad or kv_len) // block_kv)
  classes = np.pad(classes, ((0, 0), (0, num_q - classes.shape[1]),
                             (0, num_kv - classes.shape[2])))
  dense_values = None
  if formula is None:
    num_q, num_kv = classes.shape[1:]
    size = len(heads) * num_q * block_q * num_kv * block_kv
    if size > MAX_DENSE_BYTES:
      raise ValueError(
          f"{_OP}: this mask would be materialised as {size / 2**30:.1f} GiB "
          f"(int8 [heads, q_len, kv_len]; limit {MAX_DENSE_BYTES >> 30} GiB): "
          "per-head masks and Dense masks are stored whole; share one "
          "formula mask (Causal, Local, ChunkedCausal, PrefixLM and their "
          "combinations) across heads instead")
    dense_values = np.zeros((len(heads), num_q * block_q, num_kv * block_kv),
                            np.int8)
    for h, m in enumerate(heads):
      dense_values[h, :q_len, :kv_len] = dense(m, q_len, kv_len)
  q_major = _compress(classes)
  kv_major = _compress(np.swapaxes(classes, 1, 2))
  return BlockTables(q_len, kv_len, block_q, block_kv, classes, *q_major,
                     *kv_major, formula=formula, dense=dense_values)


# Flags of a walk step (``Walk.flags``); bits HEAD_SHIFT and up hold the
# step's head offset within the walk head's group.
RUNS, MASKED, FIRST, LAST = 1, 2, 4, 8
HEAD_SHIFT = 4


@dataclasses.dataclass(frozen=True)
class Walk:
  """Every listed block of a table as one flat sequence of grid steps:
  ``row/col/flags [walk_heads, entries]`` int32, row-major, partial blocks
  (``MASKED``) first, ``FIRST``/``LAST`` marking a row's ends; ``repeat``
  grid steps per entry. Layout: docs/design/attention.md."""
  row: np.ndarray
  col: np.ndarray
  flags: np.ndarray
  dense_col: np.ndarray | None
  repeat: int

  @property
  def steps(self) -> int:
    """Grid steps per walk head."""
    return self.row.shape[1] * self.repeat

  def arrays(self) -> list[np.ndarray]:
    return [self.row, self.col, self.flags] + (
        [] if self.dense_col is None else [self.dense_col])


def walk(classes: np.ndarray, merge: int = 1, repeat: int = 1,
         dense: bool = False) -> Walk:
  """The ``Walk`` of block classes ``[heads, rows, cols]``: the rows of
  each ``merge`` consecutive heads are walked together (one walk head per
  group, entries of every head of a row in turn); ``repeat`` as in
  ``Walk``."""
  heads, rows, cols = classes.shape
  per_walk = classes.reshape(heads // merge, merge, rows, cols)
  lists = [_walk_entries(np.swapaxes(c, 0, 1)) for c in per_walk]
  width = max(len(entries[0]) for entries in lists)
  out = np.zeros((4, len(lists), width), np.int32)
  for w, entries in enumerate(lists):
    n = len(entries[0])
    out[:, w, :n] = entries
    out[:, w, n:] = entries[:, -1:]
    out[2, w, n:] &= ~np.int32(RUNS | MASKED | FIRST | LAST)
  return Walk(row=out[0], col=out[1], flags=out[2],
              dense_col=out[3] if dense else None, repeat=repeat)


def _walk_entries(classes: np.ndarray) -> np.ndarray:
  """int32 [4, entries] (row, col, flags, dense col) of one walk head's
  classes ``[rows, heads, cols]``."""
  rows, heads, cols = classes.shape
  r, g, c = np.nonzero(classes)
  partial = classes[r, g, c] == 1
  # Row-major; in a row, head by head, partial blocks first, by col.
  key = ((r * heads + g) * 2 + ~partial) * cols + c
  empty = np.flatnonzero(~classes.any(axis=(1, 2)))
  r = np.concatenate([r, empty])
  g = np.concatenate([g, np.zeros_like(empty)])
  c = np.concatenate([c, np.zeros_like(empty)])
  partial = np.concatenate([partial, np.zeros(empty.shape, bool)])
  runs = np.concatenate([np.ones(key.shape, bool), np.zeros(empty.shape, bool)])
  order = np.argsort(np.concatenate([key, empty * heads * 2 * cols]),
                     kind="stable")
  r, g, c, partial, runs = r[order], g[order], c[order], partial[order], \
      runs[order]
  n = len(r)
  starts_row = np.ones(n, bool)
  starts_row[1:] = r[1:] != r[:-1]
  ends_row = np.ones(n, bool)
  ends_row[:-1] = starts_row[1:]
  # The dense tile stays on its (row, head) segment's last partial block.
  segment = np.ones(n, bool)
  segment[1:] = (r[1:] != r[:-1]) | (g[1:] != g[:-1])
  held = np.where(partial | segment, np.arange(n), 0)
  held = np.maximum.accumulate(held)
  flags = (runs * RUNS | partial * MASKED | starts_row * FIRST
           | ends_row * LAST | g << HEAD_SHIFT)
  return np.stack([r, c, flags, c[held]]).astype(np.int32)


def element_mask(tables: BlockTables, rows, cols, dense_tile=None):
  """The allowed-pair mask of a kernel tile: ``rows``/``cols`` are query and
  key indices (jax int32 arrays, broadcast); ``dense_tile`` the tile of
  ``tables.dense`` when the mask has no formula."""
  if dense_tile is not None:
    return dense_tile != 0
  offset = tables.kv_len - tables.q_len
  return tables.formula.allowed(rows + offset, cols) & (cols < tables.kv_len)
