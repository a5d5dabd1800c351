"""Pure-JAX grouped matmul: ``jax.lax.ragged_dot`` and its transposed form."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def group_bounds(group_sizes, m: int):
  """(starts, ends) [G] int32 of each group's rows, clamped to [0, m]."""
  sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  ends = jnp.minimum(jnp.cumsum(sizes), m)
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  return starts, ends


def row_groups(group_sizes, m: int):
  """[M] int32: the group of each row, G for rows past the last group."""
  _, ends = group_bounds(group_sizes, m)
  return jnp.searchsorted(ends, jnp.arange(m, dtype=jnp.int32), side="right")


def gmm(lhs, rhs, group_sizes, *, transpose_rhs=False, out_dtype=None):
  """lhs [M, K], rhs [G, K, N] ([G, N, K] transposed) -> [M, N]."""
  out_dtype = out_dtype or lhs.dtype
  if transpose_rhs:
    rhs = jnp.swapaxes(rhs, 1, 2)
  m = lhs.shape[0]
  groups = row_groups(group_sizes, m)
  # ragged_dot over the clamped sizes; rows past the groups give zeros.
  sizes = jnp.diff(jnp.concatenate(
      [jnp.zeros((1,), jnp.int32), group_bounds(group_sizes, m)[1]]))
  out = jax.lax.ragged_dot(lhs, rhs, sizes,
                           preferred_element_type=jnp.float32)
  out = jnp.where((groups < rhs.shape[0])[:, None], out, 0)
  return out.astype(out_dtype)


def tgmm(lhs, dout, group_sizes, num_groups: int, *, out_dtype=None):
  """lhs [M, K], dout [M, N] -> [G, K, N]: per group, lhs_g^T @ dout_g
  (rows past the groups contribute nothing): the transpose of ``gmm`` in
  rhs, taken by XLA's own ragged_dot differentiation."""
  out_dtype = out_dtype or lhs.dtype
  k, n = lhs.shape[1], dout.shape[1]
  rhs = jnp.zeros((num_groups, k, n), jnp.float32)
  _, pull = jax.vjp(
      lambda r: gmm(lhs.astype(jnp.float32), r, group_sizes,
                    out_dtype=jnp.float32), rhs)
  return pull(dout.astype(jnp.float32))[0].astype(out_dtype)


def grouped_matmul(lhs, rhs, group_sizes, *, transpose_rhs=False,
                   preferred_element_type=None):
  """``pallas_kernels.grouped_matmul`` in plain JAX (``jax.lax.ragged_dot``)."""
  return gmm(lhs, rhs, jnp.asarray(group_sizes), transpose_rhs=transpose_rhs,
             out_dtype=preferred_element_type)
