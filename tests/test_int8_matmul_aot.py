"""The int8 Mosaic kernels through the real TPU compiler (v5e, v6e)."""
from __future__ import annotations


import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import sweeps
from pallas_kernels import tpu_aot
from pallas_kernels.quant import int8_api as api, int8_block_sizes as bs

pytestmark = pytest.mark.tpu_aot

S = jax.ShapeDtypeStruct
GENERATIONS = {"v5e:2x2": "v5e", "v6e:2x2": "v6e"}

# mode -> (x dtype, extra arrays, flags)
MODES = {
    "raw": (jnp.int8, (), {}),
    "fused": (jnp.int8, ("x_scale", "w_scale", "bias"), {}),
    "dynamic": (jnp.bfloat16, ("w_scale",), {}),
    "w8a16": (jnp.bfloat16, ("w_scale", "bias"), dict(weight_only=True)),
}


def _call(mode, generation):
  _, names, flags = MODES[mode]

  def fn(x, w, *arrays):
    return api.int8_matmul(x, w, **dict(zip(names, arrays)), **flags,
                           block_sizes=generation, backend="mosaic_tpu")
  return fn


def _specs(mode, m, k, n):
  x_dtype, names, _ = MODES[mode]
  extra = {"x_scale": S((m, 1), jnp.float32), "w_scale": S((n,), jnp.float32),
           "bias": S((n,), jnp.float32)}
  return [S((m, k), x_dtype), S((k, n), jnp.int8)] + [extra[a] for a in names]


def _compile(topology, tpu_topologies, mode, m, k, n):
  if topology not in tpu_topologies:
    pytest.skip(f"libtpu lacks {topology}")
  result = tpu_aot.compile_for_tpu(_call(mode, GENERATIONS[topology]),
                                   *_specs(mode, m, k, n), topology=topology)
  assert "tpu_custom_call" in result.hlo_text
  return result


@pytest.mark.parametrize("topology", list(GENERATIONS))
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("mkn", [(40, 300, 200), (16, 4096, 14336),
                                 (1000, 1000, 17)])
def test_small_and_decode_shapes_compile(topology, tpu_topologies, mode, mkn):
  _compile(topology, tpu_topologies, mode, *mkn)


@pytest.mark.parametrize("topology,mode", sweeps.covering_pairs(
    list(GENERATIONS), [("raw",), ("fused",), ("w8a16",)]))
def test_8192_cubed_compiles_without_an_int32_matrix_in_hbm(
    topology, tpu_topologies, mode):
  m = k = n = 8192
  result = _compile(topology, tpu_topologies, mode, m, k, n)
  out_bytes = m * n * (4 if mode == "raw" else 2)
  in_bytes = m * k * (1 if mode != "w8a16" else 2) + k * n
  # Fused modes write bf16 only: nothing of int32 size beyond in + out.
  assert result.peak_bytes < in_bytes + out_bytes + 64 * 2**20


@pytest.mark.slow
@pytest.mark.parametrize("topology", list(GENERATIONS))
@pytest.mark.parametrize("mkn", [(8192, 8192, 8192), (2048, 4096, 14336),
                                 (128, 14336, 4096)])
def test_dynamic_and_llm_shapes_compile(topology, tpu_topologies, mkn):
  for mode in MODES:
    _compile(topology, tpu_topologies, mode, *mkn)


def test_sharded_over_four_chips_by_rows(tpu_topologies):
  if "v5e:2x2" not in tpu_topologies:
    pytest.skip("libtpu lacks v5e:2x2")
  m, k, n = 4096, 4096, 4096
  result = tpu_aot.compile_for_tpu(
      _call("fused", "v5e"), *_specs("fused", m, k, n), topology="v5e:2x2",
      mesh_axes=("data",), in_specs=(P("data"), P(), P("data"), P(), P()),
      out_specs=P("data"))
  assert "tpu_custom_call" in result.hlo_text
  # Each chip holds a quarter of x (and of x_scale) and all of w.
  assert result.memory.argument_size_in_bytes == (
      m * k // 4 + k * n + m * 4 // 4 + 2 * n * 4)


def test_plan_reports_vmem_for_each_generation():
  for generation in ("v5e", "v6e"):
    for m in (16, 512, 8192):
      plan = bs.plan_tpu(m, 8192, 8192, x_bytes=1, out_bytes=2, mode="dequant",
                         generation=generation)
      assert plan.vmem_bytes <= bs.tpu_vmem_budget(generation, "dequant")[0]


@pytest.mark.parametrize("topology", list(GENERATIONS))
@pytest.mark.parametrize("mode", ["raw", "w8a16"])
def test_nk_weight_layout_compiles(topology, tpu_topologies, mode):
  if topology not in tpu_topologies:
    pytest.skip(f"libtpu lacks {topology}")
  m, k, n = 256, 4096, 1024
  specs = _specs(mode, m, k, n)
  specs[1] = S((n, k), jnp.int8)
  _, names, flags = MODES[mode]

  def fn(x, w, *arrays):
    return api.int8_matmul(x, w, **dict(zip(names, arrays)), **flags,
                           weight_layout="nk",
                           block_sizes=GENERATIONS[topology],
                           backend="mosaic_tpu")
  result = tpu_aot.compile_for_tpu(fn, *specs, topology=topology)
  assert "tpu_custom_call" in result.hlo_text


@pytest.mark.parametrize("mode", ["raw", "fused", "dynamic"])
def test_v4_int8_modes_compile_through_bf16(tpu_topologies, mode):
  """v4's MXU takes no int8 operands (Mosaic rejects an i8 dot there): its
  int8 modes upcast K chunks to bf16; the table's tiles and a 2048-deep K
  tile (two chunks per step) both compile."""
  topology = "v4:2x2x1"
  if topology not in tpu_topologies:
    pytest.skip(f"libtpu lacks {topology}")
  m, k, n = 512, 4096, 1024
  _, names, flags = MODES[mode]
  for blocks in ("v4", bs.BlockSizes(256, 2048, 512)):
    def fn(x, w, *arrays, blocks=blocks):
      return api.int8_matmul(x, w, **dict(zip(names, arrays)), **flags,
                             block_sizes=blocks, backend="mosaic_tpu")
    result = tpu_aot.compile_for_tpu(fn, *_specs(mode, m, k, n),
                                     topology=topology)
    assert "int8_matmul_" in result.hlo_text
    assert result.cost["flops"] >= 2 * m * k * n
