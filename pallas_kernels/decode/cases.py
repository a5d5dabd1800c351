"""Main-job cases for decode attention (``python -m pallas_kernels``)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels._cases import Case
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
