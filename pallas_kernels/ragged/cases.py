"""Main-job cases for ragged paged attention and its MLA form (``python -m
pallas_kernels``).
"""
from __future__ import annotations

import numpy as np

from pallas_kernels._cases import Case, abstract
from pallas_kernels.attention.cases import relative_error
from pallas_kernels.ragged import api

# (prefill tokens per prefill, prefills, decodes, heads, kv_heads, page
# size, pages per sequence, dtype name) per size.
SHAPES = {
    "small": (40, 1, 5, 4, 2, 16, 8, "float32"),
    "medium": (256, 1, 31, 32, 8, 16, 128, "bfloat16"),
    "large": (1024, 2, 62, 32, 8, 16, 512, "bfloat16"),
}


def main_job_cases(size):
  import jax.numpy as jnp
  prefill, n_prefill, n_decode, h, hk, page, pages, dtype = SHAPES[size]
  dtype = jnp.dtype(dtype)
  d = 128
  rng = np.random.default_rng(0)
  s = n_prefill + n_decode
  capacity = page * pages
  # A vLLM-style step: chunked prefills (cache partly filled before) and
  # decodes of one token, in one call; the page pool dealt at random.
  q_lens = [prefill] * n_prefill + [1] * n_decode
  kv_lens = rng.integers(np.array(q_lens), capacity + 1)
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  table = rng.permutation(s * pages).reshape(s, pages).astype(np.int32)
  q = jnp.asarray(rng.standard_normal((int(cu[-1]), h, d)), dtype)
  kv = jnp.asarray(rng.standard_normal((s * pages, page, 2 * hk, d)), dtype)
  args = (q, kv, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(table),
          jnp.asarray(cu), jnp.asarray([s], jnp.int32))

  def ragged_paged_attention(*a, backend=None):
    return api.ragged_paged_attention(*a, sm_scale=d ** -0.5,
                                      backend=backend)

  exact = dtype == jnp.float32
  return [Case(op="ragged_paged_attention",
               shape=(f"{n_prefill}x{prefill}+{n_decode}x1 tokens H{h}/{hk} "
                      f"D{d} page{page}x{pages} {dtype.name}"),
               fn=ragged_paged_attention, args=args,
               tolerance=2e-5 if exact else 2e-2, error=relative_error)
          ] + _mla_cases(size)


# (heads, decodes, prefill tokens, page size, pages per sequence, dtype) of
# the MLA cases: DeepSeek-V3's absorbed row (latent 512 + rope 64).
MLA_SHAPES = {
    "small": (4, 3, 20, 16, 4, "float32"),
    "medium": (16, 31, 256, 16, 64, "bfloat16"),
    "large": (128, 62, 1024, 64, 64, "bfloat16"),
}


def _mla_cases(size):
  import jax.numpy as jnp
  h, n_decode, prefill, page, pages, dtype = MLA_SHAPES[size]
  dtype = jnp.dtype(dtype)
  latent, d = 512, 576
  rng = np.random.default_rng(1)
  s = n_decode + 1
  q_lens = [prefill] + [1] * n_decode
  kv_lens = rng.integers(np.array(q_lens), page * pages + 1)
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  table = rng.permutation(s * pages).reshape(s, pages).astype(np.int32)
  q = jnp.asarray(rng.standard_normal((int(cu[-1]), h, d)), dtype)
  kv = jnp.asarray(rng.standard_normal((s * pages, page, d)), dtype)
  args = (q, kv, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(table),
          jnp.asarray(cu), jnp.asarray([s], jnp.int32))

  def mla_ragged_paged_attention(*a, backend=None):
    return api.mla_ragged_paged_attention(*a, latent_dim=latent,
                                          sm_scale=192 ** -0.5,
                                          backend=backend)

  exact = dtype == jnp.float32
  return [Case(op="mla_ragged_paged_attention",
               shape=(f"1x{prefill}+{n_decode}x1 tokens H{h} D{d} latent "
                      f"{latent} page{page}x{pages} {dtype.name}"),
               fn=mla_ragged_paged_attention, args=args,
               tolerance=2e-5 if exact else 2e-2, error=relative_error)]


def support_cases():
  """(label, run(backend)) rows of the docs' backend-support table: each run
  traces one call with ``jax.eval_shape``."""
  import jax
  import jax.numpy as jnp
  def call(dtype=jnp.bfloat16, d=128, kv_heads=2):
    q = abstract((64, 8, d), dtype)
    pages = abstract((32, 16, 2 * kv_heads, d), dtype)
    ints = [abstract((4,), jnp.int32), abstract((4, 8), jnp.int32),
            abstract((5,), jnp.int32), abstract((1,), jnp.int32)]

    def run(backend):
      return jax.eval_shape(
          lambda *a: api.ragged_paged_attention(*a, backend=backend), q,
          pages, *ints)
    return run

  def mla(dtype=jnp.bfloat16, d=576, latent=512):
    q = abstract((64, 16, d))
    pages = abstract((32, 16, d), dtype)
    ints = [abstract((4,), jnp.int32), abstract((4, 8), jnp.int32),
            abstract((5,), jnp.int32), abstract((1,), jnp.int32)]

    def run(backend):
      return jax.eval_shape(
          lambda *a: api.mla_ragged_paged_attention(
              *a, latent_dim=latent, backend=backend), q, pages, *ints)
    return run

  return [
      ("bf16 cache, head_dim 128, GQA 4", call()),
      ("float32 cache, head_dim 64", call(jnp.float32, 64)),
      ("MLA: bf16 cache, D 576 (latent 512 + rope 64), 16 heads", mla()),
      ("MLA: fp8 e4m3 cache, D 576", mla(jnp.float8_e4m3fn)),
  ]
