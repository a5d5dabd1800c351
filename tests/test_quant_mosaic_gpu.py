"""The Mosaic GPU (Hopper) 8-bit x 8-bit matmul (``quant.mosaic_gpu``): what
it supports, its tiles, its choice by quantized_matmul's and int8_matmul's
choosers, its lowering for CUDA from this CPU host (the 8-bit wgmma
instructions in the PTX), and its tiling in jax's Mosaic GPU interpreter
(persistent tile walk, warp-specialised pipeline and TMA simulated on the
CPU; the wgmma is a float32 / int32 dot of the same tiles there).

Results are compared with the float64 / exact-integer oracles
(``oracles.quant``, ``oracles.int8``) within their stated bounds. On a
Hopper GPU (tests marked ``gpu``, skipped elsewhere) fp8 sums use the
tensor cores' narrower adds: there the bound is a relative norm error (see
``HARDWARE_FP8_REL``).

Without Mosaic GPU (jax < 0.10, e.g. 0.7.1) ``supports`` must decline and
the choosers take the Triton kernel.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracles import int8 as int8_oracle
from oracles import quant as oracle

import pallas_kernels as pk
from pallas_kernels import _backend, _compat, _mosaic_gpu
from pallas_kernels.quant import int8_api
from pallas_kernels.quant import api as quant_api
from pallas_kernels.quant import mosaic_gpu, operands

INTERPRET = mosaic_gpu.interpret_params()
MISSING = mosaic_gpu.api_missing()
needs_api = pytest.mark.skipif(MISSING is not None,
                               reason="no Mosaic GPU Pallas API in this jax")
needs_interpreter = pytest.mark.skipif(
    MISSING is not None or INTERPRET is None,
    reason="this jax has no Mosaic GPU Pallas interpreter")
needs_hopper = pytest.mark.skipif(
    MISSING is not None or not _mosaic_gpu.is_hopper(),
    reason="needs a Hopper GPU")
E4, E5, I8 = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.int8
# Hopper's fp8 wgmma adds with fewer bits than float32 (measured on an
# H100: 3.4e-4 at K = 512, 2.1e-3 at K = 8192, as cuBLAS fast accumulation).
HARDWARE_FP8_REL = 4e-3


def _sds(shape, dtype):
  return jax.ShapeDtypeStruct(shape, dtype)


def _supports(m=256, k=512, n=256, x=E4, w=E4, mode="dequant",
              out_dtype=jnp.bfloat16, tiles=None):
  return mosaic_gpu.supports(_sds((m, k), x), _sds((n, k), w), mode=mode,
                             out_dtype=out_dtype, tiles=tiles)


# ------------------------------------------------------------- supports --

def test_supports_declines_what_it_does_not_implement():
  if MISSING is not None:
    assert isinstance(_supports(), str)
    return
  assert _supports() is None
  assert _supports(x=E5, w=E4) is None  # mixed fp8 formats
  assert _supports(x=I8, w=I8) is None
  assert _supports(x=I8, w=I8, mode="raw", out_dtype=None) is None
  assert _supports(x=jnp.bfloat16, w=I8, mode="dynamic") is None
  assert "weight_only" in _supports(x=jnp.bfloat16, mode="weight_only")
  assert "int8 x float8" in _supports(x=I8, w=E4)
  assert "float8_e4m3fn x int8" in _supports(x=E4, w=I8)
  assert "M, K, N > 0" in _supports(m=0)
  assert "M, K, N > 0" in _supports(k=0)
  big = mosaic_gpu.Tiles(stages=8)
  assert "shared memory" in _supports(tiles=big)


@pytest.mark.parametrize("field, value", [
    ("block_m", 64), ("block_n", 320), ("block_n", 100), ("tile_k", 64),
    ("stages", 1), ("minor", "k"), ("snake", 0), ("ctas", 0)])
def test_bad_tiles_raise_naming_the_field(field, value):
  tiles = mosaic_gpu.Tiles(**{field: value})
  with pytest.raises(ValueError, match=field):
    tiles.check()
  if MISSING is None:
    assert field in _supports(tiles=tiles)


def test_256x256_tiles_exceed_the_registers():
  with pytest.raises(ValueError, match="64x256"):
    mosaic_gpu.Tiles(block_m=256, block_n=256).check()


def test_tiles_narrow_where_wide_tiles_leave_sms_idle():
  sms = mosaic_gpu.num_sms()
  wide, narrow = mosaic_gpu.DEFAULT_TILES, mosaic_gpu.NARROW_TILES
  assert mosaic_gpu.tiles_for(8192, 8192) == wide
  # 2 x 56 tiles of 128 x 256 fill the SMs; 2 x 32 do not
  assert (2 * 56 >= mosaic_gpu.FILL_FRACTION * sms
          and mosaic_gpu.tiles_for(256, 14336) == wide)
  assert (2 * 32 < mosaic_gpu.FILL_FRACTION * sms
          and mosaic_gpu.tiles_for(256, 8192) == narrow)
  for t in (wide, narrow):  # both fit the H100's shared memory
    assert mosaic_gpu.smem_bytes(t.check()) <= (
        mosaic_gpu.SMEM_BYTES)


# -------------------------------------------------------------- lowering --

@needs_api
@pytest.mark.parametrize("x, w, mode, out_dtype, layout, ptx", [
    (E4, E4, "dequant", jnp.bfloat16, "nk", "f32.e4m3.e4m3"),
    (E5, E4, "dequant", jnp.float32, "kn", "f32.e5m2.e4m3"),
    (I8, I8, "raw", None, "nk", "s32.s8.s8"),
])
def test_lowers_to_8bit_wgmma_for_cuda_on_a_cpu_host(x, w, mode, out_dtype,
                                                     layout, ptx):
  """The Pallas -> Mosaic GPU lowering runs here down to the PTX text of
  the wgmma (operand formats, int32 or float32 accumulator)."""
  m, k, n = 1000, 520, 700
  scaled = mode == "dequant"
  w_shape = (n, k) if layout == "nk" else (k, n)

  def fn(x_, w_, xs, ws, b):
    return mosaic_gpu.matmul(x_, w_, xs if scaled else None,
                             ws if scaled else None, b if scaled else None,
                             mode=mode, out_dtype=out_dtype, w_layout=layout)
  args = (_sds((m, k), x), _sds(w_shape, w), _sds((m, 1), jnp.float32),
          _sds((1, n), jnp.float32), _sds((1, n), jnp.float32))
  out = jax.eval_shape(fn, *args)
  assert out.shape == (m, n)
  assert out.dtype == (jnp.int32 if mode == "raw" else out_dtype)
  text = _compat.lower_for_cuda(fn, *args).as_text()
  # few output tiles: NARROW_TILES, a 64 x 128 wgmma per warpgroup
  assert "wgmma.mma_async.sync.aligned.m64n128k32." + ptx in text


# -------------------------------------------------------------- choosers --

def _quant_pick(m, x=E4, w=E4, backend=None, block_sizes=None,
                weight_only=False):
  picked = []

  def pick(x_, w_, xs, ws):  # traced: operands normalizes arrays
    call = operands.matmul_call(x_, w_, x_scale=xs, w_scale=ws,
                                weight_only=weight_only, weight_layout="nk")
    blocks, generation = int8_api.as_block_sizes(block_sizes)
    rows = quant_api._kernels(call, blocks, generation)
    picked.append(_backend.choose("quantized_matmul", backend, rows,
                                  platform="cuda")[0].name)
  quantized_x = jnp.dtype(x) in (jnp.dtype(E4), jnp.dtype(E5), jnp.dtype(I8))
  jax.eval_shape(pick, _sds((m, 512), x), _sds((256, 512), w),
                 _sds((m,), jnp.float32) if quantized_x else None,
                 _sds((256,), jnp.float32))
  return picked[0]


def _int8_pick(m, backend=None, mode="dequant", block_sizes=None):
  static = dict(mode=mode, out_dtype=jnp.bfloat16, w_layout="nk")
  x = _sds((m, 512), jnp.float32 if mode == "dynamic" else I8)
  rows = int8_api._matmul_kernels(x, _sds((256, 512), I8), None, static,
                                  block_sizes, None)
  return _backend.choose("int8_matmul", backend, rows, platform="cuda")[0].name


def test_choosers_take_it_on_hopper_in_its_m_range():
  with _backend.target_override(gpu_capability="8.0"):
    assert _quant_pick(1024) == "triton"  # an Ampere target
    assert _int8_pick(1024) == "triton"
    reason = MISSING or "needs a Hopper GPU"
    with pytest.raises(ValueError, match=re.escape(reason)):
      _quant_pick(1024, backend="mosaic_gpu")
  with _backend.target_override(gpu_capability="9.0"):
    if MISSING is not None:
      assert _quant_pick(1024) == _int8_pick(1024) == "triton"
      return
    low = mosaic_gpu.AUTO_MIN_M["int8"]
    assert mosaic_gpu.AUTO_MIN_M["float8"] == 1
    for m in (1, 16, 8192):
      assert _quant_pick(m) == _quant_pick(m, x=E5) == "mosaic_gpu"
    assert _quant_pick(1024, x=jnp.bfloat16) == "mosaic_gpu"  # dynamic
    assert _quant_pick(1024, backend="gpu") == "mosaic_gpu"
    assert _quant_pick(1024, block_sizes=(64, 64, 64)) == "triton"
    for mode in ("dequant", "raw", "dynamic"):
      assert _int8_pick(low, mode=mode) == "mosaic_gpu"
      assert _int8_pick(low - 1, mode=mode) == "triton"
    assert _quant_pick(low, x=I8, w=I8) == "mosaic_gpu"
    assert _quant_pick(low - 1, x=I8, w=I8) == "triton"
    with pytest.raises(ValueError, match=rf"M={low - 1} is below {low}"):
      _int8_pick(low - 1, backend="mosaic_gpu")
    # weight-only calls keep the weight-only kernel's M range
    assert _quant_pick(4096, x=jnp.bfloat16, weight_only=True) == "triton"


@needs_api
def test_public_calls_lower_to_the_8bit_kernel_for_a_hopper_target():
  def lowered():  # a fresh function each time: no cached trace
    fp8 = lambda x, w, s: pk.quantized_matmul(x, w, x_scale=s)  # noqa: E731
    args = (_sds((64, 256), E4), _sds((256, 128), E4),
            _sds((64,), jnp.float32))
    return _compat.lower_for_cuda(fp8, *args).as_text()
  with _backend.target_override(gpu_capability="9.0"):
    assert "f32.e4m3.e4m3" in lowered()
  with _backend.target_override(gpu_capability="8.0"):
    assert "wgmma" not in lowered()


# ------------------------------------------------- interpreter semantics --

def _fp8_inputs(rng, m, k, n, x_dtype, w_dtype, layout):
  x = np.asarray(jnp.asarray(rng.standard_normal((m, k)) * 3, x_dtype))
  w_shape = (n, k) if layout == "nk" else (k, n)
  w = np.asarray(jnp.asarray(rng.standard_normal(w_shape) * 3, w_dtype))
  return x, w


def _vectors(rng, m, n, which):
  make = {"x_scale": lambda: rng.uniform(0.5, 2, (m, 1)),
          "w_scale": lambda: rng.uniform(1e-3, 2e-3, (1, n)),
          "bias": lambda: rng.standard_normal((1, n))}
  return {name: make[name]().astype(np.float32) for name in which}


def _run(x, w, vectors, mode, out_dtype, layout, tiles, interpret):
  get = lambda name: (None if name not in vectors  # noqa: E731
                      else jnp.asarray(vectors[name]))
  return mosaic_gpu.matmul(jnp.asarray(x), jnp.asarray(w), get("x_scale"),
                           get("w_scale"), get("bias"), mode=mode,
                           out_dtype=out_dtype, w_layout=layout, tiles=tiles,
                           interpret=interpret)


def _oracle_vectors(vectors):
  return {k: v.reshape(-1) if k != "x_scale" else v
          for k, v in vectors.items()}


FP8_CASES = [
    # ragged M, N, K; two N tiles; 2 CTAs walk 4 tiles (m-minor snake)
    (130, 200, 72, E4, E4, "nk", ("x_scale", "w_scale", "bias"),
     jnp.float32, dict(block_n=64, stages=2, ctas=2)),
    # mixed formats, w [K, N], bf16 out, n-minor walk, one CTA
    (60, 300, 130, E5, E4, "kn", ("w_scale",), jnp.bfloat16,
     dict(block_n=128, stages=3, minor="n", snake=1, ctas=1)),
]


@needs_interpreter
@pytest.mark.parametrize("case", range(len(FP8_CASES)))
def test_fp8_matches_float64(rng, case):
  m, k, n, xd, wd, layout, which, out_dtype, tiles = FP8_CASES[case]
  x, w = _fp8_inputs(rng, m, k, n, xd, wd, layout)
  vectors = _vectors(rng, m, n, which)
  out = _run(x, w, vectors, "dequant", out_dtype, layout,
             mosaic_gpu.Tiles(**tiles), INTERPRET)
  assert out.dtype == out_dtype and out.shape == (m, n)
  oracle.assert_matmul(out, x, w, jnp.dtype(out_dtype).name, layout=layout,
                       **_oracle_vectors(vectors))


@needs_interpreter
def test_fp8_dynamic_quantizes_rows_into_w_format(rng):
  m, k, n = 70, 256, 64
  x = rng.standard_normal((m, k)).astype(np.float32) * rng.uniform(
      0.1, 10, (m, 1)).astype(np.float32)
  _, w = _fp8_inputs(rng, m, k, n, E4, E4, "nk")
  vectors = _vectors(rng, m, n, ("w_scale",))
  out = _run(x, w, vectors, "dynamic", jnp.float32, "nk",
             mosaic_gpu.Tiles(block_n=64, stages=2), INTERPRET)
  oracle.assert_matmul(out, x, w, "float32", layout="nk",
                       **_oracle_vectors(vectors))


@needs_interpreter
@pytest.mark.parametrize("m, k, n, layout, which, mode, out_dtype, tiles", [
    # raw int32, exact; 2 x 2 tiles of 128 x 64 over 3 CTAs
    (200, 384, 100, "nk", (), "raw", None, dict(block_n=64, stages=2,
                                                ctas=3)),
    # dequant epilogue, w [K, N], block_m 256 (two 128-row warpgroups)
    (20, 128, 64, "kn", ("x_scale", "w_scale", "bias"), "dequant",
     jnp.float32, dict(block_m=256, block_n=64, stages=2)),
])
def test_int8_matches_exact_oracle(rng, m, k, n, layout, which, mode,
                                   out_dtype, tiles):
  x = rng.integers(-128, 128, (m, k)).astype(np.int8)
  w = rng.integers(-128, 128, (n, k) if layout == "nk" else (k, n)).astype(
      np.int8)
  vectors = _vectors(rng, m, n, which)
  out = _run(x, w, vectors, mode, out_dtype, layout,
             mosaic_gpu.Tiles(**tiles), INTERPRET)
  expected = "int32" if mode == "raw" else jnp.dtype(out_dtype).name
  assert jnp.dtype(out.dtype) == expected
  int8_oracle.assert_int8_matmul(out, x, w, expected, weight_layout=layout,
                                 **_oracle_vectors(vectors))


@needs_interpreter
def test_int8_matmul_public_call_runs_it(rng):
  """int8_matmul(backend="mosaic_gpu") at the chooser's smallest M."""
  m, k, n = mosaic_gpu.AUTO_MIN_M["int8"], 128, 64
  x = rng.integers(-128, 128, (m, k)).astype(np.int8)
  w = rng.integers(-128, 128, (n, k)).astype(np.int8)
  with _backend.force_interpret("generic"):
    out = pk.int8_matmul(jnp.asarray(x), jnp.asarray(w), weight_layout="nk",
                         backend="mosaic_gpu")
  int8_oracle.assert_int8_matmul(out, x, w, "int32", weight_layout="nk")


