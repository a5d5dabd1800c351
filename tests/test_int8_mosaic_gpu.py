"""The Mosaic GPU (Hopper) weight-only int8 kernel: what it supports, its
plans, its choice by int8_matmul's chooser, its lowering for CUDA from this
CPU host, and its tiling in jax's Mosaic GPU interpreter (warp-specialised
pipeline, barriers and TMA copies simulated on the CPU; the wgmma is a
float32-accumulated dot of the same tiles there). The shared suite in
test_int8_matmul.py runs it through the public call.

Results are compared with ``oracles.int8`` within its stated bound.

Skipped where jax has no Mosaic GPU interpreter (jax < 0.10, e.g. 0.7.1);
there ``supports`` must decline.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracles import int8 as oracle
from oracles import quant as quant_oracle

from pallas_kernels import _backend, _compat
from pallas_kernels.quant import int8_api as api, int8_mosaic_gpu as mosaic_gpu
from pallas_kernels.quant import int8_block_sizes as bs

INTERPRET = mosaic_gpu.interpret_params()
needs_interpreter = pytest.mark.skipif(
    mosaic_gpu.api_missing() is not None or INTERPRET is None,
    reason="this jax has no Mosaic GPU Pallas interpreter")


def _sds(shape, dtype):
  return jax.ShapeDtypeStruct(shape, dtype)


def _supports(m, k, n, *, x_dtype=jnp.bfloat16, mode="weight_only",
              w_layout="nk", x_scale=None, block_sizes=None):
  w_shape = (n, k) if w_layout == "nk" else (k, n)
  return mosaic_gpu.supports(_sds((m, k), x_dtype), _sds(w_shape, jnp.int8),
                             x_scale, mode=mode, w_layout=w_layout,
                             block_sizes=block_sizes)


def _inputs(rng, m, k, n, w_layout="nk"):
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  w_shape = (n, k) if w_layout == "nk" else (k, n)
  w = jnp.asarray(rng.integers(-128, 128, w_shape), jnp.int8)
  w_scale = jnp.asarray(rng.uniform(1e-3, 2e-3, (1, n)), jnp.float32)
  bias = jnp.asarray(rng.standard_normal((1, n)), jnp.float32)
  return x, w, w_scale, bias


def _run(x, w, w_scale, bias, out_dtype, sizes=None, w_layout="nk"):
  return mosaic_gpu.matmul(x, w, None, w_scale, bias, mode="weight_only",
                           out_dtype=out_dtype, w_layout=w_layout,
                           block_sizes=sizes, interpret=INTERPRET)


def _check(got, x, w, w_scale, bias, out_dtype, w_layout="nk"):
  oracle.assert_int8_matmul(got, x, w, jnp.dtype(out_dtype).name,
                            w_scale=w_scale, bias=bias, weight_only=True,
                            weight_layout=w_layout)


# ------------------------------------------------------------- supports --

def test_supports_declines_what_it_does_not_implement():
  if mosaic_gpu.api_missing() is not None:
    assert isinstance(_supports(16, 256, 128), str)
    return
  assert _supports(16, 256, 128) is None
  assert _supports(1, 64, 1) is None
  assert _supports(128, 4096, 14336) is None
  assert _supports(16, 256, 128, w_layout="kn") is None
  cases = [dict(w_layout="tn"), dict(x_dtype=jnp.float32),
           dict(x_dtype=jnp.float16), dict(mode="dequant"),
           dict(x_scale=_sds((16, 1), jnp.float32))]
  for kwargs in cases:
    assert isinstance(_supports(16, 256, 128, **kwargs), str), kwargs
  assert _supports(256, 256, 128) is None
  assert "M <= 256" in _supports(257, 256, 128)
  for w_dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2):
    assert mosaic_gpu.supports(_sds((16, 256), jnp.bfloat16),
                               _sds((128, 256), w_dtype), mode="weight_only",
                               w_layout="nk") is None
  assert "float16" in mosaic_gpu.supports(
      _sds((16, 256), jnp.bfloat16), _sds((128, 256), jnp.float16),
      mode="weight_only", w_layout="nk")
  assert isinstance(_supports(0, 256, 128), str)
  assert isinstance(_supports(16, 0, 128), str)
  too_big = mosaic_gpu.MgpuBlockSizes(tile_k=1024, stages=4)
  assert "shared memory" in _supports(128, 4096, 4096, block_sizes=too_big)


@pytest.mark.parametrize("field, value", [
    ("tile_k", 100), ("tile_k", -64), ("stages", 1), ("max_split", 0),
    ("target_ctas", 0)])
def test_bad_block_sizes_raise(field, value):
  sizes = mosaic_gpu.MgpuBlockSizes(**{field: value})
  with pytest.raises(ValueError, match=field):
    mosaic_gpu.plan(16, 1024, 1024, sizes)
  if mosaic_gpu.api_missing() is None:
    assert field in _supports(16, 1024, 1024, block_sizes=sizes)


def test_plan_split_fills_one_wave_and_fuses_unsplit():
  # 112 column tiles of 128: no split, epilogue in the kernel; 32 tiles:
  # split 4 (128 CTAs <= 132), partials summed by XLA.
  p = mosaic_gpu.plan(16, 4096, 14336)
  assert p.split == 1 and p.fused
  p = mosaic_gpu.plan(16, 14336, 4096)
  assert p.split == 4 and not p.fused
  assert p.steps * p.split * p.sizes.tile_k == p.kp >= 14336
  # never more K pieces than K tiles, nor more than max_split
  assert mosaic_gpu.plan(16, 256, 128).split == 1
  assert mosaic_gpu.plan(
      16, 1 << 16, 128, mosaic_gpu.MgpuBlockSizes(max_split=2)).split == 2
  for m, mp in ((1, 16), (16, 16), (17, 32), (40, 64), (65, 128),
                (128, 128), (129, 192), (192, 192), (193, 256), (256, 256)):
    assert mosaic_gpu.padded_m(m) == mp
    assert mosaic_gpu.plan(m, 512, 200).mp == mp
  for m in (16, 32, 64, 128, 192, 256):  # tables fit the H100's SMEM
    for layout in ("nk", "kn"):
      p = mosaic_gpu.plan(m, 4096, 4096, w_layout=layout)
      assert mosaic_gpu.smem_bytes(p, layout) <= mosaic_gpu.SMEM_BYTES
      assert p.sizes.tile_k % mosaic_gpu.KN_CHUNK == 0  # whole chunks


@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_8bit_table_rows_fit_smem_as_written(layout):
  # A row that only fits after plan drops stages would time another ring.
  for mp, (tile_k, stages) in mosaic_gpu.TILES[8, layout].items():
    p = mosaic_gpu.plan(mp, 8192, 8192, w_layout=layout)
    assert p.mp == mp and (p.sizes.tile_k, p.sizes.stages) == (tile_k, stages)
    assert mosaic_gpu.smem_bytes(p, layout) <= mosaic_gpu.SMEM_BYTES
    assert tile_k % mosaic_gpu.KN_CHUNK == 0 and stages >= 2


def test_plan_pairs_ctas_for_x_multicast_at_mp_128():
  def cluster(m, k, n, layout="kn", bits=8):
    return mosaic_gpu.plan(m, k, n, w_layout=layout, bits=bits).cluster
  assert cluster(16, 4096, 14336) == 1
  assert cluster(64, 4096, 14336) == 1
  assert cluster(128, 4096, 14336) == 2
  assert cluster(256, 8192, 8192) == 2
  assert cluster(128, 14336, 4096) == 2  # split K too
  assert cluster(128, 4096, 14336 - 128) == 1  # odd tiles
  # 8-bit w [N, K] never pairs; int4 [N, K] does
  assert cluster(128, 4096, 14336, "nk") == 1
  assert cluster(256, 8192, 8192, "nk") == 1
  assert cluster(128, 4096, 14336, "nk", bits=4) == 2


@pytest.mark.skipif(mosaic_gpu.api_missing() is not None,
                    reason="no Mosaic GPU Pallas API in this jax")
@pytest.mark.parametrize("m, k, n, w_layout, w_dtype", [
    (16, 4096, 14336, "nk", jnp.int8),   # fused epilogue: scale and bias
    (128, 14336, 4096, "nk", jnp.int8),  # split K, XLA sum
    (100, 256, 512, "nk", jnp.int8),     # fused
    (100, 256, 512, "kn", jnp.int8),     # fused, x pairs
    # w [K, N]: the bf16 conversion buffers and wgmma from shared memory
    (1, 4096, 1024, "kn", jnp.int8),
    (128, 14336, 4096, "kn", jnp.float8_e4m3fn),
    (256, 512, 640, "kn", jnp.float8_e5m2),
])
def test_gpu_kernel_lowers_for_cuda_on_a_cpu_host(m, k, n, w_layout,
                                                   w_dtype):
  """The Pallas -> Mosaic GPU lowering (wgmma, layouts, TMA, the epilogue's
  vector loads) runs here; the interpreter tests skip it. Only the PTX
  compile needs the GPU."""
  fn = lambda x, w, s, b: mosaic_gpu.matmul(  # noqa: E731
      x, w, None, s, b, mode="weight_only", out_dtype=jnp.bfloat16,
      w_layout=w_layout)
  w_shape = (n, k) if w_layout == "nk" else (k, n)
  args = (_sds((m, k), jnp.bfloat16), _sds(w_shape, w_dtype),
          _sds((1, n), jnp.float32), _sds((1, n), jnp.float32))
  assert jax.eval_shape(fn, *args).shape == (m, n)
  text = _compat.lower_for_cuda(fn, *args).as_text()
  assert "mosaic_gpu" in text


# -------------------------------------------------------------- wiring --

def _picked(m, backend=None, block_sizes=None, mode="weight_only",
            w_layout="nk", w_dtype=jnp.int8):
  """The kernel int8_matmul's chooser takes for a CUDA lowering."""
  w_shape = (256, 512) if w_layout == "nk" else (512, 256)
  static = dict(mode=mode, out_dtype=jnp.bfloat16, w_layout=w_layout)
  rows = api._matmul_kernels(_sds((m, 512), jnp.bfloat16),
                             _sds(w_shape, w_dtype), None, static,
                             block_sizes, None)
  return _backend.choose("int8_matmul", backend, rows, platform="cuda")[0].name


