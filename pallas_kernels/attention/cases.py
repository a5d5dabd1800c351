"""Main-job cases for flash attention (``python -m pallas_kernels``)."""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._cases import Case, max_abs_error
from pallas_kernels.attention.api import flash_attention

# (batch, heads, kv_heads, seq, head_dim, dtype) per size.
_SHAPES = {
    "small": (1, 2, 1, 256, 64, jnp.float32),
    "medium": (2, 8, 2, 1024, 128, jnp.bfloat16),
    "large": (4, 16, 4, 4096, 128, jnp.bfloat16),
}


def relative_error(out, ref) -> float:
  """Max abs error over the largest reference magnitude (at least 1)."""
  scale = max([1.0] + [float(np.max(np.abs(np.asarray(r, np.float64)),
                                    initial=0))
                       for r in jax.tree_util.tree_leaves(ref)])
  return max_abs_error(out, ref) / scale


def _causal(q, k, v, *, backend=None):
  return flash_attention(q, k, v, causal=True, backend=backend)


def _features(q, k, v, q_seg, kv_seg, bias, *, backend=None):
  return flash_attention(q, k, v, causal=True, sliding_window=q.shape[2] // 4,
                         segment_ids=(q_seg, kv_seg), logit_soft_cap=20.0,
                         bias=bias, return_lse=True, backend=backend)


def _gradients(q, k, v, *, backend=None):
  def loss(q, k, v):
    out = flash_attention(q, k, v, causal=True, backend=backend)
    return jnp.sum(out.astype(jnp.float32) ** 2)
  return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def main_job_cases(size: str) -> list[Case]:
  b, h, hk, length, d, dtype = _SHAPES[size]
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((b, h, length, d)), dtype)
  k = jnp.asarray(rng.standard_normal((b, hk, length, d)), dtype)
  v = jnp.asarray(rng.standard_normal((b, hk, length, d)), dtype)
  # Two packed sequences per row, and a per-head bias.
  seg = jnp.asarray(np.broadcast_to(
      (np.arange(length) >= length // 3).astype(np.int32), (b, length)))
  bias = jnp.asarray(0.1 * rng.standard_normal((1, h, length, length)), dtype)
  exact = dtype == jnp.float32
  shape = f"B{b} H{h}/{hk} L{length} D{d} {jnp.dtype(dtype).name}"
  return [
      Case("flash_attention", f"causal GQA {shape}", _causal, (q, k, v),
           tolerance=2e-5 if exact else 2e-2, error=relative_error),
      Case("flash_attention", f"segments+window+cap+bias {shape}",
           _features, (q, k, v, seg, seg, bias),
           tolerance=2e-5 if exact else 2e-2, error=relative_error),
      Case("flash_attention", f"grad causal {shape}", _gradients, (q, k, v),
           tolerance=1e-4 if exact else 5e-2, error=relative_error),
  ]
