"""quantized_matmul (int8, int4, fp8 weights; fp8 x fp8): one suite on every
backend, then what is particular to each kernel and to the public API.

Results are compared with ``oracles.quant`` (numpy + ml_dtypes, independent
of the package). Tolerances: integer results exact; float results within
(K + 6) float32 roundings of |x| @ |w_deq| * |scales| + |bias| (the float32
sums and the epilogue; the grouped weight's own rounding to x's dtype is
reproduced exactly by the oracle), plus the output dtype's unit roundoff
(2**-8 bfloat16, 2**-11 float16, 2**-24 float32).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import backends
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from oracles import quant as oracle

import pallas_kernels as pk
from pallas_kernels import _backend, _compat, force_interpret
from pallas_kernels.quant import int8_block_sizes as int8_bs
from pallas_kernels.quant import block_sizes as bs

NP_DTYPES = {"int8": np.int8, "int4": ml_dtypes.int4,
             "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
             "float8_e5m2": ml_dtypes.float8_e5m2}
JNP_DTYPES = {"int8": jnp.int8, "int4": jnp.int4,
              "float8_e4m3fn": jnp.float8_e4m3fn,
              "float8_e5m2": jnp.float8_e5m2}


def weight_values(rng, fmt, shape):
  """Random codes of ``fmt`` covering its range (both extremes for
  integers; fp8 over many binades, +-max included)."""
  if fmt in ("int8", "int4"):
    lo, hi = (-128, 127) if fmt == "int8" else (-8, 7)
    a = rng.integers(lo, hi + 1, shape)
    if a.size:
      flat = a.reshape(-1)
      flat[rng.integers(0, flat.size, max(1, flat.size // 10))] = lo
      flat[rng.integers(0, flat.size, max(1, flat.size // 10))] = hi
    return a.astype(NP_DTYPES[fmt])
  top = 448.0 if fmt == "float8_e4m3fn" else 57344.0
  a = rng.standard_normal(shape) * 2.0 ** rng.integers(-8, 8, shape)
  a = np.clip(a, -top, top)
  if a.size:
    a.reshape(-1)[0] = top
  return a.astype(NP_DTYPES[fmt])


@dataclasses.dataclass(frozen=True)
class Case:
  """One quantized_matmul call. ``kind``: weight_only, dequant (quantized
  x), dynamic (float x quantized per row) or raw. ``refused``: the kernels
  whose ``supports`` turns the call down (asserted, not skipped)."""
  fmt: str
  x_shape: tuple
  n: int
  kind: str = "weight_only"
  x_dtype: str = "bfloat16"
  layout: str = "kn"
  group_size: int | None = None
  zero: bool = False
  extras: tuple = ("w_scale",)
  out_dtype: str | None = None
  refused: tuple = ()

  def __str__(self):
    parts = [self.kind, self.fmt, "x".join(map(str, self.x_shape)),
             f"n{self.n}", self.x_dtype, self.layout,
             f"g{self.group_size}" if self.group_size else "",
             "zero" if self.zero else "", *self.extras, self.out_dtype or ""]
    return "-".join(p for p in parts if p)

  def inputs(self, rng):
    k = self.x_shape[-1]
    m_shape = self.x_shape[:-1]
    if self.kind in ("dequant", "raw"):
      x = weight_values(rng, self.x_dtype, self.x_shape)
    else:
      x = (rng.standard_normal(self.x_shape)
           * rng.uniform(0.1, 10, m_shape + (1,)))
      x = np.asarray(jnp.asarray(x, self.x_dtype))
    w_shape = (k, self.n) if self.layout == "kn" else (self.n, k)
    w = weight_values(rng, self.fmt, w_shape)
    kw = {}
    if self.group_size:
      groups = -(-k // self.group_size)   # the last group may be partial
      table = (groups, self.n) if self.layout == "kn" else (self.n, groups)
      kw["w_scale"] = rng.uniform(1e-3, 2e-2, table).astype(np.float32)
      if self.zero:
        lo, hi = (-8, 7) if self.fmt == "int4" else (-128, 127)
        kw["w_zero"] = rng.integers(lo, hi + 1, table).astype(
            NP_DTYPES[self.fmt])
    make = {
        "x_scale": lambda: rng.uniform(0.5, 2, m_shape),
        "x_scale_g": lambda: rng.uniform(
            0.5, 2, m_shape + (-(-k // self.group_size),)),
        "x_scale_1": lambda: np.asarray(rng.uniform(0.5, 2)),
        "w_scale": lambda: rng.uniform(1e-3, 2e-2, (self.n,)),
        "w_scale_1": lambda: np.asarray(rng.uniform(1e-3, 2e-2)),
        "bias": lambda: rng.standard_normal(self.n),
    }
    for name in self.extras:
      if self.group_size and name == "w_scale":
        continue
      kw[name.removesuffix("_1").removesuffix("_g")] = make[name]().astype(
          np.float32)
    return x, w, kw

  def options(self):
    return dict(group_size=self.group_size, out_dtype=self.out_dtype,
                weight_only=self.kind == "weight_only",
                weight_layout=self.layout)

  def expected_dtype(self):
    if self.out_dtype:
      return self.out_dtype
    if self.kind == "raw":
      return "int32"
    return "bfloat16" if self.kind == "dequant" else self.x_dtype


def mosaic_gpu_takes(case) -> bool:
  """The Mosaic GPU kernel's calls: weight-only with bf16 x, per-channel
  8-bit or int4 w, or int4 w with group sizes that are multiples of 64, M
  in its range for w's dtype (its own refusals are tested in
  test_int8_mosaic_gpu.py)."""
  grouped_ok = case.group_size is None or (
      case.fmt == "int4" and case.group_size % 64 == 0)
  low, high = int8_bs.gpu_weight_only_mosaic_m(case.fmt, case.layout)
  return (case.kind == "weight_only" and grouped_ok
          and case.x_dtype == "bfloat16"
          and low <= math.prod(case.x_shape[:-1]) <= high)


def run_case(backend, case, x, w, kw):
  if backend.name == "mosaic_gpu" and not mosaic_gpu_takes(case):
    pytest.skip("the Mosaic GPU kernel takes weight-only calls with bf16 "
                "x (group scales: int4, multiples of 64), M in "
                "block_sizes.gpu_weight_only_mosaic_m")
  arrays = {name: jnp.asarray(v) for name, v in kw.items()}
  call = functools.partial(backend.run, pk.quantized_matmul, jnp.asarray(x),
                           jnp.asarray(w), **arrays, **case.options())
  if backend.backend in case.refused:
    with pytest.raises(ValueError, match="cannot run this call"):
      call()
    return None
  return call()


def check(out, case, x, w, kw):
  assert jnp.dtype(out.dtype) == case.expected_dtype()
  oracle.assert_matmul(out, x, w, case.expected_dtype(),
                       group_size=case.group_size,
                       weight_only=case.kind == "weight_only",
                       layout=case.layout, **kw)


CASES = [
    Case("int4", (1, 64), 1, refused=("triton",)),   # odd N: no int4 pairs
    Case("int4", (3, 5, 256), 130, group_size=64, zero=True,
         extras=("bias",)),
    # grouped weight-only with w [N, K]: tables [N, K // g]
    Case("int4", (17, 128), 96, x_dtype="float32", layout="nk",
         group_size=32),
    Case("int4", (9, 256), 70, layout="nk", group_size=64, zero=True,
         extras=("bias",)),
    Case("int8", (13, 384), 35, layout="nk", group_size=128, zero=True),
    Case("int8", (3, 128), 17, x_dtype="float32", layout="nk",
         group_size=32),
    Case("float8_e4m3fn", (21, 256), 33, layout="nk", group_size=64),
    Case("float8_e5m2", (2, 3, 128), 129, x_dtype="float16", layout="nk",
         group_size=128, extras=("bias",), out_dtype="float32"),
    Case("int4", (6, 130), 40, layout="nk", extras=("w_scale_1", "bias"),
         out_dtype="float32"),
    Case("float8_e4m3fn", (13, 200), 150, layout="nk", extras=("w_scale",
                                                               "bias")),
    # the Mosaic GPU kernel's range: M 40 (padded to 64), M 130 (to 192)
    Case("float8_e4m3fn", (2, 20, 200), 150, layout="nk",
         extras=("w_scale", "bias")),
    Case("int8", (130, 128), 70, layout="nk"),
    Case("float8_e5m2", (8, 96), 64, x_dtype="float16", group_size=32),
    Case("float8_e4m3fn", (33, 70), 50, kind="dequant",
         x_dtype="float8_e4m3fn", extras=("x_scale", "w_scale", "bias"),
         out_dtype="float32"),
    Case("float8_e5m2", (1, 40), 30, kind="dequant", x_dtype="float8_e4m3fn",
         layout="nk", extras=("x_scale_1", "w_scale_1")),
    Case("float8_e5m2", (9, 100), 40, kind="dynamic", x_dtype="float32",
         extras=("w_scale", "bias"), out_dtype="float32"),
    Case("int8", (5, 256), 200, group_size=128, zero=True),
    Case("int8", (7, 64), 33, kind="dequant", x_dtype="int8",
         extras=("x_scale", "w_scale")),
    Case("int8", (4, 50), 20, kind="raw", x_dtype="int8", extras=()),
    # quantized x with group scales: x_scale [..., K // g], w_scale [K // g,
    # N] ([N, K // g] for "nk"); per-row and scalar x_scale broadcast
    Case("int8", (37, 256), 70, kind="dequant", x_dtype="int8",
         group_size=32, extras=("x_scale_g", "bias"), out_dtype="float32"),
    Case("int8", (2, 3, 192), 33, kind="dequant", x_dtype="int8",
         layout="nk", group_size=64, extras=("x_scale",)),
    Case("int8", (5, 384), 130, kind="dequant", x_dtype="int8",
         group_size=128, extras=("x_scale_1", "bias")),
    Case("float8_e4m3fn", (11, 256), 40, kind="dequant",
         x_dtype="float8_e4m3fn", group_size=64, extras=("x_scale_g",),
         out_dtype="float32"),
    Case("float8_e5m2", (6, 96), 129, kind="dequant", x_dtype="float8_e5m2",
         layout="nk", group_size=32, extras=("x_scale_g", "bias")),
    Case("float8_e5m2", (1, 128), 3, kind="dequant",
         x_dtype="float8_e4m3fn", group_size=128, extras=()),
    # K not a multiple of the group: the last group is partial
    Case("int4", (5, 200), 48, group_size=64, zero=True, extras=("bias",)),
    Case("int4", (3, 100), 24, layout="nk", group_size=32, zero=True),
    Case("float8_e4m3fn", (7, 160), 40, layout="nk", group_size=128),
    Case("int8", (4, 96), 20, kind="dequant", x_dtype="int8",
         group_size=64, extras=("x_scale_g",), out_dtype="float32"),
]


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("backend", backends.params())
def test_quantized_matmul_matches_oracle(backend, case, rng):
  x, w, kw = case.inputs(rng)
  out = run_case(backend, case, x, w, kw)
  if out is not None:
    check(out, case, x, w, kw)


@pytest.mark.parametrize("backend", backends.params(
    ["interpret_generic", "triton", "reference"]))
@settings(max_examples=5)
@given(m=st.integers(1, 40), groups=st.integers(1, 4), n=st.integers(1, 70),
       fmt=st.sampled_from(["int4", "int8", "float8_e4m3fn", "float8_e5m2"]),
       layout=st.sampled_from(["kn", "nk"]), zero=st.booleans(),
       short=st.integers(0, 31), seed=st.integers(0, 2**32 - 1))
def test_grouped_weight_only_random_shapes(backend, m, groups, n, fmt,
                                           layout, zero, short, seed):
  # ``short``: values missing from the last group of 32
  integer = fmt in ("int4", "int8")
  case = Case(fmt, (m, 32 * groups - short),
              n + (n % 2 if fmt == "int4" else 0),
              layout=layout, group_size=32, zero=zero and integer)
  x, w, kw = case.inputs(np.random.default_rng(seed))
  check(run_case(backend, case, x, w, kw), case, x, w, kw)


@pytest.mark.parametrize("backend", backends.params(
    ["interpret_generic", "triton", "reference"]))
@settings(max_examples=5)
@given(m=st.integers(1, 40), groups=st.integers(1, 5), n=st.integers(1, 70),
       fmt=st.sampled_from(["int8", "float8_e4m3fn", "float8_e5m2"]),
       group_size=st.sampled_from([32, 64]),
       layout=st.sampled_from(["kn", "nk"]),
       x_scale=st.sampled_from(["x_scale_g", "x_scale", "x_scale_1"]),
       short=st.integers(0, 31), seed=st.integers(0, 2**32 - 1))
def test_group_products_random_shapes(backend, m, groups, n, fmt, group_size,
                                      layout, x_scale, short, seed):
  # ``short``: values missing from the last group
  case = Case(fmt, (m, group_size * groups - short), n, kind="dequant",
              x_dtype=fmt,
              layout=layout, group_size=group_size,
              extras=(x_scale, "bias"), out_dtype="float32")
  x, w, kw = case.inputs(np.random.default_rng(seed))
  check(run_case(backend, case, x, w, kw), case, x, w, kw)


@pytest.mark.parametrize("backend", backends.params(
    ["interpret", "triton", "reference"]))
def test_int8_group_products_are_exact(backend, rng):
  """Power-of-two scales and |x|, |w| <= 64: each group's int32 sum times its
  scales is exact in float32, and so is the sum over 4 groups (within 24
  bits), so the result equals the int64 oracle bit for bit."""
  m, g, groups, n = 19, 32, 4, 45
  x = rng.integers(-64, 65, (m, g * groups)).astype(np.int8)
  w = rng.integers(-64, 65, (g * groups, n)).astype(np.int8)
  xs = 2.0 ** -rng.integers(0, 3, (m, groups))
  ws = 2.0 ** -rng.integers(0, 3, (groups, n))
  out = backend.run(pk.quantized_matmul, jnp.asarray(x), jnp.asarray(w),
                    x_scale=jnp.asarray(xs, jnp.float32),
                    w_scale=jnp.asarray(ws, jnp.float32), group_size=g,
                    out_dtype=jnp.float32)
  parts = oracle.group_partial_sums(x.astype(np.int64), w.astype(np.int64), g)
  want = (parts * (xs.T[:, :, None] * ws[:, None, :])).sum(0)
  np.testing.assert_array_equal(np.asarray(out, np.float64), want)


def test_quantize_gives_the_group_products_scales(rng):
  """quantize(x, dtype, group_size=g) along K gives x_scale [..., K // g]
  and quantize(w, dtype, axis=0, group_size=g) w_scale [K // g, N]: their
  product is x @ w within the quantization error."""
  x = rng.standard_normal((2, 5, 256)).astype(np.float32)
  w = (rng.standard_normal((256, 48)) / 16).astype(np.float32)
  exact = x.astype(np.float64) @ w.astype(np.float64)
  for dtype, tolerance in ((jnp.int8, 0.02), (jnp.float8_e4m3fn, 0.1)):
    xq, xs = pk.quantize(jnp.asarray(x), dtype, group_size=64)
    wq, ws = pk.quantize(jnp.asarray(w), dtype, axis=0, group_size=64)
    assert xs.shape == (2, 5, 4) and ws.shape == (4, 48)
    out = pk.quantized_matmul(xq, wq, x_scale=xs, w_scale=ws, group_size=64,
                              out_dtype=jnp.float32, backend="reference")
    err = np.abs(np.asarray(out, np.float64) - exact).max()
    assert err < tolerance * np.abs(exact).max(), (dtype, err)
    check(out, Case(jnp.dtype(dtype).name, (2, 5, 256), 48, kind="dequant",
                    x_dtype=jnp.dtype(dtype).name, group_size=64,
                    out_dtype="float32"),
          np.asarray(xq), np.asarray(wq),
          dict(x_scale=np.asarray(xs), w_scale=np.asarray(ws)))


# ----------------------------------------------------------------------------
# Choosing a kernel


def test_chooser_falls_back_to_the_reference_where_kernels_refuse(rng):
  """Groups of 4 values (under the TPU sublane tile of 8 and Triton's dot
  depth of 16) have no kernel: backend=None runs the reference on the CPU
  (whose TPU kernel is interpreted) and says so when named."""
  case = Case("int4", (5, 16), 24, x_dtype="float32", layout="nk",
              group_size=4)
  x, w, kw = case.inputs(rng)
  arrays = [jnp.asarray(a) for a in (x, w)]
  scales = {k: jnp.asarray(v) for k, v in kw.items()}
  with pytest.raises(ValueError, match="group_size=4 is not a multiple of 8"):
    pk.quantized_matmul(*arrays, **scales, **case.options(),
                        backend="mosaic_tpu")
  auto = jax.jit(lambda *a: pk.quantized_matmul(*a, **scales,
                                                **case.options()))(*arrays)
  ref = jax.jit(lambda *a: pk.quantized_matmul(
      *a, **scales, **case.options(), backend="reference"))(*arrays)
  np.testing.assert_array_equal(np.asarray(auto), np.asarray(ref))
  check(auto, case, x, w, kw)
  from pallas_kernels.quant import api
  from pallas_kernels.quant import operands
  for group_size, tpu, cuda in ((4, "reference", "reference"),
                                (8, "mosaic_tpu", "reference"),
                                (16, "mosaic_tpu", "triton")):
    case = dataclasses.replace(case, group_size=group_size)
    x, w, kw = case.inputs(rng)
    call = operands.matmul_call(*(jnp.asarray(a) for a in (x, w)),
                                **{k: jnp.asarray(v) for k, v in kw.items()},
                                **case.options())
    kernels = api._kernels(call, None, None)
    assert _backend.resolve_for_platform("tpu", kernels) == tpu
    assert _backend.resolve_for_platform("cuda", kernels) == cuda


def test_group_products_need_32_value_groups_on_the_kernels(rng):
  """Quantized x with groups of 16: the 8-bit tiles are sliced per group, in
  32-row units on TPU and 32-deep dots in Triton; the reference runs."""
  case = Case("int8", (4, 64), 8, kind="dequant", x_dtype="int8",
              group_size=16, extras=("x_scale_g",), out_dtype="float32")
  x, w, kw = case.inputs(rng)
  from pallas_kernels.quant import api
  from pallas_kernels.quant import operands
  call = operands.matmul_call(jnp.asarray(x), jnp.asarray(w),
                              **{k: jnp.asarray(v) for k, v in kw.items()},
                              **case.options())
  kernels = api._kernels(call, None, None)
  assert _backend.resolve_for_platform("tpu", kernels) == "reference"
  assert _backend.resolve_for_platform("cuda", kernels) == "reference"
  with pytest.raises(ValueError, match="not a multiple of 32"):
    pk.quantized_matmul(jnp.asarray(x), jnp.asarray(w),
                        **{k: jnp.asarray(v) for k, v in kw.items()},
                        **case.options(), backend="mosaic_tpu")
  check(pk.quantized_matmul(jnp.asarray(x), jnp.asarray(w),
                            **{k: jnp.asarray(v) for k, v in kw.items()},
                            **case.options()), case, x, w, kw)


def test_int8_calls_run_the_int8_kernels(monkeypatch, rng):
  from pallas_kernels.quant import int8_mosaic_tpu as int8_tpu
  seen = []
  original = int8_tpu.matmul
  monkeypatch.setattr(int8_tpu, "matmul", lambda *a, **kw: (
      seen.append(kw["mode"]), original(*a, **kw))[1])
  x = jnp.asarray(rng.integers(-127, 128, (4, 64)), jnp.int8)
  w = jnp.asarray(rng.integers(-127, 128, (64, 8)), jnp.int8)
  out = pk.quantized_matmul(x, w, backend="interpret")
  np.testing.assert_array_equal(np.asarray(out), np.asarray(
      pk.int8_matmul(x, w, backend="reference")))
  assert seen == ["raw"]


# ----------------------------------------------------------------------------
# TPU kernel


@pytest.mark.parametrize("fmt,kind,layout", [
    ("int4", "weight_only", "kn"), ("float8_e4m3fn", "weight_only", "kn"),
    ("int4", "weight_only", "nk"), ("int8", "weight_only", "nk"),
    ("int8", "dequant", "kn"), ("float8_e5m2", "dequant", "nk")])
def test_tpu_grouped_multi_k_tiles_and_padding(fmt, kind, layout, rng):
  """K = 800 with groups of 32 and bk = 512 (unit lcm(128, 8 * 32) = 256):
  K is padded to 1024, scales (x's too) by 7 zero groups, two K steps."""
  case = Case(fmt, (40, 800), 140, kind=kind,
              x_dtype=fmt if kind == "dequant" else "bfloat16",
              layout=layout, group_size=32,
              zero=fmt in ("int4", "int8") and kind == "weight_only",
              extras=("x_scale_g", "bias") if kind == "dequant"
              else ("bias",))
  x, w, kw = case.inputs(rng)
  out = pk.quantized_matmul(jnp.asarray(x), jnp.asarray(w),
                            **{k: jnp.asarray(v) for k, v in kw.items()},
                            **case.options(), block_sizes=(32, 512, 128),
                            backend="interpret")
  check(out, case, x, w, kw)


@pytest.mark.parametrize("kind", ["weight_only", "dequant"])
def test_no_data_races_in_tpu_interpreter(kind, rng):
  case = Case("int4" if kind == "weight_only" else "int8", (40, 1024), 256,
              kind=kind, x_dtype="int8" if kind == "dequant" else "bfloat16",
              layout="nk", group_size=64, zero=kind == "weight_only",
              extras=("x_scale_g",) if kind == "dequant" else ())
  x, w, kw = case.inputs(rng)
  names = sorted(kw)
  out, log = _backend.find_races(
      lambda x, w, *tables: pk.quantized_matmul(
          x, w, **dict(zip(names, tables)), **case.options(),
          block_sizes=(32, 512, 128)),
      *(jnp.asarray(a) for a in (x, w, *(kw[k] for k in names))))
  check(out, case, x, w, kw)
  assert log.launches >= 1 and not log.found, log


@pytest.mark.parametrize("generation", ["v4", "v5e", "v5p", "v6e", "tpu7x",
                                        None])
@pytest.mark.parametrize("group_size", [None, 32, 128])
@pytest.mark.parametrize("mkn", [(16, 4096, 14336), (128, 14336, 4096),
                                 (2048, 4096, 14336), (8192, 8192, 8192),
                                 (1000, 1024, 17)])
def test_tpu_plans_fit_vmem_and_tile(generation, group_size, mkn):
  m, k, n = mkn
  plan = bs.plan_tpu(m, k, n, x_bytes=2, w_bits=4, out_bytes=2,
                     compute_bytes=2, generation=generation,
                     group_size=group_size, has_zero=True)
  budget, _ = int8_bs.TPU_VMEM.get(generation, int8_bs.TPU_VMEM["default"])
  assert plan.vmem_bytes <= budget <= plan.vmem_limit_bytes
  assert plan.k_padded % plan.bk == 0 and plan.k_padded >= k
  unit = bs.k_unit(group_size)
  assert plan.bk == plan.k_padded or plan.bk % unit == 0
  assert plan.bm == m or plan.bm % 32 == 0
  assert plan.bn == n or plan.bn % 128 == 0


# ----------------------------------------------------------------------------
# Triton kernel


@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("fmt,kind", [("int4", "weight_only"),
                                      ("float8_e5m2", "weight_only"),
                                      ("int8", "dequant"),
                                      ("float8_e4m3fn", "dequant")])
def test_triton_split_k_and_padding(fmt, kind, layout, rng):
  """bk 32 inside groups of 64, split K over 3 programs, every dimension
  padded; int4 w [K, N] writes even and odd columns separately. Group
  products split K over 2 programs of 3 steps: group 1 (steps 2 and 3) is
  cut between them, each program scaling its part."""
  dequant = kind == "dequant"
  case = Case(fmt, (20, 192), 70, kind=kind,
              x_dtype=fmt if dequant else "bfloat16", layout=layout,
              group_size=64, zero=fmt == "int4",
              extras=("x_scale_g", "bias") if dequant else ("bias",),
              out_dtype="float32")
  x, w, kw = case.inputs(rng)
  triton = backends.Backend("triton", "triton", "generic")
  out = triton.run(pk.quantized_matmul, jnp.asarray(x), jnp.asarray(w),
                   **{k: jnp.asarray(v) for k, v in kw.items()},
                   **case.options(),
                   block_sizes=int8_bs.BlockSizes(16, 32, 32,
                                                  split_k=2 if dequant else 3))
  check(out, case, x, w, kw)


def test_triton_int4_decoding_is_exact_for_every_byte():
  """Each byte's two nibbles, low first, decode to INT4_BIAS + value
  (integer ops only), against sign-extended nibbles."""
  from pallas_kernels.quant import triton as quant_triton
  codes = np.arange(256, dtype=np.uint8).reshape(16, 16)
  got = np.stack([np.asarray(p, np.float64) for p in
                  quant_triton._int4_planes(jnp.asarray(codes))], axis=-1)
  nibbles = np.stack([codes & 0xF, codes >> 4], axis=-1)
  want = (nibbles.astype(np.int8) << 4 >> 4).astype(np.float64)  # sign
  np.testing.assert_array_equal(got - quant_triton.INT4_BIAS, want)


@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("m,k,n", [(1, 1536, 96), (5, 640, 2050),
                                   (40, 1152, 160)])
def test_triton_int4_default_plan_odd_shapes(m, k, n, layout, rng):
  """The int4 decode / narrow plans (K split, evict-first w) at odd shapes,
  grouped with zeros and per channel."""
  triton = backends.Backend("triton", "triton", "generic")
  for group_size in (128, None):
    case = Case("int4", (m, k), n, layout=layout, group_size=group_size,
                zero=group_size is not None,
                extras=("w_scale",) + (("bias",) if group_size else ()))
    x, w, kw = case.inputs(rng)
    out = triton.run(pk.quantized_matmul, jnp.asarray(x), jnp.asarray(w),
                     **{a: jnp.asarray(v) for a, v in kw.items()},
                     **case.options())
    check(out, case, x, w, kw)


def test_triton_int4_plans_fill_the_gpu():
  """Small-M int4 plans split K until the programs reach the target, keep
  MIN_STEPS_PER_PROGRAM K steps each and stream w."""
  for m, k, n in [(1, 4096, 14336), (16, 14336, 4096), (64, 8192, 8192),
                  (8, 1024, 256)]:
    plan = bs.plan_gpu(m, k, n, mode="weight_only", group_size=128,
                       int4=True)
    programs = -(-m // plan.bm) * -(-n // plan.bn) * plan.split_k
    steps = k // plan.bk // plan.split_k
    assert plan.stream_w and 128 % plan.bk == 0
    assert steps >= bs.MIN_STEPS_PER_PROGRAM
    assert (programs >= bs.GPU_TARGET_PROGRAMS
            or plan.split_k == bs.GPU_MAX_SPLIT_K
            or steps < 2 * bs.MIN_STEPS_PER_PROGRAM), (m, k, n, plan)


def test_triton_int4_block_n_at_least_32():
  with pytest.raises(ValueError, match="block_sizes.bn=16 must be >= 32"):
    bs.plan_gpu(4, 256, 64, mode="weight_only", int4=True,
                block_sizes=int8_bs.BlockSizes(16, 32, 16))


def test_triton_block_k_must_divide_the_group():
  x = jnp.zeros((4, 128), jnp.bfloat16)
  w = jnp.zeros((128, 32), jnp.int4)
  with force_interpret("generic"), pytest.raises(ValueError,
                                                 match="must divide"):
    pk.quantized_matmul(x, w, w_scale=jnp.ones((4, 32)), group_size=32,
                        weight_only=True, block_sizes=(16, 64, 32),
                        backend="triton")


@pytest.mark.parametrize("call", ["int4_grouped_kn", "int4_nk", "fp8_fp8",
                                  "fp8_grouped"])
def test_triton_kernel_lowers_for_cuda(call):
  if not hasattr(jax.jit(lambda: 0), "trace"):
    pytest.skip("this jax cannot lower for another platform")
  S = jax.ShapeDtypeStruct
  m, k, n = 16, 4096, 1024
  calls = {
      "int4_grouped_kn": (functools.partial(
          pk.quantized_matmul, group_size=128, weight_only=True),
          [S((m, k), jnp.bfloat16), S((k, n), jnp.int4)],
          dict(w_scale=S((k // 128, n), jnp.float32),
               w_zero=S((k // 128, n), jnp.int4))),
      "int4_nk": (functools.partial(pk.quantized_matmul, weight_only=True,
                                    weight_layout="nk"),
                  [S((m, k), jnp.bfloat16), S((n, k), jnp.int4)],
                  dict(w_scale=S((n,), jnp.float32))),
      "fp8_fp8": (pk.quantized_matmul,
                  [S((256, k), jnp.float8_e4m3fn),
                   S((k, n), jnp.float8_e4m3fn)],
                  dict(x_scale=S((256,), jnp.float32),
                       w_scale=S((n,), jnp.float32))),
      "fp8_grouped": (functools.partial(
          pk.quantized_matmul, group_size=128, weight_only=True),
          [S((m, k), jnp.bfloat16), S((k, n), jnp.float8_e4m3fn)],
          dict(w_scale=S((k // 128, n), jnp.float32))),
  }
  fn, args, kw = calls[call]
  names = list(kw)
  lowered = _compat.lower_for_cuda(
      lambda *a: fn(*a[:2], **dict(zip(names, a[2:]))), *args, *kw.values())
  text = lowered.as_text()
  assert "triton" in text.lower() and '"quantized_matmul_' in text


# ----------------------------------------------------------------------------
# Public API: errors, empties, gradients


def test_empty_dimensions():
  for m, k, n in [(0, 64, 8), (4, 64, 0), (4, 0, 8)]:
    x = jnp.zeros((m, k), jnp.bfloat16)
    w = jnp.zeros((k, n), jnp.int4)
    bias = jnp.arange(n, dtype=jnp.float32)
    out = pk.quantized_matmul(x, w, bias=bias, weight_only=True,
                              out_dtype=jnp.float32, backend="interpret")
    assert out.shape == (m, n)
    np.testing.assert_array_equal(np.asarray(out),
                                  np.broadcast_to(bias, (m, n)))


XB = jnp.zeros((4, 64), jnp.bfloat16)
W4 = jnp.zeros((64, 6), jnp.int4)
X8 = jnp.zeros((4, 64), jnp.int8)
W8 = jnp.zeros((64, 6), jnp.int8)
# quantized x with groups of 32 (2 groups), kn tables
Q8 = dict(x=X8, w=W8, weight_only=False, group_size=32)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(w=jnp.zeros((64, 6), jnp.bfloat16)), TypeError,
     "w must be int8, int4, float8_e4m3fn or float8_e5m2"),
    (dict(x=jnp.zeros((4, 64), jnp.int4)), TypeError, "x must be bfloat16"),
    (dict(weight_only=False), ValueError, "int4 w with float x needs "
     "weight_only=True"),
    (dict(group_size=48), ValueError, r"group_size=48 needs w_scale of shape "
     r"\(2, 6\)"),
    (dict(group_size=0), ValueError, "group_size must be a positive int"),
    (dict(group_size=32), ValueError, r"group_size=32 needs w_scale of shape "
     r"\(2, 6\)"),
    (dict(group_size=32, w_scale=jnp.ones((6, 2))), ValueError,
     r"w_scale has shape \(6, 2\); expected \(2, 6\)"),
    (dict(w_zero=jnp.zeros((2, 6))), ValueError, "w_zero needs w_scale"),
    (dict(group_size=32, w_scale=jnp.ones((2, 6)),
          w_zero=jnp.zeros((2, 6), jnp.bool_)), TypeError,
     "w_zero must be an integer or float"),
    (dict(w=jnp.zeros((64, 6), jnp.float8_e4m3fn), group_size=32,
          w_scale=jnp.ones((2, 6)), w_zero=jnp.zeros((2, 6))), ValueError,
     "w_zero is for int8 and int4"),
    (dict(x=jnp.zeros((4, 64), jnp.int8), weight_only=False), TypeError,
     "int8 x needs int8 w"),
    (dict(x=jnp.zeros((4, 64), jnp.float8_e4m3fn), weight_only=False),
     TypeError, "float8_e4m3fn x needs fp8 w"),
    (dict(x=jnp.zeros((4, 64), jnp.int8)), ValueError,
     "weight_only=True needs float x"),
    (dict(x_scale=jnp.ones((4,))), ValueError, "x_scale is only for "
     "quantized x"),
    (dict(w_scale=jnp.ones((5,))), ValueError, "w_scale has shape"),
    (dict(w=jnp.zeros((63, 6), jnp.int4)), ValueError,
     r"x's last dimension \(64\)"),
    (dict(weight_layout="kn_t"), ValueError, "weight_layout must be"),
    (dict(weight_only="yes"), TypeError, "weight_only must be a bool"),
    (dict(out_dtype=jnp.int32), ValueError, "out_dtype=int32 is only"),
    (dict(out_dtype=jnp.int8), TypeError, "quantized_matmul: out_dtype must "
     "be int32 or a float"),
    (dict(block_sizes="v9"), ValueError, "quantized_matmul: block_sizes='v9'"),
    (dict(backend="tpu"), ValueError, "backend='tpu' is not one of"),
    # quantized x with group scales
    (dict(Q8, w_scale=jnp.ones((2, 6)), x_scale=jnp.ones((4, 3))),
     ValueError, r"x_scale has shape \(4, 3\); expected a scalar, "
     r"x.shape\[:-1\] = \(4,\) or \(4, 1\), or \(4, 2\) = "
     r"x.shape\[:-1\] \+ \(ceil\(K / group_size\),\)"),
    (dict(Q8, group_size=48, w_scale=jnp.ones((1, 6))), ValueError,
     r"w_scale has shape \(1, 6\); expected \(2, 6\) = \[ceil\(K / "
     r"group_size\), N\]"),
    (dict(Q8, w_scale=jnp.ones((6, 2))), ValueError,
     r"w_scale has shape \(6, 2\); expected \(2, 6\) = \[ceil\(K / "
     r"group_size\), N\]"),
    (dict(Q8, w=jnp.zeros((6, 64), jnp.int8), weight_layout="nk",
          w_scale=jnp.ones((2, 6))), ValueError,
     r"w_scale has shape \(2, 6\); expected \(6, 2\) = \[N, ceil\(K / "
     r"group_size\)\] for weight_layout='nk'"),
    (dict(Q8), ValueError, r"group_size=32 needs w_scale of shape \(2, 6\)"),
    (dict(Q8, w_scale=jnp.ones((2, 6)), w_zero=jnp.zeros((2, 6), jnp.int8)),
     ValueError, "w_zero is for weight-only calls"),
    (dict(x=X8, w=W8, weight_only=False, x_scale=jnp.ones((4, 2))),
     ValueError, r"x_scale has shape \(4, 2\); expected a scalar"),
    (dict(Q8, w=jnp.zeros((64, 6), jnp.float8_e4m3fn),
          w_scale=jnp.ones((2, 6))), TypeError, "int8 x needs int8 w"),
])
def test_bad_inputs_raise_naming_the_argument(kwargs, error, match):
  kwargs = dict(kwargs)
  x = kwargs.pop("x", XB)
  w = kwargs.pop("w", W4)
  kwargs.setdefault("weight_only", True)
  with pytest.raises(error, match=match):
    pk.quantized_matmul(x, w, **kwargs)


def test_int8_group_products_bound_the_group_not_k():
  """Each group's int32 sum is exact up to MAX_INT8_K products: K may pass
  it with groups, a group may not."""
  k = 262144
  x = jax.ShapeDtypeStruct((1, k), jnp.int8)
  w = jax.ShapeDtypeStruct((k, 8), jnp.int8)
  out = jax.eval_shape(lambda x_, w_: pk.quantized_matmul(
      x_, w_, w_scale=jnp.ones((k // 128, 8)), group_size=128), x, w)
  assert out.shape == (1, 8)
  with pytest.raises(ValueError, match="group_size=131072 exceeds 131071"):
    jax.eval_shape(lambda x_, w_: pk.quantized_matmul(
        x_, w_, w_scale=jnp.ones((2, 8)), group_size=131072), x, w)


def test_fp8_x_int8_k_bound():
  x = jax.ShapeDtypeStruct((1, 131072), jnp.int8)
  w = jax.ShapeDtypeStruct((131072, 1), jnp.int8)
  with pytest.raises(ValueError, match="K=131072 exceeds 131071"):
    jax.eval_shape(pk.quantized_matmul, x, w)
  xf = jax.ShapeDtypeStruct((1, 131072), jnp.float8_e4m3fn)
  wf = jax.ShapeDtypeStruct((131072, 1), jnp.float8_e4m3fn)
  assert jax.eval_shape(pk.quantized_matmul, xf, wf).shape == (1, 1)


@pytest.mark.parametrize("backend", backends.params(
    ["interpret", "triton", "reference"]))
def test_differentiable_in_x_and_bias_through_the_kernels(backend, rng):
  """Weight-only calls differentiate in x and bias (the tangent is plain
  JAX): dx = dy @ w_deq.T, dbias = sum of dy, against float64 numpy."""
  case = Case("int4", (6, 64), 48, x_dtype="float32", group_size=32,
              zero=True, extras=("bias",), out_dtype="float32")
  x, w, kw = case.inputs(rng)
  dy = rng.standard_normal((6, 48))

  def loss(x_, b_):
    out = backend.run(pk.quantized_matmul, x_, jnp.asarray(w),
                      w_scale=jnp.asarray(kw["w_scale"]),
                      w_zero=jnp.asarray(kw["w_zero"]), bias=b_,
                      **case.options())
    return jnp.sum(out * jnp.asarray(dy, jnp.float32))

  dx, db = jax.grad(loss, argnums=(0, 1))(jnp.asarray(x),
                                          jnp.asarray(kw["bias"]))
  w_deq = oracle.dequantized_weight(w, kw["w_scale"], kw["w_zero"], 32,
                                    "float32")
  np.testing.assert_allclose(np.asarray(dx), dy @ w_deq.T, rtol=1e-5,
                             atol=1e-5 * np.abs(dy).sum(1).max())
  # dy is rounded to float32 and summed in float32: 1e-6 of sum |dy|.
  np.testing.assert_allclose(np.asarray(db), dy.sum(0), rtol=0,
                             atol=1e-6 * np.abs(dy).sum(0).max())


@pytest.mark.parametrize("op", ["quantized_matmul", "int8_matmul"])
def test_gradient_of_the_quantized_weight_names_it(op):
  """What used to fail inside the kernel ("Linearization failed") is a
  TypeError naming the operand: scales from quantizing a float weight in the
  loss, an fp8 w, a dynamically quantized x."""
  fn = getattr(pk, op)
  x = jnp.ones((2, 64), jnp.float32)
  wf = jnp.linspace(-1, 1, 64 * 4).reshape(64, 4)
  quantize = (lambda w: pk.quantize(w, jnp.int8, axis=0)) if op == \
      "quantized_matmul" else (lambda w: pk.quantize_int8(w, axis=0))

  def through_scales(w):
    q, s = quantize(w)
    return fn(x, q, w_scale=s.reshape(-1), weight_only=True).sum()
  with pytest.raises(TypeError, match="with respect to w_scale"):
    jax.grad(through_scales)(wf)
  with pytest.raises(TypeError, match="with respect to x: float x is "
                     "quantized per row"):
    jax.grad(lambda x_: fn(x_, quantize(wf)[0]).astype(jnp.float32).sum())(x)
  if op == "quantized_matmul":
    w8 = jnp.ones((64, 4), jnp.float8_e4m3fn)
    with pytest.raises(TypeError, match="with respect to w: w is a "
                       "quantized weight"):
      jax.grad(lambda w_: fn(x, w_, weight_only=True).sum())(w8)


@pytest.mark.slow
def test_main_job_cases_match_reference():
  from pallas_kernels.quant import cases
  listed = cases.main_job_cases("small")
  assert {c.op for c in listed} == {"quantized_matmul", "quantize",
                                    "quantized_dense"}
  with force_interpret("generic"):
    for case in listed:
      out = jax.jit(functools.partial(case.fn, backend="interpret"))(*case.args)
      ref = jax.jit(functools.partial(case.fn, backend="reference"))(*case.args)
      assert case.error(out, ref) <= case.tolerance, case.shape


@pytest.mark.parametrize("case", [
    Case("int8", (300, 512), 384),                       # int8 kernel
    Case("int4", (300, 512), 384, group_size=128, zero=True),
    Case("float8_e4m3fn", (300, 512), 384, kind="dequant",
         x_dtype="float8_e4m3fn", extras=("x_scale", "w_scale")),
    Case("int8", (300, 512), 384, kind="dequant", x_dtype="int8",
         group_size=128, extras=("x_scale_g",)),
], ids=str)
def test_tpu_grids_split_rows_and_columns_across_cores(monkeypatch, case, rng):
  # Megacore chips (v4, v5p) split "parallel" grid axes between their two
  # cores; K carries the running sum, so it must stay "arbitrary".
  launches = []
  pallas_call = _compat.pallas_call

  def recording(kernel, **kwargs):
    launches.append(kwargs)
    return pallas_call(kernel, **kwargs)
  monkeypatch.setattr(_compat, "pallas_call", recording)
  x, w, kw = case.inputs(rng)
  with force_interpret("generic"):   # the TPU kernel, traced only
    jax.eval_shape(lambda: pk.quantized_matmul(
        jnp.asarray(x), jnp.asarray(w),
        **{k: jnp.asarray(v) for k, v in kw.items()}, **case.options()))
  assert launches   # the op traces its kernel (once per trace of the op)
  for launch in launches:
    assert len(launch["grid"]) == 3 and launch["grid"][0] > 1
    assert launch["compiler_params"].dimension_semantics == (
        "parallel", "parallel", "arbitrary")


# ----------------------------------------------------------------------------
# What quantize returns goes into quantized_matmul unchanged


def _dequantized(q, scale, zero, axis, group_size):
  """float64 (q - zero) * scale, scale and zero (one value per group of
  ``group_size`` along ``axis``, the last group partial) repeated along it."""
  length = q.shape[axis]

  def spread(a):
    a = np.asarray(a, np.float64)
    return np.repeat(a, group_size, axis=axis).take(range(length), axis=axis)
  q = np.asarray(q).astype(np.float64)
  zero = 0.0 if zero is None else spread(np.asarray(zero).astype(np.float64))
  return (q - zero) * spread(scale)


def _assert_product(out, x_deq, w_deq):
  """out (float32) = x_deq @ w_deq ([K, N], float64) within (K + 8) float32
  roundings of |x_deq| @ |w_deq| (the float32 sums and epilogue)."""
  want = x_deq @ w_deq
  bound = (w_deq.shape[0] + 8) * 2.0**-24 * (np.abs(x_deq) @ np.abs(w_deq))
  got = np.asarray(out, np.float64).reshape(-1, want.shape[1])
  assert got.shape == want.shape and np.all(np.isfinite(got))
  excess = np.abs(got - want) - bound
  assert np.all(excess <= 0), f"max excess {excess.max():.3g}"


def _round_trip_params():
  for fmt in ("int8", "int4", "float8_e4m3fn", "float8_e5m2"):
    integer = fmt in ("int8", "int4")
    for mode in ("weight_only", "dynamic", "dequant"):
      if fmt == "int4" and mode != "weight_only":
        continue  # int4 w multiplies float x only
      for symmetric in (True, False) if integer else (True,):
        for group_size in (None, 16):
          if mode == "dynamic" and group_size:
            continue  # float x is quantized per row only
          for layout in ("kn", "nk"):
            yield pytest.param(
                fmt, mode, symmetric, group_size, layout,
                id=f"{fmt}-{mode}-{'sym' if symmetric else 'asym'}-"
                   f"g{group_size}-{layout}")


@pytest.mark.parametrize("fmt,mode,symmetric,group_size,layout",
                         list(_round_trip_params()))
def test_quantize_outputs_go_in_unchanged(fmt, mode, symmetric, group_size,
                                          layout, rng):
  """quantize(w, dtype, axis=<K's axis>, group_size=g, symmetric=...)'s
  (q, scale[, zero]) pass as w, w_scale[, w_zero] as they come, in both
  layouts ([K, N] scale tables along axis 0, [N, K] along axis 1), and
  quantize(x, ...)'s (q, scale) as x, x_scale; the product is the float64
  one of the dequantized operands. Asymmetric w with quantized x is refused
  naming w_zero (zero points are for weight-only calls)."""
  m_shape, k, n = (2, 3), 40, 7   # g = 16: the last group holds 8
  dtype = JNP_DTYPES[fmt]
  k_axis = 0 if layout == "kn" else 1
  w_float = rng.standard_normal((k, n) if layout == "kn" else (n, k))
  x = (rng.standard_normal(m_shape + (k,))
       * rng.uniform(0.1, 10, m_shape + (1,))).astype(np.float32)

  def quantize_and_multiply(w_float, x):  # one jit: one compile per case
    w_out = pk.quantize(w_float, dtype, axis=k_axis, group_size=group_size,
                        symmetric=symmetric)
    kw = dict(w_scale=w_out[1], w_zero=None if symmetric else w_out[2])
    x_out = (x,)
    if mode == "dequant":
      x_out = pk.quantize(x, dtype, axis=-1, group_size=group_size)
      kw["x_scale"] = x_out[1]
    out = pk.quantized_matmul(x_out[0], w_out[0], **kw,
                              group_size=group_size,
                              weight_only=mode == "weight_only",
                              weight_layout=layout, out_dtype=jnp.float32)
    return out, w_out, x_out

  run = jax.jit(quantize_and_multiply)
  args = (jnp.asarray(w_float, jnp.float32), jnp.asarray(x))
  if not symmetric and mode != "weight_only":
    with pytest.raises(ValueError, match="w_zero is for weight-only calls"):
      run(*args)
    return
  out, w_out, x_out = run(*args)
  w_deq = _dequantized(w_out[0], w_out[1], None if symmetric else w_out[2],
                       k_axis, group_size or k)
  w_deq = w_deq if layout == "kn" else w_deq.T
  if mode == "weight_only":
    x_deq = x.astype(np.float64)
  elif mode == "dynamic":  # x quantized per row into w's format
    x_deq = _dequantized(*oracle.quantize(x, fmt, axis=-1), None, -1, k)
  else:
    x_deq = _dequantized(*x_out, None, -1, group_size or k)
  assert out.shape == m_shape + (n,)
  _assert_product(out, x_deq.reshape(-1, k), w_deq)


@pytest.mark.parametrize("mode", ["weight_only", "dynamic", "dequant"])
@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_quantize_int8_outputs_go_into_int8_matmul(mode, layout, rng):
  """quantize_int8(w, axis=<K's axis>)'s scale ([1, N] for "kn", [N, 1]
  for "nk") and quantize_int8(x)'s [..., 1] pass as they come."""
  k, n = 37, 9
  k_axis = 0 if layout == "kn" else 1
  w_float = rng.standard_normal((k, n) if layout == "kn" else (n, k))
  x = rng.standard_normal((5, k)).astype(np.float32)

  @jax.jit
  def quantize_and_multiply(w_float, x):
    wq, ws = pk.quantize_int8(w_float, axis=k_axis)
    x_out = pk.quantize_int8(x) if mode == "dequant" else (x, None)
    out = pk.int8_matmul(x_out[0], wq, x_scale=x_out[1], w_scale=ws,
                         weight_only=mode == "weight_only",
                         weight_layout=layout, out_dtype=jnp.float32)
    return out, (wq, ws), x_out

  out, w_out, x_out = quantize_and_multiply(
      jnp.asarray(w_float, jnp.float32), jnp.asarray(x))
  w_deq = _dequantized(*w_out, None, k_axis, k)
  w_deq = w_deq if layout == "kn" else w_deq.T
  if mode == "weight_only":
    x_deq = x.astype(np.float64)
  elif mode == "dynamic":
    x_deq = _dequantized(*oracle.quantize(x, "int8", axis=-1), None, -1, k)
  else:
    x_deq = _dequantized(*x_out, None, -1, k)
  _assert_product(out, x_deq, w_deq)


W_SQUARE = jnp.zeros((6, 6), jnp.int8)


@pytest.mark.parametrize("op,kwargs,match", [
    # a scale per K row (quantized along N) is not a channel scale, even
    # where K == N makes its shape look like [N, 1] / [1, N]
    ("quantized_matmul", dict(w=W4, w_scale=jnp.ones((64, 1))),
     r"w_scale has shape \(64, 1\); expected a scalar, \(6,\) or \(1, 6\) "
     r"\(per output channel: quantize w \[K, N\] along axis=0\)"),
    ("quantized_matmul", dict(w=W_SQUARE, x=jnp.zeros((4, 6)),
                              w_scale=jnp.ones((6, 1))),
     r"w_scale has shape \(6, 1\); expected a scalar, \(6,\) or \(1, 6\)"),
    ("quantized_matmul", dict(w=jnp.zeros((6, 64), jnp.int4),
                              weight_layout="nk", w_scale=jnp.ones((1, 64))),
     r"w_scale has shape \(1, 64\); expected a scalar, \(6,\), \(6, 1\) or "
     r"\(1, 6\) \(per output channel: quantize w \[N, K\] along axis=1\)"),
    ("int8_matmul", dict(w=jnp.zeros((6, 64), jnp.int8), weight_layout="nk",
                         w_scale=jnp.ones((1, 64))),
     r"int8_matmul: w_scale has shape \(1, 64\); expected a scalar, \(6,\), "
     r"\(6, 1\) or \(1, 6\)"),
    ("int8_matmul", dict(w=W8, w_scale=jnp.ones((64, 1))),
     r"int8_matmul: w_scale has shape \(64, 1\)"),
    # per-channel zero points: their shape, their partner, their mode
    ("quantized_matmul", dict(w_scale=jnp.ones(6), w_zero=jnp.zeros((2, 6))),
     r"w_zero has shape \(2, 6\); expected a scalar, \(6,\) or \(1, 6\)"),
    ("quantized_matmul", dict(w_scale=jnp.ones((6, 1)),
                              w_zero=jnp.zeros((1, 6), jnp.int4)),
     r"w_scale has shape \(6, 1\)"),
    ("quantized_matmul", dict(w_zero=jnp.zeros((1, 6), jnp.int4)),
     "w_zero needs w_scale"),
    ("quantized_matmul", dict(w_scale=jnp.ones(6), w_zero=jnp.zeros(6, bool)),
     "w_zero must be an integer or float array"),
    ("quantized_matmul", dict(x=X8, w=W8, weight_only=False,
                              w_scale=jnp.ones(6), w_zero=jnp.zeros(6)),
     "w_zero is for weight-only calls"),
    ("quantized_matmul", dict(w=W8, weight_only=False, w_scale=jnp.ones(6),
                              w_zero=jnp.zeros(6)),
     "w_zero is for weight-only calls"),
    ("quantized_matmul", dict(w=jnp.zeros((64, 6), jnp.float8_e4m3fn),
                              w_scale=jnp.ones(6), w_zero=jnp.zeros(6)),
     "w_zero is for int8 and int4 w"),
])
def test_channel_tables_of_the_wrong_shape_name_it(op, kwargs, match):
  kwargs = dict(kwargs)
  x = kwargs.pop("x", XB)
  w = kwargs.pop("w", W4)
  kwargs.setdefault("weight_only", True)
  with pytest.raises((ValueError, TypeError), match=match):
    getattr(pk, op)(x, w, **kwargs)


def test_channel_zero_points_with_empty_k():
  """K = 0: the zero points shift no products; the result is the bias."""
  out = pk.quantized_matmul(jnp.zeros((3, 0)), jnp.zeros((0, 5), jnp.int4),
                            w_scale=jnp.ones((1, 5)),
                            w_zero=jnp.ones((1, 5), jnp.int4),
                            bias=jnp.arange(5.0), weight_only=True,
                            out_dtype=jnp.float32)
  np.testing.assert_array_equal(np.asarray(out),
                                np.broadcast_to(np.arange(5.0), (3, 5)))
