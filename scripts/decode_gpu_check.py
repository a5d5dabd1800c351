"""The GPU kernel of decode_attention compiled (not interpreted) against the
tests' float64 oracle on every case of the shared suite (MLA head dims,
paged and contiguous caches, 8-bit caches, windows, sinks). Run on a GPU:

    PYTHONPATH=. python scripts/decode_gpu_check.py [NAME_SUBSTRING ...]
"""
from __future__ import annotations

import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import backends  # noqa: E402
import test_decode_attention as t  # noqa: E402
import pallas_kernels as pk  # noqa: E402
import _gpu_check  # noqa: E402

GPU = backends.Backend("triton", "triton", None)   # compiled: no flavour


def _check(name):
  case = t.CASES[name]
  q, k, v, lengths, kw = case.inputs(np.random.default_rng(len(name)))
  out = GPU.run(jax.jit(pk.decode_attention, static_argnames=(
      "sm_scale", "logit_soft_cap", "sliding_window", "backend")),
      q, k, v, lengths, **kw)
  assert out.shape == case.out_shape, (out.shape, case.out_shape)
  want = t.oracle.decode_attention(q, k, v, lengths, **kw)
  t._assert_close(out, want, t.TOLERANCES[case.dtype], name)


def main():
  return _gpu_check.run([(n, lambda n=n: _check(n)) for n in sorted(t.CASES)
                         if not t._refusal(GPU, t.CASES[n])])

if __name__ == "__main__":
  sys.exit(main())
