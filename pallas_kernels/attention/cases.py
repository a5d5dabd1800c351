"""Main-job cases for flash attention (``python -m pallas_kernels``)."""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._cases import Case, abstract, max_abs_error
from pallas_kernels.attention import masks
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


def support_cases():
  """(label, run(backend)) rows of the docs' backend-support table: each run
  traces one call with ``jax.eval_shape``."""
  def call(d=128, dtype=jnp.bfloat16, kv_heads=4, grad=False, dv=None,
           **kw):
    q = abstract((2, 4, 256, d), dtype)
    kv = abstract((2, kv_heads, 256, d), dtype)
    v = kv if dv is None else abstract((2, kv_heads, 256, dv), dtype)

    def run(backend):
      def f(q, k, v, *extra):
        options = dict(kw)
        if "segment_ids" in options:
          options["segment_ids"] = (extra[0], extra[0])
        if "bias" in options:
          options["bias"] = extra[-1]
        if "sinks" in options:
          options["sinks"] = extra[-1]
        return flash_attention(q, k, v, backend=backend, **options)
      extra = []
      if "segment_ids" in kw:
        extra.append(abstract((2, 256), jnp.int32))
      if "bias" in kw:
        extra.append(abstract((2, 4, 256, 256), jnp.float32))
      if "sinks" in kw:
        extra.append(abstract((4,), jnp.float32))
      if grad:
        loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32))  # noqa: E731
        return jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), q, kv, v,
                              *extra)
      return jax.eval_shape(f, q, kv, v, *extra)
    return run

  return [
      ("bf16, head_dim 128", call()),
      ("head_dim 64", call(d=64)),
      ("head_dim 96", call(d=96)),
      ("head_dim 256", call(d=256)),
      ("float32", call(dtype=jnp.float32)),
      ("causal", call(causal=True)),
      ("sliding_window", call(sliding_window=(64, 0))),
      ("segment_ids", call(segment_ids=True)),
      ("bias", call(bias=True)),
      ("logit_soft_cap", call(logit_soft_cap=30.0)),
      ("mask=ChunkedCausal(64)", call(mask=masks.ChunkedCausal(64))),
      ("sinks", call(sinks=True)),
      ("GQA (4 q heads, 2 kv heads)", call(kv_heads=2)),
      ("MLA (q/k head_dim 192, v 128)", call(d=192, dv=128)),
      ("backward, head_dim 128", call(grad=True)),
      ("backward, head_dim 256", call(d=256, grad=True)),
      ("backward, causal", call(causal=True, grad=True)),
      ("backward, MLA (192, v 128)", call(d=192, dv=128, grad=True)),
  ]
