"""The real TPU compiler runs here, without a TPU."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from pallas_kernels import tpu_aot
from pallas_kernels._compat import pl

pytestmark = pytest.mark.tpu_aot


def _add_one(x_ref, o_ref):
  o_ref[...] = x_ref[...] + 1


def _tiled_add_one(x, block):
  return pl.pallas_call(
      _add_one, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      grid=(x.shape[0] // block[0],),
      in_specs=[pl.BlockSpec(block, lambda i: (i, 0))],
      out_specs=pl.BlockSpec(block, lambda i: (i, 0)))(x)


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
def test_trivial_mosaic_kernel_compiles(topology, tpu_topologies):
  if topology not in tpu_topologies:
    pytest.skip(f"libtpu lacks {topology}")
  spec = jax.ShapeDtypeStruct((256, 128), jnp.float32)
  result = tpu_aot.compile_for_tpu(lambda x: _tiled_add_one(x, (8, 128)), spec,
                                   topology=topology)
  assert "tpu_custom_call" in result.hlo_text
  assert result.memory.argument_size_in_bytes == 256 * 128 * 4
  assert result.peak_bytes >= 2 * 256 * 128 * 4


def test_sharded_over_four_chips(tpu_topologies):
  if "v5e:2x2" not in tpu_topologies:
    pytest.skip("libtpu lacks v5e:2x2")
  spec = jax.ShapeDtypeStruct((1024, 128), jnp.float32)
  result = tpu_aot.compile_for_tpu(
      lambda x: _tiled_add_one(x, (8, 128)), spec, topology="v5e:2x2",
      mesh_axes=("data",), in_specs=(P("data"),), out_specs=P("data"))
  # Each chip holds a quarter of the input.
  assert result.memory.argument_size_in_bytes == 1024 * 128 * 4 // 4


def test_bad_block_shape_is_a_readable_error(tpu_topologies):
  spec = jax.ShapeDtypeStruct((6, 100), jnp.float32)
  with pytest.raises(tpu_aot.TpuCompileError,
                     match=r"(?s)TPU compilation for .* failed:.*divisible by 8 and 128"):
    tpu_aot.compile_for_tpu(lambda x: _tiled_add_one(x, (3, 100)), spec,
                            topology=tpu_topologies[0])


def test_unknown_topology_is_reported(tpu_topologies):
  with pytest.raises(tpu_aot.LibtpuUnavailable, match="v99x"):
    tpu_aot.topology_devices("v99x:9x9")
