"""decode_attention's Mosaic kernel through the real TPU compiler (no TPU).

Default: contiguous and paged caches up to 128k positions at head_dim 128
(and an odd head_dim and page size) on v5e and v6e, each kernel's VMEM
within its generation's, and a 4-chip sharded call; an int8 cache on v5e
and a float8_e4m3fn paged one on v6e; MLA's q/k head_dim 192 with v's 128,
paged on v5e and contiguous on v6e. ``--runslow`` sweeps head_dim
64/128/256, caches 8k..128k, contiguous and paged, on every generation
libtpu compiles for, the 8-bit formats on every generation, and v head_dims
narrower and wider than q's.
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import sweeps
from pallas_kernels import _backend, _compat, decode_attention, tpu_aot

pytestmark = pytest.mark.tpu_aot

REQUIRED = ("v5e:2x2", "v6e:2x2")
ALL_GENERATIONS = REQUIRED + ("v5p:2x2x1", "tpu7x:2x2x1", "v4:2x2x1")


def _need(topology, tpu_topologies):
  if topology not in tpu_topologies:
    pytest.skip(f"libtpu lacks {topology}")


def _spec(*shape, dtype=jnp.bfloat16):
  return jax.ShapeDtypeStruct(shape, dtype)


def _compile(topology, b, h, hk, t, length, d, page_size=None,
             cache_dtype=jnp.bfloat16, dv=None, **kw):
  """Compiles one call; checks it ran the Mosaic kernel within VMEM. An
  8-bit ``cache_dtype`` comes with per-head scales; ``dv``: v's head_dim
  (MLA), default d."""
  q = _spec(b, h, t, d)
  lengths = _spec(b, dtype=jnp.int32)
  if cache_dtype != jnp.bfloat16:
    kw.update(k_scale=jnp.full((hk,), 0.02), v_scale=jnp.full((hk,), 0.03))
  if page_size is None:
    k_cache, v_cache = (_spec(b, hk, length, dim, dtype=cache_dtype)
                        for dim in (d, dv or d))
    args = (q, k_cache, v_cache, lengths)
    fn = lambda q, k, v, n: decode_attention(  # noqa: E731
        q, k, v, n, backend="mosaic_tpu", **kw)
  else:
    pages = length // page_size
    k_cache, v_cache = (_spec(b * pages, hk, page_size, dim,
                              dtype=cache_dtype) for dim in (d, dv or d))
    args = (q, k_cache, v_cache, lengths, _spec(b, pages, dtype=jnp.int32))
    fn = lambda q, k, v, n, table: decode_attention(  # noqa: E731
        q, k, v, n, page_table=table, backend="mosaic_tpu", **kw)
  result = tpu_aot.compile_for_tpu(fn, *args, topology=topology)
  assert jax.eval_shape(fn, *args).shape == (b, h, t, dv or d)
  vmem = result.kernel_vmem_bytes
  assert vmem, "no Mosaic kernel in the program"
  limit = _backend.TPU_VMEM_BYTES[tpu_aot.topology_generation(topology)]
  assert max(vmem.values()) <= limit, vmem
  return result


@pytest.mark.parametrize("topology,b,h,hk,t,length,d,page_size,kw",
                         sweeps.covering_pairs(REQUIRED, [
    (1, 32, 8, 1, 131072, 128, None, {}),
    (64, 32, 8, 1, 8192, 128, None, dict(sliding_window=1024)),
    (4, 8, 2, 4, 1000, 96, None, dict(logit_soft_cap=30.0)),
    (8, 32, 8, 2, 131072, 128, 128, {}),
    (64, 32, 8, 1, 32768, 128, 16, {}),   # page table over two launches
    (2, 8, 2, 3, 1500, 96, 24, dict(sliding_window=100)),
]))
def test_compiles_within_vmem(topology, b, h, hk, t, length, d, page_size, kw,
                              tpu_topologies):
  _need(topology, tpu_topologies)
  if page_size and d % 128 and _compat.JAX_VERSION < (0, 12):
    # The chooser refuses with the reason (backend=None takes the reference).
    with pytest.raises(tpu_aot.TpuCompileError, match="need jax >= 0.12"):
      _compile(topology, b, h, hk, t, length, d, page_size, **kw)
    return
  _compile(topology, b, h, hk, t, length, d, page_size, **kw)


def test_8bit_caches_compile(tpu_topologies):
  """B8 H32/8 D128, 32k positions: int8 contiguous on v5e, float8_e4m3fn
  in pages of 64 on v6e; the kernel reads the caches as they are (the
  program holds no bfloat16 copy of them)."""
  for topology, page_size, dtype, cache in (
      ("v5e:2x2", None, jnp.int8, "8,8,32768,128"),
      ("v6e:2x2", 64, jnp.float8_e4m3fn, "4096,8,64,128")):
    _need(topology, tpu_topologies)
    result = _compile(topology, 8, 32, 8, 1, 32768, 128, page_size,
                      cache_dtype=dtype)
    stored = {jnp.int8: "s8", jnp.float8_e4m3fn: "f8e4m3fn"}[dtype]
    assert f"{stored}[{cache}]" in result.hlo_text
    assert f"bf16[{cache}]" not in result.hlo_text


@pytest.mark.parametrize("topology,page_size", [("v5e:2x2", 128),
                                                ("v6e:2x2", None)])
def test_mla_value_head_dim_compiles(topology, page_size, tpu_topologies):
  """MLA (DeepSeek-V3): q/k head_dim 192, v's 128; B4 H16/2 T2 over 32k
  positions with a window, paged on v5e, contiguous on v6e (both on both:
  ``test_mla_sweep``)."""
  _need(topology, tpu_topologies)
  args = (topology, 4, 16, 2, 2, 32768, 192, page_size)
  if page_size and _compat.JAX_VERSION < (0, 12):
    with pytest.raises(tpu_aot.TpuCompileError, match="need jax >= 0.12"):
      _compile(*args, dv=128, sliding_window=4096)
    return
  _compile(*args, dv=128, sliding_window=4096)


def test_sinks_and_sixteen_tokens_compile(tpu_topologies):
  _need("v6e:2x2", tpu_topologies)
  q = _spec(2, 16, 16, 256)
  cache = _spec(2, 2, 4096, 256)
  result = tpu_aot.compile_for_tpu(
      lambda q, k, v, n, s: decode_attention(q, k, v, n, sinks=s,
                                             backend="mosaic_tpu"),
      q, cache, cache, _spec(2, dtype=jnp.int32), _spec(16, dtype=jnp.float32),
      topology="v6e:2x2")
  assert result.kernel_vmem_bytes


def test_platform_default_picks_mosaic(tpu_topologies):
  result = tpu_aot.compile_for_tpu(
      lambda q, k, v, n: decode_attention(q, k, v, n),
      _spec(2, 8, 1, 128), _spec(2, 2, 2048, 128), _spec(2, 2, 2048, 128),
      _spec(2, dtype=jnp.int32), topology=tpu_topologies[0])
  assert "tpu_custom_call" in result.hlo_text


def test_sharded_over_four_chips(tpu_topologies):
  topology = "v5e:2x2"
  _need(topology, tpu_topologies)
  mesh = tpu_aot.topology_mesh(topology, ("data", "model"), (2, 2))
  b, h, hk, length, d = 4, 32, 8, 8192, 128
  big = NamedSharding(mesh, P("data", "model", None, None))
  specs = [jax.ShapeDtypeStruct((b, h, 1, d), jnp.bfloat16, sharding=big),
           jax.ShapeDtypeStruct((b, hk, length, d), jnp.bfloat16,
                                sharding=big),
           jax.ShapeDtypeStruct((b, hk, length, d), jnp.bfloat16,
                                sharding=big),
           jax.ShapeDtypeStruct((b,), jnp.int32,
                                sharding=NamedSharding(mesh, P("data")))]
  spec4 = P("data", "model", None, None)
  fn = _compat.shard_map(
      lambda q, k, v, n: decode_attention(q, k, v, n, backend="mosaic_tpu"),
      mesh=mesh, in_specs=(spec4, spec4, spec4, P("data")), out_specs=spec4)
  version_cap = getattr(_compat, "mosaic_version_for_aot",
                        contextlib.nullcontext)
  with tpu_aot._captured_stderr(), version_cap():
    compiled = jax.jit(fn).lower(*specs).compile()
  assert "tpu_custom_call" in compiled.as_text()
  # Each chip holds a quarter of q and the caches (the lengths: padding).
  per_chip = (b * h * d + 2 * b * hk * length * d) * 2 // 4
  held = compiled.memory_analysis().argument_size_in_bytes
  assert per_chip <= held < per_chip + 4096


@pytest.mark.slow
@pytest.mark.parametrize("topology", ALL_GENERATIONS)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("length", [8192, 32768, 131072])
@pytest.mark.parametrize("page_size", [None, 64])
def test_sweep(topology, d, length, page_size, tpu_topologies):
  _need(topology, tpu_topologies)
  _compile(topology, 2, 16, 4, 4, length, d, page_size,
           sliding_window=length // 2, logit_soft_cap=50.0)


@pytest.mark.slow
@pytest.mark.parametrize("topology", ALL_GENERATIONS)
@pytest.mark.parametrize("d,dv", [(192, 128), (128, 256), (64, 128)])
@pytest.mark.parametrize("page_size", [None, 64])
def test_mla_sweep(topology, d, dv, page_size, tpu_topologies):
  _need(topology, tpu_topologies)
  if page_size and (d % 128 or dv % 128) and _compat.JAX_VERSION < (0, 12):
    pytest.skip("paged head_dims off the 128 grid need jax >= 0.12")
  _compile(topology, 2, 16, 4, 4, 32768, d, page_size, dv=dv,
           sliding_window=8000, logit_soft_cap=50.0)


@pytest.mark.slow
@pytest.mark.parametrize("topology", ALL_GENERATIONS)
@pytest.mark.parametrize("cache_dtype", [jnp.int8, jnp.float8_e4m3fn,
                                         jnp.float8_e5m2])
@pytest.mark.parametrize("page_size,t", [(None, 1), (16, 4), (128, 1)])
def test_8bit_sweep(topology, cache_dtype, page_size, t, tpu_topologies):
  _need(topology, tpu_topologies)
  _compile(topology, 4, 32, 8, t, 32768, 128, page_size,
           cache_dtype=cache_dtype, sliding_window=8000)
