"""int8_matmul and quantize_int8: exactness, bounds, modes, errors.

Tolerances. int32 results are compared bit-exactly with numpy int64.
Dequantized results against float64: the int32 accumulator is exact, its
float32 conversion, two scale multiplies and the bias add each round once
(<= 4 * 2**-24 relative to |acc * xs * ws| + |bias|), and the final cast adds
the unit roundoff of out_dtype (2**-8 bf16, 2**-11 f16, 2**-24 f32) relative to the result.
Weight-only float32 sums of K exact products add K * 2**-24 * sum|x*w|.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, strategies as st

import pallas_kernels as pk
from pallas_kernels import _compat, force_interpret
from pallas_kernels.int8 import api, block_sizes as bs, triton

MAX_K = api.MAX_INT8_K
HALF_ULP = {jnp.bfloat16: 2.0**-8, jnp.float16: 2.0**-11, jnp.float32: 2.0**-24}


def int8_values(rng, shape, extremes=True):
  a = rng.integers(-128, 128, shape).astype(np.int8)
  if extremes and a.size:
    flat = a.reshape(-1)
    flat[rng.integers(0, flat.size, max(1, flat.size // 10))] = -128
    flat[rng.integers(0, flat.size, max(1, flat.size // 10))] = 127
  return a


def exact_int(x, w):
  return np.asarray(x, np.int64) @ np.asarray(w, np.int64)


def check_dequant(out, acc, xs, ws, bias, out_dtype):
  """out vs float64 ((acc * xs) * ws + bias) within the stated bound."""
  acc = np.asarray(acc, np.float64)
  prod = acc * np.asarray(xs, np.float64) * np.asarray(ws, np.float64)
  b = 0.0 if bias is None else np.asarray(bias, np.float64)
  want = prod + b
  got = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
  bound = (4 * 2.0**-24 * (np.abs(prod) + np.abs(b))
           + HALF_ULP[out_dtype] * np.abs(want) * 1.001 + 1e-30)
  assert got.shape == want.shape
  excess = np.abs(got - want) - bound
  assert np.all(excess <= 0), f"max excess {excess.max():.3g}"


# ----------------------------------------------------------------------------
# raw int32: bit-exact


RAW_CASES = [  # (x shape, N, block sizes)
    ((1, 1), 1, None),
    ((17, 1000), 17, None),
    ((1, 17), 1000, None),
    ((40, 300), 200, (32, 128, 128)),     # 2 x 2 x 3 grid, ragged M and N, K padded
    ((2, 3, 129), 130, (32, 128, 128)),   # batch dims
]


@pytest.mark.parametrize("x_shape,n,blocks", RAW_CASES)
def test_raw_int32_bit_exact_tpu_interpreter(rng, x_shape, n, blocks):
  x = int8_values(rng, x_shape)
  w = int8_values(rng, (x_shape[-1], n))
  out = pk.int8_matmul(jnp.asarray(x), jnp.asarray(w), block_sizes=blocks,
                       backend="interpret")
  assert out.dtype == jnp.int32 and out.shape == x_shape[:-1] + (n,)
  np.testing.assert_array_equal(np.asarray(out), exact_int(x, w))


@pytest.mark.parametrize("x_shape,n,blocks", RAW_CASES)
def test_raw_int32_bit_exact_gpu_kernel(rng, x_shape, n, blocks):
  x = int8_values(rng, x_shape).reshape(-1, x_shape[-1])
  w = int8_values(rng, (x_shape[-1], n))
  block = None if blocks is None else bs.BlockSizes(16, 64, 32)
  out = triton.matmul(jnp.asarray(x), jnp.asarray(w), None, None, None,
                   mode="raw", out_dtype=None, block_sizes=block,
                   interpret=True)
  np.testing.assert_array_equal(np.asarray(out), exact_int(x, w))


def test_no_data_races_in_tpu_interpreter(rng):
  from pallas_kernels import _compat
  x = jnp.asarray(int8_values(rng, (40, 300)))
  w = jnp.asarray(int8_values(rng, (300, 130)))
  ws = jnp.asarray(rng.uniform(1e-3, 2e-3, (130,)), jnp.float32)
  with force_interpret("races"):
    out = pk.int8_matmul(x, w, w_scale=ws, out_dtype=jnp.float32,
                         block_sizes=(32, 128, 128))
  check_dequant(out, exact_int(x, w), 1.0, np.asarray(ws), None, jnp.float32)
  assert not _compat.races_found()


def test_raw_worst_case_at_k_bound_does_not_overflow():
  # Every product is (-128) * (-128): the sum reaches 131071 * 16384.
  x = jnp.full((1, MAX_K), -128, jnp.int8)
  w = jnp.full((MAX_K, 1), -128, jnp.int8)
  want = MAX_K * 128 * 128
  assert want <= 2**31 - 1 < (MAX_K + 1) * 128 * 128
  with force_interpret("generic"):
    out = pk.int8_matmul(x, w)
  assert int(out[0, 0]) == want
  assert int(pk.int8_matmul(x, w, backend="reference")[0, 0]) == want


def test_k_above_bound_raises():
  x = jax.ShapeDtypeStruct((1, MAX_K + 1), jnp.int8)
  w = jax.ShapeDtypeStruct((MAX_K + 1, 1), jnp.int8)
  for kwargs in ({}, {"w_scale": jnp.ones(1)}):
    with pytest.raises(ValueError, match=r"K=131072 exceeds 131071"):
      jax.eval_shape(functools.partial(pk.int8_matmul, **kwargs), x, w)
  xf = jax.ShapeDtypeStruct((1, MAX_K + 1), jnp.bfloat16)
  with pytest.raises(ValueError, match="K=131072"):
    jax.eval_shape(pk.int8_matmul, xf, w)
  # weight-only accumulates in float32: no bound.
  out = jax.eval_shape(functools.partial(pk.int8_matmul, weight_only=True), xf, w)
  assert out.shape == (1, 1)


@pytest.mark.parametrize("mode", ["raw", "dequant", "weight_only"])
@pytest.mark.parametrize("split_k", [1, 3])
def test_gpu_kernel_k_major_weights_and_split_k(rng, mode, split_k):
  m, k, n = 33, 200, 70
  x = (jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
       if mode == "weight_only" else jnp.asarray(int8_values(rng, (m, k))))
  w = jnp.asarray(int8_values(rng, (k, n)))
  ws = jnp.asarray(rng.uniform(1e-3, 2e-3, (1, n)), jnp.float32)
  ws = None if mode == "raw" else ws
  run = functools.partial(triton.matmul, x, w, None, ws, None, mode=mode,
                          out_dtype=jnp.float32, interpret=True)
  kmajor = run(block_sizes=bs.BlockSizes(16, 64, 32, 4, 3, w_kmajor=True,
                                         split_k=split_k))
  plain = run(block_sizes=bs.BlockSizes(16, 64, 32, 4, 3, w_kmajor=False))
  if mode != "raw":  # float sums may associate differently
    np.testing.assert_allclose(np.asarray(kmajor), np.asarray(plain), rtol=0,
                               atol=2e-6 * float(np.abs(plain).max()))
  else:
    np.testing.assert_array_equal(np.asarray(kmajor), np.asarray(plain))
  if mode == "raw":
    np.testing.assert_array_equal(np.asarray(kmajor), exact_int(x, w))


WEIGHT_ONLY_VARIANTS = [  # (layout, BlockSizes keyword switches)
    ("nk", dict(swap_ab=True)),
    ("kn", dict(swap_ab=True, split_k=2)),
    ("nk", dict(stream_w=True, split_k=2)),
    ("kn", dict(swap_ab=True, stream_w=True)),
]


@pytest.mark.parametrize("layout,switches", WEIGHT_ONLY_VARIANTS)
def test_gpu_weight_only_decode_variants(rng, layout, switches):
  """swap_ab (w @ x.T, transposed back), evict-first w loads and staggered
  K order compute the same weight-only product (float64 reference)."""
  m, k, n = 13, 200, 150  # ragged: M, K and N all padded
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  w = int8_values(rng, (k, n))
  ws = rng.uniform(0.5, 1.5, (1, n)).astype(np.float32)
  bias = rng.standard_normal((1, n)).astype(np.float32)
  blocks = bs.BlockSizes(16, 32, 64, 4, 3, **switches)
  out = triton.matmul(x, jnp.asarray(w if layout == "kn" else w.T.copy()), None,
                   jnp.asarray(ws), jnp.asarray(bias), mode="weight_only",
                   out_dtype=jnp.float32, block_sizes=blocks, w_layout=layout,
                   interpret=True)
  prod = np.asarray(x, np.float64) @ w.astype(np.float64)
  want = prod * ws + bias
  # float32 sums of exact products, then scale and bias (module docstring)
  bound = (k * 2.0**-24 * (np.abs(np.asarray(x, np.float64))
                           @ np.abs(w.astype(np.float64))) * ws
           + 4 * 2.0**-24 * (np.abs(prod * ws) + np.abs(bias)))
  excess = np.abs(np.asarray(out, np.float64) - want) - bound
  assert out.shape == (m, n) and np.all(excess <= 0), excess.max()


def test_gpu_weight_only_decode_plan_fills_the_gpu():
  target = bs.GPU_WEIGHT_ONLY_TARGET_PROGRAMS["decode"]
  for k, n in [(4096, 14336), (14336, 4096), (4096, 4096), (300, 200)]:
    plan = bs.plan_gpu(16, k, n, mode="weight_only", w_layout="nk")
    programs = -(-n // plan.bn) * plan.split_k
    assert programs >= min(target, -(-n // 32) * min(8, -(-k // plan.bk))), (
        k, n, plan)
    assert plan.bn >= 32 and plan.split_k <= 8
  wide = bs.plan_gpu(16, 4096, 14336, mode="weight_only", w_layout="nk")
  assert (wide.bn, wide.split_k) == (64, 1)  # 224 column tiles: no split
  long_k = bs.plan_gpu(16, 14336, 4096, mode="weight_only", w_layout="nk")
  assert (long_k.bn, long_k.split_k, long_k.num_warps) == (32, 2, 4)
  # swap_ab is a weight-only switch: int8 x int8 plans never swap
  cfg = bs.BlockSizes(16, 64, 64, swap_ab=True)
  assert not bs.plan_gpu(16, 256, 256, mode="raw", block_sizes=cfg).swap_ab
  assert bs.plan_gpu(128, 4096, 4096, mode="weight_only",
                     w_layout="nk").swap_ab


@pytest.mark.parametrize("ni,nj,group_m", [(5, 3, 2), (7, 4, 8), (1, 6, 4),
                                          (8, 2, 4)])
def test_gpu_grouped_tile_order_visits_every_tile_once(ni, nj, group_m):
  grid, tile = triton._tile_order(ni, nj, group_m)
  seen = [tuple(int(v) for v in tile(jnp.int32(p), jnp.int32(q)))
          for p in range(grid[0]) for q in range(grid[1])]
  assert sorted(seen) == [(i, j) for i in range(ni) for j in range(nj)]
  if group_m > 1 and ni > 1:  # consecutive programs share a column tile
    assert seen[0][1] == seen[1][1] and seen[0][0] != seen[1][0]


def test_gpu_grouped_order_raw_exact_and_dequant(rng):
  # 5 row tiles in bands of 2 (the last band is short), split K too.
  m, k, n = 70, 200, 100
  x, w = int8_values(rng, (m, k)), int8_values(rng, (k, n))
  blocks = bs.BlockSizes(16, 64, 32, 4, 3, split_k=2, group_m=2)
  out = triton.matmul(jnp.asarray(x), jnp.asarray(w), None, None, None,
                   mode="raw", out_dtype=None, interpret=True,
                   block_sizes=blocks)
  np.testing.assert_array_equal(np.asarray(out), exact_int(x, w))
  xs = rng.uniform(1e-3, 2e-3, (m, 1)).astype(np.float32)
  ws = rng.uniform(1e-3, 2e-3, (1, n)).astype(np.float32)
  bias = rng.standard_normal((1, n)).astype(np.float32)
  blocks = bs.BlockSizes(16, 64, 32, 4, 3, w_kmajor=True, group_m=3)
  out = triton.matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(xs),
                   jnp.asarray(ws), jnp.asarray(bias), mode="dequant",
                   out_dtype=jnp.float32, interpret=True, block_sizes=blocks)
  check_dequant(out, exact_int(x, w), xs, ws, bias, jnp.float32)


def test_gpu_auto_split_k_fills_the_gpu():
  plan = bs.plan_gpu(16, 14336, 4096, mode="dequant")
  bm, bk, bn, split = plan[0], plan[1], plan[2], plan[6]
  assert (4096 // bn) * split >= min(bs.GPU_TARGET_PROGRAMS, (4096 // bn) * 8)
  assert split <= 14336 // bk


# ----------------------------------------------------------------------------
# dequantized, dynamic and weight-only modes


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("scalar_scales", [False, True])
def test_dequant_fused_epilogue_tpu_interpreter(rng, out_dtype, scalar_scales):
  m, k, n = 40, 300, 200
  x, w = int8_values(rng, (m, k)), int8_values(rng, (k, n))
  if scalar_scales:
    xs, ws = np.float32(rng.uniform(0.5, 2)), np.float32(rng.uniform(1e-3, 2e-3))
  else:
    xs = rng.uniform(0.5, 2, (m, 1)).astype(np.float32)
    ws = rng.uniform(1e-3, 2e-3, (n,)).astype(np.float32)
  bias = rng.standard_normal(n).astype(np.float32)
  out = pk.int8_matmul(jnp.asarray(x), jnp.asarray(w), x_scale=jnp.asarray(xs),
                       w_scale=jnp.asarray(ws), bias=jnp.asarray(bias),
                       out_dtype=out_dtype, block_sizes=(32, 128, 128),
                       backend="interpret")
  assert out.dtype == out_dtype
  check_dequant(out, exact_int(x, w), np.reshape(xs, (-1, 1)) if xs.ndim else xs,
                ws, bias, out_dtype)


@pytest.mark.parametrize("mode_kwargs", [
    dict(x_scale=True, w_scale=True, bias=True),
    dict(w_scale=True),
    dict(bias=True, out_dtype=jnp.float32),
    dict(w_scale=True, out_dtype=jnp.float16),
    dict(out_dtype=jnp.float32),
])
def test_dequant_variants_gpu_kernel(rng, mode_kwargs):
  m, k, n = 33, 70, 50
  x, w = int8_values(rng, (m, k)), int8_values(rng, (k, n))
  xs = rng.uniform(0.5, 2, (m, 1)).astype(np.float32)
  ws = rng.uniform(1e-3, 2e-3, (1, n)).astype(np.float32)
  bias = rng.standard_normal((1, n)).astype(np.float32)
  out_dtype = mode_kwargs.get("out_dtype", jnp.bfloat16)
  out = triton.matmul(
      jnp.asarray(x), jnp.asarray(w),
      jnp.asarray(xs) if mode_kwargs.get("x_scale") else None,
      jnp.asarray(ws) if mode_kwargs.get("w_scale") else None,
      jnp.asarray(bias) if mode_kwargs.get("bias") else None,
      mode="dequant", out_dtype=out_dtype, interpret=True)
  check_dequant(out, exact_int(x, w),
                xs if mode_kwargs.get("x_scale") else 1.0,
                ws if mode_kwargs.get("w_scale") else 1.0,
                bias if mode_kwargs.get("bias") else None, out_dtype)


def test_dynamic_w8a8_matches_quantize_then_matmul(rng):
  m, k, n = 3 * 13, 260, 130
  x = (rng.standard_normal((3, 13, k)) * rng.uniform(0.1, 10, (3, 13, 1)))
  x = jnp.asarray(x, jnp.bfloat16)
  w = int8_values(rng, (k, n))
  ws = rng.uniform(1e-3, 2e-3, (n,)).astype(np.float32)
  out = pk.int8_matmul(x, jnp.asarray(w), w_scale=jnp.asarray(ws),
                       block_sizes=(32, 128, 128), backend="interpret")
  assert out.dtype == jnp.bfloat16 and out.shape == (3, 13, n)
  q, s = pk.quantize_int8(x, backend="reference")
  check_dequant(out.reshape(m, n),
                exact_int(np.asarray(q).reshape(m, k), w),
                np.asarray(s).reshape(m, 1), ws, None, jnp.bfloat16)
  # ... and it approximates the float product within the quantization error.
  xf = np.asarray(x, np.float64).reshape(m, k)
  want = xf @ (np.asarray(w, np.float64) * ws)
  quant_err = (np.asarray(s, np.float64).reshape(m, 1) / 2) @ np.abs(
      np.asarray(w, np.float64) * ws).sum(0, keepdims=True)
  got = np.asarray(out.astype(jnp.float32), np.float64).reshape(m, n)
  assert np.all(np.abs(got - want) <= quant_err + 2**-8 * np.abs(want) + 1e-6)


@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float32, jnp.float16])
def test_weight_only_w8a16(rng, x_dtype):
  m, k, n = 20, 300, 140
  x = jnp.asarray(rng.standard_normal((m, k)), x_dtype)
  w = int8_values(rng, (k, n))
  ws = rng.uniform(1e-3, 2e-3, (n,)).astype(np.float32)
  bias = rng.standard_normal(n).astype(np.float32)
  xf = np.asarray(x.astype(jnp.float32), np.float64)
  prod = xf @ np.asarray(w, np.float64)
  abs_sum = np.abs(xf) @ np.abs(np.asarray(w, np.float64))
  want = prod * ws + bias
  bound = ((k * 2.0**-24 * abs_sum) * ws + 4 * 2.0**-24 * (np.abs(prod * ws)
           + np.abs(bias)) + HALF_ULP[x_dtype] * np.abs(want) * 1.001)
  kernels = {
      "tpu": lambda: pk.int8_matmul(x, jnp.asarray(w), w_scale=jnp.asarray(ws),
                                    bias=jnp.asarray(bias), weight_only=True,
                                    block_sizes=(32, 128, 128),
                                    backend="interpret"),
      "gpu": lambda: triton.matmul(
          x.astype(jnp.float32) if x_dtype == jnp.float16 else x,
          jnp.asarray(w), None, jnp.asarray(ws).reshape(1, n),
          jnp.asarray(bias).reshape(1, n), mode="weight_only",
          out_dtype=x_dtype, interpret=True),
  }
  for name, run in kernels.items():
    out = run()
    assert out.dtype == x_dtype, name
    got = np.asarray(out.astype(jnp.float32), np.float64)
    assert np.all(np.abs(got - want) <= bound), name


def test_backends_agree_and_auto_backend_under_jit(rng):
  x = jnp.asarray(int8_values(rng, (24, 160)))
  w = jnp.asarray(int8_values(rng, (160, 48)))
  ws = jnp.asarray(rng.uniform(1e-3, 2e-3, (48,)), jnp.float32)
  ref = pk.int8_matmul(x, w, w_scale=ws, backend="reference")
  auto = jax.jit(lambda a, b, c: pk.int8_matmul(a, b, w_scale=c))(x, w, ws)
  np.testing.assert_array_equal(np.asarray(auto, np.float32),
                                np.asarray(ref, np.float32))


def test_module_and_function_names_both_work():
  # Importing the package binds pallas_kernels.int8 to it; calling it
  # must still run the op.
  x = jnp.ones((2, 3), jnp.int8)
  w = jnp.ones((3, 4), jnp.int8)
  np.testing.assert_array_equal(np.asarray(pk.int8_matmul(x, w, backend="reference")),
                                np.full((2, 4), 3))
  from pallas_kernels import reference as ref_ns
  np.testing.assert_array_equal(np.asarray(ref_ns.int8_matmul(x, w)),
                                np.full((2, 4), 3))


@pytest.mark.parametrize("m,k,n", [(0, 5, 3), (4, 5, 0), (4, 0, 3)])
def test_empty_dimensions(m, k, n):
  x = jnp.zeros((m, k), jnp.int8)
  w = jnp.zeros((k, n), jnp.int8)
  out = pk.int8_matmul(x, w, backend="interpret")
  assert out.shape == (m, n) and out.dtype == jnp.int32
  assert not np.any(np.asarray(out))
  bias = jnp.arange(n, dtype=jnp.float32)
  out = pk.int8_matmul(x, w, bias=bias, out_dtype=jnp.float32,
                       backend="interpret")
  np.testing.assert_array_equal(np.asarray(out), np.broadcast_to(bias, (m, n)))


def test_nan_scale_propagates_to_its_row_only(rng):
  x = jnp.asarray(int8_values(rng, (8, 64)))
  w = jnp.asarray(int8_values(rng, (64, 16)))
  xs = np.ones((8, 1), np.float32)
  xs[3] = np.nan
  out = np.asarray(pk.int8_matmul(x, w, x_scale=jnp.asarray(xs),
                                  out_dtype=jnp.float32, backend="interpret"))
  assert np.all(np.isnan(out[3])) and np.all(np.isfinite(np.delete(out, 3, 0)))


# ----------------------------------------------------------------------------
# quantize_int8


@pytest.mark.parametrize("backend", ["interpret", "reference"])
def test_quantize_rows_properties(rng, backend):
  x = rng.standard_normal((37, 300)) * rng.uniform(1e-3, 1e3, (37, 1))
  x[5] = 0.0                       # amax == 0: scale 1, q 0
  x[6, :3] = [2.5, -2.5, 0.5]      # ties: round half to even
  x[6, 3:] = 0.0
  x[6, 3] = 127.0                  # scale exactly 1
  x = jnp.asarray(x, jnp.float32)
  q, s = pk.quantize_int8(x, backend=backend)
  q, s, xf = np.asarray(q), np.asarray(s, np.float64), np.asarray(x, np.float64)
  assert q.dtype == np.int8 and s.shape == (37, 1)
  assert np.all(np.abs(q) <= 127)
  assert s[5, 0] == 1.0 and not np.any(q[5])
  np.testing.assert_array_equal(q[6, :4], [2, -2, 0, 127])
  amax = np.abs(xf).max(1, keepdims=True)
  np.testing.assert_allclose(s[amax[:, 0] > 0], amax[amax > 0][:, None] / 127,
                             rtol=2**-23)
  # Each row's largest magnitude maps to +-127, and q * s is within s / 2,
  # up to the float32 rounding of x / s (|x / s| <= 127, so 127 * 2^-23 of
  # a step): a quotient just above a half can round onto it, then to even.
  rows = np.arange(37)
  assert np.all(np.abs(q[rows, np.abs(xf).argmax(1)])[amax[:, 0] > 0] == 127)
  assert np.all(np.abs(q * s - xf) <= s * (0.5 + 128 * 2**-23))


def test_quantize_kernel_equals_reference_bitwise(rng):
  x = jnp.asarray(rng.standard_normal((2, 45, 130)) * 3, jnp.bfloat16)
  q1, s1 = pk.quantize_int8(x, backend="interpret")
  q2, s2 = pk.quantize_int8(x, backend="reference")
  np.testing.assert_array_equal(np.asarray(q1), np.asarray(q2))
  np.testing.assert_array_equal(np.asarray(s1), np.asarray(s2))
  assert q1.shape == x.shape and s1.shape == (2, 45, 1)


def test_quantize_axes_and_per_tensor(rng):
  x = jnp.asarray(rng.standard_normal((6, 10)), jnp.float32)
  q0, s0 = pk.quantize_int8(x, axis=0)
  assert s0.shape == (1, 10)
  np.testing.assert_allclose(np.asarray(s0), np.abs(np.asarray(x)).max(0, keepdims=True) / 127, rtol=1e-6)
  qn, sn = pk.quantize_int8(x, axis=None)
  assert sn.shape == () and qn.shape == x.shape
  assert int(np.abs(np.asarray(qn)).max()) == 127
  assert float(sn) == pytest.approx(float(np.abs(np.asarray(x)).max()) / 127)


def test_quantize_non_finite_rows():
  x = np.ones((3, 8), np.float32)
  x[0, 2] = np.nan
  x[1, 4] = np.inf
  for backend in ("interpret", "reference"):
    q, s = pk.quantize_int8(jnp.asarray(x), backend=backend)
    q, s = np.asarray(q), np.asarray(s)
    assert np.isnan(s[0, 0]) and q[0, 2] == 0
    assert np.isinf(s[1, 0])
    assert s[2, 0] == np.float32(1 / 127) and np.all(q[2] == 127)


@given(m=st.integers(1, 70), k=st.integers(1, 300), n=st.integers(1, 300),
       batch=st.integers(0, 2), seed=st.integers(0, 2**31 - 1))
def test_hypothesis_shapes_raw_and_fused(m, k, n, batch, seed):
  rng = np.random.default_rng(seed)
  x = int8_values(rng, (m, k))
  w = int8_values(rng, (k, n))
  ws = rng.uniform(1e-3, 2e-3, (n,)).astype(np.float32)
  xb = x.reshape((1,) * batch + (m, k))
  with force_interpret("generic"):
    raw = pk.int8_matmul(jnp.asarray(xb), jnp.asarray(w),
                         block_sizes=(32, 128, 128))
    fused = pk.int8_matmul(jnp.asarray(xb), jnp.asarray(w),
                           w_scale=jnp.asarray(ws), out_dtype=jnp.float32)
  assert raw.shape == xb.shape[:-1] + (n,)
  acc = exact_int(x, w)
  np.testing.assert_array_equal(np.asarray(raw).reshape(m, n), acc)
  check_dequant(np.asarray(fused).reshape(m, n), acc, 1.0, ws, None, jnp.float32)


@given(m=st.integers(1, 40), k=st.integers(1, 200), seed=st.integers(0, 2**31 - 1))
@example(m=24, k=128, seed=118)  # a float32 quotient exactly on a .5 tie
def test_hypothesis_quantize_roundtrip(m, k, seed):
  rng = np.random.default_rng(seed)
  x = (rng.standard_normal((m, k)) * 10.0 ** rng.uniform(-3, 3)).astype(np.float32)
  with force_interpret("generic"):
    q, s = pk.quantize_int8(jnp.asarray(x))
  q, s = np.asarray(q, np.float64), np.asarray(s, np.float64)
  # Round to nearest of the float32 quotient x / s: that quotient carries a
  # rounding of up to 2**-24 relative (hypothesis found one that lands on a
  # .5 tie), so |q s - x| <= s / 2 + |x| 2**-24; 2**-22 allows a reciprocal.
  assert np.all(np.abs(q * s - x) <= s / 2 + np.abs(x) * 2.0**-22)


# ----------------------------------------------------------------------------
# block sizes


@pytest.mark.parametrize("generation", ["v4", "v5e", "v5p", "v6e", None])
@pytest.mark.parametrize("mode", ["raw", "dequant", "weight_only"])
@pytest.mark.parametrize("mkn", [(16, 4096, 14336), (128, 14336, 4096),
                                 (2048, 4096, 14336), (8192, 8192, 8192),
                                 (1000, 1000, 17), (5, 131071, 3)])
def test_tpu_plans_fit_vmem_and_tile(generation, mode, mkn):
  m, k, n = mkn
  x_bytes = 2 if mode == "weight_only" else 1
  plan = bs.plan_tpu(m, k, n, x_bytes=x_bytes, out_bytes=4 if mode == "raw" else 2,
                     mode=mode, generation=generation)
  budget, _ = bs.TPU_VMEM.get(generation or "default")
  assert plan.vmem_bytes <= budget <= plan.vmem_limit_bytes
  assert plan.k_padded >= k and plan.k_padded % plan.bk == 0
  assert plan.k_padded == k or k % 128  # pads only a ragged K
  assert plan.bm == m or plan.bm % 32 == 0
  assert plan.bn == n or plan.bn % 128 == 0


# ----------------------------------------------------------------------------
# bad inputs


I8 = jnp.zeros((4, 8), jnp.int8)
W8 = jnp.zeros((8, 6), jnp.int8)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(x=jnp.zeros((4, 8), jnp.int32)), TypeError, "x must be int8"),
    (dict(w=jnp.zeros((8, 6), jnp.bfloat16)), TypeError, "w must be int8"),
    (dict(w=jnp.zeros((8, 6, 1), jnp.int8)), ValueError, "w must be 2-D"),
    (dict(w=jnp.zeros((7, 6), jnp.int8)), ValueError, r"x's last dimension \(8\)"),
    (dict(x=np.int8(3)), ValueError, "at least one dimension"),
    (dict(x=[1, 2]), TypeError, "x must be an array"),
    (dict(x_scale=jnp.ones((4, 2))), ValueError, "x_scale has shape"),
    (dict(x_scale=jnp.ones((4, 1), jnp.int32)), TypeError, "x_scale must be a float"),
    (dict(w_scale=jnp.ones((5,))), ValueError, "w_scale has shape"),
    (dict(bias=jnp.ones((6, 1))), ValueError, "bias has shape"),
    (dict(bias=jnp.ones((6,)), out_dtype=jnp.int32), ValueError, "out_dtype=int32"),
    (dict(out_dtype=jnp.int8), TypeError, "out_dtype must be"),
    (dict(weight_only=True), ValueError, "weight_only=True needs float x"),
    (dict(x=jnp.zeros((4, 8), jnp.bfloat16), x_scale=jnp.ones((4, 1))),
     ValueError, "x_scale is only for int8 x"),
    (dict(block_sizes=(32, 0, 128)), ValueError, "block_sizes.bk=0"),
    (dict(block_sizes="v9"), ValueError, "names no TPU generation"),
    (dict(block_sizes=3), TypeError, "block_sizes=3"),
    (dict(backend="tpu"), ValueError, "backend='tpu' is not one of"),
    (dict(weight_layout="kn_t"), ValueError, "weight_layout must be 'kn'"),
    (dict(weight_layout="nk"), ValueError, r"w's second dimension for weight_layout='nk'"),
])
def test_bad_inputs_raise_naming_the_argument(kwargs, error, match):
  kwargs = dict(kwargs)
  x = kwargs.pop("x", I8)
  w = kwargs.pop("w", W8)
  with pytest.raises(error, match=match):
    pk.int8_matmul(x, w, **kwargs)


def test_bad_block_sizes_for_a_kernel_raise():
  x = jnp.zeros((64, 256), jnp.int8)
  w = jnp.zeros((256, 256), jnp.int8)
  with pytest.raises(ValueError, match="block_sizes.bk=96 must be a multiple of 128"):
    pk.int8_matmul(x, w, block_sizes=(32, 96, 128), backend="interpret")
  with pytest.raises(ValueError, match="power of two"):
    triton.matmul(x, w, None, None, None, mode="raw", out_dtype=None,
               block_sizes=bs.BlockSizes(32, 96, 128), interpret=True)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(x=jnp.zeros((3,), jnp.int8)), TypeError, "x must be bfloat16"),
    (dict(axis=2), ValueError, "axis=2 is out of range"),
    (dict(axis=1.0), TypeError, "axis must be an int"),
    (dict(backend="cuda"), ValueError, "backend='cuda'"),
])
def test_quantize_bad_inputs(kwargs, error, match):
  kwargs = dict(kwargs)
  x = kwargs.pop("x", jnp.zeros((3, 4), jnp.float32))
  with pytest.raises(error, match=match):
    pk.quantize_int8(x, **kwargs)


# ----------------------------------------------------------------------------
# weight_layout="nk": w given as [N, K]


@pytest.mark.parametrize("path", ["tpu_interpreter", "gpu_kernel", "reference"])
@pytest.mark.parametrize("mode", ["raw", "dequant", "weight_only"])
def test_nk_weight_layout_equals_kn_layout(rng, path, mode):
  m, k, n = 19, 300, 137
  w = int8_values(rng, (k, n))
  w_nk = jnp.asarray(np.ascontiguousarray(w.T))
  ws = jnp.asarray(rng.uniform(0.5, 2.0, n), jnp.float32)
  bias = jnp.asarray(rng.standard_normal(n), jnp.float32)
  if mode == "weight_only":
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    kwargs = dict(w_scale=ws, bias=bias, weight_only=True)
  else:
    x = jnp.asarray(int8_values(rng, (m, k)))
    kwargs = {} if mode == "raw" else dict(
        x_scale=jnp.asarray(rng.uniform(0.5, 2.0, (m, 1)), jnp.float32),
        w_scale=ws, bias=bias, out_dtype=jnp.float32)
  if path == "gpu_kernel":
    def run(w_arg, layout):
      return _gpu_call(x, w_arg, layout=layout, **kwargs)
  else:
    backend = "reference" if path == "reference" else "interpret"
    def run(w_arg, layout):
      with force_interpret("tpu"):
        return pk.int8_matmul(x, w_arg, weight_layout=layout, backend=backend,
                              **kwargs)
  got, want = run(w_nk, "nk"), run(jnp.asarray(w), "kn")
  assert got.shape == (m, n) and got.dtype == want.dtype
  if mode == "raw":
    np.testing.assert_array_equal(np.asarray(got), exact_int(x, w))
  elif mode == "dequant" and path == "gpu_kernel":
    # The plan splits K here (float32 partial sums): same int32 partials
    # either way, so the layouts agree bit for bit.
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  elif mode == "dequant":
    check_dequant(got, exact_int(x, w), kwargs["x_scale"], ws, bias,
                  jnp.float32)
  else:  # float32 sums in another order: K * 2**-24 * sum|x w| apart
    scale = np.abs(np.asarray(x, np.float64)) @ np.abs(w.astype(np.float64))
    bound = 2 * k * 2.0**-24 * scale * np.asarray(ws) + 1e-6
    assert np.all(np.abs(np.asarray(got) - np.asarray(want)) <= bound)


def _gpu_call(x, w, *, layout, x_scale=None, w_scale=None, bias=None,
              weight_only=False, out_dtype=None):
  mode = ("weight_only" if weight_only else
          "raw" if x_scale is None else "dequant")
  out_dtype = out_dtype or (jnp.int32 if mode == "raw" else x.dtype)
  ws = None if w_scale is None else w_scale.reshape(1, -1)
  b = None if bias is None else bias.reshape(1, -1)
  return triton.matmul(x, w, x_scale, ws, b, mode=mode, out_dtype=out_dtype,
                    w_layout=layout, interpret=True)


def test_nk_layout_with_batch_dims_and_empty_k(rng):
  x = jnp.asarray(int8_values(rng, (2, 3, 40)))
  w = int8_values(rng, (40, 9))
  got = pk.int8_matmul(x, jnp.asarray(w.T), weight_layout="nk",
                       backend="interpret")
  np.testing.assert_array_equal(
      np.asarray(got), exact_int(np.asarray(x).reshape(6, 40), w).reshape(2, 3, 9))
  empty = pk.int8_matmul(jnp.zeros((4, 0), jnp.int8), jnp.zeros((5, 0), jnp.int8),
                         weight_layout="nk")
  assert empty.shape == (4, 5) and not np.asarray(empty).any()


# ----------------------------------------------------------------------------
# GPU kernel lowers for CUDA (Triton) from this CPU host


@pytest.mark.parametrize("m,k,n", [(16, 4096, 14336), (2048, 4096, 4096),
                                   (40, 300, 200)])
def test_gpu_kernel_lowers_for_cuda(m, k, n):
  if not hasattr(jax.jit(lambda: 0), "trace"):
    pytest.skip("this jax cannot lower for another platform")
  specs = dict(x8=jax.ShapeDtypeStruct((m, k), jnp.int8),
               xb=jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
               w=jax.ShapeDtypeStruct((k, n), jnp.int8),
               ws=jax.ShapeDtypeStruct((n,), jnp.float32))
  calls = {
      "raw": (lambda x, w: pk.int8_matmul(x, w), ("x8", "w")),
      "fused": (lambda x, w, s: pk.int8_matmul(x, w, w_scale=s), ("x8", "w", "ws")),
      "dynamic": (lambda x, w, s: pk.int8_matmul(x, w, w_scale=s), ("xb", "w", "ws")),
      "w8a16": (lambda x, w, s: pk.int8_matmul(x, w, w_scale=s, weight_only=True),
                ("xb", "w", "ws")),
  }
  for name, (fn, args) in calls.items():
    lowered = _compat.lower_for_cuda(fn, *[specs[a] for a in args])
    assert "triton" in lowered.as_text().lower(), name


def test_main_job_cases_match_reference():
  from pallas_kernels.int8 import cases
  listed = cases.main_job_cases("small")
  assert {c.op for c in listed} == {"int8_matmul", "quantize_int8"}
  with force_interpret("generic"):
    for case in listed:
      out = jax.jit(functools.partial(case.fn, backend="interpret"))(*case.args)
      ref = jax.jit(functools.partial(case.fn, backend="reference"))(*case.args)
      assert case.error(out, ref) <= case.tolerance, case.shape
