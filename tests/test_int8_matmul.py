"""int8_matmul and quantize_int8: one suite on every backend, then what is
particular to a kernel (block plans, Triton plan options, CUDA lowering
from this CPU host) and to the public API (bounds, bad inputs, empties).

Results are compared with ``oracles.int8`` (numpy, independent of the
package). Tolerances: int32 results and scales bit-exact, q too except one
step at near ties (a GPU reciprocal may round differently; on this CPU all
are exact); float results within ``oracle.int8_matmul_bound``: float32
roundings of the epilogue (and of weight-only float32 sums), plus the
output dtype's unit roundoff (2**-8 bfloat16, 2**-11 float16, 2**-24
float32).
"""
from __future__ import annotations

import dataclasses
import functools

import backends
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from oracles import int8 as oracle

import pallas_kernels as pk
from pallas_kernels import _backend, _compat, force_interpret
from pallas_kernels.quant import int8_api as api, int8_block_sizes as bs

MAX_K = api.MAX_INT8_K
# A GPU's reciprocal may round q to the other side of a near tie; a CPU's
# (IEEE) one rounds exactly as the oracle.
NEAR_TIES = jax.default_backend() != "cpu"


def int8_values(rng, shape):
  """Random int8 with both extremes (-128, 127) present."""
  a = rng.integers(-128, 128, shape).astype(np.int8)
  if a.size:
    flat = a.reshape(-1)
    flat[rng.integers(0, flat.size, max(1, flat.size // 10))] = -128
    flat[rng.integers(0, flat.size, max(1, flat.size // 10))] = 127
  return a


@dataclasses.dataclass(frozen=True)
class MatmulCase:
  """One int8_matmul call: x [..., K], w for ``layout``, the optional
  arrays (``extras``: x_scale, x_scale_1 (scalar), w_scale, w_scale_1,
  bias), and the public options."""
  x_shape: tuple
  n: int
  x_dtype: str = "int8"
  layout: str = "kn"
  extras: tuple = ()
  out_dtype: str | None = None
  weight_only: bool = False
  block_sizes: tuple | None = None

  @property
  def m(self):
    return int(np.prod(self.x_shape[:-1]))

  @property
  def raw(self):
    return (self.x_dtype == "int8" and not self.extras
            and self.out_dtype in (None, "int32"))

  @property
  def mosaic_gpu(self):
    """The Mosaic GPU kernel's row takes this call."""
    low, high = bs.gpu_weight_only_mosaic_m(jnp.int8)
    return (self.weight_only and self.x_dtype == "bfloat16"
            and self.block_sizes is None and low <= self.m <= high)

  def __str__(self):
    mode = ("raw" if self.raw else "w8a16" if self.weight_only else
            "dequant" if self.x_dtype == "int8" else "dynamic")
    shape = "x".join(map(str, self.x_shape))
    parts = [mode, f"{shape}x{self.n}", self.x_dtype, self.layout,
             *self.extras, self.out_dtype or "",
             "blocks" if self.block_sizes else ""]
    return "-".join(p for p in parts if p)

  def inputs(self, rng):
    """numpy (x, w, extras dict)."""
    k = self.x_shape[-1]
    if self.x_dtype == "int8":
      x = int8_values(rng, self.x_shape)
    else:
      x = (rng.standard_normal(self.x_shape)
           * rng.uniform(0.1, 10, self.x_shape[:-1] + (1,)))
      x = np.asarray(jnp.asarray(x, self.x_dtype))
    w = int8_values(rng, (k, self.n) if self.layout == "kn" else (self.n, k))
    make = {
        "x_scale": lambda: rng.uniform(0.5, 2, self.x_shape[:-1] + (1,)),
        "x_scale_1": lambda: np.asarray(rng.uniform(0.5, 2)),
        "w_scale": lambda: rng.uniform(1e-3, 2e-3, (self.n,)),
        "w_scale_1": lambda: np.asarray(rng.uniform(1e-3, 2e-3)),
        "bias": lambda: rng.standard_normal(self.n),
    }
    extras = {name.removesuffix("_1"): make[name]().astype(np.float32)
              for name in self.extras}
    return x, w, extras

  def options(self):
    return dict(out_dtype=self.out_dtype, weight_only=self.weight_only,
                weight_layout=self.layout, block_sizes=self.block_sizes)


def check_matmul(out, case, x, w, extras):
  out_dtype = case.out_dtype or ("int32" if case.raw else "bfloat16"
                                 if case.x_dtype == "int8" else case.x_dtype)
  assert jnp.dtype(out.dtype) == out_dtype
  oracle.assert_int8_matmul(out, x, w, out_dtype, **extras,
                            weight_only=case.weight_only,
                            weight_layout=case.layout, near_ties=NEAR_TIES)


def run_matmul(backend, case, x, w, extras):
  if backend.name == "mosaic_gpu" and not case.mosaic_gpu:
    pytest.skip("the Mosaic GPU kernel takes weight-only bf16 x, "
                "M in GPU_WEIGHT_ONLY_MOSAIC_AUTO_M")
  arrays = {name: jnp.asarray(v) for name, v in extras.items()}
  return backend.run(pk.int8_matmul, jnp.asarray(x), jnp.asarray(w),
                     **arrays, **case.options())


# ----------------------------------------------------------------------------
# The suite: every mode, both layouts, odd shapes, on every backend

BLOCKS = (32, 128, 128)  # a multi-tile grid for the TPU and Triton kernels

MATMUL_CASES = [
    MatmulCase((1, 1), 1),
    MatmulCase((2, 3, 129), 130, layout="nk"),
    MatmulCase((40, 300), 200, block_sizes=BLOCKS),
    MatmulCase((17, 1000), 17, out_dtype="int32", layout="nk"),
    MatmulCase((33, 70), 50, extras=("x_scale", "w_scale", "bias"),
               out_dtype="float32", layout="nk"),
    MatmulCase((40, 300), 200, extras=("x_scale_1", "w_scale_1", "bias"),
               block_sizes=BLOCKS),
    MatmulCase((5, 64), 33, extras=("w_scale", "bias"), out_dtype="float16"),
    MatmulCase((1, 17), 1, out_dtype="float32", layout="nk"),
    MatmulCase((3, 13, 260), 130, x_dtype="bfloat16", extras=("w_scale",),
               block_sizes=BLOCKS),
    MatmulCase((1, 100), 64, x_dtype="float32", extras=("w_scale", "bias"),
               layout="nk"),
    MatmulCase((13, 200), 150, x_dtype="bfloat16", extras=("w_scale", "bias"),
               layout="nk", weight_only=True),
    MatmulCase((20, 300), 140, x_dtype="float32", extras=("w_scale", "bias"),
               weight_only=True, block_sizes=BLOCKS),
    MatmulCase((1, 96), 1, x_dtype="float16", extras=("w_scale_1",),
               layout="nk", weight_only=True),
    # the Mosaic GPU kernel's range: M 100 -> 128, K split
    MatmulCase((100, 384), 256, x_dtype="bfloat16", extras=("w_scale", "bias"),
               layout="nk", weight_only=True),
]


@pytest.mark.parametrize("case", MATMUL_CASES, ids=str)
@pytest.mark.parametrize("backend", backends.params())
def test_int8_matmul_matches_oracle(backend, case, rng):
  x, w, extras = case.inputs(rng)
  check_matmul(run_matmul(backend, case, x, w, extras), case, x, w, extras)


@pytest.mark.parametrize("backend", backends.params(
    ["interpret_generic", "triton", "reference"]))
@settings(max_examples=6)
@given(m=st.integers(1, 70), k=st.integers(1, 300), n=st.integers(1, 300),
       kind=st.sampled_from(["raw", "dequant", "dynamic", "w8a16"]),
       layout=st.sampled_from(["kn", "nk"]), seed=st.integers(0, 2**32 - 1))
def test_int8_matmul_random_shapes(backend, m, k, n, kind, layout, seed):
  case = MatmulCase(
      (m, k), n, x_dtype="int8" if kind in ("raw", "dequant") else "bfloat16",
      layout=layout, extras=() if kind == "raw" else ("w_scale", "bias"),
      weight_only=kind == "w8a16")
  x, w, extras = case.inputs(np.random.default_rng(seed))
  check_matmul(run_matmul(backend, case, x, w, extras), case, x, w, extras)


def _special_rows(shape):
  """Rows with amax 0, exact ties, a value of exactly 127, NaN and inf."""
  x = np.random.default_rng(0).standard_normal(shape) * 10.0 ** np.linspace(
      -3, 3, shape[0])[:, None]
  x[1] = 0.0
  x[2] = 0.0
  x[2, :4] = [2.5, -2.5, 0.5, 127.0]  # scale exactly 1: ties to even
  x[3, 2] = np.nan
  x[4, 1] = np.inf
  return x


QUANTIZE_CASES = [  # (x, axis)
    (_special_rows((37, 300)).astype(np.float32), -1),
    (np.random.default_rng(1).standard_normal((2, 45, 130)) * 3, -1),
    (np.random.default_rng(2).standard_normal((5, 1)), -1),
    (_special_rows((6, 10)).T.astype(np.float32), 0),
    (np.random.default_rng(3).standard_normal((6, 10)), None),
]
QUANTIZE_DTYPES = ["float32", "bfloat16", "float16", "float32", "float32"]


@pytest.mark.parametrize("index", range(len(QUANTIZE_CASES)))
@pytest.mark.parametrize("backend", backends.params())
def test_quantize_int8_matches_oracle(backend, index):
  x, axis = QUANTIZE_CASES[index]
  x = jnp.asarray(x, QUANTIZE_DTYPES[index])
  q, s = backend.run(pk.quantize_int8, x, axis=axis)
  assert q.dtype == jnp.int8 and s.dtype == jnp.float32
  oracle.assert_quantized(q, s, np.asarray(x), axis, near_ties=NEAR_TIES)


@pytest.mark.parametrize("backend", backends.params(
    ["interpret_generic", "reference"]))
@settings(max_examples=6)
@given(m=st.integers(1, 40), k=st.integers(1, 200),
       dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
       seed=st.integers(0, 2**32 - 1))
def test_quantize_int8_random_shapes(backend, m, k, dtype, seed):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((m, k)) * 10.0 ** rng.uniform(-3, 3),
                  dtype)
  q, s = backend.run(pk.quantize_int8, x)
  oracle.assert_quantized(q, s, np.asarray(x), near_ties=NEAR_TIES)


def test_quantize_oracle_rounds_to_nearest():
  """The oracle's own contract: each row's largest magnitude maps to 127
  and q * scale is within half a step (plus the float32 quotient's rounding)
  of x."""
  x = _special_rows((37, 300))[5:].astype(np.float32)
  q, s = oracle.quantize_int8(x)
  xf = x.astype(np.float64)
  assert np.all(np.abs(q[np.arange(len(x)), np.abs(xf).argmax(1)]) == 127)
  assert np.all(np.abs(q * s.astype(np.float64) - xf)
                <= s * (0.5 + 128 * 2.0**-24))


# ----------------------------------------------------------------------------
# Choosing a kernel


def test_auto_backend_under_jit_equals_reference(rng):
  """On the CPU the automatic choice is the reference. Both run under jit:
  eager and jitted programs may fuse the scaling differently and round the
  bfloat16 output one ulp apart."""
  case = MATMUL_CASES[5]
  x, w, extras = case.inputs(rng)
  arrays = [jnp.asarray(a) for a in (x, w, *extras.values())]
  names = list(extras)

  def run(*a, **backend):
    return pk.int8_matmul(*a[:2], **dict(zip(names, a[2:])), **backend)

  ref = jax.jit(lambda *a: run(*a, backend="reference"))(*arrays)
  auto = jax.jit(run)(*arrays)
  np.testing.assert_array_equal(np.asarray(auto, np.float32),
                                np.asarray(ref, np.float32))


def test_quantize_has_no_gpu_kernel():
  x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 8)),
                  jnp.float32)
  with pytest.raises(ValueError, match="no triton kernel exists"):
    pk.quantize_int8(x, backend="triton")
  for got, want in zip(pk.quantize_int8(x, backend="gpu"),
                       pk.quantize_int8(x, backend="reference")):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_tpu_table_row_follows_the_lowering_target(monkeypatch):
  seen = []
  plan = bs.plan_tpu
  monkeypatch.setattr(bs, "plan_tpu", lambda *a, **kw: (
      seen.append(kw["generation"]), plan(*a, **kw))[1])
  x = jax.ShapeDtypeStruct((16, 256), jnp.int8)
  w = jax.ShapeDtypeStruct((256, 128), jnp.int8)
  fn = functools.partial(pk.int8_matmul, backend="mosaic_tpu")
  with _backend.target_override(tpu_generation="v6e"):
    jax.eval_shape(fn, x, w)
  assert seen and set(seen) == {"v6e"}
  seen.clear()
  jax.eval_shape(functools.partial(fn, block_sizes="v5p"), x, w)
  assert seen and set(seen) == {"v5p"}


# ----------------------------------------------------------------------------
# TPU kernel


def test_no_data_races_in_tpu_interpreter(rng):
  case = MatmulCase((40, 300), 130, extras=("w_scale",), out_dtype="float32",
                    block_sizes=BLOCKS)
  x, w, extras = case.inputs(rng)
  out, log = _backend.find_races(
      lambda x, w, s: pk.int8_matmul(x, w, w_scale=s, out_dtype=jnp.float32,
                                     block_sizes=BLOCKS),
      jnp.asarray(x), jnp.asarray(w), jnp.asarray(extras["w_scale"]))
  check_matmul(out, case, x, w, extras)
  assert log.launches >= 1 and not log.found, log


@pytest.mark.parametrize("generation", ["v4", "v5e", "v5p", "v6e", "tpu7x",
                                        None])
@pytest.mark.parametrize("mode", ["raw", "dequant", "weight_only"])
@pytest.mark.parametrize("mkn", [(16, 4096, 14336), (128, 14336, 4096),
                                 (2048, 4096, 14336), (8192, 8192, 8192),
                                 (1000, 1000, 17), (5, 131071, 3)])
def test_tpu_plans_fit_vmem_and_tile(generation, mode, mkn):
  m, k, n = mkn
  x_bytes = 2 if mode == "weight_only" else 1
  plan = bs.plan_tpu(m, k, n, x_bytes=x_bytes,
                     out_bytes=4 if mode == "raw" else 2, mode=mode,
                     generation=generation)
  budget, _ = bs.tpu_vmem_budget(generation, mode)
  assert plan.vmem_bytes <= budget <= plan.vmem_limit_bytes
  assert plan.k_padded >= k and plan.k_padded % plan.bk == 0
  assert plan.k_padded == k or k % 128  # pads only a ragged K
  assert plan.bm == m or plan.bm % 32 == 0
  assert plan.bn == n or plan.bn % 128 == 0


# ----------------------------------------------------------------------------
# Triton kernel: plan options through the public call, plans, lowering

TRITON_OPTIONS = [  # (case, BlockSizes beyond bm, bk, bn = 16, 64, 32)
    (MatmulCase((33, 200), 70), dict(w_kmajor=True, split_k=3)),
    (MatmulCase((33, 200), 70, extras=("w_scale",), out_dtype="float32"),
     dict(w_kmajor=True, split_k=3)),
    (MatmulCase((70, 200), 100), dict(split_k=2, group_m=2)),
    (MatmulCase((70, 200), 100, extras=("x_scale", "w_scale", "bias"),
                out_dtype="float32"), dict(w_kmajor=True, group_m=3)),
    (MatmulCase((33, 200), 70, x_dtype="bfloat16", extras=("w_scale",),
                weight_only=True), dict(w_kmajor=True, split_k=3)),
    (MatmulCase((13, 200), 150, x_dtype="bfloat16", layout="nk",
                extras=("w_scale", "bias"), out_dtype="float32",
                weight_only=True), dict(swap_ab=True)),
    (MatmulCase((13, 200), 150, x_dtype="bfloat16", extras=("w_scale", "bias"),
                out_dtype="float32", weight_only=True),
     dict(swap_ab=True, split_k=2)),
    (MatmulCase((13, 200), 150, x_dtype="bfloat16", layout="nk",
                extras=("w_scale", "bias"), out_dtype="float32",
                weight_only=True), dict(stream_w=True, split_k=2)),
    (MatmulCase((13, 200), 150, x_dtype="bfloat16", extras=("w_scale", "bias"),
                out_dtype="float32", weight_only=True),
     dict(swap_ab=True, stream_w=True)),
]


@pytest.mark.parametrize("case,options", TRITON_OPTIONS,
                         ids=[f"{c}-{'-'.join(o)}" for c, o in TRITON_OPTIONS])
def test_triton_plan_options(rng, case, options):
  """K-major w, split K, banded program order, swap_ab and evict-first w
  loads on ragged shapes (M, K and N all padded)."""
  case = dataclasses.replace(
      case, block_sizes=bs.BlockSizes(16, 64, 32, 4, 3, **options))
  x, w, extras = case.inputs(rng)
  triton = backends.Backend("triton", "triton", "generic")
  check_matmul(run_matmul(triton, case, x, w, extras), case, x, w, extras)


@pytest.mark.parametrize("ni,nj,group_m", [(5, 3, 2), (7, 4, 8), (1, 6, 4),
                                          (8, 2, 4)])
def test_triton_grouped_tile_order_visits_every_tile_once(ni, nj, group_m):
  from pallas_kernels.quant import triton
  grid, tile = triton._tile_order(ni, nj, group_m)
  seen = [tuple(int(v) for v in tile(jnp.int32(p), jnp.int32(q)))
          for p in range(grid[0]) for q in range(grid[1])]
  assert sorted(seen) == [(i, j) for i in range(ni) for j in range(nj)]
  if group_m > 1 and ni > 1:  # consecutive programs share a column tile
    assert seen[0][1] == seen[1][1] and seen[0][0] != seen[1][0]


def test_triton_decode_plans_fill_the_gpu():
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
  plan = bs.plan_gpu(16, 14336, 4096, mode="dequant")  # int8: auto split
  assert (4096 // plan.bn) * plan.split_k >= min(bs.GPU_TARGET_PROGRAMS,
                                                 (4096 // plan.bn) * 8)
  assert plan.split_k <= 14336 // plan.bk


@pytest.mark.parametrize("m,k,n", [(16, 4096, 14336), (2048, 4096, 4096),
                                   (40, 300, 200)])
def test_triton_kernel_lowers_for_cuda(m, k, n):
  if not hasattr(jax.jit(lambda: 0), "trace"):
    pytest.skip("this jax cannot lower for another platform")
  specs = dict(x8=jax.ShapeDtypeStruct((m, k), jnp.int8),
               xb=jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
               w=jax.ShapeDtypeStruct((k, n), jnp.int8),
               ws=jax.ShapeDtypeStruct((n,), jnp.float32))
  calls = {
      "raw": (lambda x, w: pk.int8_matmul(x, w), ("x8", "w")),
      "fused": (lambda x, w, s: pk.int8_matmul(x, w, w_scale=s),
                ("x8", "w", "ws")),
      "dynamic": (lambda x, w, s: pk.int8_matmul(x, w, w_scale=s),
                  ("xb", "w", "ws")),
      "w8a16": (lambda x, w, s: pk.int8_matmul(x, w, w_scale=s,
                                               weight_only=True),
                ("xb", "w", "ws")),
  }
  for name, (fn, args) in calls.items():
    lowered = _compat.lower_for_cuda(fn, *[specs[a] for a in args])
    assert "triton" in lowered.as_text().lower(), name
    assert '"int8_matmul_' in lowered.as_text(), name   # the launch's name


# ----------------------------------------------------------------------------
# Public API: K bound, empties, NaN, bad inputs


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


def test_v4_path_through_bf16_is_exact(rng):
  """v4 (no int8 MXU operands) multiplies int8 tiles as bf16 with float32
  sums over K chunks of EXACT_F32_K: still the exact integer result, where
  one float32 sum over K would round. K = 2048 in one K tile (two chunks)
  and in two K tiles; row 0 sums 2047 * 127^2 + 127 * 2: odd and above
  2^24, so not a float32 value."""
  k = 2048
  assert bs.EXACT_F32_K < k and not bs.int8_mxu("v4")
  x = rng.integers(-128, 128, (40, k), dtype=np.int8)
  w = rng.integers(-128, 128, (k, 130), dtype=np.int8)
  x[0], w[:, 0], w[-1, 0] = 127, 127, 2
  want = x.astype(np.int64) @ w.astype(np.int64)
  assert want[0, 0] > 2**24 and want[0, 0] % 2 == 1
  for bk in (k, k // 2):
    with _backend.target_override(tpu_generation="v4"):
      out = pk.int8_matmul(jnp.asarray(x), jnp.asarray(w), backend="interpret",
                           block_sizes=bs.BlockSizes(32, bk, 128))
    np.testing.assert_array_equal(np.asarray(out), want)


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
  out = jax.eval_shape(functools.partial(pk.int8_matmul, weight_only=True),
                       xf, w)
  assert out.shape == (1, 1)


@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("m,k,n", [(0, 5, 3), (4, 5, 0), (4, 0, 3)])
def test_empty_dimensions(m, k, n, layout):
  x = jnp.zeros((m, k), jnp.int8)
  w = jnp.zeros((k, n) if layout == "kn" else (n, k), jnp.int8)
  out = pk.int8_matmul(x, w, weight_layout=layout, backend="interpret")
  assert out.shape == (m, n) and out.dtype == jnp.int32
  assert not np.any(np.asarray(out))
  bias = jnp.arange(n, dtype=jnp.float32)
  out = pk.int8_matmul(x, w, bias=bias, out_dtype=jnp.float32,
                       weight_layout=layout, backend="interpret")
  np.testing.assert_array_equal(np.asarray(out), np.broadcast_to(bias, (m, n)))


def test_nan_scale_propagates_to_its_row_only(rng):
  x = jnp.asarray(int8_values(rng, (8, 64)))
  w = jnp.asarray(int8_values(rng, (64, 16)))
  xs = np.ones((8, 1), np.float32)
  xs[3] = np.nan
  out = np.asarray(pk.int8_matmul(x, w, x_scale=jnp.asarray(xs),
                                  out_dtype=jnp.float32, backend="interpret"))
  assert np.all(np.isnan(out[3])) and np.all(np.isfinite(np.delete(out, 3, 0)))


def test_reference_namespace_matches_backend_reference():
  x = jnp.ones((2, 3), jnp.int8)
  w = jnp.ones((3, 4), jnp.int8)
  from pallas_kernels import reference as ref_ns
  np.testing.assert_array_equal(np.asarray(ref_ns.int8_matmul(x, w)),
                                np.full((2, 4), 3))
  xf = jnp.asarray([[1.0, -2.0]], jnp.float32)
  for got, want in zip(ref_ns.quantize_int8(xf), oracle.quantize_int8(xf)):
    np.testing.assert_array_equal(np.asarray(got), want)


I8 = jnp.zeros((4, 8), jnp.int8)
W8 = jnp.zeros((8, 6), jnp.int8)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(x=jnp.zeros((4, 8), jnp.int32)), TypeError, "x must be int8"),
    (dict(w=jnp.zeros((8, 6), jnp.bfloat16)), TypeError, "w must be int8"),
    (dict(w=jnp.zeros((8, 6, 1), jnp.int8)), ValueError, "w must be 2-D"),
    (dict(w=jnp.zeros((7, 6), jnp.int8)), ValueError,
     r"x's last dimension \(8\)"),
    (dict(x=np.int8(3)), ValueError, "at least one dimension"),
    (dict(x=[1, 2]), TypeError, "x must be an array"),
    (dict(x_scale=jnp.ones((4, 2))), ValueError, "x_scale has shape"),
    (dict(x_scale=jnp.ones((4, 1), jnp.int32)), TypeError,
     "x_scale must be a float"),
    (dict(w_scale=jnp.ones((5,))), ValueError, "w_scale has shape"),
    (dict(bias=jnp.ones((6, 1))), ValueError, "bias has shape"),
    (dict(bias=jnp.ones((6,)), out_dtype=jnp.int32), ValueError,
     "out_dtype=int32"),
    (dict(out_dtype=jnp.int8), TypeError, "out_dtype must be"),
    (dict(weight_only=True), ValueError, "weight_only=True needs float x"),
    (dict(x=jnp.zeros((4, 8), jnp.bfloat16), weight_only="no"), TypeError,
     "weight_only must be a bool"),
    (dict(weight_only=None), TypeError, "weight_only must be a bool"),
    (dict(x=jnp.zeros((4, 8), jnp.bfloat16), x_scale=jnp.ones((4, 1))),
     ValueError, "x_scale is only for int8 x"),
    (dict(block_sizes=(32, 0, 128)), ValueError, "block_sizes.bk=0"),
    (dict(block_sizes="v9"), ValueError, "names no TPU generation"),
    (dict(block_sizes=3), TypeError, "block_sizes=3"),
    (dict(backend="tpu"), ValueError, "backend='tpu' is not one of"),
    (dict(weight_layout="kn_t"), ValueError, "weight_layout must be 'kn'"),
    (dict(weight_layout="nk"), ValueError,
     r"w's second dimension for weight_layout='nk'"),
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
  with pytest.raises(ValueError,
                     match="block_sizes.bk=96 must be a multiple of 128"):
    pk.int8_matmul(x, w, block_sizes=(32, 96, 128), backend="interpret")
  with force_interpret("generic"), pytest.raises(ValueError,
                                                 match="power of two"):
    pk.int8_matmul(x, w, block_sizes=(32, 96, 128), backend="triton")


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


def test_main_job_cases_match_reference():
  from pallas_kernels.quant import int8_cases as cases
  listed = cases.main_job_cases("small")
  assert {c.op for c in listed} == {"int8_matmul", "quantize_int8", "int8_dense"}
  with force_interpret("generic"):
    for case in listed:
      out = jax.jit(functools.partial(case.fn, backend="interpret"))(*case.args)
      ref = jax.jit(functools.partial(case.fn, backend="reference"))(*case.args)
      assert case.error(out, ref) <= case.tolerance, case.shape


# ----------------------------------------------------------------------------
# The dequantizing epilogue's float32 order, bit for bit

EPILOGUE_CASES = [
    # (x shape, N, extras, block_sizes): split_k makes the Triton kernel sum
    # partial accumulators before the epilogue.
    ((37, 300), 70, ("x_scale", "w_scale"), None),
    ((37, 300), 70, ("x_scale", "w_scale"), dict(bm=16, bk=64, bn=32,
                                                 split_k=3)),
    ((5, 3, 130), 33, ("x_scale_1", "w_scale", "bias"), None),
    ((37, 300), 70, ("x_scale", "w_scale", "bias"), dict(bm=16, bk=64, bn=32,
                                                         split_k=3)),
    ((9, 200), 40, ("dynamic", "w_scale", "bias"), dict(bm=16, bk=64, bn=32,
                                                        split_k=2)),
]


@pytest.mark.parametrize("case", range(len(EPILOGUE_CASES)))
@pytest.mark.parametrize("backend", backends.params(
    ["interpret", "interpret_generic", "triton", "reference"]))
def test_dequant_epilogue_follows_the_documented_order(backend, case, rng):
  """float32 results equal ``((acc * x_scale) * w_scale) + bias`` rounded at
  every step, bit for bit; only the last multiply-add may be one FMA (XLA's
  CPU and GPU backends and Triton contract them). The bias cancels most of
  the product, so an FMA or another order shows as many ulps."""
  shape, n, extras, blocks = EPILOGUE_CASES[case]
  if blocks is not None and backend.name != "triton":
    pytest.skip("split_k is a Triton option")
  k = shape[-1]
  w = int8_values(rng, (k, n))
  if "dynamic" in extras:
    x = rng.standard_normal(shape).astype(np.float32)
  else:
    x = int8_values(rng, shape)
  arrays = {}
  if "x_scale" in extras:
    arrays["x_scale"] = rng.uniform(1e-3, 2e-2, shape[:-1] + (1,))
  if "x_scale_1" in extras:
    arrays["x_scale"] = np.asarray(rng.uniform(1e-3, 2e-2))
  if "w_scale" in extras:
    arrays["w_scale"] = rng.uniform(1e-3, 2e-2, n)
  arrays = {name: v.astype(np.float32) for name, v in arrays.items()}
  if "bias" in extras:  # minus one row's product, so that sums cancel
    product = oracle.dequant_float32(x, w, **arrays)
    arrays["bias"] = -product.reshape(-1, n)[0].astype(np.float32)
  out = np.asarray(backend.run(
      pk.int8_matmul, jnp.asarray(x), jnp.asarray(w),
      **{name: jnp.asarray(v) for name, v in arrays.items()},
      out_dtype=jnp.float32, block_sizes=blocks))
  separate = oracle.dequant_float32(x, w, **arrays)
  fused = oracle.dequant_float32(x, w, **arrays, fused_add=True)
  exact = (out.view(np.int32) == separate.view(np.int32)) | (
      out.view(np.int32) == fused.view(np.int32))
  assert exact.all(), (f"{int((~exact).sum())} of {exact.size} differ; e.g. "
                       f"{out[~exact][:3]} vs {separate[~exact][:3]}")
