"""Mosaic TPU flash attention: forward, dq and dk/dv kernels.

Forward: online softmax over the (query block, kv block) pairs of each
(batch, head). Backward: two kernels recompute the probabilities from lse
(dq walks like the forward; dk/dv walks every query head of its kv head).
Bands and static masks walk a scalar-prefetched list of blocks
(``masks.Walk``). Structure: docs/design/attention.md.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import _backend, _compat
from pallas_kernels._compat import pl, pltpu
from pallas_kernels.attention import block_sizes as _bs
from pallas_kernels.attention import masks as _masks

LANES = _bs.LANES
_SQ = pl.Squeezed() if hasattr(pl, "Squeezed") else None
_NT = (((1,), (1,)), ((), ()))   # a @ b^T
_NN = (((1,), (0,)), ((), ()))   # a @ b
_LOG2E = float(np.log2(np.e))     # exp(x) = exp2(log2(e) x)


def _round_up(x, m):
  return -(-x // m) * m


def _div(a, b):
  """Integer division of non-negative traced scalars."""
  return lax.div(a, jnp.int32(b))


class _Step(NamedTuple):
  """What one grid step computes (traced scalars)."""
  head: Any        # query head
  q_block: Any
  kv_block: Any
  first: Any       # the row's first step: initialise the accumulators
  last: Any        # the row's last step: write the outputs
  listed: Any      # a listed block (segment ids may still skip it)
  masked: Any      # needs the element mask (segment ids apply regardless)
  dense_col: Any   # the dense mask tile's block along the row (or None)


@dataclasses.dataclass(frozen=True)
class _Geometry:
  """Static problem geometry and, for masked calls, the walks: "kv" rows
  (forward, dq: a query block's kv blocks) or "q" rows (dk/dv: a kv block's
  query blocks over the kv head's ``group`` query heads)."""
  q_len: int
  kv_len: int
  block_q: int
  block_kv: int
  has_segments: bool
  group: int = 1
  tables: _masks.BlockTables | None = dataclasses.field(default=None,
                                                        compare=False)
  walks: dict | None = dataclasses.field(default=None, compare=False)

  @property
  def q_pad(self):
    return _round_up(self.q_len, self.block_q)

  @property
  def kv_pad(self):
    return _round_up(self.kv_len, self.block_kv)

  @property
  def num_q(self):
    return self.q_pad // self.block_q

  @property
  def num_kv(self):
    return self.kv_pad // self.block_kv

  @property
  def may_mask(self):
    """Whether some step needs the element (band, static or padded-key)
    mask; segment ids are masked on every step, apart from this."""
    return self.kv_pad != self.kv_len or self.tables is not None

  @property
  def dense(self):
    """Whether the mask is a materialised int8 array (no formula)."""
    return self.tables is not None and self.tables.dense is not None

  def grid(self, major, batch, heads):
    """The grid of a ``major`` walk ("kv": forward/dq over ``heads`` query
    heads; "q": dk/dv over ``heads`` kv heads)."""
    if self.walks is not None:
      return (batch, heads, self.walks[major].steps)
    if major == "kv":
      return (batch, heads, self.num_q, self.num_kv)
    return (batch, heads, self.num_kv, self.group * self.num_q)

  @property
  def grid_ids(self):
    """Grid axes after (batch, head)."""
    return 1 if self.walks is not None else 2

  def flat_tables(self, major):
    """The ``major`` walk's arrays, flattened for SMEM."""
    return jnp.asarray(np.concatenate(
        [a.ravel() for a in self.walks[major].arrays()]))

  def step(self, major, h, ids, table_ref=None) -> _Step:
    """The step at grid position (h, *ids) of a ``major`` walk; ``h`` is
    the query head ("kv") or the kv head ("q")."""
    if self.walks is not None:
      return self._walk_step(major, h, ids[0], table_ref)
    row, t = ids
    if major == "kv":
      return _Step(h, row, t, t == 0, t == self.num_kv - 1, jnp.bool_(True),
                   self._padded_keys(t), None)
    steps = self.group * self.num_q
    return _Step(h * self.group + _div(t, self.num_q),
                 lax.rem(t, jnp.int32(self.num_q)), row, t == 0,
                 t == steps - 1, jnp.bool_(True), self._padded_keys(row),
                 None)

  def _walk_step(self, major, h, s, table_ref):
    walk = self.walks[major]
    size = walk.row.size
    entry, extra = s, 0
    if walk.repeat > 1:
      entry, extra = _div(s, walk.repeat), lax.rem(s, jnp.int32(walk.repeat))
    at = (h if self.tables.per_head else 0) * walk.row.shape[1] + entry
    row, col = table_ref[at], table_ref[size + at]
    flags = table_ref[2 * size + at]
    dense_col = table_ref[3 * size + at] if self.dense else None

    def bit(b):
      return (flags & b) != 0
    first, last = bit(_masks.FIRST), bit(_masks.LAST)
    if walk.repeat > 1:
      first &= extra == 0
      last &= extra == walk.repeat - 1
    # A full block's dense_col names another (partial) block's tile, so
    # only MASKED steps may evaluate the element mask.
    masked = bit(_masks.MASKED)
    if major == "kv":
      return _Step(h, row, col, first, last, bit(_masks.RUNS), masked,
                   dense_col)
    head = (h * self.group + lax.shift_right_logical(
        flags, jnp.int32(_masks.HEAD_SHIFT)) + extra)
    return _Step(head, col, row, first, last, bit(_masks.RUNS), masked,
                 dense_col)

  def _padded_keys(self, j):
    """Whether kv block j holds padded keys (they need the element mask)."""
    return jnp.bool_(self.kv_pad != self.kv_len) & (j == self.num_kv - 1)

  def visited_blocks(self, heads: int = 1) -> int:
    """(q block, kv block) pairs the kernels compute over ``heads`` query
    heads (the rest are skipped)."""
    if self.tables is not None:
      return self.tables.visited_blocks(heads)
    return heads * self.num_q * self.num_kv

  def mask(self, i, j, shape, transposed, dense_ref=None):
    """Allowed-entry mask of block (i, j), broadcastable to ``shape`` (rows
    are keys when transposed; None: all allowed). ``dense_ref``: the block's
    tile of a dense mask."""
    q_axis, kv_axis = (1, 0) if transposed else (0, 1)

    def iota(axis, start):
      dims = [1, 1]
      dims[axis] = shape[axis]
      return start + lax.broadcasted_iota(jnp.int32, tuple(dims), axis)
    rows = iota(q_axis, i * self.block_q)
    cols = iota(kv_axis, j * self.block_kv)
    padded = self.kv_pad != self.kv_len
    if self.tables is None:
      return cols < self.kv_len if padded else None
    if dense_ref is None and not padded:   # no key to drop past kv_len
      offset = self.tables.kv_len - self.tables.q_len
      return self.tables.formula.allowed(rows + offset, cols)
    tile = None if dense_ref is None else dense_ref[...].astype(jnp.int32)
    return _masks.element_mask(self.tables, rows, cols, tile)


def _scores(a, b, sm_scale, cap):
  """Scaled (and soft-capped) a @ b^T in float32; returns (s, tanh or None)."""
  s = lax.dot_general(a, b, _NT, preferred_element_type=jnp.float32)
  if sm_scale != 1.0:
    s = s * sm_scale
  if cap is None:
    return s, None
  t = jnp.tanh(s / cap)
  return cap * t, t


_reciprocal = getattr(pltpu, "reciprocal", None) or pl.reciprocal
# Generations whose f32 division compiles to a long guarded sequence, so
# two Newton steps on an approximate reciprocal win (docs/design/attention.md).
_NEWTON_RECIPROCAL = ("v5e", "v5p")


def _folded_scale(sm_scale, cap, has_bias):
  """The part of sm_scale the kernels leave out of the logits and fold into
  the exp2 argument's multiply by log2(e) (and the dq/dk finish): all of it
  unless a bias or soft cap needs scaled logits."""
  return sm_scale if cap is None and not has_bias and sm_scale else 1.0


def _row_to_column(row):
  """[1, n] float32 -> [n, 128] lane-replicated column (n % 128 == 0)."""
  return jnp.broadcast_to(row, (LANES, row.shape[1])).T


# ---------------------------------------------------------------- forward --


def _query_major_logits(q, k, bias_ref, qseg_ref, kvseg_ref, geom, i, j,
                        masked, sm_scale, cap, dense_ref=None):
  """[block_q, block_kv] logits (and tanh for the soft cap) of block (i, j),
  with the bias added, and as -inf: the element mask if ``masked``, unequal
  segment ids always."""
  s, t = _scores(q, k, sm_scale, cap)
  if bias_ref is not None:
    s = s + bias_ref[...].astype(jnp.float32)
  mask = None
  if masked:
    mask = geom.mask(i, j, s.shape, transposed=False, dense_ref=dense_ref)
  if geom.has_segments:
    same = _lanes_to(qseg_ref[...], s.shape[1]) == kvseg_ref[...]
    mask = same if mask is None else mask & same
  if mask is not None:
    s = jnp.where(mask, s, -jnp.inf)
  return s, t


def _lanes_to(x, n):
  """Lane-replicated ``x [rows, 128]`` as ``[rows, n]``: whole vregs reused
  (no cross-lane broadcast) when n is a multiple of 128 or below it."""
  if n == LANES:
    return x
  if n < LANES:
    return x[:, :n]
  if n % LANES:
    return jnp.broadcast_to(x[:, :1], (x.shape[0], n))
  if hasattr(pltpu, "repeat"):      # jax < 0.8 (equal to a tile here)
    return pltpu.repeat(x, n // LANES, axis=1)
  return jnp.tile(x, (1, n // LANES))


def online_softmax_step(s, v, m_ref, l_ref, acc_ref, scale=1.0):
  """One online-softmax update with logits ``scale * s`` (-inf where masked)
  and values ``v [n, D]``. ``m_ref`` (max of the unscaled ``s``) and
  ``l_ref`` stay lane-replicated ``[rows, 128]`` (no cross-lane broadcasts);
  a row whose max is still -inf keeps l = 0."""
  m_prev, l_prev = m_ref[...], l_ref[...]
  rows = m_prev.shape
  m_new = jnp.maximum(m_prev, lax.broadcast_in_dim(jnp.max(s, axis=1), rows,
                                                   (0,)))
  m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  c = scale * _LOG2E
  p = jnp.exp2((s - _lanes_to(m_safe, s.shape[1])) * c)
  alpha = jnp.exp2((m_prev - m_safe) * c)
  l_new = alpha * l_prev + lax.broadcast_in_dim(jnp.sum(p, axis=1), rows,
                                                (0,))
  pv = lax.dot_general(p.astype(v.dtype), v, _NN,
                       preferred_element_type=jnp.float32)
  acc_ref[...] = _lanes_to(alpha, acc_ref.shape[1]) * acc_ref[...] + pv
  m_ref[...] = m_new
  l_ref[...] = l_new


def _first_block_softmax(s, v, scale):
  """``online_softmax_step`` from empty statistics, on values: (m, l, acc)
  of a row whose first block is ``s``."""
  rows = (s.shape[0], LANES)
  m = lax.broadcast_in_dim(jnp.max(s, axis=1), rows, (0,))
  m_safe = jnp.where(m == -jnp.inf, 0.0, m)
  p = jnp.exp2((s - _lanes_to(m_safe, s.shape[1])) * (scale * _LOG2E))
  l = lax.broadcast_in_dim(jnp.sum(p, axis=1), rows, (0,))
  acc = lax.dot_general(p.astype(v.dtype), v, _NN,
                        preferred_element_type=jnp.float32)
  return m, l, acc


def _run_block(step, at: _Step, geom, ranges_ref):
  """Runs ``step`` on the block of ``at`` if listed and the segment ids
  meet; with the element mask only where needed. Returns whether it ran."""
  run = at.listed
  if geom.has_segments:
    run &= _segments_meet(ranges_ref, geom, pl.program_id(0), at.q_block,
                          at.kv_block)
  if geom.may_mask:
    pl.when(run & at.masked)(lambda: step(True))
    pl.when(run & jnp.logical_not(at.masked))(lambda: step(False))
  else:
    pl.when(run)(lambda: step(False))
  return run


def _grid_step(geom, major, table_ref):
  """The current grid step of a ``major`` walk."""
  ids = [pl.program_id(2 + a) for a in range(geom.grid_ids)]
  return geom.step(major, pl.program_id(1), ids, table_ref)


def _forward_kernel(*refs, geom: _Geometry, sm_scale, cap, has_bias,
                    write_lse=True):
  it = iter(refs)
  ranges_ref = next(it) if geom.has_segments else None
  table_ref = next(it) if geom.walks is not None else None
  q_ref, k_ref, v_ref = next(it), next(it), next(it)
  qseg_ref = kvseg_ref = bias_ref = dense_ref = None
  if geom.has_segments:
    qseg_ref, kvseg_ref = next(it), next(it)
  if has_bias:
    bias_ref = next(it)
  if geom.dense:
    dense_ref = next(it)
  o_ref = next(it)
  lse_ref = next(it) if write_lse else None
  m_ref, l_ref, acc_ref = it
  at = _grid_step(geom, "kv", table_ref)
  # Without a bias or soft cap, m holds the max of the unscaled logits and
  # sm_scale joins the exp2 argument's multiply (no pass scaling the block).
  fold = _folded_scale(sm_scale, cap, bias_ref is not None)

  def logits(masked):
    s, _ = _query_major_logits(q_ref[...], k_ref[...], bias_ref, qseg_ref,
                               kvseg_ref, geom, at.q_block, at.kv_block,
                               masked, sm_scale / fold, cap, dense_ref)
    return s

  def finish(m, l, acc):
    """Writes a row's outputs from its statistics (lane-replicated
    [block_q, 128]) and accumulator."""
    has_keys = l != 0          # NaN inputs stay NaN rather than "empty"
    # A row with keys has l >= 1 (its max term is exp2(0)): max() makes
    # empty rows safe.
    safe_l = jnp.maximum(l, 1.0)
    if _backend.target().tpu_generation in _NEWTON_RECIPROCAL:
      # There f32 division is a long guarded sequence; on [1, block_kv] two
      # Newton steps take an approximate reciprocal good to 2^-8 (the
      # interpreter's) to f32 rounding.
      inv = _reciprocal(safe_l, approx=True)
      inv = inv * (2.0 - safe_l * inv)
      inv = inv * (2.0 - safe_l * inv)
    else:
      inv = 1.0 / safe_l
    width = acc.shape[1]
    o_ref[...] = jnp.where(_lanes_to(l, width) != 0,
                           acc * _lanes_to(inv, width),
                           0.0).astype(o_ref.dtype)
    if write_lse:
      lse = jnp.where(has_keys, m * fold + jnp.log(safe_l), -jnp.inf)
      lse_ref[...] = lse.T[:1, :]

  if geom.grid_ids == 2 and geom.num_kv == 1 and not geom.has_segments:
    # Each row is one block, always computed: no statistics in scratch.
    finish(*_first_block_softmax(logits(geom.may_mask), v_ref[...], fold))
    return

  def start(masked):
    """A row's first block: the statistics start from it."""
    m_ref[...], l_ref[...], acc_ref[...] = _first_block_softmax(
        logits(masked), v_ref[...], fold)

  def step(masked):
    pl.when(at.first)(lambda: start(masked))
    pl.when(jnp.logical_not(at.first))(lambda: online_softmax_step(
        logits(masked), v_ref[...], m_ref, l_ref, acc_ref, scale=fold))

  run = _run_block(step, at, geom, ranges_ref)

  @pl.when(at.first & jnp.logical_not(run))
  def _init():       # a row whose first block does not run
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  pl.when(at.last)(lambda: finish(m_ref[...], l_ref[...], acc_ref[...]))


# --------------------------------------------------------------- backward --

def _dq_kernel(*refs, geom: _Geometry, sm_scale, cap, has_bias):
  it = iter(refs)
  ranges_ref = next(it) if geom.has_segments else None
  table_ref = next(it) if geom.walks is not None else None
  q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref = (next(it) for _ in range(6))
  qseg_ref = kvseg_ref = bias_ref = dbias_ref = dense_ref = None
  if geom.has_segments:
    qseg_ref, kvseg_ref = next(it), next(it)
  if has_bias:
    bias_ref = next(it)
  if geom.dense:
    dense_ref = next(it)
  dq_ref = next(it)
  if has_bias:
    dbias_ref = next(it)
  dq_acc, lse_col, di_col = it
  at = _grid_step(geom, "kv", table_ref)

  @pl.when(at.first)
  def _init():
    dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)
    lse_col[...] = _row_to_column(lse_ref[...])
    di_col[...] = _row_to_column(di_ref[...])

  fold = _folded_scale(sm_scale, cap, has_bias)

  def step(masked):
    q, k, v = q_ref[...], k_ref[...], v_ref[...]
    s, th = _query_major_logits(q, k, bias_ref, qseg_ref, kvseg_ref, geom,
                                at.q_block, at.kv_block, masked,
                                sm_scale / fold, cap, dense_ref)
    width = s.shape[1]
    p = jnp.exp2(s * (fold * _LOG2E) - _lanes_to(lse_col[...], width))
    dp = lax.dot_general(do_ref[...], v, _NT,
                         preferred_element_type=jnp.float32)
    ds = p * (dp - _lanes_to(di_col[...], width))
    if has_bias:
      dbias_ref[...] = ds.astype(dbias_ref.dtype)
    if cap is not None:
      ds = ds * (1.0 - th * th)
    dq_acc[...] += lax.dot_general(ds.astype(k.dtype), k, _NN,
                                   preferred_element_type=jnp.float32)

  run = _run_block(step, at, geom, ranges_ref)
  if has_bias:
    # A listed block the segment ids skip owns its dbias block. Steps that
    # are not listed (an empty row's, or a walk's padding repeating the
    # last block) write nothing: the caller zeroes blocks never listed.
    @pl.when(at.listed & jnp.logical_not(run))
    def _zero_dbias():
      dbias_ref[...] = jnp.zeros(dbias_ref.shape, dbias_ref.dtype)

  @pl.when(at.last)
  def _finish():
    dq_ref[...] = (dq_acc[...] * sm_scale).astype(dq_ref.dtype)


def _dkv_kernel(*refs, geom: _Geometry, sm_scale, cap, has_bias):
  it = iter(refs)
  ranges_ref = next(it) if geom.has_segments else None
  table_ref = next(it) if geom.walks is not None else None
  q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref = (next(it) for _ in range(6))
  qseg_ref = kvseg_ref = bias_ref = dense_ref = None
  if geom.has_segments:
    qseg_ref, kvseg_ref = next(it), next(it)
  if has_bias:
    bias_ref = next(it)
  if geom.dense:
    dense_ref = next(it)
  dk_ref, dv_ref, dk_acc, dv_acc = it
  at = _grid_step(geom, "q", table_ref)

  @pl.when(at.first)
  def _init():
    dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
    dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

  fold = _folded_scale(sm_scale, cap, has_bias)

  def step(masked):
    q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
    s, th = _scores(k, q, sm_scale / fold, cap)      # [block_kv, block_q]
    if has_bias:
      s = s + bias_ref[...].astype(jnp.float32).T
    mask = None
    if masked:
      mask = geom.mask(at.q_block, at.kv_block, s.shape, transposed=True,
                       dense_ref=dense_ref)
    if geom.has_segments:
      same = _lanes_to(kvseg_ref[...], s.shape[1]) == qseg_ref[...]
      mask = same if mask is None else mask & same
    if mask is not None:
      s = jnp.where(mask, s, -jnp.inf)
    p = jnp.exp2(s * (fold * _LOG2E) - lse_ref[...])
    dv_acc[...] += lax.dot_general(p.astype(do.dtype), do, _NN,
                                   preferred_element_type=jnp.float32)
    dp = lax.dot_general(v, do, _NT, preferred_element_type=jnp.float32)
    ds = p * (dp - di_ref[...])
    if cap is not None:
      ds = ds * (1.0 - th * th)
    dk_acc[...] += lax.dot_general(ds.astype(q.dtype), q, _NN,
                                   preferred_element_type=jnp.float32)

  _run_block(step, at, geom, ranges_ref)

  @pl.when(at.last)
  def _finish():
    dk_ref[...] = (dk_acc[...] * sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


# ------------------------------------------------------------ host side --

def _f16_to_f32(*arrays):
  return tuple(x.astype(jnp.float32) if x is not None
               and x.dtype == jnp.float16 else x for x in arrays)


def _pad_axis(x, axis, size, value=0):
  extra = size - x.shape[axis]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


def _pad_head_dim(x, dim):
  return _pad_axis(x, 3, dim)


# Entries of one walk's tables the kernels may hold in SMEM (1 MiB on v5e).
MAX_TABLE_ENTRIES = 1 << 17


def _geometry(q_len, kv_len, block_q, block_kv, has_segments, causal,
              window_left, window_right, mask=None, group=1):
  """The call's geometry: the causal/window band joins ``mask``, and any
  mask becomes block tables and their walks (``group`` query heads per kv
  head)."""
  right = window_right
  if causal:
    right = 0 if right is None else min(right, 0)
  if window_left is not None or right is not None:
    band = _masks.Local(window_left, right)
    mask = band if mask is None else (
        tuple(m & band for m in mask) if isinstance(mask, tuple)
        else mask & band)
  tables = walks = None
  if mask is not None:
    tables = _masks.block_tables(mask, q_len, kv_len, block_q, block_kv)
    dense = tables.dense is not None
    by_kv = np.swapaxes(tables.classes, 1, 2)
    walks = {
        "kv": _masks.walk(tables.classes, dense=dense),
        # dk/dv: per-head tables walk a kv head's group of heads together;
        # a shared table repeats each entry once per head of the group.
        "q": (_masks.walk(by_kv, merge=group, dense=dense) if tables.per_head
              else _masks.walk(by_kv, repeat=group, dense=dense)),
    }
    entries = max(sum(a.size for a in w.arrays()) for w in walks.values())
    if entries > MAX_TABLE_ENTRIES:
      raise ValueError(
          f"flash_attention: the mask's block tables need {entries} SMEM "
          f"entries at blocks ({block_q}, {block_kv}) (limit "
          f"{MAX_TABLE_ENTRIES}); pass larger block_sizes")
  return _Geometry(q_len=q_len, kv_len=kv_len, block_q=block_q,
                   block_kv=block_kv, has_segments=has_segments, group=group,
                   tables=tables, walks=walks)


def _geometries(q_len, kv_len, head_dim, group, has_segments, causal,
                window_left, window_right, mask, block_sizes):
  """(forward geometry, backward geometry) at the chosen blocks."""
  masked = (causal or window_left is not None or window_right is not None
            or mask is not None)
  blocks = _bs.choose(q_len, kv_len, head_dim, block_sizes, masked=masked)
  def at(block_q, block_kv):
    return _geometry(q_len, kv_len, block_q, block_kv, has_segments, causal,
                     window_left, window_right, mask, group)
  return at(blocks.fwd_q, blocks.fwd_kv), at(blocks.bwd_q, blocks.bwd_kv)


def grids(batch, heads, kv_heads, q_len, kv_len, head_dim, *, causal=False,
          window_left=None, window_right=None, mask=None, block_sizes=None,
          segments=False) -> dict[str, tuple[int, ...]]:
  """The grids the kernels launch for such a call: ``{"forward": (B, H,
  ...), "dq": (B, H, ...), "dkv": (B, Hkv, ...)}``. Masked calls (causal,
  window, ``mask``) walk ``(B, H, steps)``, one step per live block
  (at least one per row); others ``(B, H, q blocks, kv blocks)``."""
  if mask is not None:
    mask = _masks.per_head(mask, heads)
  fwd, bwd = _geometries(q_len, kv_len, head_dim, heads // kv_heads,
                         segments, causal, window_left, window_right, mask,
                         block_sizes)
  return {"forward": fwd.grid("kv", batch, heads),
          "dq": bwd.grid("kv", batch, heads),
          "dkv": bwd.grid("q", batch, kv_heads)}


def _prefetch(geom, q_segment_ids, kv_segment_ids, major):
  """Scalar-prefetch (SMEM) inputs: segment ranges, then the tables of the
  ``major`` walk ("kv": forward and dq, "q": dk/dv)."""
  prefetch = []
  if geom.has_segments:
    prefetch.append(_segment_ranges(q_segment_ids, kv_segment_ids, geom))
  if geom.walks is not None:
    prefetch.append(geom.flat_tables(major))
  return prefetch


def _head_dim_specs(walk, bq, bk, group):
  """(q_spec(d), kv_spec(d)): BlockSpecs of a q-row tile and of a kv tile
  (kv head = q head // group) of ``d`` columns, on the grid ``walk``
  decodes."""
  def q_spec(d):
    return pl.BlockSpec((_SQ, _SQ, bq, d), walk(
        lambda b, at: (b, at.head, at.q_block, 0)))

  def kv_spec(d):
    return pl.BlockSpec((_SQ, _SQ, bk, d), walk(
        lambda b, at: (b, _div(at.head, group), at.kv_block, 0)))
  return q_spec, kv_spec


def _index_map(geom, major, block_index):
  """A BlockSpec index map of the ``major`` walk: ``block_index(b, step)``
  with the grid position decoded (``_Step``)."""
  ids = geom.grid_ids

  def index(b, h, *rest):
    table_ref = rest[-1] if geom.walks is not None else None
    return block_index(b, geom.step(major, h, rest[:ids], table_ref))
  return index


def _segment_layouts(segment_ids, length):
  """([B, L, 128] lane-broadcast, [B, 1, L] lane-dense), padded with -1."""
  ids = _pad_axis(segment_ids.astype(jnp.int32), 1, length, value=-1)
  column = jnp.broadcast_to(ids[:, :, None], ids.shape + (LANES,))
  return column, ids[:, None, :]


def _segment_ranges(q_segment_ids, kv_segment_ids, geom):
  """Per-block min/max segment ids, flattened for SMEM:
  [q_min (B*nq), q_max (B*nq), kv_min (B*nk), kv_max (B*nk)]. Padding repeats
  the last real id so it never widens a range."""
  def ranges(ids, length, block):
    ids = ids.astype(jnp.int32)
    extra = length - ids.shape[1]
    if extra:
      ids = jnp.pad(ids, ((0, 0), (0, extra)), mode="edge")
    ids = ids.reshape(ids.shape[0], -1, block)
    return ids.min(axis=2).ravel(), ids.max(axis=2).ravel()
  q_min, q_max = ranges(q_segment_ids, geom.q_pad, geom.block_q)
  kv_min, kv_max = ranges(kv_segment_ids, geom.kv_pad, geom.block_kv)
  return jnp.concatenate([q_min, q_max, kv_min, kv_max])


def _segments_meet(ranges_ref, geom, b, i, j):
  """False when block (i, j)'s id ranges are disjoint (no equal ids)."""
  nq, nk = geom.num_q, geom.num_kv
  batch = ranges_ref.shape[0] // (2 * (nq + nk))
  q_at, kv_at = b * nq + i, 2 * batch * nq + b * nk + j
  q_min, q_max = ranges_ref[q_at], ranges_ref[batch * nq + q_at]
  kv_min, kv_max = ranges_ref[kv_at], ranges_ref[batch * nk + kv_at]
  return (q_max >= kv_min) & (kv_max >= q_min)


def _pallas_call(kernel, prefetch, args, *, grid, in_specs, out_specs,
                 out_shape, scratch_shapes, compiler_params, interpret,
                 cost_estimate, name):
  """pallas_call with ``prefetch`` as scalar-prefetch (SMEM) inputs."""
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=len(prefetch), grid=grid, in_specs=in_specs,
      out_specs=out_specs, scratch_shapes=scratch_shapes)
  return _compat.pallas_call(
      kernel, grid_spec=grid_spec, out_shape=out_shape,
      compiler_params=compiler_params, interpret=interpret,
      cost_estimate=cost_estimate, name=name)(*prefetch, *args)


def _dense_input(geom, major):
  """(BlockSpec, int8 array) of a dense mask's tiles, indexed (head, q block,
  kv block), transposed for the "q" walk (dk/dv)."""
  t = geom.tables
  dense = jnp.asarray(t.dense)
  def head(at):
    return at.head if t.per_head else 0
  if major == "kv":
    return pl.BlockSpec((_SQ, geom.block_q, geom.block_kv), _index_map(
        geom, major, lambda b, at: (head(at), at.q_block, at.dense_col))), dense
  return pl.BlockSpec((_SQ, geom.block_kv, geom.block_q), _index_map(
      geom, major, lambda b, at: (head(at), at.kv_block, at.dense_col))), (
          jnp.swapaxes(dense, 1, 2))


def _bias_index(bias, b, h, i, j):
  return (b if bias.shape[0] > 1 else 0, h if bias.shape[1] > 1 else 0, i, j)


def vmem_bytes(block_q, block_kv, head_dim, itemsize, has_bias=False,
               value_dim=None):
  """Rough VMEM use of the backward step (the largest of the three);
  ``value_dim``: v's (padded) head dim, default ``head_dim``."""
  dims = head_dim + (head_dim if value_dim is None else value_dim)
  tiles = 2 * 2 * max(block_q, block_kv) * dims * itemsize  # q k v dO x2
  temps = 5 * block_q * block_kv * 4
  accs = block_kv * dims * 4 + 3 * block_q * LANES * 4
  bias = 2 * 2 * block_q * block_kv * 4 if has_bias else 0
  return tiles + temps + accs + bias


def cost(batch, heads, q_len, kv_len, head_dim, itemsize, *, kv_heads=None,
         causal=False, window_left=None, window_right=None, block_q=512,
         block_kv=512, backward=False, bias_itemsize=0, value_dim=None):
  """Work of the kernels as they run (skipped blocks excluded). Returns
  dict(flops, transcendentals, bytes_accessed, visited_blocks, total_blocks,
  vmem_bytes): matmul flops are 2 * bq * bk * (D + Dv) per visited block
  forward, 2 * bq * bk * (4 D + 3 Dv) backward (dq: 3 matmuls, dk/dv: 4; Dv =
  ``value_dim``, default D). HBM bytes count the k/v (or q/dO) blocks streamed
  per visited block plus one pass over the other operands and the outputs."""
  kv_heads = kv_heads or heads
  geom = _geometry(q_len, kv_len, block_q, block_kv, False, causal,
                   window_left, window_right)
  dim = _bs.padded_head_dim(head_dim)
  dim_v = dim if value_dim is None else _bs.padded_head_dim(value_dim)
  visited = geom.visited_blocks()
  per_block = block_q * block_kv
  n = batch * heads
  q_bytes = batch * heads * geom.q_pad * dim * itemsize
  o_bytes = batch * heads * geom.q_pad * dim_v * itemsize
  k_bytes = batch * kv_heads * geom.kv_pad * dim * itemsize
  v_bytes = batch * kv_heads * geom.kv_pad * dim_v * itemsize
  bias_stream = bias_itemsize * per_block
  if backward:
    flops = n * visited * 2 * per_block * (4 * dim + 3 * dim_v)
    trans = n * visited * 2 * per_block
    streamed = n * visited * ((block_kv + block_q) * (dim + dim_v) * itemsize
                              + 2 * bias_stream)
    bytes_accessed = (streamed + 2 * q_bytes + o_bytes + 2 * k_bytes
                      + 2 * v_bytes)
  else:
    flops = n * visited * 2 * per_block * (dim + dim_v)
    trans = n * visited * per_block
    streamed = n * visited * (block_kv * (dim + dim_v) * itemsize
                              + bias_stream)
    bytes_accessed = streamed + q_bytes + o_bytes + 4 * n * geom.q_pad
  return dict(flops=int(flops), transcendentals=int(trans),
              bytes_accessed=int(bytes_accessed), visited_blocks=visited,
              total_blocks=geom.num_q * geom.num_kv,
              vmem_bytes=vmem_bytes(block_q, block_kv, dim, itemsize,
                                    bias_itemsize > 0, dim_v))


def _cost_estimate(batch, heads, geom, dims, itemsize, has_bias):
  """pl.CostEstimate so XLA can schedule around the kernel; ``dims``: the
  (padded) q/k and v head dims, and per matmul of a block the dim it
  contracts or produces besides the block's two."""
  (dim, dim_v), matmul_dims = dims[:2], dims[2:]
  visited = geom.visited_blocks(heads)       # over all heads
  per_block = geom.block_q * geom.block_kv
  streamed = visited * (geom.block_kv * (dim + dim_v) * itemsize
                        + (4 * per_block if has_bias else 0))
  return pl.CostEstimate(
      flops=int(batch * visited * 2 * per_block * sum(matmul_dims)),
      transcendentals=int(batch * visited * per_block),
      bytes_accessed=int(batch * (streamed + heads * geom.q_pad
                                  * (dim + 2 * dim_v) * itemsize)))


def _compiler_params(semantics, estimate):
  """Past 12 MiB of estimated VMEM, a scoped limit of twice the estimate
  (32..96 MiB), never above the lowering target's VMEM per core. No DMA
  bounds checks: block indices come from the grid or the walk's tables, in
  range by construction, and a check adds scalar work to every step."""
  limit = None
  if estimate > 12 * 2**20:
    vmem = _backend.TPU_VMEM_BYTES[_backend.target().tpu_generation]
    limit = min(max(2 * estimate, 32 * 2**20), 96 * 2**20, vmem)
  return _compat.tpu_compiler_params(dimension_semantics=semantics,
                                     vmem_limit_bytes=limit,
                                     disable_bounds_checks=True)


def forward(q, k, v, q_segment_ids, kv_segment_ids, bias, *, sm_scale, causal,
            window_left, window_right, logit_soft_cap, block_sizes, interpret,
            mask=None, lse=True):
  """(out [B, H, Lq, Dv] q.dtype, lse [B, H, Lq] float32) of q [B, H, Lq,
  D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv]; ``mask``: a static mask
  (``masks``) or per-head tuple, walked as block tables. ``lse=False``: the
  kernel writes no lse and the lse returned is NaN (for callers that drop
  it)."""
  if q.dtype == jnp.float16 or (bias is not None and bias.dtype == jnp.float16):
    # Mosaic has no float16 matmul on v5e/v6e: run float16 as float32.
    out, lse = forward(
        *_f16_to_f32(q, k, v), q_segment_ids, kv_segment_ids,
        *_f16_to_f32(bias), sm_scale=sm_scale, causal=causal,
        window_left=window_left, window_right=window_right,
        logit_soft_cap=logit_soft_cap, block_sizes=block_sizes,
        interpret=interpret, mask=mask, lse=lse)
    return out.astype(q.dtype), lse
  batch, heads, q_len, head_dim = q.shape
  kv_heads, v_dim = k.shape[1], v.shape[3]
  group = heads // kv_heads
  geom, _ = _geometries(q_len, k.shape[2], max(head_dim, v_dim), group,
                        q_segment_ids is not None, causal, window_left,
                        window_right, mask, block_sizes)
  dim, dim_v = _bs.padded_head_dim(head_dim), _bs.padded_head_dim(v_dim)
  bq, bk = geom.block_q, geom.block_kv
  qp = _pad_head_dim(_pad_axis(q, 2, geom.q_pad), dim)
  kp = _pad_head_dim(_pad_axis(k, 2, geom.kv_pad), dim)
  vp = _pad_head_dim(_pad_axis(v, 2, geom.kv_pad), dim_v)
  walk = functools.partial(_index_map, geom, "kv")
  q_spec, kv_spec = _head_dim_specs(walk, bq, bk, group)
  in_specs = [q_spec(dim), kv_spec(dim), kv_spec(dim_v)]
  args = [qp, kp, vp]
  prefetch = _prefetch(geom, q_segment_ids, kv_segment_ids, "kv")
  if geom.has_segments:
    q_col, _ = _segment_layouts(q_segment_ids, geom.q_pad)
    _, kv_row = _segment_layouts(kv_segment_ids, geom.kv_pad)
    in_specs += [
        pl.BlockSpec((_SQ, bq, LANES), walk(lambda b, at: (b, at.q_block, 0))),
        pl.BlockSpec((_SQ, 1, bk), walk(lambda b, at: (b, 0, at.kv_block))),
    ]
    args += [q_col, kv_row]
  if bias is not None:
    bias_p = _pad_axis(_pad_axis(bias, 2, geom.q_pad), 3, geom.kv_pad)
    in_specs.append(pl.BlockSpec((_SQ, _SQ, bq, bk), walk(
        lambda b, at: _bias_index(bias, b, at.head, at.q_block,
                                  at.kv_block))))
    args.append(bias_p)
  if geom.dense:
    spec, dense = _dense_input(geom, "kv")
    in_specs.append(spec)
    args.append(dense)

  kernel = functools.partial(_forward_kernel, geom=geom, sm_scale=sm_scale,
                             cap=logit_soft_cap, has_bias=bias is not None,
                             write_lse=lse)
  estimate = vmem_bytes(bq, bk, dim, q.dtype.itemsize, bias is not None,
                        dim_v)
  grid = geom.grid("kv", batch, heads)
  out_specs = [q_spec(dim_v)]
  out_shape = [jax.ShapeDtypeStruct((batch, heads, geom.q_pad, dim_v),
                                    q.dtype)]
  if lse:
    out_specs.append(pl.BlockSpec((_SQ, _SQ, 1, bq), walk(
        lambda b, at: (b, at.head, 0, at.q_block))))
    out_shape.append(jax.ShapeDtypeStruct((batch, heads, 1, geom.q_pad),
                                          jnp.float32))
  results = _pallas_call(
      kernel, prefetch, args,
      grid=grid,
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM((bq, LANES), jnp.float32),
                      pltpu.VMEM((bq, LANES), jnp.float32),
                      pltpu.VMEM((bq, dim_v), jnp.float32)],
      compiler_params=_compiler_params(_semantics(grid), estimate),
      interpret=interpret,
      cost_estimate=_cost_estimate(batch, heads, geom, (dim, dim_v, dim,
                                                        dim_v),
                                   q.dtype.itemsize, bias is not None),
      name="flash_attention_fwd")
  out = results[0][:, :, :q_len, :v_dim]
  if not lse:
    return out, jnp.full((batch, heads, q_len), jnp.nan, jnp.float32)
  return out, results[1][:, :, 0, :q_len]


def _semantics(grid):
  """Batch, head and (rectangular grids) the row axis are parallel; the
  walked axis carries the accumulators."""
  return ("parallel",) * (len(grid) - 1) + ("arbitrary",)


def backward(q, k, v, q_segment_ids, kv_segment_ids, bias, out, lse, d_out,
             d_lse, *, sm_scale, causal, window_left, window_right,
             logit_soft_cap, block_sizes, interpret, mask=None):
  """(dq, dk, dv, dbias or None); ``d_lse`` is the cotangent of lse."""
  if q.dtype == jnp.float16 or (bias is not None and bias.dtype == jnp.float16):
    q32, k32, v32, bias32, out32, d_out32 = _f16_to_f32(q, k, v, bias, out,
                                                        d_out)
    dq, dk, dv, dbias = backward(
        q32, k32, v32, q_segment_ids, kv_segment_ids, bias32, out32, lse,
        d_out32, d_lse, sm_scale=sm_scale, causal=causal,
        window_left=window_left, window_right=window_right,
        logit_soft_cap=logit_soft_cap, block_sizes=block_sizes,
        interpret=interpret, mask=mask)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            None if dbias is None else dbias.astype(bias.dtype))
  batch, heads, q_len, head_dim = q.shape
  kv_heads, kv_len, v_dim = k.shape[1], k.shape[2], v.shape[3]
  group = heads // kv_heads
  _, geom = _geometries(q_len, kv_len, max(head_dim, v_dim), group,
                        q_segment_ids is not None, causal, window_left,
                        window_right, mask, block_sizes)
  dim, dim_v = _bs.padded_head_dim(head_dim), _bs.padded_head_dim(v_dim)
  bq, bk = geom.block_q, geom.block_kv

  di = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1)
  if d_lse is not None:
    di = di - d_lse.astype(jnp.float32)
  # lse = +inf turns p into 0 for empty rows and padded queries.
  # In log2 units: the kernels take p = exp2(log2(e) s - lse2).
  lse = jnp.where(lse == -jnp.inf, jnp.inf, lse.astype(jnp.float32) * _LOG2E)
  lse_row = _pad_axis(lse, 2, geom.q_pad, value=jnp.inf)[:, :, None, :]
  di_row = _pad_axis(di, 2, geom.q_pad)[:, :, None, :]
  qp = _pad_head_dim(_pad_axis(q, 2, geom.q_pad), dim)
  dop = _pad_head_dim(_pad_axis(d_out.astype(q.dtype), 2, geom.q_pad), dim_v)
  kp = _pad_head_dim(_pad_axis(k, 2, geom.kv_pad), dim)
  vp = _pad_head_dim(_pad_axis(v, 2, geom.kv_pad), dim_v)
  has_bias = bias is not None
  bias_p = None
  if has_bias:
    bias_p = _pad_axis(_pad_axis(bias, 2, geom.q_pad), 3, geom.kv_pad)
  segs = None
  if geom.has_segments:
    segs = (_segment_layouts(q_segment_ids, geom.q_pad),
            _segment_layouts(kv_segment_ids, geom.kv_pad))
  estimate = vmem_bytes(bq, bk, dim, q.dtype.itemsize, has_bias, dim_v)
  statics = dict(geom=geom, sm_scale=sm_scale, cap=logit_soft_cap,
                 has_bias=has_bias)

  def specs(major):
    """In-specs and args of both walks: q, k, v, dO, lse, di, segment ids,
    bias, dense mask; ``major`` picks the walk decoding the grid."""
    walk = functools.partial(_index_map, geom, major)
    q_spec, kv_spec = _head_dim_specs(walk, bq, bk, group)
    row_spec = pl.BlockSpec((_SQ, _SQ, 1, bq), walk(
        lambda b, at: (b, at.head, 0, at.q_block)))
    in_specs = [q_spec(dim), kv_spec(dim), kv_spec(dim_v), q_spec(dim_v),
                row_spec, row_spec]
    args = [qp, kp, vp, dop, lse_row, di_row]
    if segs is not None:
      (q_col, q_row), (kv_col, kv_row) = segs
      if major == "kv":
        in_specs += [
            pl.BlockSpec((_SQ, bq, LANES),
                         walk(lambda b, at: (b, at.q_block, 0))),
            pl.BlockSpec((_SQ, 1, bk), walk(lambda b, at: (b, 0, at.kv_block))),
        ]
        args += [q_col, kv_row]
      else:
        in_specs += [
            pl.BlockSpec((_SQ, 1, bq), walk(lambda b, at: (b, 0, at.q_block))),
            pl.BlockSpec((_SQ, bk, LANES),
                         walk(lambda b, at: (b, at.kv_block, 0))),
        ]
        args += [q_row, kv_col]
    if has_bias:
      in_specs.append(pl.BlockSpec((_SQ, _SQ, bq, bk), walk(
          lambda b, at: _bias_index(bias, b, at.head, at.q_block,
                                    at.kv_block))))
      args.append(bias_p)
    if geom.dense:
      spec, dense = _dense_input(geom, major)
      in_specs.append(spec)
      args.append(dense)
    return in_specs, args, q_spec(dim), (kv_spec(dim), kv_spec(dim_v))

  # dq (and dbias): query-block rows.
  in_specs, args, q_spec, _ = specs("kv")
  out_specs = [q_spec]
  out_shape = [jax.ShapeDtypeStruct(qp.shape, q.dtype)]
  if has_bias:
    out_specs.append(pl.BlockSpec((_SQ, _SQ, bq, bk), _index_map(
        geom, "kv", lambda b, at: (b, at.head, at.q_block, at.kv_block))))
    out_shape.append(jax.ShapeDtypeStruct(
        (batch, heads, geom.q_pad, geom.kv_pad), jnp.float32))
  grid = geom.grid("kv", batch, heads)
  results = _pallas_call(
      functools.partial(_dq_kernel, **statics),
      _prefetch(geom, q_segment_ids, kv_segment_ids, "kv"), args,
      grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM((bq, dim), jnp.float32),
                      pltpu.VMEM((bq, LANES), jnp.float32),
                      pltpu.VMEM((bq, LANES), jnp.float32)],
      compiler_params=_compiler_params(_semantics(grid), estimate),
      interpret=interpret,
      cost_estimate=_cost_estimate(batch, heads, geom,
                                   (dim, dim_v, dim, dim_v, dim),
                                   q.dtype.itemsize, has_bias),
      name="flash_attention_dq")
  dq = results[0][:, :, :q_len, :head_dim]
  dbias = None
  if has_bias:
    dbias = results[1]
    if geom.tables is not None:   # blocks no step listed were never written
      listed = np.repeat(np.repeat(geom.tables.classes > 0, bq, axis=1), bk,
                         axis=2)[None]
      dbias = jnp.where(listed, dbias, 0.0)
    dbias = dbias[:, :, :q_len, :kv_len]
    reduce_axes = tuple(a for a in (0, 1) if bias.shape[a] == 1)
    if reduce_axes:
      dbias = jnp.sum(dbias, axis=reduce_axes, keepdims=True)
    dbias = dbias.astype(bias.dtype)

  # dk, dv: kv-block rows over the query blocks of the kv head's group.
  in_specs, args, _, (k_spec, v_spec) = specs("q")
  grid = geom.grid("q", batch, kv_heads)
  dk, dv = _pallas_call(
      functools.partial(_dkv_kernel, **statics),
      _prefetch(geom, q_segment_ids, kv_segment_ids, "q"), args, grid=grid,
      in_specs=in_specs,
      out_specs=[k_spec, v_spec],
      out_shape=[jax.ShapeDtypeStruct(kp.shape, k.dtype),
                 jax.ShapeDtypeStruct(vp.shape, v.dtype)],
      scratch_shapes=[pltpu.VMEM((bk, dim), jnp.float32),
                      pltpu.VMEM((bk, dim_v), jnp.float32)],
      compiler_params=_compiler_params(_semantics(grid), estimate),
      interpret=interpret,
      cost_estimate=_cost_estimate(batch, heads, geom,
                                   (dim, dim_v, dim, dim_v, dim_v, dim),
                                   q.dtype.itemsize, has_bias),
      name="flash_attention_dkv")
  return (dq, dk[:, :, :kv_len, :head_dim], dv[:, :, :kv_len, :v_dim],
          dbias)