# --------------------------------------------------- on a Hopper GPU only --

@needs_hopper
@pytest.mark.parametrize("m, k, n, xd, layout, tiles", [
    (300, 520, 700, E4, "nk", None),
    (1000, 1024, 520, E5, "kn", dict(block_m=256, block_n=128)),
    (2048, 4096, 2048, E4, "nk", None),
    (7, 128, 64, E4, "nk", None),
])
def test_gpu_fp8_matches_float64(rng, m, k, n, xd, layout, tiles):
  x, w = _fp8_inputs(rng, m, k, n, xd, E4, layout)
  vectors = _vectors(rng, m, n, ("x_scale", "w_scale", "bias"))
  out = np.asarray(_run(x, w, vectors, "dequant", jnp.float32, layout,
                        tiles and mosaic_gpu.Tiles(**tiles), False))
  want, _ = oracle.matmul(x, w, layout=layout, **_oracle_vectors(vectors))
  assert np.isfinite(out).all()
  rel = np.linalg.norm(out - want) / np.linalg.norm(want)
  assert rel < HARDWARE_FP8_REL, rel


@needs_hopper
@pytest.mark.parametrize("m, k, n, layout", [
    (300, 520, 700, "nk"), (1000, 1024, 520, "kn"), (4096, 4096, 4096, "nk")])
def test_gpu_int8_is_exact(rng, m, k, n, layout):
  x = rng.integers(-128, 128, (m, k)).astype(np.int8)
  w = rng.integers(-128, 128, (n, k) if layout == "nk" else (k, n)).astype(
      np.int8)
  out = _run(x, w, {}, "raw", None, layout, None, False)
  int8_oracle.assert_int8_matmul(out, x, w, "int32", weight_layout=layout)
  vectors = _vectors(rng, m, n, ("x_scale", "w_scale", "bias"))
  out = _run(x, w, vectors, "dequant", jnp.float32, layout, None, False)
  int8_oracle.assert_int8_matmul(out, x, w, "float32", weight_layout=layout,
                                 **_oracle_vectors(vectors))
