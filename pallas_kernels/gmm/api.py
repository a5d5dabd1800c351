"""Public op: ``grouped_matmul``, ``jax.lax.ragged_dot``'s semantics.

Kernels (``backend=``): "mosaic_tpu" (``gmm.mosaic_tpu``),
"reference" (``jax.lax.ragged_dot``). Gradients: d lhs by the same kernel
on the transposed weights, d rhs by the transposed grouped matmul (tgmm).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _backend
from pallas_kernels.gmm import mosaic_tpu, reference

OP = "grouped_matmul"
FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def grouped_matmul(lhs, rhs, group_sizes, *, transpose_rhs: bool = False,
                   preferred_element_type=None, block_sizes=None,
                   backend: str | None = None):
  """Rows of lhs in consecutive groups, each times its group's matrix.

  Args:
    lhs: [M, K] float (tokens sorted by expert).
    rhs: [G, K, N] float, or [G, N, K] with ``transpose_rhs``.
    group_sizes: [G] integer (traced: changing it does not recompile).
      Group g owns rows ``[sum(group_sizes[:g]), sum(group_sizes[:g+1]))``;
      sizes are clamped to rows that exist (negative sizes count as 0, a
      running sum past M stops at M).
    transpose_rhs: rhs is [G, N, K].
    preferred_element_type: output dtype (default lhs's); sums are float32.
    block_sizes: (tm, tk, tn) tiles of the TPU kernel (tm a multiple of 8,
      tk and tn of 128); None: the generation's default.
    backend: None (the best kernel for the platform), "mosaic_tpu",
      "interpret" or "reference".

  Returns:
    [M, N]: ``lhs[rows_g] @ rhs[g]`` on each group's rows; zeros on rows
    past the last group. Differentiable in lhs and rhs.
  """
  lhs, rhs, group_sizes = _check(lhs, rhs, group_sizes, transpose_rhs)
  out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
  _backend.check_backend(OP, backend)
  tiles = _check_tiles(block_sizes)
  return _gmm(lhs, rhs, group_sizes, transpose_rhs, out_dtype, tiles, backend)


def _check_tiles(block_sizes):
  if block_sizes is None:
    return None
  tiles = tuple(int(b) for b in block_sizes)
  if (len(tiles) != 3 or tiles[0] <= 0 or tiles[0] % 8
      or any(t <= 0 or t % 128 for t in tiles[1:])):
    raise ValueError(f"{OP}: block_sizes={block_sizes!r} must be (tm, tk, tn)"
                     " with tm a positive multiple of 8 and tk, tn positive "
                     "multiples of 128")
  return tiles


def _check(lhs, rhs, group_sizes, transpose_rhs):
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  group_sizes = jnp.asarray(group_sizes)
  if lhs.ndim != 2:
    raise ValueError(f"{OP}: lhs must be [M, K], got shape {lhs.shape}")
  if rhs.ndim != 3:
    raise ValueError(f"{OP}: rhs must be [G, K, N] ([G, N, K] with "
                     f"transpose_rhs), got shape {rhs.shape}")
  k_axis = 2 if transpose_rhs else 1
  if rhs.shape[k_axis] != lhs.shape[1]:
    raise ValueError(
        f"{OP}: rhs.shape[{k_axis}]={rhs.shape[k_axis]} must equal lhs's K="
        f"{lhs.shape[1]} (transpose_rhs={transpose_rhs})")
  if group_sizes.shape != (rhs.shape[0],):
    raise ValueError(f"{OP}: group_sizes must be [G] = [{rhs.shape[0]}] "
                     f"(rhs's group count), got shape {group_sizes.shape}")
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(f"{OP}: group_sizes must be integers, got "
                     f"{group_sizes.dtype}")
  for name, x in (("lhs", lhs), ("rhs", rhs)):
    if x.dtype not in FLOAT_DTYPES:
      raise ValueError(f"{OP}: {name} must be float32, bfloat16 or float16, "
                       f"got {x.dtype}")
  if rhs.shape[0] == 0:
    raise ValueError(f"{OP}: rhs needs at least one group (G >= 1)")
  return lhs, rhs, group_sizes.astype(jnp.int32)


def _dispatch(name, backend, tiles, args, **static):
  """``reference.<name>`` or ``mosaic_tpu.<name>`` (gmm or tgmm) on
  ``args``, chosen by ``backend``; ``static`` goes to both."""
  def tpu(*a, interpret=None):
    return getattr(mosaic_tpu, name)(*a, tiles=tiles,
                                     interpret=interpret or False, **static)

  def ref(*a):
    return getattr(reference, name)(*a, **static)

  rows = [_backend.Kernel("mosaic_tpu", tpu), _backend.Kernel("reference", ref)]
  return _backend.dispatch(OP, backend, rows, *args)


def _run_gmm(lhs, rhs, group_sizes, transpose_rhs, out_dtype, tiles, backend):
  if 0 in lhs.shape or 0 in rhs.shape:
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    return jnp.zeros((lhs.shape[0], n), out_dtype)
  return _dispatch("gmm", backend, tiles, (lhs, rhs, group_sizes),
                   transpose_rhs=transpose_rhs, out_dtype=out_dtype)


def _run_tgmm(lhs, dout, group_sizes, num_groups, out_dtype, tiles, backend):
  if 0 in lhs.shape or 0 in dout.shape:
    return jnp.zeros((num_groups, lhs.shape[1], dout.shape[1]), out_dtype)
  return _dispatch("tgmm", backend, tiles, (lhs, dout, group_sizes),
                   num_groups=num_groups, out_dtype=out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _gmm(lhs, rhs, group_sizes, transpose_rhs, out_dtype, tiles, backend):
  return _run_gmm(lhs, rhs, group_sizes, transpose_rhs, out_dtype, tiles,
                  backend)


def _gmm_fwd(lhs, rhs, group_sizes, transpose_rhs, out_dtype, tiles, backend):
  out = _run_gmm(lhs, rhs, group_sizes, transpose_rhs, out_dtype, tiles,
                 backend)
  return out, (lhs, rhs, group_sizes)


def _gmm_bwd(transpose_rhs, out_dtype, tiles, backend, residuals, dout):
  del out_dtype
  lhs, rhs, group_sizes = residuals
  dout = dout.astype(lhs.dtype)
  # d lhs = dout @ rhs_g^T: the same kernel with rhs's layout flipped.
  dlhs = _run_gmm(dout, rhs, group_sizes, not transpose_rhs, lhs.dtype,
                  tiles, backend)
  drhs = _run_tgmm(lhs, dout, group_sizes, rhs.shape[0], rhs.dtype, tiles,
                   backend)
  if transpose_rhs:
    drhs = jnp.swapaxes(drhs, 1, 2)
  dsizes = np.zeros(group_sizes.shape, jax.dtypes.float0)
  return dlhs, drhs, dsizes


_gmm.defvjp(_gmm_fwd, _gmm_bwd)
