"""Exact / float64 numpy oracles for ``quantize_int8`` and ``int8_matmul``.

Independent of pallas_kernels: each op is written from its documented
semantics with numpy alone.

quantize_int8: float32 arithmetic as documented (IEEE, so bit-exact):
  scale = float32(amax) * float32(1/127), or 1 where amax == 0 (amax is NaN
  where the row holds a NaN);
  q = clip(round_half_even(float32(x) * (1 / scale)), -127, 127), NaN -> 0.
int8_matmul: the int32 accumulator exactly (int64), then the dequantizing
  epilogue ``acc * x_scale * w_scale + bias`` in float64.
``int8_matmul_bound`` is the error a float32 pipeline may add to that
float64 value, plus the rounding of the output dtype. Where a reciprocal is
not correctly rounded (GPU division), q may take the other neighbour of a
near tie: ``assert_quantized`` and the bound allow that step there.
"""
from __future__ import annotations

import numpy as np

INT8_MAX = 127
UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float16": 2.0**-11,
                 "float32": 2.0**-24}
F32 = UNIT_ROUNDOFF["float32"]


def _f32(x):
  """x as float32 (bfloat16/float16/float32 convert exactly)."""
  return np.asarray(np.asarray(x).astype(np.float32), np.float32)


def quantize_int8(x, axis=-1):
  """(q int8, scale float32) with ``axis`` kept as size 1 (0-d for None)."""
  x = _f32(x)
  with np.errstate(invalid="ignore", divide="ignore"):
    if axis is None:
      amax = np.float32(np.max(np.abs(x))) if x.size else np.float32(0)
    else:
      amax = np.max(np.abs(x), axis=axis, keepdims=True, initial=0.0)
    amax = np.asarray(amax, np.float32)
    scale = np.where(amax == 0, np.float32(1),
                     amax * np.float32(1 / INT8_MAX)).astype(np.float32)
    q = np.rint(x * (np.float32(1) / scale))  # half to even
  q = np.where(np.isnan(q), 0, np.clip(q, -INT8_MAX, INT8_MAX))
  return q.astype(np.int8), scale


def quantize_near_ties(x, axis=-1, ulps=4):
  """Where x * (1 / scale) lies within ``ulps`` float32 roundings of a
  half-integer: there a reciprocal that is not correctly rounded (GPU
  division) may round q to the other neighbour."""
  _, scale = quantize_int8(x, axis)
  with np.errstate(invalid="ignore", divide="ignore"):
    t = np.asarray(_f32(x), np.float64) / np.asarray(scale, np.float64)
    near = np.abs(np.abs(t - np.floor(t)) - 0.5) <= ulps * F32 * np.abs(t)
  return near & np.isfinite(t)


def assert_quantized(q, scale, x, axis=-1, near_ties=True):
  """``(q, scale)`` equals ``quantize_int8(x, axis)``: scale bit-exact, q
  exact (``near_ties``: except within one step where
  ``quantize_near_ties``)."""
  q_want, s_want = quantize_int8(x, axis)
  np.testing.assert_array_equal(np.asarray(scale), s_want)  # NaN == NaN
  diff = np.abs(np.asarray(q, np.int32) - q_want.astype(np.int32))
  near = quantize_near_ties(x, axis) if near_ties else np.zeros(diff.shape,
                                                                bool)
  assert np.asarray(q).shape == q_want.shape
  assert np.all(diff[~near] == 0), f"{int((diff[~near] != 0).sum())} q differ"
  assert np.all(diff <= 1)


def _columns(v, n, absent):
  """A scalar or [N] / [1, N] vector (used in float32) as float64."""
  if v is None:
    return absent
  v = np.asarray(_f32(v), np.float64)
  return float(v.reshape(())) if v.size == 1 else v.reshape(n)


def _prepared(x, w, x_scale, weight_only, weight_layout):
  """(x2 [M, K], w [K, N], x_scale | None): float x without weight_only is
  quantized per row, its scale becoming x_scale."""
  x = np.asarray(x)
  w = np.asarray(w)
  w = w.T if weight_layout == "nk" else w
  x2 = x.reshape(-1, w.shape[0])
  if x2.dtype != np.int8 and not weight_only:
    x2, x_scale = quantize_int8(x2, axis=-1)
  if x_scale is not None:
    x_scale = np.asarray(_f32(x_scale), np.float64)
    x_scale = (float(x_scale.reshape(())) if x_scale.size == 1
               else x_scale.reshape(-1, 1))
  return x2, w, x_scale


def int8_matmul(x, w, *, x_scale=None, w_scale=None, bias=None,
                weight_only=False, weight_layout="kn"):
  """x.shape[:-1] + (N,): int64 in the raw mode (int8 x, no scale or
  bias), else float64. Float x is quantized per row first unless
  ``weight_only``."""
  batch = np.shape(x)[:-1]
  x2, w, x_scale = _prepared(x, w, x_scale, weight_only, weight_layout)
  n = w.shape[1]
  if weight_only:
    acc = np.asarray(_f32(x2), np.float64) @ np.asarray(w, np.float64)
  else:
    acc = np.asarray(x2, np.int64) @ np.asarray(w, np.int64)
    if x_scale is None and w_scale is None and bias is None:
      return acc.reshape(batch + (n,))
  out = (acc * (1.0 if x_scale is None else x_scale)
         * _columns(w_scale, n, 1.0) + _columns(bias, n, 0.0))
  return np.asarray(out, np.float64).reshape(batch + (n,))


