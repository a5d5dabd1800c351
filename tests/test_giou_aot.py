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