def test_chooser_takes_mosaic_only_on_hopper_in_its_m_range():
  with _backend.target_override(gpu_capability="8.0"):
    assert _picked(128) == "triton"  # an Ampere target
    reason = mosaic_gpu.api_missing() or "needs a Hopper GPU"
    with pytest.raises(ValueError, match=re.escape(reason)):
      _picked(128, backend="mosaic_gpu")
  with _backend.target_override(gpu_capability="9.0"):
    if mosaic_gpu.api_missing() is not None:
      assert _picked(128) == "triton"
      return
    low, high = bs.GPU_WEIGHT_ONLY_MOSAIC_AUTO_M
    assert _picked(high) == _picked(low) == "mosaic_gpu"
    assert _picked(high, backend="gpu") == "mosaic_gpu"
    assert _picked(low - 1) == _picked(low - 1, backend="gpu") == "triton"
    with pytest.raises(ValueError, match=rf"M={low - 1} is outside "
                       rf"\[{low}, {high}\], where the Triton kernel"):
      _picked(low - 1, backend="mosaic_gpu")
    assert _picked(128, block_sizes=bs.BlockSizes(16, 64, 64)) == "triton"
    assert _picked(low, w_layout="kn") == "mosaic_gpu"
    assert _picked(low - 1, w_layout="kn") == "triton"
    float8_low, _ = bs.GPU_WEIGHT_ONLY_MOSAIC_AUTO_M_FLOAT8
    assert float8_low == 1
    for layout in ("nk", "kn"):
      assert _picked(1, w_layout=layout,
                     w_dtype=jnp.float8_e4m3fn) == "mosaic_gpu"
    assert _picked(128, mode="dequant") == "triton"


