"""Mosaic TPU kernel: matmul of int4 / fp8 / grouped int8 weights, and of
quantized x with group scales. Grid (M/bm, N/bn, K/bk), K innermost; each
step converts its w tile in VMEM (to x's dtype, or dequantized per group in
float32; e4m3fn at decode: widened on its way into the MXU) for one MXU
dot, or runs one dot per group for quantized x; the epilogue runs at the
last K step. Per-mode details: docs/design/quantized.md.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _backend, _cost
from pallas_kernels._compat import pl, pltpu
from pallas_kernels.quant import int8_block_sizes as int8_bs
from pallas_kernels.quant import int8_mosaic_tpu as int8_tpu
from pallas_kernels.quant import int8_quantize as int8_quant
from pallas_kernels.quant import block_sizes as bs
from pallas_kernels.quant import formats, operands, reference


def _expand_rows(a, rows, cols):
  """[G, cols] -> [rows, cols], each row repeated rows // G times."""
  groups = a.shape[0]
  return jnp.broadcast_to(a[:, None, :],
                          (groups, rows // groups, cols)).reshape(rows, cols)


def _group_products(x, w, x_scale, w_scale, *, group_size, w_layout,
                    int_products):
  """sum over the tile's groups of (x_g @ w_g) * x_scale[:, g] * w_scale[g]
  in float32: x [bm, bk], w [bk, bn] ([bn, bk] for "nk"), x_scale [bm, G],
  w_scale [G, bn]. ``int_products``: int8 tiles summed exactly in int32
  (native, or bf16 products in chunks of EXACT_F32_K when x is bf16)."""
  kn = w_layout == "kn"
  contraction = (((1,), (0 if kn else 1,)), ((), ()))
  chunk = (min(group_size, int8_bs.EXACT_F32_K) if int_products
           and x.dtype == jnp.bfloat16 else group_size)
  total = None
  for g in range(x.shape[1] // group_size):
    part = None
    for start in range(g * group_size, (g + 1) * group_size, chunk):
      cols = slice(start, start + chunk)
      xg, wg = x[:, cols], (w[cols, :] if kn else w[:, cols])
      if int_products and x.dtype == jnp.int8:
        dot = jax.lax.dot_general(xg, wg, contraction,
                                  preferred_element_type=jnp.int32)
      else:
        dot = int8_tpu.float_dot(xg, wg, w_layout)
        dot = dot.astype(jnp.int32) if int_products else dot
      part = dot if part is None else part + dot
    part = (part.astype(jnp.float32) * x_scale[:, g:g + 1]
            * w_scale[g:g + 1, :])
    total = part if total is None else total + part
  return total


# e4m3fn bytes read as e4m3b11fnuz (exponent bias 11, not 7) are the value
# / 16; the TPU widens that format to float32 in one op (vunpack), where
# e4m3fn costs six more per value. The formats differ in 0x80 (-0 / NaN)
# and 0x7F, 0xFF (NaN / +-30), which _e4m3fn_bytes_as_b11 remaps.
_B11_SCALE = 16.0
_LOW_BITS = 0x7F7F7F7F
_ONES = 0x01010101
_HIGH_BITS = 0x80808080 - (1 << 32)  # as an int32


def _e4m3fn_bytes_as_b11(w):
  """An e4m3fn tile as e4m3b11fnuz of value / 16 (NaN stays NaN, -0 becomes
  +0), four bytes per int32 word at a time: each byte goes through the same
  steps, whichever way the bitcast packs them, and no step carries across a
  byte."""
  words = pltpu.bitcast(w, jnp.int32)
  low = words & _LOW_BITS
  keep_sign = (low + _LOW_BITS) | _LOW_BITS  # bit 7 clear where low is 0
  nan = (low + _ONES) & _HIGH_BITS  # bit 7 set where low is 0x7F
  nan_low = nan - jax.lax.shift_right_logical(nan, 7)  # 0x7F there
  words = ((words & keep_sign) | nan) ^ nan_low  # NaN -> 0x80
  return pltpu.bitcast(words, jnp.float8_e4m3b11fnuz)


def _kernel(*refs, nk, has_xs, has_ws, has_zero, has_b, w_layout, grouping,
            group_size, compute_dtype, x_upcast, w_streamed):
  x_ref, w_ref, xs_ref, ws_ref, z_ref, b_ref, o_ref, rest = (
      operands.split_kernel_refs(refs, has_xs=has_xs, has_ws=has_ws,
                                 has_zero=has_zero, has_b=has_b))
  acc_ref = rest[0] if rest else None
  x = x_ref[...]
  w = w_ref[...]
  if x_upcast:
    x = x.astype(jnp.float32).astype(compute_dtype)
  if grouping == "products":
    int_products = w.dtype == jnp.int8
    if compute_dtype is not None:
      w = w.astype(jnp.float32).astype(compute_dtype)
    part = _group_products(x, w, xs_ref[...], ws_ref[...],
                           group_size=group_size, w_layout=w_layout,
                           int_products=int_products)
    xs_ref = ws_ref = None  # applied per group
  elif grouping == "weights":
    wf = w.astype(jnp.float32)
    if w_layout == "nk":  # [bn, bk] -> [bk, bn]: scale rows run along K
      wf = wf.T
    rows, cols = wf.shape
    if has_zero:
      wf = wf - _expand_rows(z_ref[...], rows, cols)
    w = (wf * _expand_rows(ws_ref[...], rows, cols)).astype(compute_dtype)
    part = int8_tpu.float_dot(x, w, "kn")
    ws_ref = None  # applied to the weight
  elif w_streamed:  # power-of-two rescale: exact
    part = int8_tpu.streamed_dot(x, _e4m3fn_bytes_as_b11(w),
                                 w_layout) * _B11_SCALE
  else:
    if compute_dtype is not None:
      w = w.astype(jnp.float32).astype(compute_dtype)
    part = int8_tpu.float_dot(x, w, w_layout)

  def finish(acc):
    o_ref[...] = int8_quant.epilogue_from_refs(acc, xs_ref, ws_ref, b_ref,
                                               o_ref.dtype)

  int8_tpu.accumulate_over_k(lambda: part, acc_ref, nk, finish)


def supports(w, group_size, w_layout, mode="weight_only") -> str | None:
  """Why this kernel cannot take the call, else None."""
  del w, w_layout
  if group_size is None:
    return None
  if mode == "weight_only" and group_size % 8:
    return (f"group_size={group_size} is not a multiple of 8 (the TPU "
            "sublane tile)")
  if mode != "weight_only" and group_size % 32:
    return (f"group_size={group_size} is not a multiple of 32 (the sublane "
            "tile of 8-bit w, sliced per group)")
  return None


def matmul(x2, w, x_scale, w_scale, w_zero, bias, *, mode, out_dtype,
           w_layout="kn", group_size=None, block_sizes=None, generation=None,
           interpret=False):
  """The normalized operands (``operands.MatmulCall``) of a weight-only
  call, an fp8 x fp8 (dequant / dynamic) call or a grouped int8 x int8 call
  -> [M, N] out_dtype."""
  kn = w_layout == "kn"
  fmt = formats.format_of(w.dtype)
  if mode == "dynamic":  # float x quantized per row into w's format
    x2, x_scale = reference.quantize_groups(x2, fmt, 1, None, True)
    mode = "dequant"
  generation = generation or _backend.target().tpu_generation
  m, k = x2.shape
  n = w.shape[1 if kn else 0]
  grouped = group_size is not None
  grouping = ("products" if grouped and mode == "dequant" else
              "weights" if grouped else None)
  native = mode == "dequant" and x2.dtype == w.dtype and (
      int8_bs.int8_mxu(generation) if fmt.name == "int8"
      else bs.fp8_mxu(generation))
  if mode == "weight_only":
    compute_dtype = x2.dtype
  else:
    compute_dtype = None if native else jnp.dtype(jnp.bfloat16)
  x_upcast = mode == "dequant" and not native
  out_dtype = jnp.dtype(out_dtype)
  w_bits = 4 if fmt.name == "int4" else 8
  # The bitcast packs 4 rows of the w tile per int32 row: whole (32, 128)
  # int8 tiles when w's row count is a multiple of 32. On an fp8 MXU
  # (tpu7x) Mosaic keeps a widened copy of the tile: not streamed there.
  w_streamed = (mode == "weight_only" and not grouped
                and w.dtype == jnp.float8_e4m3fn and w.shape[0] % 32 == 0
                and not bs.fp8_mxu(generation)
                and int8_bs.weight_only_decode_streams(m, generation,
                                                       x2.dtype))
  plan = bs.plan_tpu(
      m, k, n, x_bytes=x2.dtype.itemsize, w_bits=w_bits,
      out_bytes=out_dtype.itemsize,
      compute_bytes=0 if compute_dtype is None else compute_dtype.itemsize,
      generation=generation, group_size=group_size,
      has_zero=w_zero is not None, x_upcast=x_upcast,
      group_products=grouping == "products", block_sizes=block_sizes,
      w_streamed=w_streamed)
  groups_padded = plan.k_padded // group_size if grouped else 0
  if plan.k_padded != k:
    x2, w = int8_tpu.pad_k(x2, w, plan.k_padded, w_layout)
    if grouped:
      extra = groups_padded - k // group_size
      w_scale = jnp.pad(w_scale, ((0, extra), (0, 0)))
      w_zero = None if w_zero is None else jnp.pad(w_zero, ((0, extra),
                                                            (0, 0)))
      if grouping == "products":
        x_scale = jnp.pad(x_scale, ((0, 0), (0, extra)))
  bm, bk, bn = plan.bm, plan.bk, plan.bn
  nk = plan.k_padded // bk
  group_rows = bk // group_size if grouped else 0

  arrays = [x2, w]
  in_specs = int8_tpu.x_and_w_specs(plan, w_layout)
  if grouping == "products":
    # [M, G] -> [K steps, M, groups per step]: the step's scales are a whole
    # trailing dimension, so the tile keeps Mosaic's layout rules.
    arrays.append(x_scale.reshape(m, nk, group_rows).transpose(1, 0, 2))
    in_specs.append(pl.BlockSpec((None, bm, group_rows),
                                 lambda i, j, kk: (kk, i, 0)))
  elif x_scale is not None:
    arrays.append(x_scale)
    in_specs.append(int8_tpu.per_row_spec(bm))
  if grouped:
    for table in (w_scale, w_zero):
      if table is not None:
        arrays.append(table)
        in_specs.append(pl.BlockSpec((group_rows, bn),
                                     lambda i, j, kk: (kk, j)))
  elif w_scale is not None:
    arrays.append(w_scale)
    in_specs.append(int8_tpu.per_column_spec(bn))
  if bias is not None:
    arrays.append(bias)
    in_specs.append(int8_tpu.per_column_spec(bn))

  kernel = functools.partial(
      _kernel, nk=nk, has_xs=x_scale is not None, has_ws=w_scale is not None,
      has_zero=w_zero is not None, has_b=bias is not None, w_layout=w_layout,
      grouping=grouping, group_size=group_size, compute_dtype=compute_dtype,
      x_upcast=x_upcast, w_streamed=w_streamed)
  grid_m = pl.cdiv(m, bm)
  if grouping == "products":  # scale and add each group's [bm, bn] partial
    extra_flops = 3 * m * n * groups_padded
  else:  # dequantizing a w tile: convert, (subtract,) multiply per value
    extra_flops = grid_m * w.size * (3 if grouped else 1) + 4 * m * n
  name = f"quantized_matmul_{mode}_{fmt.name}" + ("_grouped" if grouped
                                                   else "")
  return int8_tpu.tiled_matmul_call(
      kernel, arrays, in_specs, plan=plan, m=m, n=n, out_dtype=out_dtype,
      scratch=[pltpu.VMEM((bm, bn), jnp.float32)] if nk > 1 else [],
      x_side_bytes=_cost.nbytes(x2, x_scale),
      w_side_bytes=w.size * w_bits // 8 + _cost.nbytes(w_scale, w_zero, bias),
      extra_flops=extra_flops, name=name, interpret=interpret)
