"""Flash attention's Mosaic kernels through the real TPU compiler (no TPU).

Default: forward + backward at a handful of representative shapes on v5e and
v6e (each generation with its own table blocks), one 4-chip sharded case
through ``shard_flash_attention``, and masks with sinks on v5p and tpu7x.
``--runslow`` sweeps head_dim 64/128/256 and sequence 512..32k, and a
masked call with sinks on four generations up to 128k. MLA (v's head_dim
192 -> 128): a short causal case on v5e and v6e by default; full blocks,
Dv > D and four generations with --runslow.
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import sweeps
from pallas_kernels import _compat, flash_attention, shard_flash_attention
from pallas_kernels import _backend, tpu_aot
from pallas_kernels.attention import block_sizes, masks, mosaic_tpu

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


@pytest.mark.parametrize("topology,b,h,hk,length,d,kw",
                         sweeps.covering_pairs(sorted(GENERATIONS), [
    (2, 8, 2, 2048, 128, dict(causal=True)),
    (1, 4, 4, 4096, 64, dict(sliding_window=512, causal=True)),
    (1, 2, 1, 1024, 256, dict(logit_soft_cap=30.0)),
]))
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


# ------------------------------------------------ walked grids (issue #20) --

def _live_blocks(length, block_q, block_kv, mask):
  """bool [q blocks, kv blocks]: blocks holding an allowed pair, from
  interval arithmetic on the documented rules (q_len == kv_len, so p = i)."""
  q_lo = np.arange(-(-length // block_q))[:, None] * block_q
  q_hi = np.minimum(q_lo + block_q, length) - 1
  c_lo = np.arange(-(-length // block_kv))[None, :] * block_kv
  c_hi = np.minimum(c_lo + block_kv, length) - 1
  kind, size = mask
  if kind == "causal":
    return c_lo <= q_hi
  if kind == "window":             # p - size <= j <= p
    return (c_lo <= q_hi) & (c_hi >= q_lo - size)
  live = np.zeros((q_lo.size, c_lo.size), bool)   # chunked causal
  for start in range(0, length, size):
    end = min(start + size, length) - 1
    p_lo, p_hi = np.maximum(q_lo, start), np.minimum(q_hi, end)
    j_lo, j_hi = np.maximum(c_lo, start), np.minimum(c_hi, end)
    live |= (p_lo <= p_hi) & (j_lo <= j_hi) & (j_lo <= p_hi)
  return live


def _walk_steps(live):
  """Steps of a walk over rows of ``live``: one per live block, one for an
  empty row."""
  return int(np.maximum(live.sum(axis=1), 1).sum())


@pytest.mark.parametrize("mask", [("causal", None), ("window", 1024),
                                  ("chunked", 8192)],
                         ids=["causal", "window1024", "chunked8192"])
def test_masked_grids_step_only_through_live_blocks(mask, tpu_topologies):
  """At L = 131072 on v5e the compiled forward, dq and dk/dv kernels walk
  exactly one step per live block (per kv head: per live block and query
  head of its group), and ``mosaic_tpu.grids`` says so beforehand."""
  topology = "v5e:2x2"
  _need(topology, tpu_topologies)
  b, h, hk, length, d = 1, 4, 2, 131072, 128
  # 512 x 512 blocks, so that the step counts below are those of the
  # issue's example (v5e's table row is larger).
  blocks = block_sizes.BlockSizes(block_q=512, block_kv=512,
                                  block_q_bwd=512, block_kv_bwd=512)
  kind, size = mask
  if kind == "chunked":
    kw, band = dict(mask=masks.ChunkedCausal(size)), {}
  else:
    kw = dict(causal=True, sliding_window=size)
    band = dict(causal=True, window_left=size)

  def fn(q, k, v):
    def loss(q, k, v):
      out = flash_attention(q, k, v, backend="mosaic_tpu", block_sizes=blocks,
                            **kw)
      return jnp.sum(out.astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  result = tpu_aot.compile_for_tpu(fn, *_specs(b, h, hk, length, length, d),
                                   topology=topology)
  forward = _live_blocks(length, blocks.block_q, blocks.block_kv, mask)
  backward = _live_blocks(length, blocks.block_q_bwd, blocks.block_kv_bwd,
                          mask)
  want = {"forward": (b, h, _walk_steps(forward)),
          "dq": (b, h, _walk_steps(backward)),
          "dkv": (b, hk, (h // hk) * _walk_steps(backward.T))}
  compiled = {name.split(".")[0].replace("flash_attention_", ""): grid
              for name, grid in result.kernel_grids.items()}
  compiled["forward"] = compiled.pop("fwd")
  assert compiled == want
  assert mosaic_tpu.grids(b, h, hk, length, length, d, mask=kw.get("mask"),
                          block_sizes=blocks, **band) == want
  # Against the rectangular grid: causal halves it, windows shrink to a
  # band of ceil(1024 / 512) + 1 blocks per row.
  rectangle = forward.shape[0] * forward.shape[1]
  assert want["forward"][2] == {"causal": 32896, "window": 765,
                                "chunked": 16 * 136}[kind] < rectangle


# ------------------------------------ masks and sinks on each generation --

def _compile_masked(topology, d, length, mask, with_sinks):
  """Forward + backward of ``flash_attention(q, k, v, mask=mask,
  sinks=...)`` at B1 H4/2 with the generation's own blocks (dq, dk, dv
  and, with sinks, dsinks): the forward, dq and dk/dv Mosaic kernels are
  all there, each within the generation's VMEM."""
  specs = list(_specs(1, 4, 2, length, length, d))
  if with_sinks:
    specs.append(jax.ShapeDtypeStruct((4,), jnp.float32))

  def fn(*args):
    def loss(q, k, v, sinks=None):
      out = flash_attention(q, k, v, mask=mask, sinks=sinks,
                            backend="mosaic_tpu")
      return jnp.sum(out.astype(jnp.float32))
    return jax.grad(loss, argnums=tuple(range(len(args))))(*args)
  _assert_three_kernels_fit(
      tpu_aot.compile_for_tpu(fn, *specs, topology=topology), topology)


