"""Pure-JAX grouped matmul: ``jax.lax.ragged_dot`` and its transposed form."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def group_bounds(group_sizes, m: int, num_local: int | None = None,
                 group_offset=0):
  """(starts, ends) int32 of groups ``group_offset .. + num_local`` (all
  groups by default), clamped to [0, m]: sizes below 0 count as 0 and a
  running sum past m stops at m."""
  sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  ends = jnp.minimum(jnp.cumsum(sizes), m).astype(jnp.int32)
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  if num_local is None or num_local == sizes.shape[0]:
    return starts, ends
  offset = jnp.asarray(group_offset, jnp.int32)
  return (jax.lax.dynamic_slice(starts, (offset,), (num_local,)),
          jax.lax.dynamic_slice(ends, (offset,), (num_local,)))


def dequantize(rhs, rhs_scale, dtype):
  """rhs [G, K, N] codes and scale [G, S, N] (S divides K) -> ``dtype``,
  computed as codes * scale in float32."""
  per = rhs.shape[1] // rhs_scale.shape[1]
  return (rhs.astype(jnp.float32)
          * jnp.repeat(rhs_scale, per, axis=1)).astype(dtype)


def gmm(lhs, rhs, group_sizes, rhs_scale=None, *, transpose_rhs=False,
        out_dtype=None, group_offset=0):
  """lhs [M, K], rhs [G, K, N] ([G, N, K] transposed) -> [M, N].

  ``group_sizes`` may list more groups than rhs holds: rhs[g] is group
  ``group_offset + g`` and rows of the other groups give zeros. Quantized
  rhs: dequantized with ``rhs_scale`` [G, S, N] to lhs's dtype first."""
  out_dtype = out_dtype or lhs.dtype
  if transpose_rhs:
    rhs = jnp.swapaxes(rhs, 1, 2)
  if rhs_scale is not None:
    rhs = dequantize(rhs, rhs_scale, lhs.dtype)
  m, (num_local, k, n) = lhs.shape[0], rhs.shape
  starts, ends = group_bounds(group_sizes, m, num_local, group_offset)
  # A zero weight before and after the local groups takes the other rows.
  sizes = jnp.concatenate([starts[:1], ends - starts, m - ends[-1:]])
  zero = jnp.zeros((1, k, n), rhs.dtype)
  out = jax.lax.ragged_dot(lhs, jnp.concatenate([zero, rhs, zero]), sizes,
                           preferred_element_type=jnp.float32)
  rows = jnp.arange(m, dtype=jnp.int32)[:, None]
  out = jnp.where((rows >= starts[0]) & (rows < ends[-1]), out, 0)
  return out.astype(out_dtype)


def tgmm(lhs, dout, group_sizes, num_groups: int, *, out_dtype=None,
         group_offset=0):
  """lhs [M, K], dout [M, N] -> [num_groups, K, N]: per local group g,
  lhs_g^T @ dout_g (other rows contribute nothing): the transpose of
  ``gmm`` in rhs, taken by XLA's own ragged_dot differentiation."""
  out_dtype = out_dtype or lhs.dtype
  k, n = lhs.shape[1], dout.shape[1]
  rhs = jnp.zeros((num_groups, k, n), jnp.float32)
  _, pull = jax.vjp(
      lambda r: gmm(lhs.astype(jnp.float32), r, group_sizes,
                    out_dtype=jnp.float32, group_offset=group_offset), rhs)
  return pull(dout.astype(jnp.float32))[0].astype(out_dtype)


def grouped_matmul(lhs, rhs, group_sizes, *, transpose_rhs=False,
                   preferred_element_type=None, group_offset=None,
                   rhs_scale=None):
  """``pallas_kernels.grouped_matmul`` in plain JAX (``jax.lax.ragged_dot``;
  a quantized rhs dequantized first)."""
  if rhs_scale is not None and transpose_rhs:  # [G, N, S] -> [G, S, N]
    rhs_scale = jnp.swapaxes(jnp.asarray(rhs_scale, jnp.float32), 1, 2)
  return gmm(lhs, rhs, jnp.asarray(group_sizes), rhs_scale,
             transpose_rhs=transpose_rhs, out_dtype=preferred_element_type,
             group_offset=0 if group_offset is None else group_offset)
