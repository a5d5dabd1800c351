"""Main-job cases for grouped matmul (``python -m pallas_kernels``)."""
from __future__ import annotations

import numpy as np

from pallas_kernels._cases import Case, abstract
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


def support_cases():
  """(label, run(backend)) rows of the docs' backend-support table: each run
  traces one call with ``jax.eval_shape``."""
  import jax
  import jax.numpy as jnp
  def call(fmt=None, group=None, transpose=False, offset=None, grad=False):
    m, k, n, g = 1000, 512, 384, 8
    rhs = abstract((g, n, k) if transpose else (g, k, n), fmt or jnp.bfloat16)
    operands = [abstract((m, k)), rhs, abstract((g,), jnp.int32)]
    if fmt is not None:
      s = k // group if group else 1
      operands.append(abstract((g, n, s) if transpose else (g, s, n),
                            jnp.float32))

    def run(backend):
      def f(lhs, rhs, sizes, *scale):
        out = api.grouped_matmul(lhs, rhs, sizes, transpose_rhs=transpose,
                                group_offset=offset,
                                rhs_scale=scale[0] if scale else None,
                                backend=backend)
        return out.astype(jnp.float32).sum()
      if grad:
        return jax.eval_shape(jax.grad(f, (0, 1)), *operands)
      return jax.eval_shape(f, *operands)
    return run

  return [
      ("bf16 experts", call()),
      ("bf16 experts, rhs [G, N, K]", call(transpose=True)),
      ("forward and backward (tgmm)", call(grad=True)),
      ("expert-parallel shard (group_offset)", call(offset=0)),
      ("int8 experts, per channel", call(jnp.int8)),
      ("int4 experts, group 128", call(jnp.int4, 128)),
      ("fp8 e4m3 experts, per channel, rhs [G, N, K]",
       call(jnp.float8_e4m3fn, transpose=True)),
  ]