@pytest.mark.skipif(mosaic_gpu.api_missing() is not None,
                    reason="no Mosaic GPU Pallas API in this jax")
def test_public_call_lowers_to_mosaic_gpu_for_a_hopper_target():
  def lowered(m):
    fn = lambda x, w, s: api.int8_matmul(  # noqa: E731
        x, w, w_scale=s, weight_only=True, weight_layout="nk")
    args = (_sds((m, 512), jnp.bfloat16), _sds((256, 512), jnp.int8),
            _sds((256,), jnp.float32))
    return _compat.lower_for_cuda(fn, *args).as_text()
  with _backend.target_override(gpu_capability="9.0"):
    assert "mosaic_gpu" in lowered(128)
    assert "triton" in lowered(16) and "mosaic_gpu" not in lowered(16)
  with _backend.target_override(gpu_capability="8.0"):
    assert "mosaic_gpu" not in lowered(128)  # no Hopper: Triton


# ------------------------------------------------- interpreter semantics --

@needs_interpreter
@pytest.mark.parametrize("m, k, n, out_dtype, sizes", [
    # ragged M, N and K; split K (K 300 -> 3 x 128-wide tiles, split 2)
    (5, 300, 130, jnp.float32, dict(tile_k=128, stages=2)),
    # M padded to 32, bf16 out, split K into 2 x 2 tiles of 64
    (20, 256, 64, jnp.bfloat16, dict(tile_k=64, stages=3)),
    # fused epilogue (no split): scale, bias and cast in the kernel, the
    # accumulator rows stored as output columns; ragged M and N
    (5, 200, 130, jnp.float32, dict(tile_k=128, stages=2, max_split=1)),
    (33, 192, 300, jnp.bfloat16, dict(tile_k=64, stages=3, max_split=1)),
])
def test_matches_float64(rng, m, k, n, out_dtype, sizes):
  x, w, w_scale, bias = _inputs(rng, m, k, n)
  out = _run(x, w, w_scale, bias, out_dtype,
             mosaic_gpu.MgpuBlockSizes(**sizes))
  assert out.dtype == out_dtype
  _check(out, x, w, w_scale, bias, out_dtype)


