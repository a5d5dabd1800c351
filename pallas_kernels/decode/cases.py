"""Main-job cases for decode attention (``python -m pallas_kernels``)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels._cases import Case, abstract
from pallas_kernels.attention.cases import relative_error
from pallas_kernels.decode.api import decode_attention

# (batch, heads, kv_heads, new tokens, cache length, head_dim, page size,
# dtype) per size.
_SHAPES = {
    "small": (2, 4, 2, 2, 512, 64, 64, jnp.float32),
    "medium": (8, 32, 8, 1, 8192, 128, 128, jnp.bfloat16),
    "large": (32, 32, 8, 4, 32768, 128, 128, jnp.bfloat16),
}


def _contiguous(q, k, v, lengths, sinks, *, backend=None):
  return decode_attention(q, k, v, lengths, sinks=sinks, backend=backend)


def _paged(q, k, v, lengths, table, *, backend=None):
  return decode_attention(q, k, v, lengths, page_table=table,
                          sliding_window=k.shape[2] * 3,
                          logit_soft_cap=30.0, backend=backend)


def main_job_cases(size: str) -> list[Case]:
  b, h, hk, t, length, d, page, dtype = _SHAPES[size]
  rng = np.random.default_rng(0)
  normal = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
  q = normal(b, h, t, d)
  k, v = normal(b, hk, length, d), normal(b, hk, length, d)
  lengths = jnp.asarray(rng.integers(t, length + 1, b), jnp.int32)
  sinks = jnp.asarray(rng.standard_normal(h), jnp.float32)
  pages = length // page
  # The same tokens in shuffled pages.
  table = rng.permutation(b * pages).reshape(b, pages)
  k_pages = jnp.zeros((b * pages, hk, page, d), dtype).at[table].set(
      k.reshape(b, hk, pages, page, d).transpose(0, 2, 1, 3, 4))
  v_pages = jnp.zeros((b * pages, hk, page, d), dtype).at[table].set(
      v.reshape(b, hk, pages, page, d).transpose(0, 2, 1, 3, 4))
  exact = dtype == jnp.float32
  shape = (f"B{b} H{h}/{hk} T{t} S{length} D{d} "
           f"{jnp.dtype(dtype).name}")
  return [
      Case("decode_attention", f"ragged+sinks {shape}", _contiguous,
           (q, k, v, lengths, sinks), tolerance=2e-5 if exact else 2e-2,
           error=relative_error),
      Case("decode_attention", f"paged{page}+window+cap {shape}", _paged,
           (q, k_pages, v_pages, lengths, jnp.asarray(table, jnp.int32)),
           tolerance=2e-5 if exact else 2e-2, error=relative_error),
  ]


def support_cases():
  """(label, run(backend)) rows of the docs' backend-support table: each run
  traces one call with ``jax.eval_shape``."""
  import jax
  import jax.numpy as jnp
  def call(d=128, dtype=jnp.bfloat16, t=1, page_size=None, cache_dtype=None,
           dv=None, **kw):
    q = abstract((2, 8, t, d), dtype)
    lengths = abstract((2,), jnp.int32)
    cache_dtype = cache_dtype or dtype
    if page_size is None:
      cache, v_cache = (abstract((2, 2, 1024, dim), cache_dtype)
                        for dim in (d, dv or d))
      extra = []
    else:
      cache, v_cache = (abstract((64, 2, page_size, dim), cache_dtype)
                        for dim in (d, dv or d))
      extra = [abstract((2, 1024 // page_size), jnp.int32)]
    if "sinks" in kw:
      extra.append(abstract((8,), jnp.float32))
    if cache_dtype != dtype:   # 8-bit: per-head scales
      kw.update(k_scale=jnp.ones((2,)), v_scale=jnp.ones((2,)))

    def run(backend):
      def f(q, k, v, n, *rest):
        options = dict(kw)
        rest = list(rest)
        if page_size is not None:
          options["page_table"] = rest.pop(0)
        if "sinks" in options:
          options["sinks"] = rest.pop(0)
        return decode_attention(q, k, v, n, backend=backend, **options)
      return jax.eval_shape(f, q, cache, v_cache, lengths, *extra)
    return run

  return [
      ("bf16, head_dim 128, GQA 8/2", call()),
      ("head_dim 64", call(d=64)),
      ("head_dim 96", call(d=96)),
      ("head_dim 256", call(d=256)),
      ("MLA (q/k head_dim 192, v 128)", call(d=192, dv=128)),
      ("MLA, paged, page_size 64 (192, v 128)",
       call(d=192, dv=128, page_size=64)),
      ("float32", call(dtype=jnp.float32)),
      ("float16", call(dtype=jnp.float16)),
      ("16 new tokens", call(t=16)),
      ("sliding_window", call(sliding_window=256)),
      ("logit_soft_cap", call(logit_soft_cap=30.0)),
      ("sinks", call(sinks=True)),
      ("paged, page_size 16", call(page_size=16)),
      ("paged, page_size 128", call(page_size=128)),
      ("paged, page_size 24", call(page_size=24)),
      ("int8 cache (k_scale/v_scale)", call(cache_dtype=jnp.int8)),
      ("float8_e4m3fn cache, paged",
       call(cache_dtype=jnp.float8_e4m3fn, page_size=64)),
      ("float8_e5m2 cache", call(cache_dtype=jnp.float8_e5m2)),
      ("int8 cache, float16 q", call(dtype=jnp.float16,
                                     cache_dtype=jnp.int8)),
  ]
