"""Flash attention for NVIDIA GPUs: Pallas kernels with the Triton lowering.

Forward: FlashAttention-2, one program per (q block, batch, head), online
softmax in base 2. Backward: a dq kernel and a dk/dv kernel that recompute
``p`` from lse (no atomics). Bands bound the loops; static masks come as
block tables. Tiles (``GpuBlockSizes``) and structure: docs/design/attention.md.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import _compat, _cost
from pallas_kernels.attention import masks as _masks

pl = _compat.pl

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
NEG_INF = float("-inf")
MIN_BLOCK = 16  # smallest tile dimension a Triton dot accepts
MAX_GRID_YZ = 65535  # CUDA limit on the second and third grid axes


@dataclasses.dataclass(frozen=True)
class GpuBlockSizes:
  """Tile sizes and launch parameters; None picks the default (see table)."""
  block_q: int | None = None
  block_k: int | None = None
  num_warps: int | None = None
  num_stages: int | None = None
  block_q_dq: int | None = None
  block_k_dq: int | None = None
  num_warps_dq: int | None = None
  num_stages_dq: int | None = None
  block_q_dkv: int | None = None
  block_k_dkv: int | None = None
  num_warps_dkv: int | None = None
  num_stages_dkv: int | None = None
  # Causal launch order: each head's heaviest blocks start first, in chunks
  # of this many blocks per head (see _LaunchOrder); 0 keeps the plain
  # block-major order.
  band_chunk: int | None = None

  def resolved(self, row_bytes: int, banded: bool, bias: bool = False,
               itemsize: int = 2) -> "GpuBlockSizes":
    """Fills the defaults (table: docs/design/attention.md). ``row_bytes``:
    bytes of one padded q/k/v row (head_dim * itemsize); ``banded``: causal or
    sliding window; ``bias``: a bias is given (its float32 tiles also sit in
    shared memory); ``itemsize`` of q/k/v."""
    if row_bytes <= 128:  # head_dim <= 64 in bf16
      fwd, dq, dkv = (128, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 2)
    elif row_bytes <= 256:  # head_dim 128 in bf16
      fwd = (128, 64, 8, 3) if banded or bias else (256, 64, 8, 3)
      dq, dkv = (64, 64, 4, 2), (64, 64, 4, 2)
    elif row_bytes <= 512 and itemsize == 2:  # head_dim 256 in bf16
      fwd = (64, 32, 4, 2) if bias else (128, 64, 8, 2)
      dq, dkv = (64, 32, 4, 2), (64, 64, 8, 2)
    else:  # float32 with head_dim >= 128, or wider: keep tiles in smem
      fwd, dq, dkv = (64, 32, 4, 2), (64, 32, 4, 2), (32, 64, 4, 2)
    names = ("block_q{}", "block_k{}", "num_warps{}", "num_stages{}")
    defaults = {}
    for suffix, config in (("", fwd), ("_dq", dq), ("_dkv", dkv)):
      defaults.update({n.format(suffix): c for n, c in zip(names, config)})
    defaults["band_chunk"] = 16
    values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    for name, value in values.items():
      if value is None:
        values[name] = defaults[name]
      elif name.startswith("block") and (value < MIN_BLOCK
                                         or value & (value - 1)):
        raise ValueError(
            f"GpuBlockSizes.{name}={value}: must be a power of two >= "
            f"{MIN_BLOCK}")
      elif value < (0 if name == "band_chunk" else 1):
        raise ValueError(f"GpuBlockSizes.{name}={value}: must be >= "
                         f"{0 if name == 'band_chunk' else 1}")
    return GpuBlockSizes(**values)


def _next_pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def _fit_block(block: int, length: int) -> int:
  """The block for a sequence of ``length``: no larger than needed."""
  return max(MIN_BLOCK, min(block, _next_pow2(length)))


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _pad_axis(x, axis: int, size: int, value=0):
  if x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths, constant_values=value)


@dataclasses.dataclass(frozen=True)
class _Mask:
  """Static mask structure. ``left``/``right`` None means unbounded."""
  lq: int
  lk: int
  left: int | None
  right: int | None
  segments: bool

  @property
  def offset(self) -> int:
    return self.lk - self.lq


def _make_mask(lq, lk, causal, window_left, window_right, segments) -> _Mask:
  right = window_right
  if causal:
    right = 0 if right is None else min(right, 0)
  return _Mask(lq, lk, window_left, right, segments)


def _band_entries(mask: _Mask) -> int:
  """Score-matrix entries inside the causal/window band (segments ignored)."""
  rows = np.arange(mask.lq) + mask.offset   # each row's diagonal key
  first = (np.zeros_like(rows) if mask.left is None
           else np.maximum(rows - mask.left, 0))
  last = (np.full_like(rows, mask.lk - 1) if mask.right is None
          else np.minimum(rows + mask.right, mask.lk - 1))
  return int(np.maximum(last - first + 1, 0).sum())


def _cost_estimate(mask, batch, heads, matmul_dims, arrays, tables=None):
  """Per head, one [band x d] product for each d of ``matmul_dims`` (the
  head dim each matmul contracts or produces) plus one exp per entry (a
  static mask: its listed blocks); ``arrays`` (inputs and outputs) read or
  written once."""
  if tables is None:
    entries = batch * heads * _band_entries(mask)
  else:
    entries = (batch * tables.visited_blocks(heads) * tables.block_q
               * tables.block_kv)
  return _cost.estimate(flops=2 * sum(matmul_dims) * entries,
                        transcendentals=entries,
                        bytes_accessed=_cost.nbytes(*arrays))


# Scalar index arithmetic inside the kernels. Operands are clamped to >= 0
# before dividing, so truncating division equals floor division.
def _floordiv(x, d: int):
  return lax.div(jnp.maximum(x, 0), d)


def _cdiv(x, d: int):
  return lax.div(jnp.maximum(x, 0) + (d - 1), d)


def _clip(x, lo, hi):
  return jnp.minimum(jnp.maximum(x, lo), hi)


def _mask_tables(mask, lq, lk, bq, bk, lq_pad, lk_pad):
  """Block tables of a static mask (None without one)."""
  if mask is None:
    return None
  return _masks.block_tables(mask, lq, lk, bq, bk, lq_pad, lk_pad)


def _table_rows(tables, kv_major: bool):
  """int32 [Ht, rows, W]: per block row (partial count, total count, the
  listed blocks...), W padded to a power of two for Triton."""
  if kv_major:
    parts = (tables.q_partial, tables.q_total, tables.q_index)
  else:
    parts = (tables.kv_partial, tables.kv_total, tables.kv_index)
  rows = np.concatenate([parts[0][..., None], parts[1][..., None], parts[2]],
                        axis=-1)
  width = _next_pow2(rows.shape[-1])
  return jnp.asarray(np.pad(rows, ((0, 0), (0, 0), (0, width - rows.shape[-1]))))


def _walk_listed(table_row, body, carry, segments):
  """Runs ``body(block, carry, masked)`` over a table row's listed blocks:
  ``table_row(n)`` reads entry n (0: partial count, 1: total). With segment
  ids every block is masked."""
  n_partial, n_total = table_row(0), table_row(1)
  if segments:
    n_partial = n_total
  def listed(masked):
    return lambda t, carry: body(table_row(2 + t), carry, masked)
  carry = lax.fori_loop(0, n_partial, listed(True), carry)
  return lax.fori_loop(n_partial, n_total, listed(False), carry)


def _zero_unlisted(dbias, tables, bq, bk):
  """dS blocks no program listed were never written: zero them."""
  listed = np.repeat(np.repeat(tables.classes > 0, bq, axis=1), bk, axis=2)
  return jnp.where(listed[None], dbias, 0.0)


def _kv_blocks(row0, rows: int, block_k: int, mask: _Mask):
  """kv block ranges for q rows [row0, row0 + rows). Returns (lo, a, b, hi):
  blocks [lo, hi) hold some unmasked entry; those in [a, b) are unmasked for
  every row (no mask needed)."""
  nk = -(-mask.lk // block_k)  # blocks holding some real key
  last_row = jnp.minimum(row0 + rows - 1, mask.lq - 1)
  full_k = mask.lk // block_k  # kv blocks without padded keys
  off = mask.offset
  if mask.right is None:
    hi = jnp.int32(nk)
    b = jnp.int32(full_k)
  else:
    hi = jnp.minimum(_cdiv(last_row + off + mask.right + 1, block_k), nk)
    b = jnp.minimum(_floordiv(row0 + off + mask.right + 1, block_k), full_k)
  if mask.left is None:
    lo = jnp.int32(0)
    a = jnp.int32(0)
  else:
    lo = _floordiv(row0 + off - mask.left, block_k)
    a = _cdiv(last_row + off - mask.left, block_k)
  hi = jnp.maximum(hi, lo)
  if mask.segments:
    a = b = hi
  a = _clip(a, lo, hi)
  b = _clip(b, a, hi)
  return lo, a, b, hi


def _q_blocks(col0, cols: int, block_q: int, mask: _Mask):
  """q block ranges for kv columns [col0, col0 + cols); see ``_kv_blocks``.
  Padded q rows need no mask here: their dO is zero and their lse +inf."""
  nq = -(-mask.lq // block_q)  # blocks holding some real query
  last_col = jnp.minimum(col0 + cols - 1, mask.lk - 1)
  off = mask.offset
  if mask.right is None:
    lo = jnp.int32(0)
    a = jnp.int32(0)
  else:
    lo = _floordiv(col0 - off - mask.right, block_q)
    a = _cdiv(col0 + cols - 1 - off - mask.right, block_q)
  if mask.left is None:
    hi = jnp.int32(nq)
    b = jnp.int32(nq)
  else:
    hi = jnp.minimum(_cdiv(last_col - off + mask.left + 1, block_q), nq)
    b = jnp.minimum(_floordiv(col0 - off + mask.left + 1, block_q), nq)
  hi = jnp.maximum(hi, lo)
  if mask.segments:
    a = b = hi
  if mask.lk % cols:
    # A block holding padded keys is masked throughout.
    b = jnp.where(col0 + cols > mask.lk, a, b)
  a = _clip(a, lo, hi)
  b = _clip(b, a, hi)
  return lo, a, b, hi


def _band_mask(rows, cols, mask: _Mask):
  """Boolean mask (True = attend) from broadcastable row/col index arrays."""
  ok = cols < mask.lk  # padded keys
  if mask.right is not None:
    ok = jnp.logical_and(ok, cols <= rows + (mask.offset + mask.right))
  if mask.left is not None:
    ok = jnp.logical_and(ok, cols >= rows + (mask.offset - mask.left))
  return ok


def _logits(qk, bias, *, sm_scale, soft_cap):
  """float32 logits in the base-2 domain, and tanh(x / cap) (None w/o cap)."""
  if soft_cap is None:
    s = qk * (sm_scale * LOG2E) if bias is None else qk * sm_scale
    t = None
  else:
    t = jnp.tanh(qk * (sm_scale / soft_cap))
    s = t * soft_cap
  if bias is not None:
    s = (s + bias) * LOG2E
  elif soft_cap is not None:
    s = s * LOG2E
  return s, t


def _dot_nt(a, b):
  """a @ b.T with float32 accumulation."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                         preferred_element_type=jnp.float32)