@needs_interpreter
def test_table_tiles_m128_no_scale_nan_row(rng):
  """The table's M = 128 tiles; no w_scale/bias; a NaN in x poisons only
  its output row."""
  m, k, n = 128, 256, 128
  x, w, _, _ = _inputs(rng, m, k, n)
  x = x.at[7, 3].set(jnp.nan)
  out = np.asarray(_run(x, w, None, None, jnp.float32))
  assert np.isnan(out[7]).all()
  rest = np.delete(np.arange(m), 7)
  _check(out[rest], np.asarray(x)[rest], w, None, None, jnp.float32)


@needs_interpreter
@pytest.mark.parametrize("w_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("m, k, n, sizes", [
    # M padded to 192: three 64-column epilogue stores, fused
    (150, 128, 130, dict(tile_k=64, stages=2, max_split=1)),
    # M padded to 256, split K: four 64-column partial stores per piece
    (256, 256, 64, dict(tile_k=64, stages=2)),
])
def test_float8_weights_and_wide_m_match_float64(rng, w_dtype, m, k, n,
                                                  sizes):
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((n, k)) * 8, w_dtype)
  w_scale = jnp.asarray(rng.uniform(1e-3, 2e-3, (n,)), jnp.float32)
  bias = jnp.asarray(rng.standard_normal((n,)), jnp.float32)
  out = _run(x, w, w_scale, bias, jnp.bfloat16,
             mosaic_gpu.MgpuBlockSizes(**sizes))
  quant_oracle.assert_matmul(out, x, w, "bfloat16", w_scale=w_scale,
                             bias=bias, weight_only=True, layout="nk")


@needs_interpreter
@pytest.mark.parametrize("m, k, n, out_dtype, sizes", [
    # w [K, N]: ragged M, N and K, split K (fused partial sums by XLA)
    (5, 300, 130, jnp.float32, dict(tile_k=128, stages=2)),
    # fused epilogue, two 64-row conversion chunks per slot, ragged N
    (33, 192, 300, jnp.bfloat16, dict(tile_k=128, stages=2, max_split=1)),
])
def test_kn_weights_match_float64(rng, m, k, n, out_dtype, sizes):
  x, w, w_scale, bias = _inputs(rng, m, k, n, w_layout="kn")
  out = _run(x, w, w_scale, bias, out_dtype,
             mosaic_gpu.MgpuBlockSizes(**sizes), w_layout="kn")
  assert out.dtype == out_dtype and out.shape == (m, n)
  _check(out, x, w, w_scale, bias, out_dtype, w_layout="kn")



# ------------------------------------------------------------------ int4 --

def _int4_inputs(rng, m, k, n, w_layout, group_size, zero):
  """x, w (int4, ``w_layout``), tables as the API takes them ([K // g, N],
  [N, K // g] for "nk"; per channel [N]) and as the kernel takes them
  (normalized [G, N] float32, or [1, N])."""
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  w = jnp.asarray(rng.integers(-8, 8, (k, n)), jnp.int4)
  groups = k // group_size if group_size else 1
  scale = jnp.asarray(rng.uniform(1e-2, 2e-2, (groups, n)), jnp.float32)
  zeros = (jnp.asarray(rng.integers(-8, 8, (groups, n)), jnp.int4)
           if zero else None)
  if w_layout == "nk":
    w = w.T
  api_scale, api_zero = scale, zeros
  if w_layout == "nk" and group_size:
    api_scale = scale.T
    api_zero = None if zeros is None else zeros.T
  if not group_size:
    api_scale = scale.reshape(-1)
  kernel_zero = None if zeros is None else zeros.astype(jnp.float32)
  return x, w, api_scale, api_zero, scale, kernel_zero