def int8_matmul_bound(x, w, out_dtype, *, x_scale=None, w_scale=None,
                      bias=None, weight_only=False, weight_layout="kn",
                      near_ties=True):
  """Per-element bound on |float result - ``int8_matmul``| for a float32
  pipeline followed by a cast to ``out_dtype`` ("bfloat16", "float16" or
  "float32").

  int8 x int8 (dequant, dynamic): the int32 sum is exact; its float32
  conversion, the two scale products, up to 8 split-K partials summed in
  float32 and the bias add each round once: 12 float32 roundings of
  |x| @ |w| * |x_scale * w_scale| + |bias|. Weight-only: float32 sums of K
  products (exact for bf16/f16 x, rounded once for float32 x) cost K
  roundings of |x| @ |w| * |w_scale|, the scale and bias 5 more. The final
  cast adds the output's unit roundoff of the result. ``near_ties``: float
  x's per-row quantization may be one step off at near ties.
  """
  kwargs = dict(x_scale=x_scale, w_scale=w_scale, bias=bias,
                weight_only=weight_only, weight_layout=weight_layout)
  want = np.abs(int8_matmul(x, w, **kwargs))
  x2, w, x_scale = _prepared(x, w, x_scale, weight_only, weight_layout)
  k, n = w.shape
  magnitude = (np.abs(np.asarray(_f32(x2), np.float64))
               @ np.abs(np.asarray(w, np.float64)))
  scale = np.abs((1.0 if x_scale is None else x_scale)
                 * _columns(w_scale, n, 1.0))
  roundings = k + 5 if weight_only else 12
  err = roundings * F32 * (magnitude * scale + np.abs(_columns(bias, n, 0.0)))
  x = np.asarray(x)
  if near_ties and x.dtype != np.int8 and not weight_only:
    near = quantize_near_ties(x.reshape(-1, k)).astype(np.float64)
    err = err + (near @ np.abs(np.asarray(w, np.float64))) * scale
  err = err.reshape(want.shape)
  return err + UNIT_ROUNDOFF[out_dtype] * (want + err)


def assert_int8_matmul(out, x, w, out_dtype, near_ties=True, **kwargs):
  """``out`` (any array) equals ``int8_matmul(x, w, **kwargs)`` exactly when
  that is an integer result, else lies within ``int8_matmul_bound``."""
  want = int8_matmul(x, w, **kwargs)
  got = np.asarray(out)
  assert got.shape == want.shape, (got.shape, want.shape)
  if want.dtype == np.int64:
    np.testing.assert_array_equal(got, want)
    return
  bound = int8_matmul_bound(x, w, out_dtype, near_ties=near_ties, **kwargs)
  excess = np.abs(got.astype(np.float64) - want) - bound
  assert np.all(excess <= 0), f"max excess {excess.max():.3g}"


def dequant_float32(x, w, *, x_scale=None, w_scale=None, bias=None,
                    fused_add=False):
  """The documented float32 epilogue of an int8 x int8 matmul, exactly:
  ``((float32(acc) * x_scale) * w_scale) + bias``, each step rounded to
  float32 (x float: quantized per row first, its scale as x_scale).

  ``fused_add``: the last multiply and the bias add rounded once (an FMA, as
  compilers may contract them): the float64 product of two float32 values is
  exact, and the float64 sum is corrected by its exact error (TwoSum) one
  float64 step towards the exact value, so that its float32 rounding is the
  exact value's.
  """
  x2, w, row_scale = _prepared(x, w, None, False, "kn")
  if row_scale is not None:  # float x, quantized per row
    x_scale = row_scale.astype(np.float32)
  n = w.shape[1]
  acc = np.asarray(x2, np.int64) @ np.asarray(w, np.int64)
  out = acc.astype(np.float32)
  if x_scale is not None:
    out = out * _f32(x_scale).reshape(-1, 1)
  if bias is not None and fused_add and w_scale is not None:
    product = out.astype(np.float64) * _f32(w_scale).reshape(1, n)
    b = np.broadcast_to(_f32(bias).reshape(1, n).astype(np.float64),
                        product.shape)
    total = product + b
    back = total - product
    err = (product - (total - back)) + (b - back)
    total = np.where(err == 0, total, np.nextafter(total, total + err))
    return total.astype(np.float32).reshape(np.shape(x)[:-1] + (n,))
  if w_scale is not None:
    out = out * _f32(w_scale).reshape(1, n)
  if bias is not None:
    out = out + _f32(bias).reshape(1, n)
  return out.reshape(np.shape(x)[:-1] + (n,))