def _dot_nn(a, b):
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())),
                         preferred_element_type=jnp.float32)


# ---------------------------------------------------------------------------
# Forward


def _split_table_refs(refs, tables):
  """(table row ref | None, dense mask ref | None, remaining refs)."""
  table_ref = dense_ref = None
  if tables is not None:
    table_ref, *refs = refs
    if tables.dense is not None:
      dense_ref, *refs = refs
  return table_ref, dense_ref, refs


def _split_refs(refs, segments, has_bias):
  """(q, k, v, q_seg|None, kv_seg|None, bias|None, remaining refs)."""
  q_ref, k_ref, v_ref, *rest = refs
  qseg_ref = kvseg_ref = bias_ref = None
  if segments:
    qseg_ref, kvseg_ref, *rest = rest
  if has_bias:
    bias_ref, *rest = rest
  return q_ref, k_ref, v_ref, qseg_ref, kvseg_ref, bias_ref, rest


def _kv_block_logits(q, k, bias_ref, kvseg_ref, qseg, rows, c, kv_slice,
                     masked, *, mask, sm_scale, soft_cap, tables=None,
                     dense_ref=None):
  """Logits of a query block against kv block ``c`` (rows of the query block
  in ``rows``); ``masked`` applies the band (or the static mask of
  ``tables``) and segment masks as -inf."""
  block_q, block_k = rows.shape
  bias = None
  if bias_ref is not None:
    bias = bias_ref[:, kv_slice].astype(jnp.float32)
  s, t = _logits(_dot_nt(q, k), bias, sm_scale=sm_scale, soft_cap=soft_cap)
  if masked:
    cols = c * block_k + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
    if tables is None:
      ok = _band_mask(rows, cols, mask)
    else:
      tile = None if dense_ref is None else dense_ref[:, kv_slice]
      ok = _masks.element_mask(tables, rows, cols, tile)
    if qseg is not None:
      ok = jnp.logical_and(ok, qseg[:, None] == kvseg_ref[kv_slice][None, :])
    s = jnp.where(ok, s, NEG_INF)
  return s, t


