"""The GPU kernel of ragged_paged_attention compiled (not interpreted)
against the tests' float64 oracle: the shared suite's cases and a random
sweep (page sizes 4-32, GQA 1-8, head_dim 64/96/128, window, soft cap,
sinks, int8/fp8 caches with scales, splits); and mla_ragged_paged_attention's
("mla ..."): its suite's cases and a sweep over latent rows (DeepSeek's D 576
/ latent 512, 80/64, 144/128), 1-128 heads, the same options. Run on a GPU:

    PYTHONPATH=. python scripts/ragged_gpu_check.py [--list] [NAME_PART ...]
"""
from __future__ import annotations

import os
import sys

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import backends  # noqa: E402
import test_ragged_paged_attention as t  # noqa: E402
import test_mla_ragged_paged_attention as mla  # noqa: E402
import _gpu_check  # noqa: E402

GPU = backends.Backend("triton_compiled", "triton", None)


def main():
  checks = []
  for name, case in sorted(t.CASES.items()):
    case = dict(case)
    kw = case.pop("kw")
    dtype = case.get("dtype", jnp.float32)
    checks.append((name, t.make_batch(np.random.default_rng(len(name)),
                                      **case), t.TOL[dtype], kw))
  for seed in range(24):
    rng = np.random.default_rng(1000 + seed)
    kv_heads = int(rng.choice([1, 2, 4]))
    group = int(rng.choice([1, 2, 3, 4, 8]))
    page_size = int(rng.choice([4, 8, 16, 32]))
    pages_per_seq = int(rng.integers(1, 40))
    n = int(rng.integers(1, 7))
    kv_lens, q_lens = t.random_lengths(rng, n, pages_per_seq * page_size)
    cache = [None, None, jnp.int8, jnp.float8_e4m3fn,
             jnp.float8_e5m2][seed % 5]
    dtype = jnp.bfloat16 if seed % 3 == 0 or cache else jnp.float32
    kw = dict(sm_scale=float(rng.uniform(0.05, 0.3)))
    if cache is not None:
      kw.update(k_scale=0.03, v_scale=0.05)
    if seed % 2:
      kw["sliding_window"] = int(rng.integers(1, 200))
    if seed % 4 == 1:
      kw["soft_cap"] = 3.0
    if seed % 3 == 1:
      kw["sinks"] = jnp.asarray(rng.standard_normal(kv_heads * group),
                                jnp.float32)
    if seed % 6 == 5:
      kw["num_queries_per_block"] = int(rng.integers(1, 40))
      kw["num_kv_pages_per_block"] = int(rng.integers(1, 8))
    args = t.make_batch(rng, q_lens, kv_lens, heads=kv_heads * group,
                        kv_heads=kv_heads,
                        head_dim=int(rng.choice([64, 96, 128])),
                        page_size=page_size, pages_per_seq=pages_per_seq,
                        dtype=dtype, cache_dtype=cache,
                        extra_seqs=int(rng.integers(0, 3)))
    checks.append((f"sweep{seed} {cache and jnp.dtype(cache).name} q{q_lens} "
                   f"kv{[int(k) for k in kv_lens]} "
                   f"p{page_size} G{group}", args, t.TOL[dtype], kw))
  checks = [(name, lambda a=args, tol=tol, kw=kw: t._check(GPU, a, tol, **kw))
            for name, args, tol, kw in checks]
  return _gpu_check.run(checks + mla_checks())


def mla_checks():
  """(name, check) pairs of mla_ragged_paged_attention."""
  checks = []
  for name, case in sorted(mla.CASES.items()):
    case = dict(case)
    kw, latent = case.pop("kw"), case.pop("latent_dim")
    args = mla.mla_batch(np.random.default_rng(len(name)), **case)
    checks.append((f"mla {name}", args,
                   mla.TOL[case.get("dtype", jnp.float32)], latent, kw))
  for seed in range(16):
    rng = np.random.default_rng(2000 + seed)
    heads = int(rng.choice([1, 3, 16, 128]))
    head_dim, latent = [(576, 512), (80, 64), (144, 128)][seed % 3]
    page_size = int(rng.choice([4, 16, 32]))
    pages_per_seq = int(rng.integers(1, 40))
    n = int(rng.integers(1, 7))
    kv_lens, q_lens = t.random_lengths(rng, n, pages_per_seq * page_size)
    cache = [None, jnp.int8, None, jnp.float8_e4m3fn][seed % 4]
    dtype = jnp.bfloat16 if seed % 2 == 0 or cache else jnp.float32
    kw = dict(sm_scale=float(rng.uniform(0.02, 0.1)))
    if cache is not None:
      kw.update(k_scale=0.03, v_scale=0.05)
    if seed % 3 == 1:
      kw["sliding_window"] = int(rng.integers(1, 200))
    if seed % 5 == 1:
      kw["soft_cap"] = 3.0
    if seed % 4 == 2:
      kw["sinks"] = jnp.asarray(rng.standard_normal(heads), jnp.float32)
    if seed % 6 == 5:
      kw["num_queries_per_block"] = int(rng.integers(1, 40))
      kw["num_kv_pages_per_block"] = int(rng.integers(1, 8))
    args = mla.mla_batch(rng, q_lens, kv_lens, heads=heads,
                         head_dim=head_dim, page_size=page_size,
                         pages_per_seq=pages_per_seq, dtype=dtype,
                         cache_dtype=cache,
                         extra_seqs=int(rng.integers(0, 3)))
    checks.append((f"mla sweep{seed} {cache and jnp.dtype(cache).name} "
                   f"D{head_dim}/{latent} H{heads} q{q_lens} "
                   f"kv{[int(k) for k in kv_lens]} p{page_size}", args,
                   mla.TOL[dtype], latent, kw))
  return [(name, lambda a=args, tol=tol, d=latent, kw=kw: mla._check(
      GPU, a, tol, latent_dim=d, **kw))
          for name, args, tol, latent, kw in checks]

if __name__ == "__main__":
  sys.exit(main())
