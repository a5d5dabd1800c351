"""Flash attention's Mosaic kernels through the real TPU compiler (no TPU).

Default: forward + backward at a handful of representative shapes on v5e and
v6e (each generation with its own table blocks), and one 4-chip sharded case
through ``shard_flash_attention``. ``--runslow`` sweeps head_dim 64/128/256
and sequence 512..32k.
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_kernels import _compat, flash_attention, shard_flash_attention
from pallas_kernels import tpu_aot
from pallas_kernels.attention import block_sizes

pytestmark = pytest.mark.tpu_aot

GENERATIONS = {"v5e:2x2": "v5e", "v6e:2x2": "v6e"}


def _need(topology, tpu_topologies):
  if topology not in tpu_topologies:
    pytest.skip(f"libtpu lacks {topology}")


def _specs(b, h, hk, lq, lk, d, dtype=jnp.bfloat16):
  return (jax.ShapeDtypeStruct((b, h, lq, d), dtype),
          jax.ShapeDtypeStruct((b, hk, lk, d), dtype),
          jax.ShapeDtypeStruct((b, hk, lk, d), dtype))


def _kernel_calls(result):
  return result.hlo_text.count('custom_call_target="tpu_custom_call"')


@pytest.mark.parametrize("topology", sorted(GENERATIONS))
@pytest.mark.parametrize("b,h,hk,length,d,kw", [
    (2, 8, 2, 2048, 128, dict(causal=True)),
    (1, 4, 4, 4096, 64, dict(sliding_window=512, causal=True)),
    (1, 2, 1, 1024, 256, dict(logit_soft_cap=30.0)),
])
def test_forward_backward_compile(topology, b, h, hk, length, d, kw,
                                  tpu_topologies):
  _need(topology, tpu_topologies)
  blocks = block_sizes.table_block_sizes(GENERATIONS[topology], d)
  specs = _specs(b, h, hk, length, length, d)

  def fn(q, k, v):
    def loss(q, k, v):
      out = flash_attention(q, k, v, backend="mosaic_tpu", block_sizes=blocks,
                            **kw)
      return jnp.sum(out.astype(jnp.float32))
    return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
  result = tpu_aot.compile_for_tpu(fn, *specs, topology=topology)
  # The forward, dq and dk/dv kernels are all Mosaic custom calls.
  assert _kernel_calls(result) >= 3


@pytest.mark.parametrize("topology", sorted(GENERATIONS))
def test_segments_bias_and_odd_lengths_compile(topology, tpu_topologies):
  _need(topology, tpu_topologies)
  b, h, hk, lq, lk, d = 2, 4, 2, 1000, 1500, 96
  q, k, v = _specs(b, h, hk, lq, lk, d)
  seg_q = jax.ShapeDtypeStruct((b, lq), jnp.int32)
  seg_k = jax.ShapeDtypeStruct((b, lk), jnp.int32)
  bias = jax.ShapeDtypeStruct((1, h, lq, lk), jnp.bfloat16)

  def fn(q, k, v, seg_q, seg_k, bias):
    def loss(q, k, v, bias):
      out, lse = flash_attention(q, k, v, causal=True, segment_ids=(seg_q,
                                                                    seg_k),
                                 bias=bias, return_lse=True,
                                 backend="mosaic_tpu")
      return jnp.sum(out.astype(jnp.float32)) + jnp.sum(
          jnp.where(jnp.isinf(lse), 0.0, lse))
    return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, bias)
  result = tpu_aot.compile_for_tpu(fn, q, k, v, seg_q, seg_k, bias,
                                   topology=topology)
  assert _kernel_calls(result) >= 3


def test_platform_default_picks_mosaic(tpu_topologies):
  topology = tpu_topologies[0]
  result = tpu_aot.compile_for_tpu(
      lambda q, k, v: flash_attention(q, k, v, causal=True),
      *_specs(1, 2, 2, 512, 512, 128), topology=topology)
  assert "tpu_custom_call" in result.hlo_text


def test_sharded_over_four_chips(tpu_topologies):
  topology = "v5e:2x2"
  _need(topology, tpu_topologies)
  mesh = tpu_aot.topology_mesh(topology, ("data", "model"), (2, 2))
  b, h, hk, length, d = 4, 8, 2, 2048, 128
  spec = NamedSharding(mesh, P("data", "model", None, None))
  specs = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=spec)
           for s in _specs(b, h, hk, length, length, d)]

  def fn(q, k, v):
    def loss(q, k, v):
      out = shard_flash_attention(mesh, q, k, v, causal=True,
                                  batch_axis="data", head_axis="model")
      return jnp.sum(out.astype(jnp.float32))
    return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

  # The same compile path compile_for_tpu takes, with our own 4-chip mesh.
  version_cap = getattr(_compat, "mosaic_version_for_aot",
                        contextlib.nullcontext)
  with tpu_aot._captured_stderr(), version_cap():
    compiled = jax.jit(fn).lower(*specs).compile()
  assert "tpu_custom_call" in compiled.as_text()
  memory = compiled.memory_analysis()
  # Each chip holds a quarter of q, k and v.
  per_chip = (b * h * length * d + 2 * b * hk * length * d) * 2 // 4
  assert memory.argument_size_in_bytes == per_chip


@pytest.mark.slow
@pytest.mark.parametrize("topology", sorted(GENERATIONS))
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("length", [512, 2048, 8192, 32768])
def test_sweep_head_dims_and_lengths(topology, d, length, tpu_topologies):
  _need(topology, tpu_topologies)
  blocks = block_sizes.table_block_sizes(GENERATIONS[topology], d)
  specs = _specs(1, 8, 2, length, length, d)

  def fn(q, k, v):
    def loss(q, k, v):
      out = flash_attention(q, k, v, causal=True, block_sizes=blocks,
                            backend="mosaic_tpu")
      return jnp.sum(out.astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  result = tpu_aot.compile_for_tpu(fn, *specs, topology=topology)
  assert _kernel_calls(result) >= 3