def test_int4_supports_group_sizes_in_64s():
  if mosaic_gpu.api_missing() is not None:
    return
  x, w = _sds((16, 512), jnp.bfloat16), _sds((256, 512), jnp.int4)
  sup = lambda **kw: mosaic_gpu.supports(  # noqa: E731
      x, w, mode="weight_only", w_layout="nk", **kw)
  assert sup() is None and sup(group_size=128) is None
  assert sup(group_size=64, w_zero=_sds((8, 256), jnp.float32)) is None
  assert "multiple of 64" in sup(group_size=32)
  assert "w_zero with group scales" in sup(w_zero=_sds((1, 256), jnp.float32))
  assert "int4 w only" in mosaic_gpu.supports(
      x, _sds((256, 512), jnp.int8), mode="weight_only", w_layout="nk",
      group_size=128)
  for m in (16, 32, 64, 128, 192, 256):  # int4 tables fit the H100's SMEM
    for layout in ("nk", "kn"):
      p = mosaic_gpu.plan(m, 8192, 8192, w_layout=layout, bits=4)
      assert mosaic_gpu.smem_bytes(p, layout, 4) <= mosaic_gpu.SMEM_BYTES
      assert p.sizes.tile_k % mosaic_gpu.k_chunk(p.sizes.tile_k, layout, 4,
                                                 128) == 0


def test_int4_k_chunks_lie_in_one_group():
  assert mosaic_gpu.k_chunk(512, "nk", 4, 128) == 128
  assert mosaic_gpu.k_chunk(512, "nk", 4, 192) == 64
  assert mosaic_gpu.k_chunk(64, "nk", 4, 128) == 64
  assert mosaic_gpu.k_chunk(512, "kn", 4, 128) == mosaic_gpu.KN_CHUNK
  assert mosaic_gpu.k_chunk(256, "nk", 8, None) == 256  # 8-bit: one chunk


@pytest.mark.skipif(mosaic_gpu.api_missing() is not None,
                    reason="no Mosaic GPU Pallas API in this jax")
@pytest.mark.parametrize("m, k, n, w_layout, group_size, zero", [
    (16, 4096, 14336, "nk", 128, True),   # register dequantization, fused
    (8, 4096, 4096, "nk", 64, True),      # four groups per step, split K
    (1, 14336, 4096, "kn", 128, True),    # SMEM buffers, split K
    (128, 8192, 1024, "nk", 64, False),   # 64-wide chunks, x pairs
    (256, 1024, 640, "kn", None, False),  # per-channel int4
])
def test_int4_lowers_for_cuda_on_a_cpu_host(m, k, n, w_layout, group_size,
                                            zero):
  groups = k // group_size if group_size else 1
  fn = lambda x, w, s, z: mosaic_gpu.matmul(  # noqa: E731
      x, w, None, s, None, mode="weight_only", out_dtype=jnp.bfloat16,
      w_layout=w_layout, group_size=group_size, w_zero=z, integer_zero=zero)
  w_shape = (n, k) if w_layout == "nk" else (k, n)
  table = _sds((groups, n), jnp.float32)
  text = _compat.lower_for_cuda(fn, _sds((m, k), jnp.bfloat16),
                                _sds(w_shape, jnp.int4), table,
                                table if zero else None).as_text()
  assert "mosaic_gpu" in text


