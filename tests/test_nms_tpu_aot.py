"""The NMS Mosaic kernels compile for real TPUs at N up to 300k: the whole op
on v5e and v6e, the kernels alone on every generation libtpu knows."""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from pallas_kernels import tpu_aot

pytestmark = pytest.mark.tpu_aot

GENERATIONS = ("v5e", "v6e")


def _topologies(found, generations=GENERATIONS):
  chosen = [t for t in found if t.split(":")[0] in generations]
  if not chosen:
    pytest.skip(f"libtpu compiles for none of {generations}")
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


def test_nms_100k_has_no_xla_sort_or_scatter(tpu_topologies):
  """XLA's TPU sort and scatter of 100k elements compile for tens of seconds
  to minutes; the op sorts with its Mosaic kernel and compacts without a
  scatter (v5e: ~6 s for the whole op)."""
  fn = functools.partial(pk.nms, iou_threshold=0.5, max_output_size=1000)
  topology, = _topologies(tpu_topologies, ("v5e",))
  result = tpu_aot.compile_for_tpu(fn, _spec(100_000, 4), _spec(100_000),
                                   topology=topology)
  assert result.hlo_text.count("tpu_custom_call") >= 2  # sort and NMS
  assert not re.findall(r"\s(sort|scatter)\(", result.hlo_text)


@pytest.mark.slow
@pytest.mark.parametrize("n,m", [(10_000, 10_000), (300_000, 1000)])
def test_nms_compiles_large(tpu_topologies, n, m):
  _compile_nms(tpu_topologies, n, m)


def test_sort_kernel_compiles_on_every_generation(tpu_topologies):
  """300k keys (sorted as 2^19) in VMEM on every chip: 8 bytes a key (jax
  0.7's Mosaic reserves twice that), within v4's 16 MiB."""
  from pallas_kernels.boxes.nms import mosaic_tpu
  for topology in _topologies(tpu_topologies, tpu_aot.GENERATIONS):
    result = tpu_aot.compile_for_tpu(
        mosaic_tpu.sort_keys, _spec(2, 300_000, dtype=jnp.int32),
        topology=topology)
    vmem = sum(result.kernel_vmem_bytes.values())
    assert 8 * 2**19 <= vmem <= 16 * 2**19, (topology, vmem)


@pytest.mark.parametrize("n", [10_000, 100_000])
def test_kernel_compiles_bounded_vmem(tpu_topologies, n):
  """The NMS kernel alone on every chip: VMEM does not grow with N."""
  from pallas_kernels.boxes.nms import block_sizes, mosaic_tpu
  tile = block_sizes.tpu_tile(n)
  padded = block_sizes.padded_size(n, tile)
  fn = functools.partial(mosaic_tpu.keep_mask, iou_threshold=0.5,
                         max_output_size=n, tile=tile)
  for topology in _topologies(tpu_topologies, tpu_aot.GENERATIONS):
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

