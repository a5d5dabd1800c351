"""quantize(x, dtype, ...) for int8, int4, float8_e4m3fn and float8_e5m2:
bit-exact against ``oracles.quant`` (numpy; fp8 rounding by ml_dtypes),
round-trip bounds as hypothesis properties, errors, and the TPU kernel row
(symmetric int8 along the last axis)."""
from __future__ import annotations

import backends
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from oracles import quant as oracle

import pallas_kernels as pk

FORMATS = ["int8", "int4", "float8_e4m3fn", "float8_e5m2"]
DTYPES = {"int8": jnp.int8, "int4": jnp.int4,
          "float8_e4m3fn": jnp.float8_e4m3fn, "float8_e5m2": jnp.float8_e5m2}
QMAX = {"int8": 127, "int4": 7, "float8_e4m3fn": 448.0,
        "float8_e5m2": 57344.0}


def special(shape, seed=0):
  """Rows over 6 decades, a zero row, exact ties, NaN and inf rows."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * 10.0 ** np.linspace(-3, 3, shape[0])[:,
                                                                        None]
  x[1] = 0.0
  x[2] = 0.0
  x[2, :5] = [2.5, -2.5, 0.5, 7.0, 127.0]
  x[3, 2] = np.nan
  x[4, 1] = np.inf
  return x.astype(np.float32)


CASES = [  # (x, kwargs)
    (special((12, 64)), dict()),
    (special((12, 64)), dict(group_size=16)),
    (special((12, 64)).T.copy(), dict(axis=0, group_size=32)),
    (special((6, 40)), dict(symmetric=False)),
    (special((6, 40)), dict(symmetric=False, group_size=8)),
    # the last group partial (40 = 3 x 12 + 4), its values all of one sign
    (special((6, 40)), dict(symmetric=False, group_size=12)),
    (np.abs(special((5, 40))).T.copy(), dict(axis=0, group_size=16,
                                             symmetric=False)),
    (special((12, 64)), dict(group_size=24)),
    (np.random.default_rng(1).standard_normal((2, 3, 32)), dict(axis=1)),
    (np.random.default_rng(2).standard_normal((5, 8)), dict(axis=None)),
]


# fp8 is symmetric only (its refusal is in test_bad_inputs).
FORMAT_CASES = [(fmt, i) for fmt in FORMATS for i, (_, kw) in enumerate(CASES)
                if kw.get("symmetric", True) or fmt in ("int8", "int4")]


@pytest.mark.parametrize("fmt,index", FORMAT_CASES)
@pytest.mark.parametrize("backend", backends.params(   # generic: the fallback
    ["interpret", "interpret_generic", "reference"], every_flavour=True))
def test_quantize_matches_oracle(backend, fmt, index):
  x, kwargs = CASES[index]
  kernel_takes = (fmt == "int8" and kwargs.get("axis", -1) in (-1, x.ndim - 1)
                  and "group_size" not in kwargs
                  and kwargs.get("symmetric", True))
  for dtype in ("float32", "bfloat16"):
    xj = jnp.asarray(x, dtype)
    if backend.name == "interpret" and not kernel_takes:
      with pytest.raises(ValueError, match="cannot run this call: the TPU "
                         "kernel quantizes"):
        backend.run(pk.quantize, xj, DTYPES[fmt], **kwargs)
      continue
    got = backend.run(pk.quantize, xj, DTYPES[fmt], **kwargs)
    oracle.assert_quantized(got, np.asarray(xj), fmt, **kwargs)


def test_symmetric_int8_equals_quantize_int8():
  x = jnp.asarray(special((12, 64)))
  for got, want in zip(pk.quantize(x, jnp.int8), pk.quantize_int8(x)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_rounds_and_saturates_as_ml_dtypes(fmt):
  """One scale of exactly 1 (amax = max): q is ml_dtypes' round to nearest
  even of x, subnormals and ties included, and anything beyond the top
  saturates (no NaN for e4m3fn, no inf for e5m2)."""
  top = QMAX[fmt]
  np_dtype = getattr(ml_dtypes, fmt)
  grid = np.asarray(np.arange(256, dtype=np.uint8).view(np_dtype),
                    np.float32)
  grid = np.unique(grid[np.isfinite(grid)])
  mids = (grid[:-1] + grid[1:]) / 2  # exact ties
  rng = np.random.default_rng(0)
  x = np.concatenate([grid, mids, rng.uniform(-top, top, 4000),
                      rng.standard_normal(4000) * 2.0 ** -10]).astype(
                          np.float32)
  x[0] = top  # amax = top: scale exactly 1
  x[1] = -top
  q, scale = pk.quantize(jnp.asarray(x), DTYPES[fmt], axis=None)
  assert float(scale) == 1.0
  np.testing.assert_array_equal(np.asarray(q, np.float32),
                                x.astype(np_dtype).astype(np.float32))
  over = jnp.asarray([top, 3 * top, -5 * top, top * 1.0001], jnp.float32)
  q, scale = pk.quantize(over, DTYPES[fmt], axis=None)
  deq = np.asarray(q, np.float32) * np.asarray(scale)
  assert np.all(np.isfinite(deq)) and np.abs(np.asarray(q, np.float32)).max(
  ) == top


@settings(max_examples=12)
@given(rows=st.integers(1, 6), groups=st.integers(1, 4),
       group=st.sampled_from([1, 8, 32]), fmt=st.sampled_from(FORMATS),
       symmetric=st.booleans(), decades=st.floats(-4, 4),
       seed=st.integers(0, 2**32 - 1))
def test_round_trip_error_is_within_half_a_step(rows, groups, group, fmt,
                                                symmetric, decades, seed):
  """|dequantize(quantize(x)) - x| <= scale / 2 for integers (plus the
  float32 quotient's rounding); for fp8 half the fp8 spacing at x / scale
  (at least the subnormal spacing), times scale."""
  if fmt.startswith("float8"):
    symmetric = True
  rng = np.random.default_rng(seed)
  x = (rng.standard_normal((rows, groups * group)) * 10.0 ** decades).astype(
      np.float32)
  out = pk.quantize(jnp.asarray(x), DTYPES[fmt], group_size=group,
                    symmetric=symmetric)
  q = np.asarray(out[0], np.float64)
  scale = np.repeat(np.asarray(out[1], np.float64), group, axis=1)
  zero = (0.0 if symmetric else
          np.repeat(np.asarray(out[2], np.float64), group, axis=1))
  err = np.abs((q - zero) * scale - x)
  t = np.abs(x) / scale
  if fmt in ("int8", "int4"):
    bound = scale * (0.5 + 2 * (t + 256) * 2.0**-24)
  else:
    mbits, emin = (3, -6) if fmt == "float8_e4m3fn" else (2, -14)
    spacing = np.exp2(np.maximum(np.floor(np.log2(np.maximum(t, 1e-30))),
                                 emin) - mbits)
    bound = scale * (spacing / 2 + 2 * t * 2.0**-24)
  assert np.all(err <= bound), float((err - bound).max())


def test_tpu_kernel_row_takes_symmetric_int8_rows_only():
  x = jnp.asarray(special((8, 32)))
  q, s = pk.quantize(x, jnp.int8, backend="interpret")
  oracle.assert_quantized((q, s), np.asarray(x), "int8")
  with pytest.raises(ValueError, match="symmetric int8 without groups"):
    pk.quantize(x, jnp.int4, backend="mosaic_tpu")
  with pytest.raises(ValueError, match="last axis"):
    pk.quantize(x, jnp.int8, axis=0, backend="mosaic_tpu")
  # backend=None on a CPU: the refused call runs the reference.
  for fmt in ("int4", "float8_e5m2"):
    oracle.assert_quantized(jax.jit(lambda v: pk.quantize(v, DTYPES[fmt]))(x),
                            np.asarray(x), fmt)


def test_empty_inputs():
  for shape, kwargs in [((0, 8), {}), ((4, 0), {}), ((0, 8), dict(
      group_size=4)), ((4, 0), dict(axis=None))]:
    out = pk.quantize(jnp.zeros(shape), jnp.int4, **kwargs)
    assert out[0].shape == shape and out[0].dtype == jnp.int4
    want = oracle.quantize(np.zeros(shape, np.float32), "int4", **kwargs)
    assert out[1].shape == want[1].shape


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(x=jnp.zeros((3, 4), jnp.int8)), TypeError, "x must be bfloat16"),
    (dict(dtype=jnp.int16), TypeError, "dtype must be one of"),
    (dict(dtype="float8_e4m3fnuz"), TypeError, "dtype must be one of"),
    (dict(axis=2), ValueError, "axis=2 is out of range"),
    (dict(axis=1.0), TypeError, "axis must be an int"),
    (dict(group_size=-1), ValueError, "group_size must be a positive int"),
    (dict(axis=None, group_size=2), ValueError, "group_size needs an axis"),
    (dict(dtype=jnp.float8_e5m2, symmetric=False), ValueError,
     "float8_e5m2 is symmetric only"),
    (dict(symmetric=1), TypeError, "symmetric must be a bool"),
    (dict(backend="cuda"), ValueError, "backend='cuda'"),
])
def test_bad_inputs(kwargs, error, match):
  kwargs = dict(kwargs)
  x = kwargs.pop("x", jnp.zeros((3, 4), jnp.float32))
  dtype = kwargs.pop("dtype", jnp.int4)
  with pytest.raises(error, match=match):
    pk.quantize(x, dtype, **kwargs)