@needs_interpreter
@pytest.mark.parametrize("m, k, n, w_layout, group_size, zero, sizes", [
    # split K, ragged M and N; two 128-wide chunks (two groups) per step
    (5, 512, 130, "nk", 128, True, dict(tile_k=256, stages=2)),
    # groups of 192 with 64-wide chunks, fused epilogue, float32 out
    (20, 384, 64, "nk", 192, True, dict(tile_k=128, stages=2, max_split=1)),
    # w [K, N]: split K, groups of 64 (one per conversion chunk)
    (5, 256, 130, "kn", 64, True, dict(tile_k=128, stages=2)),
    # w [K, N], groups longer than a step, no zeros, fused
    (33, 512, 300, "kn", 256, False, dict(tile_k=128, stages=2,
                                          max_split=1)),
    # w [N, K], four groups of 64 per step, split K
    (9, 1024, 200, "nk", 64, True, dict(tile_k=256, stages=2)),
    # the same with float zero points (subtracted in float32)
    (9, 1024, 200, "nk", 64, "float", dict(tile_k=256, stages=2)),
    # per-channel int4 (scale in the epilogue), both layouts
    (7, 256, 130, "nk", None, False, dict(tile_k=128, stages=2)),
    (7, 256, 130, "kn", None, False, dict(tile_k=128, stages=2,
                                          max_split=1)),
])
def test_int4_matches_float64(rng, m, k, n, w_layout, group_size, zero,
                              sizes):
  x, w, api_scale, api_zero, scale, zeros = _int4_inputs(
      rng, m, k, n, w_layout, group_size, zero)
  bias = jnp.asarray(rng.standard_normal((1, n)), jnp.float32)
  out_dtype = jnp.float32 if sizes.get("max_split") else jnp.bfloat16
  if zero == "float":  # zero points off the integers
    zeros = zeros + jnp.float32(0.375)
    api_zero = zeros.T if w_layout == "nk" else zeros
  out = mosaic_gpu.matmul(
      x, w, None, scale, bias, mode="weight_only", out_dtype=out_dtype,
      w_layout=w_layout, group_size=group_size, w_zero=zeros,
      integer_zero=zero is True,
      block_sizes=mosaic_gpu.MgpuBlockSizes(**sizes), interpret=INTERPRET)
  assert out.shape == (m, n) and out.dtype == out_dtype
  quant_oracle.assert_matmul(out, x, w, jnp.dtype(out_dtype).name,
                             w_scale=api_scale, w_zero=api_zero,
                             group_size=group_size, bias=bias,
                             weight_only=True, layout=w_layout)


def test_quantized_matmul_routes_int4_to_mosaic_on_hopper():
  """int4 weight-only calls (group scales in 64s, or per channel) take the
  Mosaic GPU kernel on a Hopper target in its M range; groups of 32 and
  non-Hopper targets keep the Triton kernel."""
  from pallas_kernels.quant import api as quant_api
  from pallas_kernels.quant import operands as quant_operands

  def picked(m, group_size, layout="kn", capability="9.0"):
    k, n = 512, 256
    w = jnp.zeros((k, n) if layout == "kn" else (n, k), jnp.int4)
    shape = ((k // group_size, n) if layout == "kn" else
             (n, k // group_size)) if group_size else (n,)
    call = quant_operands.matmul_call(
        jnp.zeros((m, k), jnp.bfloat16), w, w_scale=jnp.ones(shape),
        w_zero=jnp.zeros(shape, jnp.int4) if group_size else None,
        group_size=group_size, weight_only=True, weight_layout=layout)
    rows = quant_api._kernels(call, None, None)
    with _backend.target_override(gpu_capability=capability):
      return _backend.choose("quantized_matmul", None, rows,
                             platform="cuda")[0].name

  expected = "triton" if mosaic_gpu.api_missing() else "mosaic_gpu"
  for layout in ("kn", "nk"):
    low, high = bs.gpu_weight_only_mosaic_m(jnp.int4, layout)
    assert picked(low, 128, layout) == expected
    assert picked(high, 64, layout) == expected
    assert picked(low, None, layout) == expected
    assert picked(high + 1, 128, layout) == "triton"
    assert picked(low, 32, layout) == "triton"
    assert picked(low, 128, layout, capability="8.0") == "triton"
  low, _ = bs.gpu_weight_only_mosaic_m(jnp.int4, "kn")
  assert low > 1 and picked(low - 1, 128, "kn") == "triton"


def test_integer_zero_marks_only_zero_points_exact_in_bf16():
  """int4, uint4 and int8 zero points keep w - zero within bf16's exact
  integers (|w - zero| <= 135); uint8 (up to 263), wider integers and
  floats take the float32 subtraction."""
  from pallas_kernels.quant import operands as quant_operands
  x = jnp.zeros((4, 256), jnp.bfloat16)
  w = jnp.zeros((256, 128), jnp.int4)
  scale = jnp.ones((2, 128), jnp.float32)

  def flag(dtype):
    return quant_operands.matmul_call(
        x, w, w_scale=scale, w_zero=jnp.zeros((2, 128), dtype),
        group_size=128, weight_only=True).integer_zero
  assert flag(jnp.int4) and flag(jnp.uint4) and flag(jnp.int8)
  assert not any(flag(d) for d in (jnp.uint8, jnp.int16, jnp.float32,
                                   jnp.bfloat16))
  assert not quant_operands.matmul_call(
      x, w, w_scale=scale, group_size=128, weight_only=True).integer_zero
