"""IoU-family Mosaic kernels compiled by the real TPU compiler (v5e, v6e)."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from pallas_kernels import tpu_aot

pytestmark = pytest.mark.tpu_aot
GENERATIONS = ("v5e", "v6e")


@pytest.fixture(scope="module")
def topologies(tpu_topologies):
  found = [t for t in tpu_topologies if t.split(":")[0] in GENERATIONS]
  if not found:
    pytest.skip("libtpu knows neither v5e nor v6e")
  return found


def _loss_and_grads(pred, target):
  return jax.value_and_grad(
      lambda p, t: pk.giou_loss(p, t, reduction="mean"), argnums=(0, 1))(
          pred, target)


def test_giou_loss_forward_backward_has_no_layout_copies(topologies):
  # The write-up's shape. [B, N, 4] with N % 128 == 0 is viewed as coordinate
  # planes for free: no temp buffer beyond the tiny partial sums.
  spec = jax.ShapeDtypeStruct((1024, 256, 4), jnp.float32)
  for topology in topologies:
    result = tpu_aot.compile_for_tpu(_loss_and_grads, spec, spec,
                                     topology=topology)
    assert result.hlo_text.count("tpu_custom_call") >= 2  # forward, backward
    assert result.memory.temp_size_in_bytes < 2**20, result.memory
    relayouts = re.findall(r"= \S+ (?:copy|transpose)\(", result.hlo_text)
    assert not relayouts, relayouts


# Ops that would copy boxes or results around the kernels in HBM (an async
# copy-start into VMEM is XLA prefetching, not a relayout).
_RELAYOUT = re.compile(r"= \S+ (?:copy|transpose|pad|slice|concatenate)\(|"
                       r"%\S*(?:pad|slice|transpose|concatenate)\S* = ")


def _relayouts(hlo_text):
  return _RELAYOUT.findall(hlo_text[hlo_text.find("\nENTRY"):])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_odd_box_count_is_read_and_written_in_place(topologies, dtype):
  # 1000 boxes: not a multiple of 128. The kernels read [N, 4] as [4, N]
  # planes (a bitcast) and write exact outputs: no pad, slice or copy.
  spec = jax.ShapeDtypeStruct((1000, 4), dtype)

  def values_and_grads(p, t):
    out, pullback = jax.vjp(lambda x, y: pk.giou_loss(x, y), p, t)
    return (out,) + pullback(out) + _loss_and_grads(p, t)

  result = tpu_aot.compile_for_tpu(values_and_grads, spec, spec,
                                   topology=topologies[0])
  assert result.hlo_text.count("tpu_custom_call") >= 4
  relayouts = _relayouts(result.hlo_text)
  # The [N] cotangent of the unreduced loss is padded to whole 128-box rows
  # (4 bytes per box); the boxes never are.
  assert len(relayouts) <= 1, relayouts


def test_pairwise_odd_sizes_write_the_exact_output(topologies):
  n, m = 1000, 1001
  result = tpu_aot.compile_for_tpu(
      pk.pairwise_giou, jax.ShapeDtypeStruct((n, 4), jnp.float32),
      jax.ShapeDtypeStruct((m, 4), jnp.float32), topology=topologies[0])
  assert not _relayouts(result.hlo_text), _relayouts(result.hlo_text)
  # [N, M] f32 tiled (8, 128): the output itself, once.
  exact = -(-n // 8) * 8 * (-(-m // 128) * 128) * 4
  assert result.memory.output_size_in_bytes == exact, result.memory
  assert result.memory.temp_size_in_bytes < exact // 8, result.memory


@pytest.mark.parametrize("loss", ["ciou_loss", "diou_loss", "iou_loss"])
def test_other_losses_bf16_cxcywh_odd_size(topologies, loss):
  spec = jax.ShapeDtypeStruct((1000, 4), jnp.bfloat16)
  fn = getattr(pk, loss)

  def fwd_bwd(p, t):
    out, pullback = jax.vjp(lambda x, y: fn(x, y, box_format="cxcywh"), p, t)
    return out, pullback(out)

  result = tpu_aot.compile_for_tpu(fwd_bwd, spec, spec, topology=topologies[0])
  assert "tpu_custom_call" in result.hlo_text


def test_pairwise_4096(topologies):
  spec = jax.ShapeDtypeStruct((4096, 4), jnp.float32)
  for topology in topologies:
    result = tpu_aot.compile_for_tpu(pk.pairwise_giou, spec, spec,
                                     topology=topology)
    assert "tpu_custom_call" in result.hlo_text
    # Output written once, never padded or copied.
    assert result.memory.temp_size_in_bytes < 2**20, result.memory


def test_metrics_and_box_iou(topologies):
  spec = jax.ShapeDtypeStruct((8, 300, 4), jnp.float32)

  def all_metrics(a, b):
    return (pk.giou(a, b), pk.ciou(a, b), pk.box_iou(a, b, iou_kind="diou"),
            jax.grad(lambda x: jnp.sum(pk.diou(x, b)))(a))

  result = tpu_aot.compile_for_tpu(all_metrics, spec, spec,
                                   topology=topologies[-1])
  assert result.hlo_text.count("tpu_custom_call") >= 4


def test_sharded_over_four_chips(topologies):
  # Each chip runs the kernels on its slice of the batch (shard_map).
  spec = jax.ShapeDtypeStruct((1024, 256, 4), jnp.float32)

  def per_shard(pred, target):
    loss = pk.giou_loss(pred, target)
    grads = jax.grad(lambda p, t: jnp.sum(pk.giou_loss(p, t)),
                     argnums=(0, 1))(pred, target)
    return (loss,) + grads

  result = tpu_aot.compile_for_tpu(
      per_shard, spec, spec, topology=topologies[0], mesh_axes=("data",),
      in_specs=(P("data"), P("data")),
      out_specs=(P("data"), P("data"), P("data")))
  assert result.hlo_text.count("tpu_custom_call") >= 2
