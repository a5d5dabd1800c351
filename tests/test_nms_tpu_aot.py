"""The NMS Mosaic kernel compiles for real TPUs (v5e, v6e) at N up to 100k."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from pallas_kernels import tpu_aot

pytestmark = pytest.mark.tpu_aot

GENERATIONS = ("v5e", "v6e")


def _topologies(found):
  chosen = [t for t in found if t.split(":")[0] in GENERATIONS]
  if not chosen:
    pytest.skip("libtpu compiles for neither v5e nor v6e")
  return chosen


def _spec(*shape, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype)


def _compile_nms(tpu_topologies, n, m):
  fn = functools.partial(pk.nms, iou_threshold=0.5, max_output_size=m)
  for topology in _topologies(tpu_topologies):
    result = tpu_aot.compile_for_tpu(fn, _spec(n, 4), _spec(n),
                                     topology=topology)
    assert "tpu_custom_call" in result.hlo_text
    # O(N) memory (the XLA sort dominates), never an N x N matrix.
    assert result.peak_bytes < 1000 * n + (16 << 20), result.peak_bytes


def test_nms_compiles(tpu_topologies):
  _compile_nms(tpu_topologies, 1000, 128)


@pytest.mark.slow
@pytest.mark.parametrize("n,m", [(10_000, 10_000), (100_000, 1000)])
def test_nms_compiles_large(tpu_topologies, n, m):
  """The whole op; XLA's sort of 10k / 100k scores compiles for 10-40 s."""
  _compile_nms(tpu_topologies, n, m)


@pytest.mark.parametrize("n", [10_000, 100_000])
def test_kernel_compiles_bounded_vmem(tpu_topologies, n):
  """The Mosaic kernel alone (the sort is XLA's): VMEM does not grow with N."""
  from pallas_kernels.boxes.nms import block_sizes, mosaic_tpu
  tile = block_sizes.tpu_tile(n)
  padded = block_sizes.padded_size(n, tile)
  fn = functools.partial(mosaic_tpu.keep_mask, iou_threshold=0.5,
                         max_output_size=n, tile=tile)
  for topology in _topologies(tpu_topologies):
    result = tpu_aot.compile_for_tpu(fn, _spec(2, 8, padded),
                                     topology=topology)
    assert "tpu_custom_call" in result.hlo_text
    # Inputs, keep mask and the slab store: ~68 bytes per box per image.
    assert result.peak_bytes < 2 * 80 * padded + (1 << 20), result.peak_bytes


def test_class_aware_batched_compiles_sharded_over_four_chips(tpu_topologies):
  """Batch of images split across the 4 chips of a 2x2 slice."""
  def fn(boxes, scores, classes):
    return pk.batched_nms(boxes, scores, iou_threshold=0.5,
                          max_output_size=100, class_ids=classes)
  for topology in _topologies(tpu_topologies):
    result = tpu_aot.compile_for_tpu(
        fn, _spec(8, 2000, 4), _spec(8, 2000),
        _spec(8, 2000, dtype=jnp.int32), topology=topology,
        mesh_axes=("batch",), in_specs=(P("batch"), P("batch"), P("batch")),
        out_specs=(P("batch"), P("batch")))
    assert "tpu_custom_call" in result.hlo_text