@dataclasses.dataclass(frozen=True)
class _LaunchOrder:
  """Grid of ``blocks`` per (batch, head) program and its index mapping.
  Triton starts programs in grid order; ``reverse`` puts a head's heavy
  (causal) blocks first and ``chunk`` > 0 launches ``chunk`` blocks of every
  head at a time, so the heaviest start early and a head's blocks still
  share its tiles in L2."""
  blocks: int
  heads: int
  reverse: bool = False
  chunk: int = 0

  def grid(self, batch: int):
    if not self.chunk:
      return (self.blocks, batch, self.heads)
    return (self.chunk, batch * self.heads, self.blocks // self.chunk)

  def ids(self, g0, g1, g2):
    """(block, batch, head) of the program at grid index (g0, g1, g2)."""
    if self.chunk:
      block, b, h = g2 * self.chunk + g0, g1 // self.heads, g1 % self.heads
    else:
      block, b, h = g0, g1, g2
    if self.reverse:
      block = self.blocks - 1 - block
    return block, b, h

  def spec(self, shape, index):
    """BlockSpec whose index map is ``index(block, batch, head)``."""
    return pl.BlockSpec(shape, lambda *g: index(*self.ids(*g)))

  def block_id(self):
    return self.ids(pl.program_id(0), pl.program_id(1), pl.program_id(2))[0]


def _launch_order(blocks, batch, heads, mask: _Mask, sizes,
                  heavy_last: bool):
  """Causal masks: heavy blocks first, chunked (``GpuBlockSizes.band_chunk``).
  ``heavy_last``: the last blocks carry the most work (q blocks of the forward
  and dq kernels; for the dk/dv kernel it is the first kv blocks)."""
  if mask.right is None or mask.left is not None:
    return _LaunchOrder(blocks, heads)
  chunk = math.gcd(blocks, sizes.band_chunk) if sizes.band_chunk else 0
  if batch * heads > MAX_GRID_YZ:  # the chunked grid's second axis
    chunk = 0
  return _LaunchOrder(blocks, heads, reverse=heavy_last, chunk=chunk)


def _forward_kernel(q_ref, k_ref, v_ref, qseg_ref, kvseg_ref, bias_ref,
                    table_ref, dense_ref, o_ref, lse_ref, *, sm_scale,
                    soft_cap, mask: _Mask, tables, block_q, block_k,
                    order: _LaunchOrder):
  row0 = order.block_id() * block_q
  q = q_ref[...]
  dim = v_ref.shape[-1]
  rows = row0 + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
  qseg = None if qseg_ref is None else qseg_ref[...]

  def body(c, carry, masked):
    acc, m_prev, l_prev = carry
    kv_slice = pl.ds(c * block_k, block_k)
    s, _ = _kv_block_logits(q, k_ref[kv_slice, :], bias_ref, kvseg_ref, qseg,
                            rows, c, kv_slice, masked, mask=mask,
                            sm_scale=sm_scale, soft_cap=soft_cap,
                            tables=tables, dense_ref=dense_ref)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    m_shift = m_next
    if masked or bias_ref is not None:
      # A row with nothing unmasked yet keeps m = -inf; shift it by 0.
      m_shift = jnp.where(m_next == NEG_INF, 0.0, m_next)
    alpha = jnp.exp2(m_prev - m_shift)
    p = jnp.exp2(s - m_shift[:, None])
    l_next = l_prev * alpha + jnp.sum(p, axis=1)
    v = v_ref[kv_slice, :]
    acc = acc * alpha[:, None] + _dot_nn(p.astype(v.dtype), v)
    return acc, m_next, l_next

  carry = (jnp.zeros((block_q, dim), jnp.float32),
           jnp.full((block_q,), NEG_INF, jnp.float32),
           jnp.zeros((block_q,), jnp.float32))
  if tables is not None:
    acc, m, l = _walk_listed(lambda n: table_ref[n], body, carry,
                             qseg_ref is not None)
  else:
    lo, a, b, hi = _kv_blocks(row0, block_q, block_k, mask)
    masked_body = functools.partial(body, masked=True)
    carry = lax.fori_loop(lo, a, masked_body, carry)
    carry = lax.fori_loop(a, b, functools.partial(body, masked=False), carry)
    acc, m, l = lax.fori_loop(b, hi, masked_body, carry)

  empty = l == 0.0
  o_ref[...] = (acc / jnp.where(empty, 1.0, l)[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(empty, NEG_INF, (m + jnp.log2(l)) * LN2)


def _prepare(q, k, v, q_segment_ids, kv_segment_ids, bias, bq, bk, dp):
  """Pads sequences to tile multiples and the head dims to ``dp`` (q/k's,
  v's; zeros)."""
  lq_pad = _round_up(q.shape[2], bq)
  lk_pad = _round_up(k.shape[2], bk)
  q = _pad_axis(_pad_axis(q, 2, lq_pad), 3, dp[0])
  k = _pad_axis(_pad_axis(k, 2, lk_pad), 3, dp[0])
  v = _pad_axis(_pad_axis(v, 2, lk_pad), 3, dp[1])
  if q_segment_ids is not None:
    q_segment_ids = _pad_axis(q_segment_ids.astype(jnp.int32), 1, lq_pad)
    kv_segment_ids = _pad_axis(kv_segment_ids.astype(jnp.int32), 1, lk_pad)
  if bias is not None:
    bias = _pad_axis(_pad_axis(bias, 2, lq_pad), 3, lk_pad)
  return q, k, v, q_segment_ids, kv_segment_ids, bias


def _head_dim_padded(head_dim: int) -> int:
  return max(MIN_BLOCK, _next_pow2(head_dim))


def _sizes(block_sizes, dp: int, dtype, mask: _Mask,
           bias) -> GpuBlockSizes:
  if not isinstance(block_sizes, GpuBlockSizes):
    block_sizes = GpuBlockSizes()
  banded = mask.left is not None or mask.right is not None
  itemsize = jnp.dtype(dtype).itemsize
  return block_sizes.resolved(dp * itemsize, banded, bias is not None,
                              itemsize)


def _crop(x, shape):
  """x[:shape] without emitting a slice when nothing is cut."""
  if tuple(x.shape) == tuple(shape):
    return x
  return x[tuple(slice(0, n) for n in shape)]


def _geometry(q, k, v, q_segment_ids, bias, *, causal, window_left,
              window_right, block_sizes):
  """(group, padded head dims (q/k's, v's), has segments, mask, block
  sizes) of a call; the tiles fit the wider head dim."""
  (_, heads, lq, dim), (kv_heads, lk) = q.shape, k.shape[1:3]
  dp = (_head_dim_padded(dim), _head_dim_padded(v.shape[3]))
  segments = q_segment_ids is not None
  mask = _make_mask(lq, lk, causal, window_left, window_right, segments)
  return (heads // kv_heads, dp, segments, mask,
          _sizes(block_sizes, max(dp), q.dtype, mask, bias))


def _table_inputs(order, tables, *, bq, kv_major, group=1):
  """(in_specs, args) of a static mask: the program's table row and, for a
  mask without formula, its dense rows (transposed for the key-major dk/dv
  kernel, whose programs cover ``group`` query heads)."""
  if tables is None:
    return [], []
  rows = _table_rows(tables, kv_major)
  width = rows.shape[-1]
  # Query-major programs read their head's row; key-major ones the rows of
  # their kv head's query heads.
  heads = group if tables.per_head and kv_major else None
  head = (lambda h: h) if tables.per_head else (lambda h: 0)
  specs = [order.spec((heads, None, width), lambda n, b, h: (head(h), n, 0))]
  args = [rows]
  if tables.dense is not None:
    dense = jnp.asarray(tables.dense)
    if kv_major:
      dense = jnp.swapaxes(dense, 1, 2)
    specs.append(order.spec((heads, bq, dense.shape[2]),
                            lambda n, b, h: (head(h), n, 0)))
    args.append(dense)
  return specs, args


def _q_major_inputs(order, q, k, v, qseg, kvseg, bias, *, bq, group):
  """(in_specs, args) of the kernels gridded over q blocks: a q block, the
  whole (padded) k and v of its kv head, segment ids and the bias rows."""
  lk_pad = k.shape[2]

  def kv_full(dp):
    return order.spec((None, None, lk_pad, dp),
                      lambda i, b, h: (b, h // group, 0, 0))
  in_specs = [order.spec((None, None, bq, q.shape[3]),
                         lambda i, b, h: (b, h, i, 0)),
              kv_full(k.shape[3]), kv_full(v.shape[3])]
  args = [q, k, v]
  if qseg is not None:
    in_specs += [order.spec((None, bq), lambda i, b, h: (b, i)),
                 order.spec((None, lk_pad), lambda i, b, h: (b, 0))]
    args += [qseg, kvseg]
  if bias is not None:
    per_batch, per_head = bias.shape[0] != 1, bias.shape[1] != 1
    in_specs.append(order.spec(
        (None, None, bq, lk_pad),
        lambda i, b, h: (b if per_batch else 0, h if per_head else 0, i, 0)))
    args.append(bias)
  return in_specs, args


def forward(q, k, v, q_segment_ids, kv_segment_ids, bias, *, sm_scale,
            causal, window_left, window_right, logit_soft_cap, block_sizes,
            interpret, mask=None):
  """Attention forward. Returns (out [B,H,Lq,Dv] q.dtype, lse [B,H,Lq] f32). q
  [B, H, Lq, D]; k [B, Hk, Lk, D]; v [B, Hk, Lk, Dv]; segment ids [B, Lq] / [B,
  Lk] or None; bias [B or 1, H or 1, Lq, Lk] or None; the window already split
  into ``window_left``/``window_right`` (None: unbounded); no dimension empty
  (``flash_attention`` answers those itself). ``block_sizes``: a
  ``GpuBlockSizes`` (anything else: the defaults). ``interpret``: run in Pallas'
  interpreter. ``mask``: a static mask (``masks``) or per-head tuple, walked as
  block tables."""
  batch, heads, lq, dim = q.shape
  lk, dim_v = k.shape[2], v.shape[3]
  static_mask = mask
  group, dp, segments, mask, sizes = _geometry(
      q, k, v, q_segment_ids, bias, causal=causal, window_left=window_left,
      window_right=window_right, block_sizes=block_sizes)
  bq = _fit_block(sizes.block_q, lq)
  bk = _fit_block(sizes.block_k, lk)
  q, k, v, qseg, kvseg, bias = _prepare(
      q, k, v, q_segment_ids, kv_segment_ids, bias, bq, bk, dp)
  lq_pad = q.shape[2]
  nq = lq_pad // bq
  tables = _mask_tables(static_mask, lq, lk, bq, bk, lq_pad, k.shape[2])
  order = _launch_order(nq, batch, heads, mask, sizes, heavy_last=True)
  in_specs, args = _q_major_inputs(order, q, k, v, qseg, kvseg, bias, bq=bq,
                                   group=group)
  table_specs, table_args = _table_inputs(order, tables, bq=bq,
                                          kv_major=False)
  in_specs, args = in_specs + table_specs, args + table_args

  def kernel(*refs):
    (q_ref, k_ref, v_ref, qseg_ref, kvseg_ref, bias_ref,
     rest) = _split_refs(refs, segments, bias is not None)
    table_ref, dense_ref, rest = _split_table_refs(rest, tables)
    o_ref, lse_ref = rest
    _forward_kernel(q_ref, k_ref, v_ref, qseg_ref, kvseg_ref, bias_ref,
                    table_ref, dense_ref, o_ref, lse_ref, sm_scale=sm_scale,
                    soft_cap=logit_soft_cap, mask=mask, tables=tables,
                    block_q=bq, block_k=bk, order=order)

  out_shape = [jax.ShapeDtypeStruct((batch, heads, lq_pad, dp[1]), q.dtype),
               jax.ShapeDtypeStruct((batch, heads, lq_pad), jnp.float32)]
  out, lse = _compat.pallas_call(
      kernel,
      grid=order.grid(batch),
      in_specs=in_specs,
      out_specs=[
          order.spec((None, None, bq, dp[1]), lambda i, b, h: (b, h, i, 0)),
          order.spec((None, None, bq), lambda i, b, h: (b, h, i)),
      ],
      out_shape=out_shape,
      compiler_params=_compat.gpu_compiler_params(
          num_warps=sizes.num_warps, num_stages=sizes.num_stages),
      interpret=interpret,
      cost_estimate=_cost_estimate(mask, batch, heads, (dim, dim_v),
                                   [*args, *out_shape], tables),
      name="flash_attention_fwd_gpu",
  )(*args)
  return _crop(out, (batch, heads, lq, dim_v)), _crop(lse, (batch, heads, lq))


# ---------------------------------------------------------------------------
# Backward


def _dq_kernel(q_ref, k_ref, v_ref, qseg_ref, kvseg_ref, bias_ref, do_ref,
               o_ref, lse_ref, dlse_ref, table_ref, dense_ref, dq_ref,
               delta_ref, dbias_ref, *, sm_scale, soft_cap, mask: _Mask,
               tables, block_q, block_k, nk, block_index):
  row0 = block_index * block_q
  q = q_ref[...]
  do = do_ref[...]
  # delta = rowsum(dO * O) here, not in a separate pass over O and dO; the
  # dk/dv kernel reads it back.
  delta = jnp.sum(do.astype(jnp.float32) * o_ref[...].astype(jnp.float32),
                  axis=1)
  if dlse_ref is not None:
    delta = delta - dlse_ref[...]
  delta_ref[...] = delta
  lse = lse_ref[...]
  # +inf for empty rows makes their p exactly 0.
  lse2 = jnp.where(lse == NEG_INF, jnp.inf, lse * LOG2E)
  rows = row0 + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
  qseg = None if qseg_ref is None else qseg_ref[...]

  def body(c, dq, masked):
    kv_slice = pl.ds(c * block_k, block_k)
    k = k_ref[kv_slice, :]
    v = v_ref[kv_slice, :]
    s, t = _kv_block_logits(q, k, bias_ref, kvseg_ref, qseg,
                            rows, c, kv_slice, masked, mask=mask,
                            sm_scale=sm_scale, soft_cap=soft_cap,
                            tables=tables, dense_ref=dense_ref)
    p = jnp.exp2(s - lse2[:, None])
    ds = p * (_dot_nt(do, v) - delta[:, None])
    if dbias_ref is not None:
      dbias_ref[:, kv_slice] = ds
    if t is not None:
      ds = ds * (1.0 - t * t)
    return dq + _dot_nn(ds.astype(k.dtype), k)

  dq = jnp.zeros(q.shape, jnp.float32)
  if tables is not None:   # unlisted dS blocks are zeroed by the caller
    dq = _walk_listed(lambda n: table_ref[n], body, dq, qseg_ref is not None)
    dq_ref[...] = (dq * sm_scale).astype(dq_ref.dtype)
    return
  lo, a, b, hi = _kv_blocks(row0, block_q, block_k, mask)
  if dbias_ref is not None:
    # Skipped blocks still need their (zero) bias gradient written.
    def zero(c, carry):
      dbias_ref[:, pl.ds(c * block_k, block_k)] = jnp.zeros(
          (block_q, block_k), jnp.float32)
      return carry
    lax.fori_loop(0, lo, zero, 0)
    lax.fori_loop(hi, nk, zero, 0)
  masked_body = functools.partial(body, masked=True)
  dq = lax.fori_loop(lo, a, masked_body, dq)
  dq = lax.fori_loop(a, b, functools.partial(body, masked=False), dq)
  dq = lax.fori_loop(b, hi, masked_body, dq)
  dq_ref[...] = (dq * sm_scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, qseg_ref, kvseg_ref, bias_ref, do_ref,
                lse_ref, delta_ref, table_ref, dense_ref, dk_ref, dv_ref, *,
                sm_scale, soft_cap, mask: _Mask, tables, block_q, block_k,
                group, bias_per_head, order: _LaunchOrder):
  col0 = order.block_id() * block_k
  k = k_ref[...]
  v = v_ref[...]
  # Work in the transposed orientation: rows are keys, columns are queries.
  cols_k = col0 + lax.broadcasted_iota(jnp.int32, (block_k, block_q), 0)
  kvseg = None if kvseg_ref is None else kvseg_ref[...]

  def body(i, carry, g, masked):
    dk, dv = carry
    q_slice = pl.ds(i * block_q, block_q)
    q = q_ref[g, q_slice, :]
    do = do_ref[g, q_slice, :]
    lse = lse_ref[g, q_slice]
    lse2 = jnp.where(lse == NEG_INF, jnp.inf, lse * LOG2E)
    delta = delta_ref[g, q_slice]
    bias = None
    if bias_ref is not None:
      bias_g = g if bias_per_head else 0
      bias = bias_ref[bias_g, q_slice, :].astype(jnp.float32).T
    s, t = _logits(_dot_nt(k, q), bias, sm_scale=sm_scale, soft_cap=soft_cap)
    if masked:
      rows_q = i * block_q + lax.broadcasted_iota(
          jnp.int32, (block_k, block_q), 1)
      if tables is None:
        ok = _band_mask(rows_q, cols_k, mask)
      else:
        tile = None
        if dense_ref is not None:
          tile = (dense_ref[g, :, q_slice] if tables.per_head
                  else dense_ref[:, q_slice])
        ok = _masks.element_mask(tables, rows_q, cols_k, tile)
      if kvseg is not None:
        ok = jnp.logical_and(ok, kvseg[:, None] == qseg_ref[q_slice][None, :])
      s = jnp.where(ok, s, NEG_INF)
    p = jnp.exp2(s - lse2[None, :])
    dv = dv + _dot_nn(p.astype(do.dtype), do)
    ds = p * (_dot_nt(v, do) - delta[None, :])
    if t is not None:
      ds = ds * (1.0 - t * t)
    dk = dk + _dot_nn(ds.astype(q.dtype), q)
    return dk, dv

  if tables is not None:
    def head(g, carry):
      def table_row(n):
        return table_ref[g, n] if tables.per_head else table_ref[n]
      return _walk_listed(
          table_row, lambda i, carry, masked: body(i, carry, g, masked), carry,
          kvseg_ref is not None)
    zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dk, dv = lax.fori_loop(0, group, head, zeros)
    dk_ref[...] = (dk * sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)
    return

  lo, a, b, hi = _q_blocks(col0, block_k, block_q, mask)

  def head(g, carry):
    masked_body = functools.partial(body, g=g, masked=True)
    carry = lax.fori_loop(lo, a, masked_body, carry)
    carry = lax.fori_loop(a, b, functools.partial(body, g=g, masked=False),
                          carry)
    return lax.fori_loop(b, hi, masked_body, carry)

  zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  dk, dv = lax.fori_loop(0, group, head, zeros)
  dk_ref[...] = (dk * sm_scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def backward(q, k, v, q_segment_ids, kv_segment_ids, bias, out, lse, d_out,
             d_lse, *, sm_scale, causal, window_left, window_right,
             logit_soft_cap, block_sizes, interpret, mask=None):
  """Attention backward: (dq, dk, dv, dbias or None) for ``forward``'s output.
  ``out``/``lse`` may come from any forward kernel (lse natural-log, -inf for
  rows without keys). ``d_lse`` ([B, H, Lq] or None) is the cotangent of lse:
  since d lse_i / d s_ij = p_ij it only shifts delta (ds = p * (dp - delta +
  d_lse))."""
  batch, heads, lq, dim = q.shape
  kv_heads, lk, dim_v = k.shape[1], k.shape[2], v.shape[3]
  dbias_wanted = bias is not None
  static_mask = mask
  group, dp, segments, mask, sizes = _geometry(
      q, k, v, q_segment_ids, bias, causal=causal, window_left=window_left,
      window_right=window_right, block_sizes=block_sizes)
  bq_dq = _fit_block(sizes.block_q_dq, lq)
  bk_dq = _fit_block(sizes.block_k_dq, lk)
  bq_kv = _fit_block(sizes.block_q_dkv, lq)
  bk_kv = _fit_block(sizes.block_k_dkv, lk)

  bias_shape, bias_dtype = (None, None) if bias is None else (bias.shape,
                                                              bias.dtype)
  q, k, v, qseg, kvseg, bias = _prepare(
      q, k, v, q_segment_ids, kv_segment_ids, bias, max(bq_dq, bq_kv),
      max(bk_dq, bk_kv), dp)
  lq_pad, lk_pad = q.shape[2], k.shape[2]
  d_out = _pad_axis(_pad_axis(d_out.astype(q.dtype), 2, lq_pad), 3, dp[1])
  out = _pad_axis(_pad_axis(out, 2, lq_pad), 3, dp[1])
  lse = _pad_axis(lse.astype(jnp.float32), 2, lq_pad, jnp.inf)
  if d_lse is not None:
    d_lse = _pad_axis(d_lse.astype(jnp.float32), 2, lq_pad)
  per_batch = per_head = False
  if bias is not None:
    per_batch, per_head = bias.shape[0] != 1, bias.shape[1] != 1

  dq_tables = _mask_tables(static_mask, lq, lk, bq_dq, bk_dq, lq_pad, lk_pad)
  dq, delta, dbias = _dq_call(
      q, k, v, qseg, kvseg, bias, d_out, out, lse, d_lse, sizes=sizes,
      mask=mask, tables=dq_tables, bq=bq_dq, bk=bk_dq, group=group,
      dbias_wanted=dbias_wanted, sm_scale=sm_scale, soft_cap=logit_soft_cap,
      interpret=interpret)
  dkv_tables = _mask_tables(static_mask, lq, lk, bq_kv, bk_kv, lq_pad, lk_pad)
  # dk, dv: grid over kv blocks and kv heads; loops over the group's q heads.
  order = _launch_order(lk_pad // bk_kv, batch, kv_heads, mask, sizes,
                        heavy_last=False)
  def kv_block(d):
    return order.spec((None, None, bk_kv, d), lambda j, b, hk: (b, hk, j, 0))

  def q_group(d):
    return order.spec((None, group, lq_pad, d),
                      lambda j, b, hk: (b, hk, 0, 0))
  rows_group = order.spec((None, group, lq_pad), lambda j, b, hk: (b, hk, 0))
  in_specs = [q_group(dp[0]), kv_block(dp[0]), kv_block(dp[1])]
  args = [q, k, v]
  if segments:
    in_specs += [order.spec((None, lq_pad), lambda j, b, hk: (b, 0)),
                 order.spec((None, bk_kv), lambda j, b, hk: (b, j))]
    args += [qseg, kvseg]
  if bias is not None:
    in_specs.append(order.spec(
        (None, group if per_head else 1, lq_pad, bk_kv),
        lambda j, b, hk: (b if per_batch else 0, hk if per_head else 0, 0, j)))
    args.append(bias)
  in_specs += [q_group(dp[1]), rows_group, rows_group]
  args += [d_out, lse, delta]
  table_specs, table_args = _table_inputs(order, dkv_tables, bq=bk_kv,
                                          kv_major=True, group=group)
  in_specs, args = in_specs + table_specs, args + table_args

  def dkv_kernel(*refs):
    (q_ref, k_ref, v_ref, qseg_ref, kvseg_ref, bias_ref,
     rest) = _split_refs(refs, segments, bias is not None)
    do_ref, lse_ref, delta_ref, *rest = rest
    table_ref, dense_ref, rest = _split_table_refs(rest, dkv_tables)
    dk_ref, dv_ref = rest
    _dkv_kernel(q_ref, k_ref, v_ref, qseg_ref, kvseg_ref, bias_ref, do_ref,
                lse_ref, delta_ref, table_ref, dense_ref, dk_ref, dv_ref,
                sm_scale=sm_scale, soft_cap=logit_soft_cap, mask=mask,
                tables=dkv_tables, block_q=bq_kv, block_k=bk_kv, group=group,
                bias_per_head=per_head, order=order)

  dkv_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype),
               jax.ShapeDtypeStruct(v.shape, v.dtype)]
  dk, dv = _compat.pallas_call(
      dkv_kernel, grid=order.grid(batch), in_specs=in_specs,
      out_specs=[kv_block(dp[0]), kv_block(dp[1])],
      out_shape=dkv_shape,
      compiler_params=_compat.gpu_compiler_params(
          num_warps=sizes.num_warps_dkv, num_stages=sizes.num_stages_dkv),
      interpret=interpret,
      # Recomputes s and dp, forms dv and dk: four matmuls.
      cost_estimate=_cost_estimate(mask, batch, heads,
                                   (dim, dim_v, dim_v, dim),
                                   [*args, *dkv_shape], dkv_tables),
      name="flash_attention_dkv_gpu",
  )(*args)

  dq = _crop(dq, (batch, heads, lq, dim))
  dk = _crop(dk, (batch, kv_heads, lk, dim))
  dv = _crop(dv, (batch, kv_heads, lk, dim_v))
  if dbias is not None:
    if dq_tables is not None:
      dbias = _zero_unlisted(dbias, dq_tables, bq_dq, bk_dq)
    dbias = _crop(dbias, (batch, heads, lq, lk))
    axes = tuple(a for a in (0, 1) if bias_shape[a] == 1)
    if axes:
      dbias = jnp.sum(dbias, axis=axes, keepdims=True)
    dbias = dbias.astype(bias_dtype)
  return dq, dk, dv, dbias


def _dq_call(q, k, v, qseg, kvseg, bias, d_out, out, lse, d_lse, *, sizes,
             mask, tables, bq, bk, group, dbias_wanted, sm_scale, soft_cap,
             interpret):
  """The dq kernel: (dq, delta, dS or None), grid over q blocks."""
  batch, heads, lq_pad, dp = q.shape
  lk_pad = k.shape[2]
  nq, nk = lq_pad // bq, lk_pad // bk
  segments = qseg is not None
  order = _launch_order(nq, batch, heads, mask, sizes, heavy_last=True)
  q_block = order.spec((None, None, bq, dp), lambda i, b, h: (b, h, i, 0))
  o_block = order.spec((None, None, bq, v.shape[3]),
                       lambda i, b, h: (b, h, i, 0))
  row_block = order.spec((None, None, bq), lambda i, b, h: (b, h, i))
  in_specs, args = _q_major_inputs(order, q, k, v, qseg, kvseg, bias, bq=bq,
                                   group=group)
  in_specs += [o_block, o_block, row_block]
  args += [d_out, out, lse]
  if d_lse is not None:
    in_specs.append(row_block)
    args.append(d_lse)
  table_specs, table_args = _table_inputs(order, tables, bq=bq,
                                          kv_major=False)
  in_specs, args = in_specs + table_specs, args + table_args
  out_specs = [q_block, row_block]
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype),
               jax.ShapeDtypeStruct((batch, heads, lq_pad), jnp.float32)]
  if dbias_wanted:
    out_specs.append(order.spec((None, None, bq, lk_pad),
                                lambda i, b, h: (b, h, i, 0)))
    out_shape.append(
        jax.ShapeDtypeStruct((batch, heads, lq_pad, lk_pad), jnp.float32))

  def kernel(*refs):
    (q_ref, k_ref, v_ref, qseg_ref, kvseg_ref, bias_ref,
     rest) = _split_refs(refs, segments, bias is not None)
    do_ref, o_ref, lse_ref, *rest = rest
    dlse_ref = rest.pop(0) if d_lse is not None else None
    table_ref, dense_ref, rest = _split_table_refs(rest, tables)
    dq_ref, delta_ref, *rest = rest
    dbias_ref = rest[0] if dbias_wanted else None
    _dq_kernel(q_ref, k_ref, v_ref, qseg_ref, kvseg_ref, bias_ref, do_ref,
               o_ref, lse_ref, dlse_ref, table_ref, dense_ref, dq_ref,
               delta_ref, dbias_ref, sm_scale=sm_scale, soft_cap=soft_cap,
               mask=mask, tables=tables, block_q=bq, block_k=bk, nk=nk,
               block_index=order.block_id())

  results = _compat.pallas_call(
      kernel, grid=order.grid(batch), in_specs=in_specs,
      out_specs=out_specs, out_shape=out_shape,
      compiler_params=_compat.gpu_compiler_params(
          num_warps=sizes.num_warps_dq, num_stages=sizes.num_stages_dq),
      interpret=interpret,
      # Recomputes s and dp, forms dq: three matmuls.
      cost_estimate=_cost_estimate(mask, batch, heads, (dp, v.shape[3], dp),
                                   [*args, *out_shape], tables),
      name="flash_attention_dq_gpu",
  )(*args)
  return results[0], results[1], (results[2] if dbias_wanted else None)
