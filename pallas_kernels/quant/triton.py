"""Quantized matmuls for NVIDIA GPUs: Pallas lowered through Triton.

Grid (M/bm, N/bn, split_k); each program walks its K range in a pipelined
``fori_loop`` and runs the epilogue before its one store (a K split sums
partial products first). ``int8_matmul``: int8 tensor-core dots, or upcast
weight-only dots, with ``GpuPlan`` switches (group_m, split_k, swap_ab,
stream_w): docs/design/int8.md. ``matmul``: per K step the w tile is
dequantized in registers (a K step lies in one group) and multiplied at x's
dtype, or fp8 x fp8 directly; int4 is decoded from bytes with integer ops:
docs/design/quantized.md.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _compat, _cost
from pallas_kernels._compat import pl
from pallas_kernels.quant import block_sizes as bs
from pallas_kernels.quant import formats, operands, reference
from pallas_kernels.quant import int8_block_sizes as int8_bs
from pallas_kernels.quant import int8_quantize as int8_quant


def _pad_to(a, shape, value=0):
  pads = [(0, t - s) for s, t in zip(a.shape, shape)]
  if all(p == (0, 0) for p in pads):
    return a
  return jnp.pad(a, pads, constant_values=value)


def _tile_order(ni, nj, group_m):
  """(grid, tile(p, q) -> (i, j)): the output tile each program computes.
  group_m > 1 launches one flat program axis in bands: consecutive programs walk
  down group_m row tiles of one column tile, then the next column tile, so the
  programs resident together share their x rows and w columns in L2."""
  if group_m <= 1 or ni == 1:
    return (ni, nj), lambda p, q: (p, q)
  per_band = group_m * nj

  def tile(p, q):
    del q
    band = p // per_band
    first = band * group_m
    rows = jnp.minimum(ni - first, group_m)
    local = p % per_band
    return first + local % rows, local // rows

  return (ni * nj, 1), tile


def split_k_call(kernel, arrays, in_specs, *, grid, tile, plan, padded,
                 out_dtype, partial_dtype, x_side, w_side, name, interpret):
  """The Triton matmuls' launch over ``(*grid, split)``: program (p, q, s)
  writes the [bm, bn] output tile ``tile(p, q)`` of the padded [mp, np]
  result (``padded`` = (mp, kp, np)); with a K split (``plan.split_k`` > 1)
  each part writes its own ``partial_dtype`` partial product and the parts
  are summed (exact for int32). The cost counts each program streaming its
  x rows (``x_side`` arrays) and w columns (``w_side``) once."""
  mp, kp, np_ = padded
  bm, bn, split = plan.bm, plan.bn, plan.split_k
  if split == 1:
    out_spec = pl.BlockSpec((bm, bn), lambda p, q, s: tile(p, q))
    out_struct = jax.ShapeDtypeStruct((mp, np_), out_dtype)
  else:
    out_spec = pl.BlockSpec((None, bm, bn), lambda p, q, s: (s, *tile(p, q)))
    out_struct = jax.ShapeDtypeStruct((split, mp, np_), partial_dtype)
  bytes_accessed = ((np_ // bn) * _cost.nbytes(*x_side)
                    + (mp // bm) * _cost.nbytes(*w_side)
                    + _cost.nbytes(out_struct))
  out = _compat.pallas_call(
      kernel,
      grid=(*grid, split),
      in_specs=in_specs,
      out_specs=out_spec,
      out_shape=out_struct,
      compiler_params=_compat.gpu_compiler_params(
          num_warps=plan.num_warps, num_stages=plan.num_stages),
      interpret=interpret,
      cost_estimate=_cost.estimate(flops=2 * mp * np_ * kp,
                                   bytes_accessed=bytes_accessed),
      name=name,
  )(*arrays)
  return out.sum(axis=0) if split > 1 else out


# ---------------------------------------------------------------- int8_matmul

def _int8_kernel(*refs, mode, nk, bk, has_xs, has_ws, has_b, w_kmajor,
                 split, swap_ab=False, stream_w=False):
  x_ref, w_ref, xs_ref, ws_ref, b_ref, o_ref, refs = (
      operands.split_int8_kernel_refs(refs, has_xs=has_xs, has_ws=has_ws,
                                      has_b=has_b))
  bm, bn = o_ref.shape[-2:]
  weight_only = mode == "weight_only"
  acc_dtype = jnp.float32 if weight_only else jnp.int32
  first = pl.program_id(2) * nk if split else 0
  dims = (((1,), (1,)), ((), ())) if w_kmajor else (((1,), (0,)), ((), ()))
  # swap_ab: w is the left operand (w tile [bn, bk] @ x tile.T), so the
  # tensor cores take the upcast w from registers and bn fills their M.
  swapped_dims = (((1 if w_kmajor else 0,), (1,)), ((), ()))

  def load_w(window):
    if stream_w:  # read once: keep x and the partials in L2 instead
      from jax.experimental.pallas import triton as pltriton
      return pltriton.load(w_ref.at[window], eviction_policy="evict_first")
    return w_ref[window]

  def step(kk, acc):
    start = pl.multiple_of((first + kk) * bk, bk)
    x = x_ref[:, pl.ds(start, bk)]
    if w_kmajor:  # w is [N, K]: contract both operands' last dimension
      w = load_w((slice(None), pl.ds(start, bk)))
    else:
      w = load_w((pl.ds(start, bk), slice(None)))
    if weight_only:
      precision = (jax.lax.Precision.HIGHEST if x.dtype == jnp.float32
                   else jax.lax.Precision.DEFAULT)
      if swap_ab:
        return acc + jax.lax.dot_general(w.astype(x.dtype), x, swapped_dims,
                                         precision=precision,
                                         preferred_element_type=jnp.float32)
      return acc + jax.lax.dot_general(x, w.astype(x.dtype), dims,
                                       precision=precision,
                                       preferred_element_type=jnp.float32)
    return acc + jax.lax.dot_general(x, w, dims,
                                     preferred_element_type=jnp.int32)

  acc_shape = (bn, bm) if swap_ab else (bm, bn)
  acc = jax.lax.fori_loop(0, nk, step, jnp.zeros(acc_shape, acc_dtype))
  if swap_ab:
    acc = acc.T
  if mode == "raw" or split:  # split K: the epilogue follows the sum
    o_ref[...] = acc
  else:
    o_ref[...] = int8_quant.epilogue_from_refs(acc, xs_ref, ws_ref, b_ref,
                                          o_ref.dtype)


def int8_matmul(x2, w, x_scale, w_scale, bias, *, mode, out_dtype,
                block_sizes=None, w_layout="kn", interpret=False):
  """The normalized operands (``operands.Int8MatmulCall``) -> [M, N] out_dtype
  for modes raw / dequant / dynamic / weight_only; w is [K, N], or [N, K]
  for w_layout "nk". ``block_sizes`` (``BlockSizes``) overrides the table.
  ``interpret``: run in Pallas' generic interpreter."""
  if mode == "dynamic":
    x2, x_scale = int8_quant.quantize(x2, axis=-1)
    mode = "dequant"
  m, k = x2.shape
  n = w.shape[1 if w_layout == "kn" else 0]
  out_dtype = jnp.dtype(jnp.int32 if mode == "raw" else out_dtype)
  plan = int8_bs.plan_gpu(m, k, n, mode=mode, block_sizes=block_sizes,
                          w_layout=w_layout)
  w_kmajor = plan.w_kmajor or w_layout == "nk"
  bm, bk, bn, split = plan.bm, plan.bk, plan.bn, plan.split_k
  mp, kp, np_ = (int8_bs.round_up(m, bm), int8_bs.round_up(k, bk * split),
                 int8_bs.round_up(n, bn))
  grid, tile = _tile_order(mp // bm, np_ // bn, plan.group_m)
  arrays = [_pad_to(x2, (mp, kp))]
  in_specs = [pl.BlockSpec((bm, kp), lambda p, q, s: (tile(p, q)[0], 0))]
  if w_layout == "nk":
    arrays.append(_pad_to(w, (np_, kp)))
    in_specs.append(pl.BlockSpec((bn, kp), lambda p, q, s: (tile(p, q)[1], 0)))
  elif w_kmajor:
    arrays.append(_pad_to(w, (kp, np_)).T)  # K-major for the int8 MMA
    in_specs.append(pl.BlockSpec((bn, kp), lambda p, q, s: (tile(p, q)[1], 0)))
  else:
    arrays.append(_pad_to(w, (kp, np_)))
    in_specs.append(pl.BlockSpec((kp, bn), lambda p, q, s: (0, tile(p, q)[1])))
  # Split K: the programs write partial accumulators, the epilogue follows
  # their sum.
  fused = (x_scale, w_scale, bias) if split == 1 else (None, None, None)
  if fused[0] is not None:
    arrays.append(_pad_to(fused[0], (mp, 1), 1))
    in_specs.append(pl.BlockSpec((bm, 1), lambda p, q, s: (tile(p, q)[0], 0)))
  for row_vector in fused[1:]:
    if row_vector is not None:
      arrays.append(_pad_to(row_vector, (1, np_)))
      in_specs.append(pl.BlockSpec((1, bn),
                                   lambda p, q, s: (0, tile(p, q)[1])))
  kernel = functools.partial(
      _int8_kernel, mode=mode, nk=kp // bk // split, bk=bk,
      has_xs=fused[0] is not None, has_ws=fused[1] is not None,
      has_b=fused[2] is not None, w_kmajor=w_kmajor, split=split > 1,
      swap_ab=plan.swap_ab, stream_w=plan.stream_w)
  out = split_k_call(
      kernel, arrays, in_specs, grid=grid, tile=tile, plan=plan,
      padded=(mp, kp, np_), out_dtype=out_dtype,
      partial_dtype=jnp.float32 if mode == "weight_only" else jnp.int32,
      x_side=(arrays[0], fused[0]), w_side=(arrays[1], *fused[1:]),
      name=f"int8_matmul_{mode}_gpu", interpret=interpret)[:m, :n]
  if split > 1 and mode != "raw":
    out = int8_quant.epilogue(out, x_scale, w_scale, bias, out_dtype)
  return out


# ----------------------------------------------------------- quantized_matmul

# int4 nibble n (two's complement v) as float32 bits: 0x4B000000 is 2^23,
# whose mantissa unit is 1, and n ^ 8 = v + 8 lies in its low 4 bits, so the
# value is exactly INT4_BIAS + v with integer ops only (no int -> float
# conversions, which run at a quarter of the ALU rate).
_INT4_BITS = 0x4B000008
INT4_BIAS = float(2**23 + 8)


def _int4_planes(b):
  """uint8 bytes (two nibbles each, low first) -> (low, high) float32
  planes of b's shape holding INT4_BIAS + value."""
  u = b.astype(jnp.uint32)
  low = jnp.bitwise_xor(jnp.bitwise_and(u, 0xF), _INT4_BITS)
  high = jnp.bitwise_xor(jnp.right_shift(u, 4), _INT4_BITS)
  return tuple(jax.lax.bitcast_convert_type(p, jnp.float32)
               for p in (low, high))


def _kernel(*refs, nk, bk, has_xs, has_ws, has_zero, has_b, kn, int4,
            grouped, group_size, split, stream_w, compute_dtype,
            group_products):
  refs = list(refs)
  take = lambda: refs.pop(0)  # noqa: E731
  x_ref, w_ref = take(), take()
  xs_ref = take() if has_xs else None
  ws_ref = take() if has_ws else None
  z_ref = take() if has_zero else None
  b_ref = take() if has_b else None
  o_ref = take()
  first = pl.program_id(2) * nk if split else 0
  bm, bn = o_ref.shape[-2:]
  planes = 2 if int4 else 1
  # int4 planes: kn, output columns p::2 (one accumulator each); nk, x
  # columns p::2 of the K step (one accumulator).
  bkw = bk // planes if not kn else bk   # w's stored K extent per step
  acc_n = bn // planes if kn else bn

  def load_w(window):
    if stream_w:  # read once: keep x and the partial sums in L2
      from jax.experimental.pallas import triton as pltriton
      return pltriton.load(w_ref.at[window], eviction_policy="evict_first")
    return w_ref[window]

  def table_index(row, plane):
    """kn: a [1, acc_n] row of the [G, N] tables; nk: a [bn, 1] column of
    [N, G]."""
    if not kn:
      return slice(None), pl.ds(row, 1)
    if planes == 1:
      return pl.ds(row, 1), slice(None)
    return pl.ds(row, 1), pl.ds(plane, acc_n, stride=planes)

  def dequantize(wf, offset, row, plane):
    """A float32 w plane (values + offset) -> compute_dtype."""
    if not grouped:
      return (wf if offset is None else wf - offset).astype(compute_dtype)
    index = table_index(row, plane)
    if z_ref is not None:
      zero = z_ref[index].astype(jnp.float32)
      wf = wf - (zero if offset is None else zero + offset)
    elif offset is not None:
      wf = wf - offset
    return (wf * ws_ref[index]).astype(compute_dtype)

  def scaled_group(total, row):
    """A group's sum times its x scale column and w scale row."""
    return (total.astype(jnp.float32) * xs_ref[:, pl.ds(row, 1)]
            * ws_ref[pl.ds(row, 1), :])

  group_steps = group_size // bk if group_products else 1

  def group_step(kstep, accs, w):
    """Quantized x: the group's exact sum, scaled at its last step."""
    acc, group = accs
    x = x_ref[:, pl.ds(pl.multiple_of(kstep * bk, bk), bk)]
    group = group + jax.lax.dot_general(
        x, w, (((1,), (0 if kn else 1,)), ((), ())),
        preferred_element_type=group.dtype)
    row = kstep // group_steps
    if group_steps == 1:
      return acc + scaled_group(group, row), jnp.zeros_like(group)
    ends = (kstep + 1) % group_steps == 0
    acc = jnp.where(ends, acc + scaled_group(group, row), acc)
    return acc, jnp.where(ends, jnp.zeros_like(group), group)

  def step(kk, accs):
    kstep = first + kk
    wstart = pl.multiple_of(kstep * bkw, bkw)
    w = load_w((pl.ds(wstart, bkw), slice(None)) if kn
               else (slice(None), pl.ds(wstart, bkw)))
    if group_products:
      return group_step(kstep, accs, w)
    row = kstep * bk // group_size if grouped else 0
    if int4:
      ws = [dequantize(p, INT4_BIAS, row, i)
            for i, p in enumerate(_int4_planes(w))]
    elif compute_dtype is not None:
      ws = [dequantize(w.astype(jnp.float32), None, row, 0)]
    else:
      ws = [w]
    xstart = kstep * bk
    if planes == 1 or kn:
      xs = [x_ref[:, pl.ds(pl.multiple_of(xstart, bk), bk)]] * planes
    else:
      xs = [x_ref[:, pl.ds(xstart + p, bkw, stride=planes)]
            for p in range(planes)]
    precision = (jax.lax.Precision.HIGHEST if xs[0].dtype == jnp.float32
                 else jax.lax.Precision.DEFAULT)
    dims = (((1,), (0 if kn else 1,)), ((), ()))
    dots = [jax.lax.dot_general(x, wp, dims, precision=precision,
                                preferred_element_type=jnp.float32)
            for x, wp in zip(xs, ws)]
    if kn:
      return tuple(acc + d for acc, d in zip(accs, dots))
    return (functools.reduce(jnp.add, dots, accs[0]),)

  init = tuple(jnp.zeros((bm, acc_n), jnp.float32)
               for _ in range(planes if kn else 1))
  if group_products:
    integer = w_ref.dtype == jnp.int8
    init += (jnp.zeros((bm, bn), jnp.int32 if integer else jnp.float32),)
  accs = jax.lax.fori_loop(0, nk, step, init)
  if group_products:  # a group cut by a K split: its part so far
    acc = accs[0] + scaled_group(accs[1], (first + nk - 1) // group_steps)
    xs_ref = None
  elif len(accs) == 2:  # interleave the even and odd columns (Triton join)
    acc = jnp.stack(accs, axis=-1).reshape(bm, bn)
  else:
    acc = accs[0]
  if split:
    o_ref[...] = acc
  else:
    o_ref[...] = int8_quant.epilogue_from_refs(
        acc, xs_ref, None if grouped else ws_ref, b_ref, o_ref.dtype)


def supports(w, group_size, w_layout, mode="weight_only") -> str | None:
  """Why this kernel cannot take the call, else None."""
  fmt = formats.format_of(w.dtype)
  depth = 16 if mode == "weight_only" else 32
  if group_size is not None and group_size % depth:
    return (f"group_size={group_size} is not a multiple of {depth} (Triton's "
            f"smallest {'8-bit ' if depth == 32 else ''}dot depth)")
  if fmt.name == "int4":
    minor = w.shape[1]
    if minor % 2:
      which = "N" if w_layout == "kn" else "K"
      return (f"int4 w with odd {which}={minor}: its bytes pair neighbours "
              f"along {which}")
  return None


def matmul(x2, w, x_scale, w_scale, w_zero, bias, *, mode, out_dtype,
           w_layout="kn", group_size=None, block_sizes=None, interpret=False):
  """The normalized operands (``operands.MatmulCall``) of a weight-only call,
  an fp8 x fp8 call or a grouped int8 x int8 call -> [M, N] out_dtype."""
  fmt = formats.format_of(w.dtype)
  if mode == "dynamic":
    x2, x_scale = reference.quantize_groups(x2, fmt, 1, None, True)
    mode = "dequant"
  kn = w_layout == "kn"
  int4 = fmt.name == "int4"
  m, k = x2.shape
  n = w.shape[1 if kn else 0]
  plan = bs.plan_gpu(m, k, n, mode=mode, group_size=group_size,
                     int4=int4, block_sizes=block_sizes)
  bm, bk, bn, split = plan.bm, plan.bk, plan.bn, plan.split_k
  mp, kp, np_ = (bs.round_up(m, bm), bs.round_up(k, bk * split),
                 bs.round_up(n, bn))
  grouped = group_size is not None
  if mode == "dequant" and kn:
    w, kn = w.T, False  # fp8 tensor cores read w K-major
  w = _pad_to(w, (kp, np_) if kn else (np_, kp))
  if int4:  # bytes of two neighbours along w's minor dimension
    w = jax.lax.bitcast_convert_type(
        w.reshape(w.shape[0], w.shape[1] // 2, 2), jnp.uint8)
  x = _pad_to(x2, (mp, kp))
  arrays = [x, w]
  in_specs = [pl.BlockSpec((bm, kp), lambda i, j, s: (i, 0))]
  if kn:
    in_specs.append(pl.BlockSpec((w.shape[0], bn // 2 if int4 else bn),
                                 lambda i, j, s: (0, j)))
  else:
    in_specs.append(pl.BlockSpec((bn, w.shape[1]), lambda i, j, s: (j, 0)))
  fused = (x_scale, w_scale, bias) if split == 1 else (None, None, None)
  group_products = grouped and mode == "dequant"
  if grouped:  # group scales always go in, per K step
    fused = (x_scale if group_products else fused[0], w_scale, fused[2])
  groups_p = -(-kp // group_size) if grouped else 0
  if group_products:  # [M, G]: each group reads a column
    table = _pad_to(x_scale, (mp, bs.pow2_at_least(groups_p)))
    arrays.append(table)
    in_specs.append(pl.BlockSpec((bm, table.shape[1]),
                                 lambda i, j, s: (i, 0)))
  elif fused[0] is not None:
    arrays.append(_pad_to(fused[0], (mp, 1), 1))
    in_specs.append(pl.BlockSpec((bm, 1), lambda i, j, s: (i, 0)))
  for table in ((fused[1], w_zero) if grouped else (fused[1],)):
    if table is None:
      continue
    if not grouped:  # [1, N]
      arrays.append(_pad_to(table, (1, np_)))
      in_specs.append(pl.BlockSpec((1, bn), lambda i, j, s: (0, j)))
    elif group_products:  # [G, N]: each group reads a row
      table = _pad_to(table, (bs.pow2_at_least(groups_p), np_))
      arrays.append(table)
      in_specs.append(pl.BlockSpec((table.shape[0], bn),
                                   lambda i, j, s: (0, j)))
    elif kn:  # [G, N]: each K step reads a row
      table = _pad_to(table, (groups_p, np_))
      arrays.append(table)
      in_specs.append(pl.BlockSpec((groups_p, bn), lambda i, j, s: (0, j)))
    else:  # [N, G]: each K step reads a column
      table = _pad_to(table.T, (np_, bs.pow2_at_least(groups_p)))
      arrays.append(table)
      in_specs.append(pl.BlockSpec((bn, table.shape[1]),
                                   lambda i, j, s: (j, 0)))
  if fused[2] is not None:
    arrays.append(_pad_to(fused[2], (1, np_)))
    in_specs.append(pl.BlockSpec((1, bn), lambda i, j, s: (0, j)))

  compute_dtype = None if mode == "dequant" else x2.dtype
  kernel = functools.partial(
      _kernel, nk=kp // bk // split, bk=bk, has_xs=fused[0] is not None,
      has_ws=fused[1] is not None, has_zero=grouped and w_zero is not None,
      has_b=fused[2] is not None, kn=kn, int4=int4, grouped=grouped,
      group_size=group_size, split=split > 1,
      stream_w=plan.stream_w and mp == bm, compute_dtype=compute_dtype,
      group_products=group_products)
  w_and_tables = arrays[1:2] + arrays[2 + (fused[0] is not None):]
  out = split_k_call(
      kernel, arrays, in_specs, grid=(mp // bm, np_ // bn),
      tile=lambda i, j: (i, j), plan=plan, padded=(mp, kp, np_),
      out_dtype=jnp.dtype(out_dtype), partial_dtype=jnp.float32,
      x_side=(x, fused[0]), w_side=w_and_tables,
      name=f"quantized_matmul_{mode}_{fmt.name}_gpu",
      interpret=interpret)[:m, :n]
  if split > 1:
    out = int8_quant.epilogue(out, None if group_products else x_scale,
                              None if grouped else w_scale,
                              bias, out_dtype)
  return out
