"""The quantized Mosaic kernels through the real TPU compiler: every format
and mode on v5e, v6e, v5p and tpu7x (where the installed libtpu knows it),
the grouped calls on v4 too, each generation's tiles inside its VMEM."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import _backend, tpu_aot
from pallas_kernels.quant import api

pytestmark = pytest.mark.tpu_aot

S = jax.ShapeDtypeStruct
GENERATIONS = ("v5e", "v6e", "v5p", "tpu7x")

# name -> (w dtype, x dtype, options, arrays beyond x and w as (name, shape
# given m, k, n, group))
CALLS = {
    "int4_per_channel": (jnp.int4, jnp.bfloat16, dict(weight_only=True),
                         [("w_scale", lambda m, k, n, g: (n,))]),
    "int4_g128_zero": (jnp.int4, jnp.bfloat16,
                       dict(weight_only=True, group_size=128),
                       [("w_scale", lambda m, k, n, g: (-(-k // g), n)),
                        ("w_zero", lambda m, k, n, g: (-(-k // g), n))]),
    "int4_g32_f32x": (jnp.int4, jnp.float32,
                      dict(weight_only=True, group_size=32),
                      [("w_scale", lambda m, k, n, g: (-(-k // g), n))]),
    "int8_g64": (jnp.int8, jnp.bfloat16, dict(weight_only=True, group_size=64),
                 [("w_scale", lambda m, k, n, g: (-(-k // g), n))]),
    "e4m3_per_channel_nk": (jnp.float8_e4m3fn, jnp.bfloat16,
                            dict(weight_only=True, weight_layout="nk"),
                            [("w_scale", lambda m, k, n, g: (n,))]),
    "e5m2_g128": (jnp.float8_e5m2, jnp.bfloat16,
                  dict(weight_only=True, group_size=128),
                  [("w_scale", lambda m, k, n, g: (-(-k // g), n))]),
    "e4m3_x_e4m3": (jnp.float8_e4m3fn, jnp.float8_e4m3fn, {},
                    [("x_scale", lambda m, k, n, g: (m,)),
                     ("w_scale", lambda m, k, n, g: (n,)),
                     ("bias", lambda m, k, n, g: (n,))]),
    "e5m2_dynamic": (jnp.float8_e5m2, jnp.bfloat16, {},
                     [("w_scale", lambda m, k, n, g: (n,))]),
    # grouped weight-only with w [N, K]: tables [N, K // g]
    "int4_g32_nk_zero": (jnp.int4, jnp.bfloat16,
                         dict(weight_only=True, group_size=32,
                              weight_layout="nk"),
                         [("w_scale", lambda m, k, n, g: (n, -(-k // g))),
                          ("w_zero", lambda m, k, n, g: (n, -(-k // g)))]),
    "int8_g64_nk": (jnp.int8, jnp.bfloat16,
                    dict(weight_only=True, group_size=64, weight_layout="nk"),
                    [("w_scale", lambda m, k, n, g: (n, -(-k // g)))]),
    "e4m3_g128_nk": (jnp.float8_e4m3fn, jnp.bfloat16,
                     dict(weight_only=True, group_size=128,
                          weight_layout="nk"),
                     [("w_scale", lambda m, k, n, g: (n, -(-k // g)))]),
    # quantized x with group scales: a dot per group
    "int8_x_int8_g32": (jnp.int8, jnp.int8, dict(group_size=32),
                        [("x_scale", lambda m, k, n, g: (m, -(-k // g))),
                         ("w_scale", lambda m, k, n, g: (-(-k // g), n)),
                         ("bias", lambda m, k, n, g: (n,))]),
    "int8_x_int8_g128_nk": (jnp.int8, jnp.int8,
                            dict(group_size=128, weight_layout="nk"),
                            [("x_scale", lambda m, k, n, g: (m,)),
                             ("w_scale", lambda m, k, n, g: (n, -(-k // g)))]),
    "e4m3_x_e4m3_g64": (jnp.float8_e4m3fn, jnp.float8_e4m3fn,
                        dict(group_size=64),
                        [("x_scale", lambda m, k, n, g: (m, -(-k // g))),
                         ("w_scale", lambda m, k, n, g: (-(-k // g), n))]),
    "e5m2_x_e5m2_g32_nk": (jnp.float8_e5m2, jnp.float8_e5m2,
                           dict(group_size=32, weight_layout="nk"),
                           [("x_scale", lambda m, k, n, g: (m, -(-k // g))),
                            ("w_scale", lambda m, k, n, g: (n, -(-k // g))),
                            ("bias", lambda m, k, n, g: (n,))]),
}
GROUPED_NEW = ("int4_g32_nk_zero", "int8_g64_nk", "e4m3_g128_nk",
               "int8_x_int8_g32", "int8_x_int8_g128_nk", "e4m3_x_e4m3_g64",
               "e5m2_x_e5m2_g32_nk")


def _compile(generation, tpu_topologies, name, m, k, n):
  topology = tpu_aot.GENERATION_TOPOLOGY[generation]
  if topology not in tpu_topologies:
    pytest.skip(f"the installed libtpu lacks {topology}")
  w_dtype, x_dtype, options, extras = CALLS[name]
  group = options.get("group_size")
  names = [e[0] for e in extras]
  w_shape = (n, k) if options.get("weight_layout") == "nk" else (k, n)
  specs = [S((m, k), x_dtype), S(w_shape, w_dtype)]
  for extra, shape in extras:
    dtype = w_dtype if extra == "w_zero" else jnp.float32
    specs.append(S(shape(m, k, n, group), dtype))

  def fn(x, w, *arrays):
    return api.quantized_matmul(x, w, **dict(zip(names, arrays)), **options,
                                backend="mosaic_tpu")
  result = tpu_aot.compile_for_tpu(fn, *specs, topology=topology)
  vmem = result.kernel_vmem_bytes
  assert any(call.startswith("quantized_matmul_") for call in vmem), vmem
  assert max(vmem.values()) <= _backend.TPU_VMEM_BYTES[generation]
  return result


@pytest.mark.parametrize("name", sorted(CALLS))
@pytest.mark.parametrize("generation", GENERATIONS)
def test_small_shapes_compile(generation, tpu_topologies, name):
  _compile(generation, tpu_topologies, name, 40, 512, 384)


@pytest.mark.parametrize("name", GROUPED_NEW)
def test_grouped_calls_compile_on_v4(tpu_topologies, name):
  """v4 (16 MiB VMEM, no int8 or fp8 MXU operands): grouped w [N, K] and
  group products (int8 through exact bf16 products) compile."""
  _compile("v4", tpu_topologies, name, 40, 512, 384)


@pytest.mark.parametrize("name", ["int4_g128_zero", "e4m3_per_channel_nk",
                                  "e4m3_x_e4m3", "int4_g32_nk_zero",
                                  "int8_x_int8_g32", "e4m3_x_e4m3_g64"])
@pytest.mark.parametrize("generation", ["v5e", "v6e"])
def test_decode_shape_compiles_and_streams_int4_at_half_a_byte(
    generation, tpu_topologies, name):
  m, k, n = 16, 4096, 14336
  result = _compile(generation, tpu_topologies, name, m, k, n)
  if name.startswith("int4"):  # the weight stays packed in HBM
    group = CALLS[name][2].get("group_size")
    tables = sum(4 * math.prod(shape(m, k, n, group))
                 for _, shape in CALLS[name][3])  # at most 4 bytes a value
    assert result.memory.argument_size_in_bytes < k * n * 0.6 + tables


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CALLS))
@pytest.mark.parametrize("generation", GENERATIONS)
def test_llm_shapes_compile(generation, tpu_topologies, name):
  for mkn in [(16, 4096, 14336), (2048, 14336, 4096)]:
    _compile(generation, tpu_topologies, name, *mkn)


def test_fp8_products_use_the_fp8_mxu_on_tpu7x_only(monkeypatch):
  """tpu7x multiplies fp8 operands natively; the others upcast to bf16."""
  from pallas_kernels.quant import mosaic_tpu
  seen = {}
  original = mosaic_tpu._kernel

  def spy(*refs, **kw):
    seen[gen] = kw["x_upcast"]
    return original(*refs, **kw)

  monkeypatch.setattr(mosaic_tpu, "_kernel", spy)
  x = S((32, 256), jnp.float8_e4m3fn)
  w = S((256, 128), jnp.float8_e4m3fn)
  for gen in GENERATIONS:
    with _backend.target_override(tpu_generation=gen):
      jax.eval_shape(functools.partial(api.quantized_matmul,
                                       backend="mosaic_tpu"), x, w)
  assert seen == {"v5e": True, "v6e": True, "v5p": True, "tpu7x": False}


@pytest.mark.parametrize("mkn", [(1, 96, 1), (16, 511, 383), (40, 5000, 300)])
@pytest.mark.parametrize("name", ["int4_per_channel", "e4m3_per_channel_nk",
                                  "e4m3_x_e4m3"])
def test_odd_shapes_compile(tpu_topologies, name, mkn):
  """M = 1, N = 1, odd K and N (int4 packed two per byte), K padded."""
  _compile("v5e", tpu_topologies, name, *mkn)


@pytest.mark.parametrize("mkn", [(1, 96, 1), (33, 1056, 300), (5, 1000, 64)])
@pytest.mark.parametrize("name", ["int4_g32_nk_zero", "int8_x_int8_g32",
                                  "e5m2_x_e5m2_g32_nk"])
def test_odd_grouped_shapes_compile(tpu_topologies, name, mkn):
  """Grouped calls at M = 1, N = 1, K = 1056 (33 groups of 32, padded to
  the K tile unit of 256 with zero groups) and K = 1000 (a partial last
  group of 8)."""
  _compile("v5e", tpu_topologies, name, *mkn)
