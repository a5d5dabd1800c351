"""write_kv_pages against a per-token numpy loop written here: mixed
prefill/decode batches, empty sequences, sequences past ``num_seqs``,
garbage table entries, tokens past the sequences; the cache is left alone
elsewhere (bit-exact); the write then attend step equals attending over a
cache written by the loop; the TPU kernel compiles with the cache aliased.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import backends
import pallas_kernels as pk
from pallas_kernels import _compat
from test_ragged_paged_attention import make_batch

KERNELS = backends.params(["interpret", "interpret_generic", "reference"])


def _oracle(pages, new_kv, lens, table, cu, n):
  """Each sequence's new tokens at positions len - q_len + t, one by one."""
  out = np.array(pages)
  num_pages, page_size = out.shape[:2]
  for i in range(n):
    q_len = cu[i + 1] - cu[i]
    for t in range(q_len):
      pos = lens[i] - q_len + t
      if not 0 <= pos < table.shape[1] * page_size:
        continue
      page = table[i, pos // page_size]
      if 0 <= page < num_pages:
        out[page, pos % page_size] = new_kv[cu[i] + t]
  return out


def _batch(rng, dtype=jnp.float32, latent=False):
  # A prefill chunk, decodes, an empty sequence, one row past num_seqs.
  args = make_batch(rng, [6, 1, 0, 1], [9, 13, 5, 1], heads=4, kv_heads=2,
                    head_dim=128, page_size=4, pages_per_seq=4, dtype=dtype,
                    extra_seqs=1, extra_tokens=3)
  q, pages = args[0], args[1]
  pages = jnp.nan_to_num(pages, nan=-7.0)   # exact comparison below
  if latent:   # MLA's pool: one [D] row per token
    pages = pages[:, :, 0]
  new_kv = jnp.asarray(rng.standard_normal((q.shape[0],) + pages.shape[2:]),
                       dtype)
  return (pages, new_kv) + args[2:]


@pytest.mark.parametrize("latent", [False, True], ids=["kv", "latent"])
@pytest.mark.parametrize("backend", KERNELS)
def test_matches_the_per_token_loop(backend, latent, rng):
  pages, new_kv, lens, table, cu, num = _batch(rng, latent=latent)
  got = backend.run(jax.jit(pk.write_kv_pages, static_argnames="backend"),
                    pages, new_kv, lens, table, cu, num)
  want = _oracle(np.asarray(pages), np.asarray(new_kv), np.asarray(lens),
                 np.asarray(table), np.asarray(cu), int(num[0]))
  np.testing.assert_array_equal(np.asarray(got), want)
  assert not np.array_equal(want, np.asarray(pages))   # something written


def test_write_then_attend_equals_attention_over_the_written_cache(rng):
  pages, new_kv, lens, table, cu, num = _batch(rng)
  q = jnp.asarray(rng.standard_normal((new_kv.shape[0], 4, 128)),
                  jnp.float32)

  @jax.jit
  def step(pages, new_kv):
    with pk.force_interpret("generic"):
      pages = pk.write_kv_pages(pages, new_kv, lens, table, cu, num)
      return pk.ragged_paged_attention(q, pages, lens, table, cu, num,
                                       sm_scale=0.2), pages

  out, written = step(pages, new_kv)
  want = pk.ragged_paged_attention(q, jnp.asarray(_oracle(
      np.asarray(pages), np.asarray(new_kv), np.asarray(lens),
      np.asarray(table), np.asarray(cu), int(num[0]))), lens, table, cu, num,
                                   sm_scale=0.2, backend="reference")
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5)


@pytest.mark.parametrize("call, match", [
    (lambda p, n, *m: pk.write_kv_pages(p, n[:, :2], *m), "new_kv must be"),
    (lambda p, n, *m: pk.write_kv_pages(p[0, 0], n, *m), "kv_pages must be"),
    (lambda p, n, l, t, c, s: pk.write_kv_pages(p, n, l, t, c, s[None]),
     "num_seqs must be"),
    (lambda p, n, l, t, c, s: pk.write_kv_pages(p, n, l.astype(float), t, c,
                                                s), "kv_lens must be int32"),
])
def test_bad_inputs_raise(call, match, rng):
  with pytest.raises(ValueError, match=match):
    call(*_batch(rng))


@pytest.mark.tpu_aot
def test_compiles_for_tpu_with_the_cache_aliased(tpu_topologies):
  """Donated cache: the compiled program's output aliases its input."""
  from pallas_kernels import tpu_aot
  s = jax.ShapeDtypeStruct
  args = (s((512, 16, 16, 128), jnp.bfloat16), s((300, 16, 128), jnp.bfloat16),
          s((8,), jnp.int32), s((8, 64), jnp.int32), s((9,), jnp.int32),
          s((1,), jnp.int32))
  result = tpu_aot.compile_for_tpu(
      lambda *a: pk.write_kv_pages(*a, backend="mosaic_tpu"), *args,
      topology="v5e:2x2")
  assert any(name.startswith("write_kv_pages")
             for name in result.kernel_vmem_bytes)


@pytest.mark.tpu_aot
def test_latent_pool_write_compiles_for_tpu(tpu_topologies):
  """MLA's [P, page_size, D] pool: a float32 one by the kernel (one [1, D]
  row DMA per token, aliased); a bfloat16 one's rows share 32-bit words, so
  the kernel is refused with that reason and backend=None runs XLA's
  scatter."""
  from pallas_kernels import tpu_aot
  s = jax.ShapeDtypeStruct

  def args(dtype):
    return (s((512, 16, 576), dtype), s((300, 576), dtype),
            s((8,), jnp.int32), s((8, 64), jnp.int32), s((9,), jnp.int32),
            s((1,), jnp.int32))

  def compile_(dtype, backend):
    return tpu_aot.compile_for_tpu(
        lambda *a: pk.write_kv_pages(*a, backend=backend), *args(dtype),
        topology="v5e:2x2").kernel_vmem_bytes

  if _compat.JAX_VERSION < (0, 12):   # no single-row DMAs there
    with pytest.raises(tpu_aot.TpuCompileError, match="needs jax >= 0.12"):
      compile_(jnp.float32, "mosaic_tpu")
  else:
    assert any(n.startswith("write_kv_pages")
               for n in compile_(jnp.float32, "mosaic_tpu"))
  assert not compile_(jnp.bfloat16, None)   # XLA's scatter, no kernel
  with pytest.raises(tpu_aot.TpuCompileError, match="32-bit words"):
    compile_(jnp.bfloat16, "mosaic_tpu")
