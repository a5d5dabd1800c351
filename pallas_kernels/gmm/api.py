"""Public op: ``grouped_matmul``, ``jax.lax.ragged_dot``'s semantics. Kernels:
mosaic_tpu, triton, reference (``ragged_dot``). Gradients: d lhs by the same
kernel on the transposed weights, d rhs by the transposed grouped matmul
(tgmm).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _backend, _compat
from pallas_kernels.gmm import mosaic_tpu, reference, triton

OP = "grouped_matmul"
FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
QUANTIZED_DTYPES = (jnp.int8, jnp.int4, jnp.float8_e4m3fn, jnp.float8_e5m2)


def grouped_matmul(lhs, rhs, group_sizes, *, transpose_rhs: bool = False,
                   preferred_element_type=None, group_offset=None,
                   rhs_scale=None, block_sizes=None,
                   backend: str | None = None):
  """Rows of lhs in consecutive groups, each times its group's matrix.

  Args:
    lhs: [M, K] float (tokens sorted by expert).
    rhs: [G, K, N] float, or [G, N, K] with ``transpose_rhs``.
    group_sizes: [G] integer (traced: changing it does not recompile).
      Group g owns rows ``[sum(group_sizes[:g]), sum(group_sizes[:g+1]))``;
      sizes are clamped to rows that exist (negative sizes count as 0, a
      running sum past M stops at M). With ``group_offset``, [G_total] with
      G_total >= G.
    transpose_rhs: rhs is [G, N, K].
    preferred_element_type: output dtype (default lhs's); sums are float32.
    group_offset: expert parallelism: rhs holds groups ``group_offset ..
      group_offset + G - 1`` of group_sizes; rows of other groups give
      zeros (and zero gradients). An int or int32 scalar (traced: a
      device's offset, e.g. ``axis_index * G``); values past
      ``G_total - G`` are clamped to it.
    rhs_scale: with a quantized rhs (int8, int4, float8_e4m3fn,
      float8_e5m2 codes, e.g. from ``quantize(w, dtype, axis=K axis,
      group_size=...)``): float scales [G, S, N] ([G, N, S] with
      transpose_rhs), S = 1 (per output channel) or K / group size; the
      weight is ``codes * scale``. Gradients flow to lhs, rhs_scale and (fp8)
      rhs; integer codes have none.
    block_sizes: (tm, tk, tn) tiles of the TPU kernel (tm a multiple of 8,
      tk and tn of 128); None: the generation's default.
    backend: None (the best kernel for the platform), "mosaic_tpu",
      "interpret" or "reference".

  Returns:
    [M, N]: ``lhs[rows_g] @ rhs[g]`` on each group's rows; zeros on rows
    past the last group. Differentiable in lhs and rhs.
  """
  lhs, rhs, group_sizes, group_offset = _check(
      lhs, rhs, group_sizes, transpose_rhs, group_offset,
      quantized=rhs_scale is not None)
  rhs_scale = _check_scale(rhs, rhs_scale, lhs.shape[1], transpose_rhs)
  out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
  _backend.check_backend(OP, backend)
  tiles = _check_tiles(block_sizes)
  return _gmm(lhs, rhs, group_sizes, group_offset, rhs_scale, transpose_rhs,
              out_dtype, tiles, backend,
              _backend.forced_interpret_flavour())


def _check_scale(rhs, rhs_scale, k, transpose_rhs):
  """rhs_scale as float32 [G, S, N] (the [G, K, N] layout), or None."""
  if rhs_scale is None:
    return None
  scale = jnp.asarray(rhs_scale)
  g = rhs.shape[0]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  layout = "[G, N, S]" if transpose_rhs else "[G, S, N]"
  s_axis = 2 if transpose_rhs else 1
  want = (g, n, None) if transpose_rhs else (g, None, n)
  if (scale.ndim != 3 or any(w is not None and d != w
                             for d, w in zip(scale.shape, want))
      or scale.shape[s_axis] == 0 or k % scale.shape[s_axis]):
    raise ValueError(
        f"{OP}: rhs_scale must be {layout} = {want} with S dividing K={k} "
        f"(1 per channel, K / group size), got shape {scale.shape}")
  if not jnp.issubdtype(scale.dtype, jnp.floating):
    raise ValueError(f"{OP}: rhs_scale must be float, got {scale.dtype}")
  scale = scale.astype(jnp.float32)
  return jnp.swapaxes(scale, 1, 2) if transpose_rhs else scale


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


def _check(lhs, rhs, group_sizes, transpose_rhs, group_offset, *,
           quantized=False):
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
  if group_offset is None and group_sizes.shape != (rhs.shape[0],):
    raise ValueError(f"{OP}: group_sizes must be [G] = [{rhs.shape[0]}] "
                     f"(rhs's group count), got shape {group_sizes.shape}")
  if group_offset is not None and (
      group_sizes.ndim != 1 or group_sizes.shape[0] < rhs.shape[0]):
    raise ValueError(
        f"{OP}: with group_offset, group_sizes must be [G_total] with "
        f"G_total >= rhs's group count {rhs.shape[0]}, got shape "
        f"{group_sizes.shape}")
  offset = jnp.asarray(0 if group_offset is None else group_offset)
  if offset.shape != () or not jnp.issubdtype(offset.dtype, jnp.integer):
    raise ValueError(f"{OP}: group_offset must be an integer scalar, got "
                     f"{offset.dtype} of shape {offset.shape}")
  if not isinstance(offset, jax.core.Tracer):
    limit = group_sizes.shape[0] - rhs.shape[0]
    if not 0 <= int(offset) <= limit:
      raise ValueError(f"{OP}: group_offset={int(offset)} must be in [0, "
                       f"{limit}] (G_total - G)")
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(f"{OP}: group_sizes must be integers, got "
                     f"{group_sizes.dtype}")
  if lhs.dtype not in FLOAT_DTYPES:
    raise ValueError(f"{OP}: lhs must be float32, bfloat16 or float16, "
                     f"got {lhs.dtype}")
  if quantized and rhs.dtype not in QUANTIZED_DTYPES:
    raise ValueError(f"{OP}: with rhs_scale, rhs must hold int8, int4, "
                     f"float8_e4m3fn or float8_e5m2 codes, got {rhs.dtype}")
  if not quantized and rhs.dtype not in FLOAT_DTYPES:
    raise ValueError(
        f"{OP}: rhs must be float32, bfloat16 or float16 (quantized codes "
        f"need rhs_scale), got {rhs.dtype}")
  if rhs.shape[0] == 0:
    raise ValueError(f"{OP}: rhs needs at least one group (G >= 1)")
  return lhs, rhs, group_sizes.astype(jnp.int32), offset.astype(jnp.int32)


def _dispatch(name, backend, tiles, args, **static):
  """``<kernel module>.<name>`` (gmm or tgmm) on ``args`` (the last is
  group_offset), the module chosen by ``backend``; ``static`` goes to all."""
  def tpu(*a, interpret=None):
    *a, offset = a
    return getattr(mosaic_tpu, name)(*a, group_offset=offset, tiles=tiles,
                                     interpret=interpret or False, **static)

  def ref(*a):
    *a, offset = a
    return getattr(reference, name)(*a, group_offset=offset, **static)

  def gpu(*a, interpret=None):
    *a, offset = a
    return getattr(triton, name)(*a, group_offset=offset,
                                 interpret=interpret or False, **static)

  scale = args[3] if name == "gmm" and len(args) == 5 else None
  rows = [_backend.Kernel("mosaic_tpu", tpu),
          _backend.Kernel("triton", gpu, supports=lambda: triton.supports(
              scale, args[0].shape[1])),
          _backend.Kernel("reference", ref)]
  return _backend.dispatch(OP, backend, rows, *args,
                           rule=_rule(name, args, static),
                           batch_reference=True)


def _rule(name, args, static):
  """N and K split freely (a K split sums the partial products); rows and
  groups do not (a shard's rows need their own group sizes: the
  ``group_offset`` helpers)."""
  from pallas_kernels import _sharding
  if name == "tgmm":
    return _sharding.make_rule(
        "tgmm", [("lhs", "m k"), ("dout", "m n"), ("group_sizes", "t"),
                 ("group_offset", "")], ["g k n"], split="k n")
  return call_rule(args[3] if len(args) == 5 else None,
                   static["transpose_rhs"])


def call_rule(rhs_scale, transpose_rhs):
  """grouped_matmul's rule on (lhs, rhs, group_sizes[, rhs_scale],
  group_offset); the scale is laid out as rhs (size-1 dims broadcast)."""
  from pallas_kernels import _sharding
  rhs = "g n k" if transpose_rhs else "g k n"
  operands = [("lhs", "m k"), ("rhs", rhs), ("group_sizes", "t")]
  if rhs_scale is not None:
    operands.append(("rhs_scale",
                     _sharding.broadcast_factors(rhs_scale.shape, rhs, "s")))
  operands.append(("group_offset", ""))
  return _sharding.make_rule(
      OP, operands, ["m n"], split="n k", sums=["k"],
      names={"m": "rows", "n": "N", "k": "K", "g": "groups",
             "t": "group sizes"})


def _run_gmm(lhs, rhs, group_sizes, group_offset, rhs_scale, transpose_rhs,
             out_dtype, tiles, backend):
  if 0 in lhs.shape or 0 in rhs.shape:
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    return jnp.zeros((lhs.shape[0], n), out_dtype)
  args = (lhs, rhs, group_sizes) + (() if rhs_scale is None else (rhs_scale,))
  return _dispatch("gmm", backend, tiles, args + (group_offset,),
                   transpose_rhs=transpose_rhs, out_dtype=out_dtype)


def _run_tgmm(lhs, dout, group_sizes, group_offset, num_groups, out_dtype,
              tiles, backend):
  if 0 in lhs.shape or 0 in dout.shape:
    return jnp.zeros((num_groups, lhs.shape[1], dout.shape[1]), out_dtype)
  return _dispatch("tgmm", backend, tiles,
                   (lhs, dout, group_sizes, group_offset),
                   num_groups=num_groups, out_dtype=out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _gmm(lhs, rhs, group_sizes, group_offset, rhs_scale, transpose_rhs,
         out_dtype, tiles, backend, flavour):
  del flavour
  return _run_gmm(lhs, rhs, group_sizes, group_offset, rhs_scale,
                  transpose_rhs, out_dtype, tiles, backend)


def _gmm_fwd(lhs, rhs, group_sizes, group_offset, rhs_scale, transpose_rhs,
             out_dtype, tiles, backend, flavour):
  del flavour
  out = _run_gmm(lhs, rhs, group_sizes, group_offset, rhs_scale,
                 transpose_rhs, out_dtype, tiles, backend)
  return out, (lhs, rhs, group_sizes, group_offset, rhs_scale)


def _gmm_bwd(transpose_rhs, out_dtype, tiles, backend, flavour, residuals,
             dout):
  """The backward, traced under the interpreter the forward was (``flavour``):
  jax may trace it after the caller's ``force_interpret`` block ended."""
  with _backend.forced_flavour_exactly(flavour):
    return _gmm_grads(transpose_rhs, tiles, backend, residuals, dout)


def _gmm_grads(transpose_rhs, tiles, backend, residuals, dout):
  lhs, rhs, group_sizes, group_offset, rhs_scale = residuals
  dout = dout.astype(lhs.dtype)
  weights = rhs
  if rhs_scale is not None:  # d lhs from the dequantized weight
    kn = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
    weights = reference.dequantize(kn, rhs_scale, lhs.dtype)
    weights = jnp.swapaxes(weights, 1, 2) if transpose_rhs else weights
  # d lhs = dout @ rhs_g^T: the same kernel with rhs's layout flipped.
  dlhs = _run_gmm(dout, weights, group_sizes, group_offset, None,
                  not transpose_rhs, lhs.dtype, tiles, backend)
  dweights = _run_tgmm(lhs, dout, group_sizes, group_offset, rhs.shape[0],
                       jnp.float32 if rhs_scale is not None else rhs.dtype,
                       tiles, backend)  # [G, K, N]
  dscale = None
  if rhs_scale is not None:
    codes = (jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs).astype(
        jnp.float32)
    g, k, n = codes.shape
    s = rhs_scale.shape[1]
    dscale = (dweights * codes).reshape(g, s, k // s, n).sum(2)
    dweights = dweights * jnp.repeat(rhs_scale, k // s, axis=1)
  if transpose_rhs:
    dweights = jnp.swapaxes(dweights, 1, 2)
  if jnp.issubdtype(rhs.dtype, jnp.integer):
    drhs = np.zeros(rhs.shape, jax.dtypes.float0)
  else:
    drhs = dweights.astype(rhs.dtype)
  if not isinstance(drhs, np.ndarray):
    drhs = _compat.cotangent_like(drhs, rhs)
  if dscale is not None:
    dscale = _compat.cotangent_like(dscale, rhs_scale)
  return (_compat.cotangent_like(dlhs, lhs), drhs,
          np.zeros(group_sizes.shape, jax.dtypes.float0),
          np.zeros((), jax.dtypes.float0), dscale)


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def shard_grouped_matmul(mesh, lhs, rhs, group_sizes, *, expert_axis=None,
                         n_axis=None, k_axis=None, transpose_rhs=False,
                         rhs_scale=None, **kwargs):
  """``grouped_matmul`` with the experts, N and/or K split over mesh axes.

  ``expert_axis``: rhs's groups are split over it (each device holds
  ``G / axis size`` experts and every token); each device multiplies the
  rows of its own experts (``group_offset``) and the partial results, zero
  on other experts' rows, are summed (``psum``). ``n_axis``: rhs's N split
  (column parallel), the result split likewise. ``k_axis``: lhs's and rhs's
  K split (row parallel), partial products summed. group_sizes is
  replicated; rhs_scale follows rhs. Returns [M, N] split as
  ``(None, n_axis)``; differentiable.
  Other keyword arguments go to ``grouped_matmul``.

  Example::

      mesh = jax.make_mesh((4,), ("expert",))
      out = shard_grouped_matmul(mesh, tokens, w_experts, sizes,
                                 expert_axis="expert")
  """
  from jax.sharding import PartitionSpec as P
  from pallas_kernels import _sharding
  name = "shard_grouped_matmul"
  for arg, axis in (("expert_axis", expert_axis), ("n_axis", n_axis),
                    ("k_axis", k_axis)):
    if axis is not None and axis not in mesh.shape:
      raise ValueError(f"{name}: {arg}={axis!r} is not a mesh axis "
                       f"({tuple(mesh.shape)})")
  lhs, rhs, group_sizes, _ = _check(lhs, rhs, group_sizes, transpose_rhs,
                                    None, quantized=rhs_scale is not None)
  _check_scale(rhs, rhs_scale, lhs.shape[1], transpose_rhs)
  num_groups = rhs.shape[0]
  if expert_axis is not None and num_groups % mesh.shape[expert_axis]:
    raise ValueError(
        f"{name}: rhs's {num_groups} groups must divide evenly over "
        f"expert_axis={expert_axis!r} of size {mesh.shape[expert_axis]}")
  local = num_groups // (mesh.shape[expert_axis] if expert_axis else 1)
  summed = tuple(a for a in (expert_axis, k_axis) if a is not None)
  rhs_spec = (P(expert_axis, n_axis, k_axis) if transpose_rhs
              else P(expert_axis, k_axis, n_axis))
  specs, args = [P(None, k_axis), rhs_spec, P()], [lhs, rhs, group_sizes]
  if rhs_scale is not None:
    s_axis = 2 if transpose_rhs else 1
    scale_k = k_axis if jnp.shape(rhs_scale)[s_axis] > 1 else None
    specs.append(P(expert_axis, n_axis, scale_k) if transpose_rhs
                 else P(expert_axis, scale_k, n_axis))
    args.append(rhs_scale)

  def per_device(lhs, rhs, group_sizes, rhs_scale=None):
    offset = (jax.lax.axis_index(expert_axis) * local if expert_axis
              else None)
    out = grouped_matmul(lhs, rhs, group_sizes, group_offset=offset,
                         transpose_rhs=transpose_rhs, rhs_scale=rhs_scale,
                         **kwargs)
    return jax.lax.psum(out, summed) if summed else out

  return _sharding.shard_map(per_device, mesh=mesh, in_specs=tuple(specs),
                             out_specs=P(None, n_axis))(*args)
