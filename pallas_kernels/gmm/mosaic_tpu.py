"""Mosaic TPU grouped matmul (gmm) and its transpose in rhs (tgmm).

A scalar-prefetched list of (group, row tile) work items, built in XLA from
``group_sizes`` with its used length as the grid's dynamic bound (routing
changes never recompile). gmm grid (N tiles, items, K tiles); tgmm grid
(K tiles, N tiles, items). Structure: docs/design/grouped_matmul.md.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels import _backend, _compat, _cost
from pallas_kernels._compat import pl, pltpu
from pallas_kernels.gmm import reference

# (tm, tk, tn) by generation: v4's 16 MiB of VMEM takes half the tiles.
DEFAULT_TILES = {"v4": (256, 512, 512)}
TILES = (512, 1024, 1024)


def default_tiles() -> tuple[int, int, int]:
  return DEFAULT_TILES.get(_backend.target().tpu_generation, TILES)


def vmem_limit() -> int:
  spec = _backend.TPU_SPECS.get(_backend.target().tpu_generation)
  return min(48 << 20, (spec.vmem if spec else 16 << 20) * 3 // 4)


def _launch(kernel, grid_spec, out_shape, semantics, name, interpret, cost):
  return _compat.pallas_call(
      kernel, grid_spec=grid_spec, out_shape=out_shape,
      compiler_params=_compat.tpu_compiler_params(
          dimension_semantics=semantics, vmem_limit_bytes=vmem_limit()),
      interpret=interpret, name=name, cost_estimate=cost)


def work_items(starts, ends, m: int, tm: int, *, with_uncovered: bool):
  """(item_group, item_tile, used): int32 [W], [W] and [] for groups with
  row bounds ``starts``/``ends`` [G] (contiguous, clamped to [0, m]).

  The grid visits the first ``used`` items (a dynamic grid bound); the rest
  are padding. ``item_group`` >= G marks an item with no rows: G for
  uncovered tiles and padding (gmm); without ``with_uncovered`` (tgmm),
  padding is G + the last real item's group on its tile, so it extends that
  group's run."""
  num_groups = starts.shape[0]
  tiles_m = pl.cdiv(m, tm)
  num_items = tiles_m + num_groups - (1 if with_uncovered else 0)
  nonempty = ends > starts
  first = jnp.minimum(starts // tm, tiles_m - 1)
  last = (jnp.maximum(ends, 1) - 1) // tm
  # tgmm visits an empty group once (on its start's tile) to write zeros.
  counts = jnp.where(nonempty, last - first + 1, 0 if with_uncovered else 1)
  cum = jnp.cumsum(counts)
  real = cum[-1]
  w = jnp.arange(num_items, dtype=jnp.int32)
  # gmm lists the tiles before the groups' rows first, tgmm none.
  lead = (jnp.where(real > 0, starts[0] // tm, tiles_m) if with_uncovered
          else 0)
  r = w - lead
  group = jnp.clip(jnp.searchsorted(cum, r, side="right",
                                    method="compare_all"), 0,
                   num_groups - 1).astype(jnp.int32)
  tile = first[group] + r - (cum[group] - counts[group])
  is_real = (r >= 0) & (r < real)
  if with_uncovered:
    # Then the real items, then the tiles after the rows, then padding that
    # repeats the last tile (consecutive, so it is written once).
    tail = jnp.where(real > 0, pl.cdiv(ends[-1], tm), tiles_m)
    uncovered = jnp.where(r < 0, w, tail + (r - real))
    tile = jnp.where(is_real, tile, jnp.minimum(uncovered, tiles_m - 1))
    group = jnp.where(is_real, group, num_groups)
    used = lead + real + tiles_m - tail
  else:
    # Padding: G + the last real group, on its tile (same output block).
    last_real = jnp.maximum(real - 1, 0)
    tile = jnp.where(is_real, tile, tile[last_real])
    group = jnp.where(is_real, group, num_groups + group[last_real])
    used = jnp.maximum(real, 1)
  return (group.astype(jnp.int32), tile.astype(jnp.int32),
          used.astype(jnp.int32))


def metadata(group_sizes, m: int, tm: int, num_groups: int, group_offset=0,
             *, with_uncovered: bool):
  """(item_group, item_tile, starts, ends, used): the scalar-prefetched
  work list of gmm (``with_uncovered``) or tgmm for these sizes."""
  starts, ends = reference.group_bounds(group_sizes, m, num_groups,
                                        group_offset)
  group, tile, used = work_items(starts, ends, m, tm,
                                 with_uncovered=with_uncovered)
  return group, tile, starts, ends, used


def _k_tiling(k: int, tk: int, unit: int = 128) -> tuple[int, int]:
  """(K tile, padded K): all of K when it fits, else a multiple of ``unit``
  (128, or a multiple of a scale group) dividing the padded K."""
  if k <= tk:
    return k, k
  padded = pl.cdiv(k, unit) * unit
  for tile in range(tk // unit * unit, unit - 1, -unit):
    if padded % tile == 0 and tile * 4 >= tk:
      return tile, padded
  tile = max(tk // unit, 1) * unit
  return tile, pl.cdiv(k, tile) * tile


def _row_mask(rows, tile, group, starts_ref, ends_ref, num_groups):
  """[rows, 1] bool: rows of row tile ``tile`` inside ``group``."""
  safe = jnp.minimum(group, num_groups - 1)
  start = jnp.where(group < num_groups, starts_ref[safe], 0)
  end = jnp.where(group < num_groups, ends_ref[safe], 0)
  row = tile * rows + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
  return (row >= start) & (row < end)


def _weight_tile(rhs_ref, scale_ref, *, scaling, transpose_rhs, dtype):
  """The step's rhs tile as ``dtype``, [tk, tn] ([tn, tk] transposed);
  K-group scales (scale tile [groups in the tile, tn]) applied in float32."""
  w = rhs_ref[0]
  if scaling != "groups":
    return w if w.dtype == dtype else w.astype(jnp.float32).astype(dtype)
  wf = w.astype(jnp.float32)
  if transpose_rhs:
    wf = wf.T
  scale = scale_ref[...]
  rows, cols = wf.shape
  per = rows // scale.shape[0]
  expanded = jnp.broadcast_to(scale[:, None, :], (scale.shape[0], per, cols))
  return (wf * expanded.reshape(rows, cols)).astype(dtype)


def _gmm_kernel(group_ref, tile_ref, starts_ref, ends_ref, lhs_ref, rhs_ref,
                *refs, num_groups, nk, transpose_rhs, scaling):
  scale_ref = refs[0] if scaling else None
  out_ref, acc_ref = refs[-2:]
  w, kk = pl.program_id(1), pl.program_id(2)
  tile, group = tile_ref[w], group_ref[w]
  first_of_tile = (w == 0) | (tile_ref[jnp.maximum(w - 1, 0)] != tile)

  is_item = group < num_groups
  last_k = kk == nk - 1

  # The output tile stays in VMEM while consecutive items share it: zeroed
  # by the tile's first item, each item then stores its own rows under the
  # row mask, once, at its last K step (padding items store nothing).
  @pl.when(first_of_tile & (kk == 0))
  def _():
    out_ref[...] = jnp.zeros_like(out_ref)

  def product():
    lhs = lhs_ref[...]
    rhs = _weight_tile(rhs_ref, scale_ref, scaling=scaling,
                       transpose_rhs=transpose_rhs, dtype=lhs.dtype)
    n_major = transpose_rhs and scaling != "groups"
    contract = (((1,), (1 if n_major else 0,)), ((), ()))
    precision = (jax.lax.Precision.HIGHEST if lhs.dtype == jnp.float32
                 else None)
    part = jax.lax.dot_general(lhs, rhs, contract, precision=precision,
                               preferred_element_type=jnp.float32)
    return part * scale_ref[...] if scaling == "channel" else part

  def store(total):
    keep = _row_mask(lhs_ref.shape[0], tile, group, starts_ref, ends_ref,
                     num_groups)
    out_ref[...] = jnp.where(keep, total.astype(out_ref.dtype), out_ref[...])

  if nk == 1:
    pl.when(is_item)(lambda: store(product()))
  else:
    @pl.when(is_item & (kk == 0))
    def _():
      acc_ref[...] = product()

    @pl.when(is_item & (kk > 0) & jnp.logical_not(last_k))
    def _():
      acc_ref[...] += product()

    @pl.when(is_item & last_k)
    def _():
      store(acc_ref[...] + product())


def gmm(lhs, rhs, group_sizes, rhs_scale=None, *, transpose_rhs=False,
        out_dtype=None, group_offset=0, tiles=None, items=None,
        interpret=False):
  """lhs [M, K] x rhs [G, K, N] ([G, N, K] transposed) -> [M, N].
  rhs[g] is group ``group_offset + g`` of group_sizes.
  A quantized rhs (int8, int4, fp8) comes with ``rhs_scale`` [G, S, N]
  float32, S = 1 (per channel, applied to the products) or K / group size
  (applied to the weight tile, which is then cast to lhs's dtype).
  ``tiles`` = (tm, tk, tn), clamped to the problem; ``items``: this call's
  ``metadata(...)``, computed once for calls that share the routing."""
  out_dtype = jnp.dtype(out_dtype or lhs.dtype)
  m, k = lhs.shape
  num_groups = rhs.shape[0]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  scaling = (None if rhs_scale is None else
             "channel" if rhs_scale.shape[1] == 1 else "groups")
  group_size = k // rhs_scale.shape[1] if scaling == "groups" else None
  tm, tk, tn = tiles or default_tiles()
  tm = m if m <= tm else tm
  tn = n if n <= tn else tn
  unit = 128 if group_size is None else math.lcm(group_size, 128)
  tk, k_padded = _k_tiling(k, tk, unit)
  if k_padded != k:  # K tails must be zeros: they are summed
    lhs = jnp.pad(lhs, ((0, 0), (0, k_padded - k)))
    pad = ((0, 0), (0, 0), (0, k_padded - k)) if transpose_rhs else (
        (0, 0), (0, k_padded - k), (0, 0))
    rhs = jnp.pad(rhs, pad)
    if scaling == "groups":
      rhs_scale = jnp.pad(rhs_scale,
                          ((0, 0), (0, (k_padded - k) // group_size), (0, 0)))
  nk = k_padded // tk
  group, tile, starts, ends, used = items or metadata(
      group_sizes, m, tm, num_groups, group_offset, with_uncovered=True)

  def rhs_index(j, w, kk, group_ref, tile_ref, starts_ref, ends_ref):
    g = jnp.minimum(group_ref[w], num_groups - 1)
    return (g, j, kk) if transpose_rhs else (g, kk, j)

  def scale_index(j, w, kk, group_ref, *_):
    g = jnp.minimum(group_ref[w], num_groups - 1)
    return (g, kk if scaling == "groups" else 0, 0, j)

  rhs_block = (1, tn, tk) if transpose_rhs else (1, tk, tn)
  in_specs = [
      pl.BlockSpec((tm, tk), lambda j, w, kk, g, t, s, e: (t[w], kk)),
      pl.BlockSpec(rhs_block, rhs_index),
  ]
  operands = [lhs, rhs]
  if scaling:
    # [G, K steps, groups per step, N]: the step's scales are whole trailing
    # dimensions, which keeps Mosaic's tile rules for any group count.
    per_step = 1 if scaling == "channel" else tk // group_size
    operands.append(rhs_scale.reshape(num_groups, -1, per_step, n))
    in_specs.append(pl.BlockSpec((None, None, per_step, tn), scale_index))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=4,
      grid=(pl.cdiv(n, tn), used, nk),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((tm, tn), lambda j, w, kk, g, t, s, e: (t[w], j)),
      scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
  )
  kernel = functools.partial(_gmm_kernel, num_groups=num_groups, nk=nk,
                             transpose_rhs=transpose_rhs, scaling=scaling)
  out_shape = jax.ShapeDtypeStruct((m, n), out_dtype)
  # Each row meets one group's weights; every weight is read once.
  cost = _cost.estimate(flops=2 * m * k * n,
                        bytes_accessed=_cost.nbytes(lhs, rhs, rhs_scale,
                                                    out_shape))
  return _launch(kernel, grid_spec, out_shape,
                 ("parallel", "arbitrary", "arbitrary"), "grouped_matmul",
                 interpret, cost)(group, tile, starts, ends, *operands)


def _tgmm_kernel(group_ref, tile_ref, starts_ref, ends_ref, lhs_ref,
                 dout_ref, out_ref, acc_ref, *, num_groups):
  w = pl.program_id(2)
  num_items = pl.num_programs(2)
  tile, group = tile_ref[w], group_ref[w]
  prev = jnp.maximum(w - 1, 0)
  nxt = jnp.minimum(w + 1, num_items - 1)
  same = lambda other: other % num_groups == group % num_groups
  first_of_group = (w == 0) | jnp.logical_not(same(group_ref[prev]))
  last_of_group = (w == num_items - 1) | jnp.logical_not(same(group_ref[nxt]))

  @pl.when(first_of_group)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  @pl.when((group < num_groups)
           & (starts_ref[group % num_groups] < ends_ref[group % num_groups]))
  def _():
    keep = _row_mask(lhs_ref.shape[0], tile, group, starts_ref, ends_ref,
                     num_groups)
    lhs = jnp.where(keep, lhs_ref[...], jnp.zeros((), lhs_ref.dtype))
    dout = jnp.where(keep, dout_ref[...], jnp.zeros((), dout_ref.dtype))
    acc_ref[...] += jax.lax.dot_general(
        lhs, dout, (((0,), (0,)), ((), ())),
        preferred_element_type=jnp.float32)

  @pl.when(last_of_group)
  def _():
    out_ref[0] = acc_ref[...].astype(out_ref.dtype)


def tgmm(lhs, dout, group_sizes, num_groups: int, *, out_dtype=None,
         group_offset=0, tiles=None, items=None, interpret=False):
  """lhs [M, K], dout [M, N] -> [num_groups, K, N]: per local group g
  (group ``group_offset + g`` of group_sizes) lhs_g^T dout_g; groups with no
  rows give zeros."""
  out_dtype = jnp.dtype(out_dtype or lhs.dtype)
  m, k = lhs.shape
  n = dout.shape[1]
  tm, tk, tn = tiles or default_tiles()
  tm = m if m <= tm else tm
  tk = k if k <= tk else tk
  tn = n if n <= tn else tn
  group, tile, starts, ends, used = items or metadata(
      group_sizes, m, tm, num_groups, group_offset, with_uncovered=False)

  def out_index(i, j, w, group_ref, tile_ref, starts_ref, ends_ref):
    return (group_ref[w] % num_groups, i, j)

  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=4,
      grid=(pl.cdiv(k, tk), pl.cdiv(n, tn), used),
      in_specs=[
          pl.BlockSpec((tm, tk), lambda i, j, w, g, t, s, e: (t[w], i)),
          pl.BlockSpec((tm, tn), lambda i, j, w, g, t, s, e: (t[w], j)),
      ],
      out_specs=pl.BlockSpec((1, tk, tn), out_index),
      scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)],
  )
  out_shape = jax.ShapeDtypeStruct((num_groups, k, n), out_dtype)
  cost = _cost.estimate(flops=2 * m * k * n,
                        bytes_accessed=_cost.nbytes(lhs, dout, out_shape))
  out = _launch(functools.partial(_tgmm_kernel, num_groups=num_groups),
                grid_spec, out_shape,
                ("parallel", "parallel", "arbitrary"), "grouped_matmul_tgmm",
                interpret, cost)(group, tile, starts, ends, lhs, dout)
  return out
