"""Grouped matmul (gmm) for NVIDIA GPUs: Pallas lowered through Triton.

Work items are ``bm``-row tiles within one group (then the rows past the last
group, written as zeros), so no output tile is shared; the list (length
``cdiv(M, bm) + G``) is built in XLA. tgmm: a program per (group, K tile, N
tile). Quantized rhs is dequantized in registers.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _compat
from pallas_kernels._compat import pl
from pallas_kernels.gmm import reference

FIELDS = 3  # group, first row, end row


def default_tiles(m: int, num_groups: int, quantized: bool = False):
  """(bm, bk, bn, warps, stages) of gmm: bm near the mean group's rows (16
  to 128, so short groups waste little of their one tile). The 128 x 256
  config won ``bench.gmm_gpu_tiles`` on the H200 at every MoE shape; with
  quantized experts (upcast in registers) 128 x 128 ran faster."""
  mean_rows = max(1, m // num_groups)
  bm = min(128, max(16, 1 << (mean_rows - 1).bit_length()))
  if bm == 128 and not quantized:
    return 128, 64, 256, 8, 3
  return bm, 64, 128, 4, 3


def default_tgmm_tiles(m: int, num_groups: int):
  """(bm, bk, bn, warps, stages) of tgmm: wider N tiles for long groups
  (``bench.gmm_gpu_tiles``: Mixtral's 4096-row groups), narrower for short
  ones (DeepSeek-V3's and Qwen3's 128 and 256)."""
  if m // max(num_groups, 1) >= 1024:
    return 64, 128, 256, 8, 3
  return 32, 128, 128, 4, 4


def metadata(group_sizes, m: int, bm: int, num_groups: int, group_offset=0):
  """int32 [W, 3]: (group, first row, end row) of each item, group = G for
  rows past the groups; items past the used ones have end row = first."""
  starts, ends = reference.group_bounds(group_sizes, m, num_groups,
                                        group_offset)
  num_items = pl.cdiv(m, bm) + num_groups + 2
  counts = pl.cdiv(ends - starts, bm)
  cum = jnp.cumsum(counts)
  real = cum[-1]
  w = jnp.arange(num_items, dtype=jnp.int32)
  group = jnp.minimum(jnp.searchsorted(cum, w, side="right",
                                       method="compare_all"),
                      num_groups - 1).astype(jnp.int32)
  first = starts[group] + (w - (cum[group] - counts[group])) * bm
  end = jnp.minimum(first + bm, ends[group])
  # Rows before the local groups (group_offset) and after them: zeros.
  lead_rows, tail_start = starts[0], ends[-1]
  lead = pl.cdiv(lead_rows, bm)
  u = w - real
  zero_first = jnp.where(u < lead, u * bm, tail_start + (u - lead) * bm)
  zero_end = jnp.where(u < lead, jnp.minimum(zero_first + bm, lead_rows),
                       jnp.minimum(zero_first + bm, m))
  is_real = w < real
  group = jnp.where(is_real, group, num_groups)
  first = jnp.where(is_real, first, zero_first)
  end = jnp.where(is_real, end, jnp.maximum(zero_end, zero_first))
  first = jnp.minimum(first, m)
  end = jnp.clip(end, first, m)
  return jnp.stack([group, first, end], axis=1).astype(jnp.int32)


def _kernel(items_ref, lhs_ref, rhs_ref, *refs, num_groups, k, n, bm, bk, bn,
            scaling, group_size, transpose_rhs):
  from jax.experimental.pallas import triton as pltriton
  scale_ref = refs[0] if scaling else None
  out_ref = refs[-1]
  w, j = pl.program_id(0), pl.program_id(1)
  group = items_ref[w, 0]
  first = items_ref[w, 1]
  end = items_ref[w, 2]
  rows = first + jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
  cols = j * bn + jax.lax.broadcasted_iota(jnp.int32, (1, bn), 1)
  row_ok = rows < end
  col_ok = cols < n

  @pl.when((group < num_groups) & (end > first))
  def _():
    g = jnp.minimum(group, num_groups - 1)

    def step(kk, acc):
      start = kk * bk
      ks = start + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
      x = pltriton.load(lhs_ref.at[pl.ds(first, bm), pl.ds(start, bk)],
                        mask=row_ok & (ks < k), other=0)
      if transpose_rhs:  # [N, K] tile, contracted on its last axis
        wt = pltriton.load(
            rhs_ref.at[g, pl.ds(j * bn, bn), pl.ds(start, bk)],
            mask=col_ok.reshape(bn, 1) & (ks < k), other=0)
        dims = (((1,), (1,)), ((), ()))
      else:
        wt = pltriton.load(
            rhs_ref.at[g, pl.ds(start, bk), pl.ds(j * bn, bn)],
            mask=(ks.reshape(bk, 1) < k) & col_ok, other=0)
        dims = (((1,), (0,)), ((), ()))
      precision = (jax.lax.Precision.HIGHEST if x.dtype == jnp.float32
                   else jax.lax.Precision.DEFAULT)
      part = jax.lax.dot_general(x, wt.astype(x.dtype), dims,
                                 precision=precision,
                                 preferred_element_type=jnp.float32)
      if scaling == "groups":
        part = part * pltriton.load(
            scale_ref.at[g, pl.ds(start // group_size, 1), pl.ds(j * bn, bn)],
            mask=col_ok, other=0)
      return acc + part

    acc = jax.lax.fori_loop(0, pl.cdiv(k, bk), step,
                            jnp.zeros((bm, bn), jnp.float32))
    if scaling == "channel":
      acc = acc * pltriton.load(scale_ref.at[g, pl.ds(0, 1), pl.ds(j * bn, bn)],
                                mask=col_ok, other=0)
    pltriton.store(out_ref.at[pl.ds(first, bm), pl.ds(j * bn, bn)],
                   acc.astype(out_ref.dtype), mask=row_ok & col_ok)

  @pl.when((group >= num_groups) & (end > first))
  def _():
    pltriton.store(out_ref.at[pl.ds(first, bm), pl.ds(j * bn, bn)],
                   jnp.zeros((bm, bn), out_ref.dtype), mask=row_ok & col_ok)


def supports(rhs_scale, k: int) -> str | None:
  """Why this kernel cannot take the call, else None."""
  if rhs_scale is not None and rhs_scale.shape[1] > 1:
    if (k // rhs_scale.shape[1]) % 16:
      return ("the Triton kernel takes K groups of a multiple of 16 values, "
              f"not {k // rhs_scale.shape[1]}")
  return None


def gmm(lhs, rhs, group_sizes, rhs_scale=None, *, transpose_rhs=False,
        out_dtype=None, group_offset=0, tiles=None, num_warps=None,
        num_stages=None, interpret=False):
  """lhs [M, K] x rhs [G, K, N] ([G, N, K] transposed) -> [M, N]; rhs[g] is
  group ``group_offset + g``; quantized rhs with ``rhs_scale`` [G, S, N].
  ``tiles`` = (bm, bk, bn), powers of two."""
  out_dtype = jnp.dtype(out_dtype or lhs.dtype)
  m, k = lhs.shape
  num_groups = rhs.shape[0]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  bm, bk, bn, warps, stages = default_tiles(m, num_groups,
                                            rhs_scale is not None)
  bm, bk, bn = tiles or (bm, bk, bn)
  scaling = (None if rhs_scale is None else
             "channel" if rhs_scale.shape[1] == 1 else "groups")
  group_size = k // rhs_scale.shape[1] if scaling == "groups" else 0
  while group_size and group_size % bk:
    bk //= 2
  items = metadata(group_sizes, m, bm, num_groups, group_offset)
  operands = [items, lhs, rhs]
  specs = [pl.BlockSpec(items.shape, lambda w, j: (0, 0)),
           pl.BlockSpec(lhs.shape, lambda w, j: (0, 0)),
           pl.BlockSpec(rhs.shape, lambda w, j: (0, 0, 0))]
  if rhs_scale is not None:
    operands.append(rhs_scale)
    specs.append(pl.BlockSpec(rhs_scale.shape, lambda w, j: (0, 0, 0)))
  kernel = functools.partial(
      _kernel, num_groups=num_groups, k=k, n=n, bm=bm, bk=bk, bn=bn,
      scaling=scaling, group_size=group_size, transpose_rhs=transpose_rhs)
  return _compat.pallas_call(
      kernel, grid=(items.shape[0], pl.cdiv(n, bn)), in_specs=specs,
      out_specs=pl.BlockSpec((m, n), lambda w, j: (0, 0)),
      out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
      compiler_params=_compat.gpu_compiler_params(
          num_warps=num_warps or warps, num_stages=num_stages or stages),
      interpret=interpret, name="grouped_matmul_gpu")(*operands)


def _tgmm_kernel(starts_ref, ends_ref, lhs_ref, dout_ref, out_ref, *, k, n,
                 bm, bk, bn):
  from jax.experimental.pallas import triton as pltriton
  g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  start, end = starts_ref[g], ends_ref[g]
  ks = i * bk + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
  ns = j * bn + jax.lax.broadcasted_iota(jnp.int32, (1, bn), 1)

  def step(c, acc):
    first = start + c * bm
    rows = first + jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
    x = pltriton.load(lhs_ref.at[pl.ds(first, bm), pl.ds(i * bk, bk)],
                      mask=(rows < end) & (ks < k), other=0)
    dy = pltriton.load(dout_ref.at[pl.ds(first, bm), pl.ds(j * bn, bn)],
                       mask=(rows < end) & (ns < n), other=0)
    precision = (jax.lax.Precision.HIGHEST if x.dtype == jnp.float32
                 else jax.lax.Precision.DEFAULT)
    return acc + jax.lax.dot_general(x.T, dy, (((1,), (0,)), ((), ())),
                                     precision=precision,
                                     preferred_element_type=jnp.float32)

  acc = jax.lax.fori_loop(0, pl.cdiv(end - start, bm), step,
                          jnp.zeros((bk, bn), jnp.float32))
  pltriton.store(out_ref.at[g, pl.ds(i * bk, bk), pl.ds(j * bn, bn)],
                 acc.astype(out_ref.dtype), mask=(ks.reshape(bk, 1) < k)
                 & (ns < n))


def tgmm(lhs, dout, group_sizes, num_groups: int, *, out_dtype=None,
         group_offset=0, tiles=None, num_warps=None, num_stages=None,
         interpret=False):
  """lhs [M, K], dout [M, N] -> [num_groups, K, N]: per local group g
  (group ``group_offset + g``), lhs_g^T dout_g; a program per (group, K
  tile, N tile) walks the group's rows in chunks of ``bm``, so an empty
  group writes zeros. ``tiles`` = (bm, bk, bn), powers of two."""
  out_dtype = jnp.dtype(out_dtype or lhs.dtype)
  m, k = lhs.shape
  n = dout.shape[1]
  bm, bk, bn, warps, stages = default_tgmm_tiles(m, num_groups)
  bm, bk, bn = tiles or (bm, bk, bn)
  starts, ends = reference.group_bounds(group_sizes, m, num_groups,
                                        group_offset)
  whole = lambda a: pl.BlockSpec(a.shape, lambda g, i, j: (0,) * a.ndim)
  kernel = functools.partial(_tgmm_kernel, k=k, n=n, bm=bm, bk=bk, bn=bn)
  out_shape = jax.ShapeDtypeStruct((num_groups, k, n), out_dtype)
  return _compat.pallas_call(
      kernel, grid=(num_groups, pl.cdiv(k, bk), pl.cdiv(n, bn)),
      in_specs=[whole(starts), whole(ends), whole(lhs), whole(dout)],
      out_specs=whole(out_shape),
      out_shape=out_shape,
      compiler_params=_compat.gpu_compiler_params(
          num_warps=num_warps or warps, num_stages=num_stages or stages),
      interpret=interpret, name="grouped_matmul_tgmm_gpu")(
          starts, ends, lhs, dout)
