"""Flash-attention forward for Hopper GPUs: a Pallas Mosaic GPU kernel.

One CTA per (head, 128-row q tile, batch): two compute warpgroups (64 query
rows each: wgmma ``S = Q K^T``, online softmax in base 2, ``acc += P V``) and
a memory warpgroup streaming the band's K/V blocks through a TMA ring; static
masks come as block tables. Structure: docs/design/attention.md.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import _compat, _mosaic_gpu
from pallas_kernels.attention import masks as _masks

pl = _compat.pl

plgpu = _mosaic_gpu.plgpu

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
NEG_INF = float("-inf")
ROWS_PER_WG = 64  # one wgmma M tile per compute warpgroup
COMPUTE_WGS = 2
_NEEDED_API = ("kernel", "wgmma", "Barrier", "SMEM", "ACC", "Layout",
               "layout_cast", "broadcasted_iota", "barrier_wait",
               "barrier_arrive", "copy_gmem_to_smem", "copy_smem_to_gmem",
               "commit_smem", "wait_smem_to_gmem", "set_max_registers",
               "transpose_ref", "TilingTransform", "SwizzleTransform",
               "CompilerParams")


def api_missing() -> str | None:
  """Why this jax cannot build the kernel, or None when it can."""
  return _mosaic_gpu.api_missing("attention", _NEEDED_API)


interpret_params = _mosaic_gpu.interpret_params


# Head dims the Mosaic GPU kernels run natively: multiples of 16 (a wgmma K
# step and the narrowest swizzled SMEM row, 32 bytes of bf16) from 64 on.
HEAD_DIM_MULTIPLE = 16
MIN_HEAD_DIM = 64


def kernel_head_dim(head_dim: int, max_head_dim: int) -> int | None:
  """The width a head_dim runs at: head_dim rounded up to a multiple of 16
  (the extra features zero-padded: logits and outputs are unchanged); None
  below ``MIN_HEAD_DIM`` (the Triton kernel runs those without padding work)
  or when the width exceeds ``max_head_dim``."""
  if head_dim < MIN_HEAD_DIM:
    return None
  width = -(-head_dim // HEAD_DIM_MULTIPLE) * HEAD_DIM_MULTIPLE
  return width if width <= max_head_dim else None


def with_padded_head_dim(run, arrays, width: int, crop):
  """``run(*arrays)`` at head_dim ``width``: pads the last axis of every
  array with zeros to it and crops ``crop(result, head_dim)`` back."""
  head_dim = arrays[0].shape[-1]
  if width == head_dim:
    return run(*arrays)
  padded = [None if x is None else _pad_axis(x, x.ndim - 1, width)
            for x in arrays]
  return crop(run(*padded), head_dim)


def call_refusal(kernel: str, q, k, v, q_segment_ids, bias, max_head_dim):
  """Why the Mosaic GPU ``kernel`` cannot take this call, from its inputs
  alone (None: it can, as far as they tell)."""
  reason = api_missing()
  if reason:
    return reason
  if bias is not None:
    return f"the Mosaic GPU {kernel} kernel takes no bias"
  if q_segment_ids is not None:
    return f"the Mosaic GPU {kernel} kernel takes no segment ids"
  dtypes = {jnp.dtype(x.dtype) for x in (q, k, v)}
  if len(dtypes) != 1 or dtypes.pop() not in (jnp.dtype(jnp.bfloat16),
                                              jnp.dtype(jnp.float16)):
    return f"the Mosaic GPU {kernel} kernel needs q, k, v all bf16 or all fp16"
  head_dim = q.shape[-1]
  if v.shape[-1] != head_dim:
    return (f"the Mosaic GPU {kernel} kernel needs v's head_dim equal to "
            f"q's, got {v.shape[-1]} and {head_dim}")
  if kernel_head_dim(head_dim, max_head_dim) is None:
    return (f"the Mosaic GPU {kernel} kernel needs {MIN_HEAD_DIM} <= "
            f"head_dim <= {max_head_dim}, got {head_dim}")
  if min(q.shape) == 0 or min(k.shape) == 0:
    return f"the Mosaic GPU {kernel} kernel needs non-empty inputs"
  return None


# Keys per ring slot for head dims up to each key (H100-tuned;
# docs/design/attention.md): the S tile and the accumulator share the
# compute warpgroups' registers, K and V tiles the SMEM.
BLOCK_K = {64: 256, 128: 128, 256: 64}
MAX_HEAD_DIM = max(BLOCK_K)


def block_k_for(head_dim: int) -> int:
  """Keys per ring slot at a (native) head_dim."""
  return BLOCK_K[min(d for d in BLOCK_K if d >= head_dim)]
STAGES = 2
# Per-thread registers of the compute and memory warpgroups (setmaxnreg).
# 384 threads start with 168 each; the compute warpgroups can only gain what
# the memory one gives back, 2 (c - 168) <= 168 - m, and asking for more
# than the launch can give hangs the kernel.
COMPUTE_REGISTERS = 232
MEMORY_REGISTERS = 40
# Hardware barriers of the named-barrier ping-pong: Mosaic GPU itself uses
# barrier 0 (whole CTA) and 1-3 (one per warpgroup).
PING_PONG_BARRIER = 12


def default_schedule(head_dim: int, block_k: int, lk: int, causal: bool,
                     window_left, window_right, soft_cap):
  """(overlap, named_barriers): above head_dim 64 the overlapped steps when
  no step is masked (no causal mask, window or soft cap, Lk a multiple of
  block_k); with a masked step the hardware-barrier ping-pong at head dims
  80..128 and the rendezvous above; the rendezvous at head_dim 64."""
  if head_dim <= 64:
    return False, False
  unmasked = (not causal and window_left is None and window_right is None
              and lk % block_k == 0 and soft_cap is None)
  if unmasked:
    return True, False
  return False, head_dim <= 128


def supports(q, k, v, q_segment_ids=None, bias=None,
             mask=None) -> str | None:
  """None when ``forward`` handles this call, else why not (arrays or
  ShapeDtypeStructs; ``mask`` the static mask or None)."""
  return (call_refusal("attention", q, k, v, q_segment_ids, bias,
                       MAX_HEAD_DIM) or mask_refusal("attention", mask))


# --------------------------------------------------------------- masking --


@dataclasses.dataclass(frozen=True)
class _Band:
  """Static mask structure; ``left``/``right`` None mean unbounded."""
  lq: int
  lk: int
  left: int | None
  right: int | None

  @property
  def offset(self) -> int:
    return self.lk - self.lq


def _band(lq, lk, causal, window_left, window_right) -> _Band:
  right = window_right
  if causal:
    right = 0 if right is None else min(right, 0)
  return _Band(lq, lk, window_left, right)


def _div_floor(x, d: int):
  return lax.div(jnp.maximum(x, 0), jnp.int32(d))


def _div_ceil(x, d: int):
  return lax.div(jnp.maximum(x, 0) + (d - 1), jnp.int32(d))


def q_tile_program(nq: int, reverse_q: bool):
  """(batch, head, q tile, warpgroup) of this program of a q-tiled kernel."""
  tile = lax.axis_index("q_tiles")
  if reverse_q:  # causal: the longest rows first
    tile = (nq - 1) - tile
  return (lax.axis_index("batch"), lax.axis_index("heads"), tile,
          lax.axis_index("wg"))


def layout_cast(x, layout, interpreting):
  """``x`` in register ``layout`` (the interpreter has no rule for casts)."""
  return x if interpreting else plgpu.layout_cast(x, layout)


def wgmma_iota(shape, dim, interpreting):
  """int32 indices along ``dim`` of a ``shape`` tile in the wgmma layout."""
  return layout_cast(lax.broadcasted_iota(jnp.int32, shape, dim),
                     plgpu.Layout.WGMMA, interpreting)


def load_vector(ref, layout, interpreting):
  """A per-row (or per-column) vector from shared memory in ``layout``."""
  return ref[...] if interpreting else _compat.mosaic_gpu_load(ref,
                                                               layout=layout)


def register_tools(tile_shape, vector_axis: int, interpreting):
  """For one kernel: (cast(x, layout), iota(dim) over a ``tile_shape`` tile,
  load_vector(ref) in the layout of the tile reduced over ``vector_axis``,
  that layout)."""
  vector_layout = plgpu.Layout.WGMMA.reduce(vector_axis)
  return (functools.partial(layout_cast, interpreting=interpreting),
          functools.partial(wgmma_iota, tile_shape, interpreting=interpreting),
          functools.partial(load_vector, layout=vector_layout,
                            interpreting=interpreting),
          vector_layout)


def outside_band(q_rows, keys, band, check_length=True):
  """True where the causal/window band (and, with ``check_length``, the
  key length) masks (q_row, key); None when nothing can be masked."""
  out = keys >= band.lk if check_length else None
  for limit, beyond in (
      (band.right, lambda r: keys > q_rows + (band.offset + r)),
      (band.left, lambda l: keys < q_rows + (band.offset - l))):
    if limit is not None:
      out = beyond(limit) if out is None else jnp.logical_or(out,
                                                             beyond(limit))
  return out


def swizzle_bytes(row_elements: int, dtype) -> int:
  """The widest SMEM swizzle (128, 64 or 32 bytes) whose span divides a row
  of ``row_elements``: wgmma reads a tile in 8-row atoms one swizzle span
  wide, and both of its SMEM operands must use the same swizzle."""
  row_bytes = row_elements * jnp.dtype(dtype).itemsize
  for swizzle in (128, 64, 32):
    if row_bytes % swizzle == 0:
      return swizzle
  raise ValueError(f"no wgmma swizzle fits rows of {row_bytes} bytes")


def tile_smem(shape, dtype):
  """Shared memory for bf16/fp16 tiles that wgmma reads: 8-row tiles one
  swizzle span wide, the widest swizzle that the row width allows (128
  bytes at head_dim 64/128/192/256, 64 at 96/160/224, 32 at 80/112/...)."""
  swizzle = swizzle_bytes(shape[-1], dtype)
  columns = swizzle // jnp.dtype(dtype).itemsize
  return plgpu.SMEM(shape, dtype, transforms=(
      plgpu.TilingTransform((8, columns)), plgpu.SwizzleTransform(swizzle)))


def band_loop(step, skip, bounds, carry):
  """Walks blocks [lo_u, hi_u): ``skip`` outside the band ([lo_u, lo) and
  [hi, hi_u), so every warpgroup keeps the ring's pace), ``step`` with
  ``masked=True`` on the band's edges and ``masked=False`` inside [a, b)."""
  lo_u, lo, a, b, hi, hi_u = bounds
  lax.fori_loop(lo_u, lo, skip, None)
  carry = lax.fori_loop(lo, a, functools.partial(step, masked=True), carry)
  carry = lax.fori_loop(a, b, functools.partial(step, masked=False), carry)
  carry = lax.fori_loop(b, hi, functools.partial(step, masked=True), carry)
  lax.fori_loop(hi, hi_u, skip, None)
  return carry


def stream_ring(first, end, stages, load, refill, drain):
  """The memory warpgroup's TMA ring over blocks [first, end): ``load(c,
  slot)`` fills the first ``stages`` slots, ``refill(c, slot)`` waits for a
  slot's release and loads block c into it, and ``drain(slot)`` waits for the
  last releases, so every phase of the consumed barriers is observed (the
  interpreter checks this)."""
  for i in range(stages):
    @pl.when(first + i < end)
    def _prologue():
      load(first + i, i)

  def slot_of(c):
    return lax.rem(c - first, jnp.int32(stages))

  @pl.loop(first + stages, end)
  def _refill(c):
    refill(c, slot_of(c))

  @pl.loop(jnp.maximum(end - stages, first), end)
  def _drain(c):
    drain(slot_of(c))


def _kv_ranges(row0, rows: int, block_k: int, band: _Band):
  """kv block ranges for q rows [row0, row0 + rows). (lo, a, b, hi): blocks [lo,
  hi) hold some unmasked entry for some row; the blocks in [a, b) are unmasked
  for every real row."""
  nk = -(-band.lk // block_k)
  full_k = band.lk // block_k  # blocks without padded keys
  last_row = jnp.minimum(row0 + (rows - 1), band.lq - 1)
  off = band.offset
  if band.right is None:
    hi, b = jnp.int32(nk), jnp.int32(full_k)
  else:
    hi = jnp.minimum(_div_ceil(last_row + (off + band.right + 1), block_k), nk)
    b = jnp.minimum(_div_floor(row0 + (off + band.right + 1), block_k), full_k)
  if band.left is None:
    lo, a = jnp.int32(0), jnp.int32(0)
  else:
    lo = _div_floor(row0 + (off - band.left), block_k)
    a = _div_ceil(last_row + (off - band.left), block_k)
  lo = jnp.minimum(lo, hi)
  a = jnp.clip(a, lo, hi)
  b = jnp.clip(b, a, hi)
  return lo, a, b, hi


# ----------------------------------------------------------- static masks --

TABLE_HEADER = 3  # a table row: tile, partial blocks, listed blocks, ...


def mask_tables(mask, lq: int, lk: int, block_rows: int, block_cols: int,
                rows_pad: int, cols_pad: int, kv_major: bool = False):
  """(table, tiles) of a static mask shared by every head, for a kernel tiled
  over ``block_rows`` query rows walking key blocks (``kv_major``: the
  reverse). Program p's ``table`` row: (tile, partial blocks, listed blocks,
  the listed blocks partial first, their element tile ids), busiest tiles
  first. ``tiles``: None for a formula mask, else the distinct element tiles
  (float32 1/0)."""
  if kv_major:
    tables = _masks.block_tables(mask, lq, lk, block_cols, block_rows,
                                 cols_pad, rows_pad)
    partial, total, index = (tables.q_partial[0], tables.q_total[0],
                             tables.q_index[0])
  else:
    tables = _masks.block_tables(mask, lq, lk, block_rows, block_cols,
                                 rows_pad, cols_pad)
    partial, total, index = (tables.kv_partial[0], tables.kv_total[0],
                             tables.kv_index[0])
  ids = np.zeros_like(index)
  tiles = None
  if tables.formula is None:
    dense = tables.dense[0]
    if kv_major:
      dense = dense.T
    found = {}
    for row in range(index.shape[0]):
      for t in range(partial[row]):
        col = index[row, t]
        tile = dense[row * block_rows:(row + 1) * block_rows,
                     col * block_cols:(col + 1) * block_cols]
        ids[row, t] = found.setdefault(tile.tobytes(), len(found))
    tiles = np.zeros((max(1, len(found)), block_rows, block_cols), np.int8)
    for key, tile_id in found.items():
      tiles[tile_id] = np.frombuffer(key, np.int8).reshape(block_rows,
                                                           block_cols)
    tiles = tiles.astype(np.float32)
  order = np.argsort(-total, kind="stable")
  table = np.concatenate([order[:, None], partial[order, None],
                          total[order, None], index[order], ids[order]],
                         axis=1).astype(np.int32)
  return table, tiles


def table_width(mask_arrays) -> int:
  """The listed-block columns of ``mask_tables``' table (0 without one)."""
  if not mask_arrays:
    return 0
  return (mask_arrays[0].shape[1] - TABLE_HEADER) // 2


def mask_refusal(kernel: str, mask) -> str | None:
  """Why the Mosaic GPU ``kernel`` cannot take this static mask (None: it
  can): one mask shared by every head, not a per-head list."""
  if isinstance(mask, tuple):
    return (f"the Mosaic GPU {kernel} kernel takes one static mask shared "
            "by every head, not per-head lists")
  return None


def inside_mask(formula, lq: int, lk: int, q_rows, keys, check_length=True):
  """True where the static ``formula`` mask (and, with ``check_length``,
  the key length) allows (q_row, key); indices as in ``outside_band``."""
  inside = formula.allowed(q_rows + (lk - lq), keys)
  if check_length:
    inside = jnp.logical_and(inside, keys < lk)
  return inside


@dataclasses.dataclass(frozen=True)
class TileWalk:
  """How a tiled kernel's program walks its blocks: the causal/window band
  in index order (no ``mask``), or a static mask's table (``mask_tables``)."""
  band: _Band
  ranges: object
  mask: object = None
  width: int = 0

  def open(self, mask_refs, program, tiles: int, reverse: bool):
    """The program's walk: namespace of tile, block_of(step), tile_of(step)
    and, for a table, its (lo_u, hi_u) and (lo, a, b, hi)."""
    if self.mask is None:
      tile = (tiles - 1) - program if reverse else program
      return types.SimpleNamespace(tile=tile, block_of=lambda t: t,
                                   table=False)
    table_ref, tiles_ref = mask_refs
    read = lambda j: table_ref[program, j]  # noqa: E731
    zero, partial, total = jnp.int32(0), read(1), read(2)
    return types.SimpleNamespace(
        tile=read(0), block_of=lambda t: read(TABLE_HEADER + t),
        tile_of=lambda t: read(TABLE_HEADER + self.width + t),
        tiles_ref=tiles_ref, table=True, cta=(zero, total),
        rows=(zero, partial, total, total))

  def cta_bounds(self, walk, row0, rows, block):
    """(lo_u, hi_u): the steps the memory warpgroup loads for the tile."""
    if walk.table:
      return walk.cta
    lo_u, _, _, hi_u = self.ranges(row0, rows, block, self.band)
    return lo_u, hi_u

  def bounds(self, walk, row0, rows, block, lo_u, hi_u):
    """(lo, a, b, hi) of a warpgroup's rows: steps [lo, hi) run, masked
    outside [a, b)."""
    if walk.table:
      return walk.rows
    return tuple(jnp.clip(x, lo_u, hi_u)
                 for x in self.ranges(row0, rows, block, self.band))

  def apply(self, walk, s, q_rows, keys, step, tile_row0, interpreting,
            check_length=True):
    """Logits ``s`` (a tile of rows ``tile_row0`` on of the program's tile,
    step ``step``) with -inf where the band or mask masks (q_row, key)
    (``check_length``: and keys past the length)."""
    if self.mask is None:
      outside = outside_band(q_rows, keys, self.band, check_length)
      return s if outside is None else jnp.where(outside, NEG_INF, s)
    # (where on the allowed side: Mosaic GPU cannot negate a bool tile)
    if self.mask.formula:
      inside = inside_mask(self.mask, self.band.lq, self.band.lk, q_rows,
                           keys, check_length)
    else:  # padded keys are 0 in the tiles
      ref = walk.tiles_ref.at[walk.tile_of(step),
                              pl.ds(tile_row0, s.shape[0])]
      # (unoptimized: jax 0.11 plans wgmma-layout transfers for SMEM only)
      inside = (ref[...] if interpreting else _compat.mosaic_gpu_load(
          ref, layout=plgpu.Layout.WGMMA, optimized=False)) > 0
    return jnp.where(inside, s, NEG_INF)


# ---------------------------------------------------------------- kernel --


def _hardware_barrier(op: str, barrier_id: int, threads: int):
  """``bar.<op> barrier_id, threads`` (op: "sync" or "arrive")."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import llvm

  @plgpu.inline_mgpu()
  def emit(_):
    llvm.inline_asm(ir.Type.parse("!llvm.void"), [],
                    f"bar.{op} {barrier_id}, {threads};", "",
                    has_side_effects=True)

  emit()


class _Schedule:
  """The order in which the two compute warpgroups issue their matmuls:
  ``rendezvous`` (one two-arrival barrier) or ping-pong (wait on one's own
  barrier, release the other's; hardware barriers with ``named``, else
  mbarriers)."""

  def __init__(self, wg, barrier, *, rendezvous, named):
    self.wg, self.barrier = wg, barrier
    self.rendezvous, self.named = rendezvous, named

  def _named(self, op, other):
    for w in range(COMPUTE_WGS):
      target = PING_PONG_BARRIER + ((1 - w) if other else w)
      pl.when(self.wg == w)(functools.partial(
          _hardware_barrier, op, target, COMPUTE_WGS * 128))

  def sync_mine(self):
    if self.named:
      self._named("sync", other=False)
    else:
      plgpu.barrier_wait(self.barrier.at[self.wg])

  def arrive_other(self):
    if self.named:
      self._named("arrive", other=True)
    else:
      plgpu.barrier_arrive(self.barrier.at[1 - self.wg])

  # The non-overlapped step's four points.
  def start(self):  # warpgroup 1 starts one turn late
    if self.rendezvous:
      pl.when(self.wg == 1)(self._sync_both)
    else:
      pl.when(self.wg == 1)(self.sync_mine)

  def after_qk_issue(self):
    if self.rendezvous:
      self._sync_both()
    else:
      self.arrive_other()

  def before_pv_issue(self, wait_v):
    if self.rendezvous:
      plgpu.barrier_arrive(self.barrier)  # softmax done
      wait_v()
      plgpu.barrier_wait(self.barrier)  # the other warpgroup's matmuls issued
    else:
      wait_v()
      self.sync_mine()

  def end(self):
    if self.rendezvous:
      pl.when(self.wg == 0)(self._sync_both)
    else:
      pl.when(self.wg == 0)(self.arrive_other)

  def _sync_both(self):
    plgpu.barrier_arrive(self.barrier)
    plgpu.barrier_wait(self.barrier)


def stream_kv_lagged(first, end, stages, load_k, load_v, wait_k_free,
                     wait_v_free):
  """The overlapped kernel's TMA ring over blocks [first, end): K block c is
  loaded as soon as its slot's K is released, and V block c one refill later
  (that kernel releases V one step after K, so waiting for V first would
  hold back the next K). Every release is waited for once."""
  for i in range(stages):
    @pl.when(first + i < end)
    def _prologue():
      load_k(first + i, i)
      load_v(first + i, i)

  def slot_of(c):
    return lax.rem(c - first, jnp.int32(stages))

  def refill_v(c):
    wait_v_free(slot_of(c))
    load_v(c, slot_of(c))

  @pl.loop(first + stages, end)
  def _refill(c):
    wait_k_free(slot_of(c))
    load_k(c, slot_of(c))
    pl.when(c - 1 >= first + stages)(functools.partial(refill_v, c - 1))

  pl.when(end - 1 >= first + stages)(functools.partial(refill_v, end - 1))

  @pl.loop(jnp.maximum(end - stages, first), end)
  def _drain(c):
    wait_k_free(slot_of(c))
    wait_v_free(slot_of(c))


def _kernel(q_ref, k_ref, v_ref, mask_refs, out_ref, lse_ref, scratch, *,
            walk: TileWalk, sm_scale, soft_cap, block_k, stages, group, nq,
            reverse_q, interpreting, overlap, named_barriers):
  (q_smem2, k_smem, v_smem, lse_smem2), barriers = scratch
  (k_loaded, v_loaded, q_loaded, k_consumed, v_consumed,
   schedule_barrier) = barriers
  batch, head, wg = (lax.axis_index("batch"), lax.axis_index("heads"),
                     lax.axis_index("wg"))
  program = walk.open(mask_refs, lax.axis_index("q_tiles"), nq, reverse_q)
  tile, block_of = program.tile, program.block_of
  dtype = q_smem2.dtype
  head_dim = q_smem2.shape[-1]
  bq = ROWS_PER_WG
  cta_row0 = tile * (COMPUTE_WGS * bq)
  # The band of the whole tile: what the memory warpgroup loads.
  lo_u, hi_u = walk.cta_bounds(program, cta_row0, COMPUTE_WGS * bq,
                               block_k)

  @pl.when(wg < COMPUTE_WGS)
  def _compute():
    plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
    q_smem = q_smem2.at[wg]
    row0 = cta_row0 + wg * bq
    plgpu.copy_gmem_to_smem(q_ref.at[batch, head, pl.ds(row0, bq)], q_smem,
                            q_loaded.at[wg])
    lo, a, b, hi = walk.bounds(program, row0, bq, block_k, lo_u, hi_u)
    plgpu.barrier_wait(q_loaded.at[wg])

    layout = plgpu.Layout.WGMMA
    cast, iota, _, row_layout = register_tools((bq, block_k), 1, interpreting)
    schedule = _Schedule(wg, schedule_barrier,
                         rendezvous=not (overlap or named_barriers),
                         named=named_barriers and not interpreting)

    m = cast(jnp.full((bq,), NEG_INF, jnp.float32), row_layout)
    l = cast(jnp.full((bq,), 0.0, jnp.float32), row_layout)
    acc = cast(jnp.full((bq, head_dim), 0.0, jnp.float32), layout)

    def slot_of(c):
      return lax.rem(c - lo_u, jnp.int32(stages))

    def online_softmax(s, m, l, c, masked):
      """(P in the input dtype, new m, new l, alpha) for logits block c."""
      # Logits in the base-2 domain: s * scale2 (scale2 > 0, so the row max
      # can be taken before scaling and p formed with one FMA).
      if soft_cap is None:
        scale2 = sm_scale * LOG2E
      else:
        s = jnp.tanh(s * (sm_scale / soft_cap))
        scale2 = soft_cap * LOG2E
      if masked:
        s = walk.apply(program, s, row0 + iota(0),
                       block_of(c) * block_k + iota(1), c, wg * bq,
                       interpreting)
      m_next = jnp.maximum(m, s.max(axis=1) * scale2)
      m_shift = m_next
      if masked:  # a row with nothing unmasked yet keeps m = -inf
        m_shift = jnp.where(m_next == NEG_INF, 0.0, m_next)
      alpha = jnp.exp2(m - m_shift)
      p = jnp.exp2(s * scale2 - lax.broadcast_in_dim(m_shift, s.shape, [0]))
      l = l * alpha + p.sum(axis=1)
      return p.astype(dtype), m_next, l, alpha

    def qk_dot(slot):  # the interpreter's S = Q K^T
      return lax.dot_general(q_smem[...], k_smem.at[slot][...],
                             (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)

    def pv_dot(p16, slot):  # the interpreter's P V
      return lax.dot_general(p16, v_smem.at[slot][...],
                             (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)

    def k_transposed(slot):
      return plgpu.transpose_ref(k_smem.at[slot], (1, 0))

    def qk_logits(slot, after_issue):
      """S = Q K_slot^T (float32); ``after_issue`` runs once it is issued."""
      if interpreting:
        s = qk_dot(slot)
        after_issue()
        return s

      def product(s_ref):
        plgpu.wgmma(s_ref, q_smem, k_transposed(slot))
        after_issue()
        return s_ref[...]

      return pl.run_scoped(product, plgpu.ACC((bq, block_k), jnp.float32))

    def add_pv(acc, p16, slot, after_issue):
      """acc + P V_slot; ``after_issue`` runs once the product is issued."""
      if interpreting:
        acc = acc + pv_dot(p16, slot)
        after_issue()
        return acc

      def product(acc_ref):
        plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
        after_issue()

      return pl.run_state(product)(plgpu.ACC.init(acc))

    env = types.SimpleNamespace(
        schedule=schedule, slot_of=slot_of, k_loaded=k_loaded,
        v_loaded=v_loaded, k_consumed=k_consumed, v_consumed=v_consumed,
        interpreting=interpreting, q_smem=q_smem, v_smem=v_smem, bq=bq,
        block_k=block_k, wg=wg, cast=cast, dtype=dtype,
        online_softmax=online_softmax, qk_dot=qk_dot, pv_dot=pv_dot,
        k_transposed=k_transposed, qk_logits=qk_logits, add_pv=add_pv)
    steps = _overlapped_band if overlap else _plain_band
    acc, m, l = steps(env, acc, m, l, lo_u, lo, a, b, hi, hi_u)

    empty = l == 0.0
    inv_l = 1.0 / jnp.where(empty, 1.0, l)
    q_smem[...] = (acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])
                   ).astype(dtype)
    lse_smem = lse_smem2.at[wg]
    lse_smem[...] = jnp.where(empty, NEG_INF, (m + jnp.log2(l)) * LN2)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, out_ref.at[batch, head, pl.ds(row0, bq)])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, head, pl.ds(row0, bq)])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == COMPUTE_WGS)
  def _memory():
    plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")
    kv_head = lax.div(head, jnp.int32(group))

    def load_one(ref, smem, loaded, c, slot):
      rows = pl.ds(block_of(c) * block_k, block_k)
      plgpu.copy_gmem_to_smem(ref.at[batch, kv_head, rows], smem.at[slot],
                              loaded.at[slot])

    load_k = functools.partial(load_one, k_ref, k_smem, k_loaded)
    load_v = functools.partial(load_one, v_ref, v_smem, v_loaded)

    def wait_k_free(slot):
      plgpu.barrier_wait(k_consumed.at[slot])

    def wait_v_free(slot):
      plgpu.barrier_wait(v_consumed.at[slot])

    if overlap:
      stream_kv_lagged(lo_u, hi_u, stages, load_k, load_v, wait_k_free,
                       wait_v_free)
      return

    def load(c, slot):
      load_k(c, slot)
      load_v(c, slot)

    def refill(c, slot):  # K is consumed first: reload it without waiting for V
      wait_k_free(slot)
      load_k(c, slot)
      wait_v_free(slot)
      load_v(c, slot)

    def drain(slot):
      wait_k_free(slot)
      wait_v_free(slot)

    stream_ring(lo_u, hi_u, stages, load, refill, drain)


def _plain_band(env, acc, m, l, lo_u, lo, a, b, hi, hi_u):
  """One block per step: S = Q K^T, softmax, acc += P V; the two warpgroups
  ping-pong so that one's softmax overlaps the other's matmuls."""
  schedule, slot_of, hi_u_ = env.schedule, env.slot_of, hi_u
  k_loaded, v_loaded = env.k_loaded, env.v_loaded
  k_consumed, v_consumed = env.k_consumed, env.v_consumed
  schedule.start()

  # Each step finds its K block already waited for (by the step before, or
  # here for the first) and waits for the next step's K itself, inside its
  # P V product, so that the wait overlaps the matmul.
  def wait_next_k(has_next, next_slot):
    @pl.when(has_next)
    def _():
      plgpu.barrier_wait(k_loaded.at[next_slot])

  def next_k(c):
    # Computed outside run_state: a concrete bound (hi_u without a band)
    # cannot be closed over inside it.
    return c + 1 < hi_u_, slot_of(c + 1)

  @pl.when(hi_u - lo_u > 0)
  def _():
    plgpu.barrier_wait(k_loaded.at[0])

  def skip(c, carry):
    slot = slot_of(c)
    plgpu.barrier_arrive(k_consumed.at[slot])
    schedule.after_qk_issue()
    schedule.before_pv_issue(
        lambda: plgpu.barrier_wait(v_loaded.at[slot]))
    wait_next_k(*next_k(c))
    plgpu.barrier_arrive(v_consumed.at[slot])
    return carry

  def step(c, carry, masked):
    acc, m, l = carry
    slot = slot_of(c)
    s = env.qk_logits(slot, schedule.after_qk_issue)
    plgpu.barrier_arrive(k_consumed.at[slot])

    p16, m_next, l, alpha = env.online_softmax(s, m, l, c, masked)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    acc, l, m_next, p16 = lax.optimization_barrier((acc, l, m_next, p16))
    schedule.before_pv_issue(
        lambda: plgpu.barrier_wait(v_loaded.at[slot]))

    has_next, next_slot = next_k(c)
    acc = env.add_pv(acc, p16, slot,
                     lambda: wait_next_k(has_next, next_slot))
    plgpu.barrier_arrive(v_consumed.at[slot])
    return acc, m_next, l

  acc, m, l = band_loop(step, skip, (lo_u, lo, a, b, hi, hi_u), (acc, m, l))
  schedule.end()
  return acc, m, l


def _overlapped_band(env, acc, m, l, lo_u, lo, a, b, hi, hi_u):
  """Software-pipelined steps (FlashAttention-3's overlap): step c issues S_c
  and P_{c-1} V_{c-1} together and runs block c's softmax while P V runs;
  one extra step (an empty one without blocks) keeps the ping-pong paired."""
  schedule, slot_of = env.schedule, env.slot_of
  k_loaded, v_loaded = env.k_loaded, env.v_loaded
  k_consumed, v_consumed = env.k_consumed, env.v_consumed
  interpreting, q_smem, v_smem = (env.interpreting, env.q_smem,
                                  env.v_smem)
  bq, block_k, wg, cast = env.bq, env.block_k, env.wg, env.cast
  online_softmax = env.online_softmax
  layout = plgpu.Layout.WGMMA
  pl.when(wg == 1)(schedule.arrive_other)  # warpgroup 0 goes first

  def wait(barrier, c):
    plgpu.barrier_wait(barrier.at[slot_of(c)])

  def skip(c, carry):
    wait(k_loaded, c)
    wait(v_loaded, c)
    schedule.sync_mine()
    schedule.arrive_other()
    plgpu.barrier_arrive(k_consumed.at[slot_of(c)])
    plgpu.barrier_arrive(v_consumed.at[slot_of(c)])
    return carry

  def first(c, carry):
    acc, m, l, _ = carry
    slot = slot_of(c)
    wait(k_loaded, c)
    schedule.sync_mine()
    s = env.qk_logits(slot, schedule.arrive_other)
    plgpu.barrier_arrive(k_consumed.at[slot])
    p16, m, l, _ = online_softmax(s, m, l, c, True)
    return acc, m, l, p16

  zero_s = cast(jnp.zeros((bq, block_k), jnp.float32), layout)

  def middle(c, carry, masked):
    acc, m, l, p_prev = carry
    slot, prev = slot_of(c), slot_of(c - 1)
    wait(k_loaded, c)
    wait(v_loaded, c - 1)
    schedule.sync_mine()
    if interpreting:
      s = env.qk_dot(slot)
      acc = acc + env.pv_dot(p_prev, prev)
      schedule.arrive_other()
      plgpu.barrier_arrive(k_consumed.at[slot])
      p16, m, l, alpha = online_softmax(s, m, l, c, masked)
    else:
      def products(refs):
        o_ref, s_ref, p_ref, m_ref, l_ref, alpha_ref = refs
        plgpu.wgmma(s_ref, q_smem, env.k_transposed(slot))
        plgpu.wgmma(o_ref, p_ref[...], v_smem.at[prev])
        schedule.arrive_other()
        s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # S_c, not P V
        plgpu.barrier_arrive(k_consumed.at[slot])
        p16, m_next, l_next, alpha = online_softmax(
            s, m_ref[...], l_ref[...], c, masked)
        p_ref[...] = p16
        m_ref[...] = m_next
        l_ref[...] = l_next
        alpha_ref[...] = alpha

      acc, _, p16, m, l, alpha = pl.run_state(products)(
          (plgpu.ACC.init(acc), plgpu.ACC.init(zero_s), p_prev, m, l, m))
    plgpu.barrier_arrive(v_consumed.at[prev])
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    return acc, m, l, p16

  def last(c, carry):
    acc, m, l, p_prev = carry
    slot = slot_of(c)
    wait(v_loaded, c)
    schedule.sync_mine()
    acc = env.add_pv(acc, p_prev, slot, schedule.arrive_other)
    plgpu.barrier_arrive(v_consumed.at[slot])
    return acc, m, l, p_prev

  p16 = cast(jnp.zeros((bq, block_k), env.dtype), layout)
  carry = (acc, m, l, p16)
  lax.fori_loop(lo_u, lo, skip, None)
  has_band = hi > lo
  carry = lax.fori_loop(lo, jnp.where(has_band, lo + 1, lo), first, carry)
  # The band's middle: masked edges, unmasked inside (as band_loop).
  start = jnp.minimum(lo + 1, hi)
  a = jnp.clip(a, start, hi)
  b = jnp.clip(b, a, hi)
  carry = lax.fori_loop(start, a, functools.partial(middle, masked=True),
                        carry)
  carry = lax.fori_loop(a, b, functools.partial(middle, masked=False), carry)
  carry = lax.fori_loop(b, hi, functools.partial(middle, masked=True), carry)
  carry = lax.fori_loop(jnp.where(has_band, hi - 1, hi), hi, last, carry)

  @pl.when(jnp.logical_not(has_band))
  def _empty_step():
    schedule.sync_mine()
    schedule.arrive_other()

  lax.fori_loop(hi, hi_u, skip, None)
  pl.when(wg == 0)(schedule.sync_mine)  # warpgroup 1's last hand-over
  acc, m, l, _ = carry
  return acc, m, l


def _pad_axis(x, axis: int, size: int):
  if x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths)


def forward(q, k, v, q_segment_ids, kv_segment_ids, bias, *, sm_scale,
            causal, window_left, window_right, logit_soft_cap, interpret,
            mask=None):
  """Attention forward. Returns (out [B,H,Lq,D] q.dtype, lse [B,H,Lq] f32). Same
  contract as ``attention.triton.forward`` for the calls ``supports`` accepts
  (it raises ValueError on the others). ``interpret``: False on a GPU, or an
  ``InterpretGPUParams`` (``interpret_params()``) to run in the Mosaic GPU
  interpreter; True picks the default interpreter parameters. ``mask``: a static
  mask (``masks``) shared by every head, or None."""
  del kv_segment_ids  # None whenever q_segment_ids is (supports checks it)
  reason = supports(q, k, v, q_segment_ids, bias, mask)
  if reason:
    raise ValueError(f"mosaic_gpu.forward: unsupported call: {reason}")
  if q.shape[-1] % HEAD_DIM_MULTIPLE:
    kwargs = dict(sm_scale=sm_scale, causal=causal, window_left=window_left,
                  window_right=window_right, logit_soft_cap=logit_soft_cap,
                  interpret=interpret, mask=mask)
    return with_padded_head_dim(
        lambda q, k, v: forward(q, k, v, None, None, None, **kwargs),
        (q, k, v), kernel_head_dim(q.shape[-1], MAX_HEAD_DIM),
        lambda result, d: (result[0][..., :d], result[1]))
  if interpret is True:
    interpret = interpret_params()
  batch, heads, lq, head_dim = q.shape
  kv_heads, lk = k.shape[1], k.shape[2]
  group = heads // kv_heads
  block_k, stages = block_k_for(head_dim), STAGES
  overlap, named = default_schedule(head_dim, block_k, lk,
                                    causal or mask is not None,
                                    window_left, window_right,
                                    logit_soft_cap)
  overlap = overlap and hasattr(plgpu, "wgmma_accumulator_load")
  named = named and hasattr(plgpu, "inline_mgpu")
  band = _band(lq, lk, causal, window_left, window_right)
  tile_rows = COMPUTE_WGS * ROWS_PER_WG
  lq_pad = -(-lq // tile_rows) * tile_rows
  lk_pad = -(-lk // block_k) * block_k
  q = _pad_axis(q, 2, lq_pad)
  k = _pad_axis(k, 2, lk_pad)
  v = _pad_axis(v, 2, lk_pad)
  nq = lq_pad // tile_rows
  mask_arrays = [] if mask is None else [
      jnp.asarray(x) for x in mask_tables(mask, lq, lk, tile_rows, block_k,
                                          lq_pad, lk_pad) if x is not None]
  walk = TileWalk(band, _kv_ranges, mask, table_width(mask_arrays))
  interpreting = bool(interpret)
  dtype = q.dtype
  rendezvous = not (overlap or named)

  scratch = (
      tile_smem((COMPUTE_WGS, ROWS_PER_WG, head_dim), dtype),
      tile_smem((stages, block_k, head_dim), dtype),
      tile_smem((stages, block_k, head_dim), dtype),
      plgpu.SMEM((COMPUTE_WGS, ROWS_PER_WG), jnp.float32),
  )
  barriers = (
      plgpu.Barrier(num_barriers=stages),  # k loaded
      plgpu.Barrier(num_barriers=stages),  # v loaded
      plgpu.Barrier(num_barriers=COMPUTE_WGS),  # q loaded
      plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
      plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
      # schedule: one of two arrivals (rendezvous), else one per warpgroup
      # of one arrival (ping-pong; unused with hardware barriers)
      plgpu.Barrier(num_arrivals=COMPUTE_WGS) if rendezvous else
      plgpu.Barrier(num_arrivals=1, num_barriers=COMPUTE_WGS),
  )
  body = functools.partial(
      _kernel, walk=walk, sm_scale=float(sm_scale),
      soft_cap=None if logit_soft_cap is None else float(logit_soft_cap),
      block_k=block_k, stages=stages, group=group, nq=nq,
      reverse_q=band.right is not None and band.left is None,
      interpreting=interpreting, overlap=overlap, named_barriers=named)

  def entry(q_ref, k_ref, v_ref, *refs):
    mask_refs = tuple(refs[:-2]) + (None,) * (2 - len(refs[:-2]))
    out_ref, lse_ref = refs[-2:]
    pl.run_scoped(
        lambda *scoped: body(q_ref, k_ref, v_ref, mask_refs, out_ref,
                             lse_ref, (scoped[:4], scoped[4:])),
        *scratch, *barriers, collective_axes="wg")

  kwargs = {}
  if interpret:
    kwargs["interpret"] = interpret
  out, lse = plgpu.kernel(
      entry,
      out_type=(jax.ShapeDtypeStruct((batch, heads, lq_pad, head_dim), dtype),
                jax.ShapeDtypeStruct((batch, heads, lq_pad), jnp.float32)),
      grid=(heads, nq, batch),
      grid_names=("heads", "q_tiles", "batch"),
      num_threads=COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      **kwargs,
  )(q, k, v, *mask_arrays)
  if lq_pad != lq:
    out, lse = out[:, :, :lq], lse[:, :, :lq]
  return out, lse
