"""Main-job cases for grouped matmul (``python -m pallas_kernels``)."""
from __future__ import annotations

import numpy as np

from pallas_kernels._cases import Case
from pallas_kernels.gmm import api

SHAPES = {  # (tokens, K, N, experts)
    "small": (200, 128, 256, 4),
    "medium": (1024, 512, 1024, 8),
    "large": (4096, 1024, 2048, 8),
}


def main_job_cases(size):
  import jax.numpy as jnp
  m, k, n, g = SHAPES[size]
  rng = np.random.default_rng(0)
  lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal((g, k, n)) / np.sqrt(k), jnp.bfloat16)
  # Skewed routing with an empty expert and rows past the last group.
  sizes = rng.multinomial(m - m // 8, np.arange(1, g + 1) / (g * (g + 1) / 2))
  sizes[1] = 0
  sizes = jnp.asarray(sizes, jnp.int32)

  def grouped_matmul(lhs_, rhs_, sizes_, backend=None):
    return api.grouped_matmul(lhs_, rhs_, sizes_, backend=backend)

  return [Case(op="grouped_matmul", shape=f"{m}x{k}x{n}, {g} groups",
               fn=grouped_matmul, args=(lhs, rhs, sizes), tolerance=3e-2)]
