"""numpy oracles for ``quantize`` and ``quantized_matmul`` (int8, int4, fp8).

Independent of pallas_kernels: written from the documented semantics with
numpy and ml_dtypes (whose float32 -> fp8 casts round to nearest even).

quantize: float32 arithmetic as documented, so q, scale and zero are exact:
  symmetric   scale = amax * float32(1/qmax) (qmax 127, 7, 448, 57344), or
              1 where amax == 0; t = float32(x) * (1/scale); integers:
              clip(rint(t), -qmax, qmax); fp8: ml_dtypes cast of clip(t,
              -max, max); NaN -> 0.
  asymmetric  lo = min(x, 0), hi = max(x, 0); scale = (hi - lo) *
              float32(1/(qmax - qmin)) or 1; zero = clip(rint(qmin - lo *
              (1/scale))); q = clip(rint(t) + zero, qmin, qmax).
quantized_matmul: float64 of the documented pipeline; weight-only group
  dequantization ((w - zero) * scale in float32, rounded to x's dtype) is
  reproduced exactly, the float32 sums and epilogue bounded by
  ``assert_matmul``. Quantized x with group scales: each group's product in
  int64 (int8, exact) or float64 (fp8), scaled and summed in float64.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from oracles import int8 as int8_oracle

F32 = 2.0**-24
UNIT_ROUNDOFF = int8_oracle.UNIT_ROUNDOFF
# name -> (integer, qmin, qmax, numpy dtype)
FORMATS = {
    "int8": (True, -128, 127, np.int8),
    "int4": (True, -8, 7, ml_dtypes.int4),
    "float8_e4m3fn": (False, -448.0, 448.0, ml_dtypes.float8_e4m3fn),
    "float8_e5m2": (False, -57344.0, 57344.0, ml_dtypes.float8_e5m2),
}


def _f32(x):
  return np.asarray(np.asarray(x).astype(np.float32), np.float32)


def _group_slices(length, group_size):
  """Slices of consecutive groups along an axis; the last holds the rest."""
  return [slice(start, min(start + group_size, length))
          for start in range(0, length, group_size)]


def quantize(x, fmt, axis=-1, group_size=None, symmetric=True):
  """(q, scale[, zero]) as numpy; scale/zero shapes as documented: one
  entry per group along ``axis`` (ceil(length / group_size))."""
  x = _f32(x)
  if axis is None:
    q, *rest = _quantize_reduced(x.reshape(1, -1), fmt, 1, symmetric)
    return (q.reshape(x.shape), *(r.reshape(()) for r in rest))
  axis %= x.ndim
  if group_size is None:
    return _quantize_reduced(x, fmt, axis, symmetric)
  parts = [_quantize_reduced(x[(slice(None),) * axis + (piece,)], fmt, axis,
                             symmetric)
           for piece in _group_slices(x.shape[axis], group_size)]
  return tuple(np.concatenate(arrays, axis) for arrays in zip(*parts))


def _quantize_reduced(x, fmt, red, symmetric):
  """(q, scale[, zero]) of float32 x with one scale along axis ``red``
  (kept, length 1)."""
  integer, qmin, qmax, dtype = FORMATS[fmt]
  xg = x
  with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
    nan = np.isnan(xg).any(axis=red, keepdims=True)
    if symmetric:
      top = min(-qmin, qmax)
      amax = np.max(np.abs(xg), axis=red, keepdims=True, initial=0.0)
      amax = np.where(nan, np.float32(np.nan), amax).astype(np.float32)
      scale = np.where(amax == 0, np.float32(1),
                       amax * np.float32(1 / top)).astype(np.float32)
      t = xg * (np.float32(1) / scale)
      t = np.clip(t, -top, top)
      t = np.where(np.isnan(t), 0, t).astype(np.float32)
      q = np.rint(t).astype(dtype) if integer else t.astype(dtype)
      zero = None
    else:
      lo = np.min(xg, axis=red, keepdims=True, initial=0.0)
      hi = np.max(xg, axis=red, keepdims=True, initial=0.0)
      span = np.where(nan, np.float32(np.nan), hi - lo).astype(np.float32)
      scale = np.where(span == 0, np.float32(1),
                       span * np.float32(1 / (qmax - qmin))).astype(np.float32)
      inv = np.float32(1) / scale
      zero = np.clip(np.rint(qmin - lo * inv), qmin, qmax)
      zero = np.where(np.isnan(zero), 0, zero)
      q = np.clip(np.rint(xg * inv) + zero, qmin, qmax)
      q = np.where(np.isnan(q), 0, q).astype(dtype)
      zero = zero.astype(dtype)
  out = [q, scale]
  if zero is not None:
    out.append(zero)
  return tuple(out)


def assert_quantized(got, x, fmt, **kwargs):
  """got == quantize(x, fmt, **kwargs), bit for bit (NaN == NaN)."""
  want = quantize(x, fmt, **kwargs)
  assert len(got) == len(want)
  for g, w in zip(got, want):
    g = np.asarray(g)
    assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape,
                                                       g.dtype, w.dtype)
    np.testing.assert_array_equal(g.astype(np.float64), w.astype(np.float64))


def dequantized_weight(w, scale, zero, group_size, x_dtype):
  """[K, N] float64 of the weight the weight-only product multiplies:
  ((w - zero) * scale) in float32, rounded to x's dtype (float16 x
  computes as float32); per channel: w itself."""
  w = np.asarray(w).astype(np.float32)
  if group_size is None:
    return w.astype(np.float64)
  group_of_row = np.arange(w.shape[0]) // group_size
  rep = lambda a: _f32(a)[group_of_row]  # noqa: E731
  if zero is not None:
    w = (w - rep(zero)).astype(np.float32)
  w = (w * rep(scale)).astype(np.float32)
  if x_dtype == "bfloat16":
    w = w.astype(ml_dtypes.bfloat16)
  return w.astype(np.float64)


def matmul(x, w, *, x_scale=None, w_scale=None, w_zero=None,
           group_size=None, bias=None, weight_only=False, layout="kn"):
  """float64 (int64 in raw mode) x.shape[:-1] + (N,), and the bound's
  magnitude |x| @ |w| * |scales| + |bias| and rounding count."""
  x = np.asarray(x)
  w = np.asarray(w)
  if layout == "nk":
    w = w.T
    if group_size is not None:
      w_scale = np.asarray(w_scale).T
      w_zero = None if w_zero is None else np.asarray(w_zero).T
  k, n = w.shape
  batch = x.shape[:-1]
  x2 = x.reshape(-1, k)
  wname = np.dtype(w.dtype).name
  fmt = "int4" if wname == "int4" else wname
  x_float = x2.dtype.name in ("float32", "bfloat16", "float16")
  if fmt == "int8" and group_size is None and not weight_only:
    want = int8_oracle.int8_matmul(x, w, x_scale=x_scale, w_scale=w_scale,
                                   bias=bias)
    return want, None
  cols = lambda v, absent: (absent if v is None else  # noqa: E731
                            np.asarray(_f32(v), np.float64).reshape(-1)
                            if np.size(v) > 1 else float(_f32(v).reshape(())))
  if x_float and not weight_only:  # dynamic: rows quantized into w's format
    x2, x_scale = quantize(x2, fmt, axis=-1)
  if group_size is not None and not weight_only:
    return group_products(x2, w, x_scale, w_scale, group_size, bias, batch)
  xs = (1.0 if x_scale is None else
        np.asarray(_f32(x_scale), np.float64).reshape(-1, 1)
        if np.size(x_scale) > 1 else float(_f32(x_scale).reshape(())))
  if weight_only:
    x_name = x2.dtype.name
    wd = dequantized_weight(w, w_scale, w_zero, group_size, x_name)
    ws = 1.0 if group_size is not None else cols(w_scale, 1.0)
  else:
    wd = w.astype(np.float64)
    ws = cols(w_scale, 1.0)
  xf = x2.astype(np.float32).astype(np.float64)
  b = cols(bias, 0.0)
  out = (xf @ wd) * xs * ws + b
  magnitude = (np.abs(xf) @ np.abs(wd)) * np.abs(xs * ws) + np.abs(b)
  return (out.reshape(batch + (n,)),
          (magnitude.reshape(batch + (n,)), k + 6))


def group_partial_sums(x2, w, group_size):
  """[G, M, N] per-group products x_g @ w_g of numeric arrays x2 [M, K] and
  w [K, N] (int64 arrays give exact integer sums)."""
  return np.stack([x2[:, piece] @ w[piece]
                   for piece in _group_slices(x2.shape[1], group_size)])


def group_products(x2, w, x_scale, w_scale, group_size, bias, batch):
  """Quantized x with group scales: sum_g (x_g @ w_g) * x_scale[:, g] *
  w_scale[g] + bias in float64, and the bound's magnitude."""
  m, k = x2.shape
  groups = len(_group_slices(k, group_size))
  xs = (np.ones((m, groups)) if x_scale is None else
        np.asarray(_f32(x_scale), np.float64))
  xs = (np.broadcast_to(xs.reshape(1, 1), (m, groups)) if xs.size == 1
        else xs.reshape(m, groups) if xs.size == m * groups
        else np.broadcast_to(xs.reshape(m, 1), (m, groups)))
  ws = np.asarray(_f32(w_scale), np.float64).reshape(groups, -1)
  n = ws.shape[1]
  b = 0.0 if bias is None else np.asarray(_f32(bias), np.float64).reshape(-1)
  exact = np.int64 if x2.dtype == np.int8 else np.float64
  xq = x2.astype(np.float32).astype(exact)
  wq = w.astype(np.float32).astype(exact)
  parts = group_partial_sums(xq, wq, group_size).astype(np.float64)
  scale = xs.T[:, :, None] * ws[:, None, :]
  out = (parts * scale).sum(0) + b
  abs_parts = group_partial_sums(np.abs(xq), np.abs(wq),
                                 group_size).astype(np.float64)
  magnitude = (abs_parts * np.abs(scale)).sum(0) + np.abs(b)
  return (out.reshape(batch + (n,)),
          (magnitude.reshape(batch + (n,)), k + 6))


def assert_matmul(out, x, w, out_dtype, **kwargs):
  """``out`` equals ``matmul`` exactly (int results) or within float32
  roundings of the sums and epilogue plus the output's unit roundoff."""
  want, bound = matmul(x, w, **kwargs)
  got = np.asarray(out)
  assert got.shape == want.shape, (got.shape, want.shape)
  if want.dtype == np.int64:
    np.testing.assert_array_equal(got, want)
    return
  if bound is None:  # int8 x int8 epilogue: the int8 oracle's bound
    return int8_oracle.assert_int8_matmul(out, x, w, out_dtype,
                                          x_scale=kwargs.get("x_scale"),
                                          w_scale=kwargs.get("w_scale"),
                                          bias=kwargs.get("bias"),
                                          near_ties=False)
  magnitude, roundings = bound
  err = roundings * F32 * magnitude
  err = err + UNIT_ROUNDOFF[out_dtype] * (np.abs(want) + err)
  excess = np.abs(got.astype(np.float64) - want) - err
  assert np.all(excess <= 0), f"max excess {excess.max():.3g}"