# The generations without a default mask compile elsewhere, at the
# head_dims other than 128; at L2048 their blocks (1024 x 512) are full
# size and the chunks leave some empty. Separate programs compile faster
# than one holding both calls.
@pytest.mark.parametrize("topology", ["v5p:2x2x1", "tpu7x:2x2x1"])
@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("mask,with_sinks", [
    (masks.ChunkedCausal(512), True), (masks.PrefixLM(700), False)],
    ids=["chunked_sinks", "prefix_lm"])
def test_masks_and_sinks_compile_on_v5p_and_tpu7x(topology, d, mask,
                                                  with_sinks, tpu_topologies):
  _need(topology, tpu_topologies)
  _compile_masked(topology, d, 2048, mask, with_sinks)


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2", "v5p:2x2x1",
                                      "tpu7x:2x2x1"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("length", [8192, 131072])
def test_sweep_chunked_with_sinks_to_128k(topology, d, length,
                                          tpu_topologies):
  _need(topology, tpu_topologies)
  _compile_masked(topology, d, length, masks.ChunkedCausal(2048), True)


# ------------------------------------------ MLA: v's head_dim != q's --

def _compile_mla(topology, d, dv, length, dtype=jnp.bfloat16, **kw):
  """Forward + backward at B1 H4/2 with q/k of head_dim ``d`` and v of
  ``dv`` and the generation's own blocks: the three kernels, each within
  the generation's VMEM; out and dv have ``dv`` columns."""
  q, k, _ = _specs(1, 4, 2, length, length, d, dtype)
  v = jax.ShapeDtypeStruct((1, 2, length, dv), dtype)

  def fn(q, k, v):
    def loss(q, k, v):
      out = flash_attention(q, k, v, backend="mosaic_tpu", **kw)
      return jnp.sum(out.astype(jnp.float32)), out
    return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  (dq, dk, dv_), out = jax.eval_shape(fn, q, k, v)
  assert out.shape == (1, 4, length, dv)
  assert (dq.shape, dk.shape, dv_.shape) == (q.shape, k.shape, v.shape)
  _assert_three_kernels_fit(
      tpu_aot.compile_for_tpu(fn, q, k, v, topology=topology), topology)


def _assert_three_kernels_fit(result, topology):
  """The forward, dq and dkv kernels were compiled, each within the
  generation's VMEM."""
  vmem = result.kernel_vmem_bytes
  for name in ("flash_attention_fwd", "flash_attention_dq",
               "flash_attention_dkv"):
    assert any(call.startswith(name) for call in vmem), (name, vmem)
  limit = _backend.TPU_VMEM_BYTES[tpu_aot.topology_generation(topology)]
  assert 0 < max(vmem.values()) <= limit, vmem


@pytest.mark.parametrize("topology", sorted(GENERATIONS))
@pytest.mark.parametrize("length", [
    256, pytest.param(1024, marks=pytest.mark.slow)])
def test_mla_deepseek_head_dims_compile(topology, length, tpu_topologies):
  """DeepSeek-V3's q/k head_dim 192 and v head_dim 128, causal; at 1024
  the generation's full table blocks."""
  _need(topology, tpu_topologies)
  _compile_mla(topology, 192, 128, length, causal=True)


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2", "v5p:2x2x1",
                                      "tpu7x:2x2x1"])
@pytest.mark.parametrize("d,dv", [(192, 128), (128, 256), (64, 512)])
@pytest.mark.parametrize("length", [4096, 32768])
def test_sweep_mla_head_dims(topology, d, dv, length, tpu_topologies):
  _need(topology, tpu_topologies)
  _compile_mla(topology, d, dv, length, causal=True, sliding_window=2048)


@pytest.mark.slow
@pytest.mark.parametrize("topology", sorted(GENERATIONS))
def test_mla_float32_soft_cap_compile(topology, tpu_topologies):
  _need(topology, tpu_topologies)
  _compile_mla(topology, 192, 128, 2048, jnp.float32, logit_soft_cap=30.0)
