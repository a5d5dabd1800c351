"""Quantized matmul for NVIDIA GPUs: Pallas lowered through Triton.

Grid (M/bm, N/bn, split_k); each program walks its K range in a
``fori_loop``. Per K step the w tile is dequantized in registers: converted
to x's dtype (per-channel scales follow in the epilogue) or, with group
scales, ``(w - zero) * scale`` in float32 with the step's one scale (and
zero) row, then rounded to x's dtype: bk divides the group size, so a K step
lies in one group. fp8 x fp8 multiplies fp8 operands directly (Hopper's fp8
tensor cores; w is fed K-major, [N, K], as they read it), float32 sums.
Quantized x with group scales (int8 x int8 or fp8 x fp8): the steps of a
group sum their dots in a second carry (int32 for int8, exact), which at the
group's last step is scaled by the x scale column and w scale row of the
group ([M, G] and [G, N] tables) and added to the float32 sum.

int4. Triton has no 4-bit type: w is bitcast to int8 bytes holding two
neighbours along w's minor dimension (low nibble first, as XLA packs
jnp.int4), and each byte unpacked with shifts: low = (b << 4) >> 4 and
high = b >> 4 (arithmetic). w [N, K]: the nibbles are K neighbours, so x is
split into its even and odd columns (an XLA pass over x, small beside w) and
each half meets its nibble plane. w [K, N]: the nibbles are N neighbours:
the two planes give the even and odd output columns, written as two outputs
that one XLA pass interleaves.

Split K (small M): programs write unscaled float32 partial sums that XLA adds
before the epilogue; group scales are applied per step (per group), so the
sum is the dequantized product; a group cut by the split is scaled in parts.
Tiles are powers of two: M, N, K are zero-padded.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _compat, _cost
from pallas_kernels._compat import pl
from pallas_kernels.int8 import quant as int8_quant
from pallas_kernels.quant import block_sizes as bs
from pallas_kernels.quant import formats, reference


def _pad_to(a, shape, value=0):
  pads = [(0, t - s) for s, t in zip(a.shape, shape)]
  if all(p == (0, 0) for p in pads):
    return a
  return jnp.pad(a, pads, constant_values=value)


def _unpack_int4(b):
  """int8 bytes -> (low, high) nibbles as int8 in [-8, 7]."""
  return jnp.right_shift(jnp.left_shift(b, 4), 4), jnp.right_shift(b, 4)


def _kernel(*refs, nk, bkw, group_bkw, x_parts, planes, has_xs, has_ws,
            has_zero, has_b, kn, int4, split, compute_dtype, group_products):
  refs = list(refs)
  take = lambda count: [refs.pop(0) for _ in range(count)]  # noqa: E731
  x_refs = take(x_parts)
  (w_ref,) = take(1)
  xs_ref = take(1)[0] if has_xs else None
  ws_refs = take(planes) if has_ws else [None] * planes
  z_refs = take(planes) if has_zero else [None] * planes
  b_refs = take(planes) if has_b else [None] * planes
  o_refs = take(planes)
  grouped = group_bkw is not None
  first = pl.program_id(2) * nk if split else 0
  bm = o_refs[0].shape[-2]
  bn = o_refs[0].shape[-1]

  def dequantize(w, ws_ref, z_ref, row):
    if not grouped:
      return w.astype(jnp.float32).astype(compute_dtype)
    # kn: a [1, bn] row of the [G, N] tables; nk: a [bn, 1] column of [N, G].
    index = ((pl.ds(row, 1), slice(None)) if kn
             else (slice(None), pl.ds(row, 1)))
    wf = w.astype(jnp.float32)
    if z_ref is not None:
      wf = wf - z_ref[index]
    return (wf * ws_ref[index]).astype(compute_dtype)

  def scaled_group(total, row):
    """A group's sum times its x scale column and w scale row."""
    return (total.astype(jnp.float32) * xs_ref[:, pl.ds(row, 1)]
            * ws_refs[0][pl.ds(row, 1), :])

  def step(kk, accs):
    start = pl.multiple_of((first + kk) * bkw, bkw)
    xs = [r[:, pl.ds(start, bkw)] for r in x_refs]
    w = w_ref[pl.ds(start, bkw), :] if kn else w_ref[:, pl.ds(start, bkw)]
    if group_products:  # the group's exact sum, scaled at its last step
      acc, group = accs
      group = group + jax.lax.dot_general(
          xs[0], w, (((1,), (0 if kn else 1,)), ((), ())),
          preferred_element_type=group.dtype)
      steps = group_bkw // bkw
      row = (first + kk) // steps
      if steps == 1:
        return acc + scaled_group(group, row), jnp.zeros_like(group)
      ends = (first + kk + 1) % steps == 0
      acc = jnp.where(ends, acc + scaled_group(group, row), acc)
      return acc, jnp.where(ends, jnp.zeros_like(group), group)
    row = (first + kk) * bkw // group_bkw if grouped else 0
    wps = list(_unpack_int4(w)) if int4 else [w]
    if compute_dtype is not None:
      wps = [dequantize(wp, ws_refs[i if kn else 0], z_refs[i if kn else 0],
                        row) for i, wp in enumerate(wps)]
    precision = (jax.lax.Precision.HIGHEST if xs[0].dtype == jnp.float32
                 else jax.lax.Precision.DEFAULT)
    dims = (((1,), (0 if kn else 1,)), ((), ()))
    dot = lambda a, b: jax.lax.dot_general(  # noqa: E731
        a, b, dims, precision=precision, preferred_element_type=jnp.float32)
    if kn:  # one output per plane
      return tuple(acc + dot(xs[0], wp) for acc, wp in zip(accs, wps))
    total = accs[0]
    for x, wp in zip(xs, wps):  # int4: even columns x low, odd x high
      total = total + dot(x, wp)
    return (total,)

  init = tuple(jnp.zeros((bm, bn), jnp.float32) for _ in range(planes))
  if group_products:
    integer = w_ref.dtype == jnp.int8
    init += (jnp.zeros((bm, bn), jnp.int32 if integer else jnp.float32),)
  accs = jax.lax.fori_loop(0, nk, step, init)
  if group_products:  # a group cut by a K split: its part so far
    last_row = (first + nk - 1) * bkw // group_bkw
    accs = (accs[0] + scaled_group(accs[1], last_row),)
    xs_ref = None
  for i, (acc, o_ref) in enumerate(zip(accs, o_refs)):
    if split:
      o_ref[...] = acc
    else:
      o_ref[...] = int8_quant.epilogue_from_refs(
          acc, xs_ref, None if grouped else ws_refs[i], b_refs[i],
          o_ref.dtype)


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
                     block_sizes=block_sizes)
  bm, bk, bn, split = plan.bm, plan.bk, plan.bn, plan.split_k
  mp, kp, np_ = (bs.round_up(m, bm), bs.round_up(k, bk * split),
                 bs.round_up(n, bn))
  grouped = group_size is not None
  group_products = grouped and mode == "dequant"
  if mode == "dequant" and kn:
    w, kn = w.T, False  # fp8 tensor cores read w K-major
  if int4:
    w = jax.lax.bitcast_convert_type(
        w.reshape(w.shape[0], w.shape[1] // 2, 2), jnp.int8)
  # Tile extents in w's stored units: int4 halves N (kn) or K (nk).
  bkw = bk // 2 if int4 and not kn else bk
  bnw = bn // 2 if int4 and kn else bn
  planes = 2 if int4 and kn else 1
  x_parts = 2 if int4 and not kn else 1

  x = _pad_to(x2, (mp, kp))
  arrays = [x[:, 0::2], x[:, 1::2]] if x_parts == 2 else [x]
  x_spec = pl.BlockSpec((bm, kp // x_parts), lambda i, j, s: (i, 0))
  in_specs = [x_spec] * x_parts
  if kn:
    arrays.append(_pad_to(w, (kp, np_ // planes)))
    in_specs.append(pl.BlockSpec((kp, bnw), lambda i, j, s: (0, j)))
  else:
    arrays.append(_pad_to(w, (np_, kp // x_parts)))
    in_specs.append(pl.BlockSpec((bn, kp // x_parts), lambda i, j, s: (j, 0)))
  fused = (x_scale, w_scale, bias) if split == 1 else (None, None, None)
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

  def columns(v):  # [rows, N] -> one [rows, N / planes] table per plane
    v = _pad_to(v, (v.shape[0], np_))
    return [v[:, p::planes] for p in range(planes)]

  for table in ((fused[1], w_zero) if grouped else (fused[1],)):
    if table is None:
      continue
    if grouped:
      table = _pad_to(table, (groups_p, table.shape[1]))
      if not (kn or group_products):  # [N, G]: each K step reads a column
        table = _pad_to(table.T, (np_, bs.pow2_at_least(groups_p)))
        arrays.append(table)
        in_specs.append(pl.BlockSpec((bn, table.shape[1]),
                                     lambda i, j, s: (j, 0)))
        continue
      table = _pad_to(table, (bs.pow2_at_least(groups_p), table.shape[1]))
    for part in columns(table):
      arrays.append(part)
      in_specs.append(pl.BlockSpec((part.shape[0], bnw),
                                   lambda i, j, s: (0, j)))
  if fused[2] is not None:
    for part in columns(fused[2]):
      arrays.append(part)
      in_specs.append(pl.BlockSpec((1, bnw), lambda i, j, s: (0, j)))

  compute_dtype = None if mode == "dequant" else x2.dtype
  kernel = functools.partial(
      _kernel, nk=kp // bk // split, bkw=bkw,
      group_bkw=(group_size // 2 if int4 and not kn else group_size)
      if grouped else None,
      x_parts=x_parts, planes=planes, has_xs=fused[0] is not None,
      has_ws=fused[1] is not None, has_zero=grouped and w_zero is not None,
      has_b=fused[2] is not None, kn=kn, int4=int4, split=split > 1,
      compute_dtype=compute_dtype, group_products=group_products)
  out_dtype = jnp.dtype(out_dtype)
  if split == 1:
    out_spec = pl.BlockSpec((bm, bnw), lambda i, j, s: (i, j))
    out_struct = jax.ShapeDtypeStruct((mp, np_ // planes), out_dtype)
  else:
    out_spec = pl.BlockSpec((None, bm, bnw), lambda i, j, s: (s, i, j))
    out_struct = jax.ShapeDtypeStruct((split, mp, np_ // planes), jnp.float32)
  grid = (mp // bm, np_ // bn, split)
  w_bytes = arrays[x_parts].size * arrays[x_parts].dtype.itemsize
  bytes_accessed = (grid[1] * _cost.nbytes(x, fused[0])
                    + grid[0] * (w_bytes + _cost.nbytes(*arrays[x_parts + 1:]))
                    + planes * _cost.nbytes(out_struct))
  name = f"quantized_matmul_{mode}_{fmt.name}_gpu"
  outs = _compat.pallas_call(
      kernel,
      grid=grid,
      in_specs=in_specs,
      out_specs=[out_spec] * planes,
      out_shape=[out_struct] * planes,
      compiler_params=_compat.gpu_compiler_params(
          num_warps=plan.num_warps, num_stages=plan.num_stages),
      interpret=interpret,
      cost_estimate=_cost.estimate(flops=2 * mp * np_ * kp,
                                   bytes_accessed=bytes_accessed),
      name=name,
  )(*arrays)
  if split > 1:
    outs = [o.sum(axis=0) for o in outs]
  out = (outs[0] if planes == 1 else
         jnp.stack(outs, axis=-1).reshape(mp, np_))
  out = out[:m, :n]
  if split > 1:
    out = int8_quant.epilogue(out, None if group_products else x_scale,
                              None if grouped else w_scale, bias, out_dtype)
  return out
