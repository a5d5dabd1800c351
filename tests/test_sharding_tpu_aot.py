"""The sharded programs of tests/test_sharding.py, compiled for real TPUs.

Each op runs per shard under a user's shard_map (check_vma on) and under
Explicit mesh axes, compiled by libtpu for v5e:2x4 and v6e:2x2. Under Auto
axes JAX refuses to partition a Mosaic kernel, with an error naming
shard_map (custom_partitioning does not compile for TPU: jax-ml/jax#38196).
"""
from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding

import sharding_cases as sc
from pallas_kernels import _compat, tpu_aot

pytestmark = pytest.mark.tpu_aot

TOPOLOGIES = {"v5e:2x4": (2, 4), "v6e:2x2": (2, 2)}
NAMES = ["flash_attention", "decode_attention", "decode_attention_paged",
         "int8_matmul", "giou_loss_sum", "batched_nms",
         "pairwise_giou"]


def _mesh(topology, axis_type):
  devices = np.array(tpu_aot.topology_devices(topology)).reshape(
      TOPOLOGIES[topology])
  return Mesh(devices, sc.MESH_AXES, axis_types=(axis_type,) * 2)


def _structs(case, mesh):
  args = case.make(np.random.default_rng(0))
  return [jax.ShapeDtypeStruct(a.shape, a.dtype,
                               sharding=NamedSharding(mesh, s))
          for a, s in zip(args, case.specs)]


def _compile(fn, structs):
  with tpu_aot._captured_stderr(), _compat.mosaic_version_for_aot():
    return jax.jit(fn).lower(*structs).compile()


def _use_mesh(mesh):
  return (jax.set_mesh(mesh) if hasattr(jax, "set_mesh")
          else jax.sharding.use_mesh(mesh))


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
@pytest.mark.parametrize("name", NAMES)
def test_sharded_forms_compile(name, topology, tpu_topologies):
  case = sc.case(name)
  fn = case.fn(None)
  if case.grad:
    fn = sc.scalar_loss(fn, case.grad)
    out_specs = tuple(case.specs[i] for i in case.grad)
  else:
    out_specs = case.out_specs
  auto = _mesh(topology, AxisType.Auto)
  if not name.endswith("_sum"):  # a global sum is not a per-shard program
    local = jax.shard_map(fn, mesh=auto, in_specs=case.specs,
                          out_specs=out_specs,
                          check_vma=not case.grad)
    hlo = _compile(local, _structs(case, auto)).as_text()
    assert "tpu_custom_call" in hlo
  explicit = _mesh(topology, AxisType.Explicit)
  structs = _structs(case, explicit)
  with _use_mesh(explicit):
    hlo = _compile(fn, structs).as_text()
  assert "tpu_custom_call" in hlo and "all-gather" not in hlo


def test_auto_axes_on_tpu_name_shard_map(tpu_topologies):
  case = sc.case("flash_attention")
  mesh = _mesh("v6e:2x2", AxisType.Auto)
  with pytest.raises(Exception, match="shard_map"):
    _compile(case.fn(None), _structs(case, mesh))
