"""GPU (Triton-lowered Pallas) int8 matmul with the same semantics as the TPU one.

Grid (M/bm, N/bn); each program walks K in a ``fori_loop`` (Triton
software-pipelines it, ``num_stages`` deep): int8 x int8 -> int32 dots on the
tensor cores (``jnp.dot(..., preferred_element_type=jnp.int32)``), or for
weight-only mode the int8 w tile upcast to x's dtype in registers, then a
float32-accumulating dot. The epilogue (x_scale [bm, 1], w_scale [1, bn],
bias [1, bn], cast) runs on the accumulator in registers before the single
store, so no int32 matrix is written to HBM.

Triton needs power-of-two tiles, so M, N and K are zero-padded to tile
multiples (a copy of x and/or w when a dimension is not a multiple: the LLM
shapes in the bench need none). The w8a8 dynamic pre-pass (row quantization)
uses XLA here, which fuses it into one kernel on GPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _compat
from pallas_kernels._compat import pl
from pallas_kernels.int8_matmul import block_sizes as bs
from pallas_kernels.int8_matmul import reference


def _matmul_kernel(*refs, mode, nk, bk, has_xs, has_ws, has_b):
  refs = list(refs)
  x_ref, w_ref = refs.pop(0), refs.pop(0)
  xs_ref = refs.pop(0) if has_xs else None
  ws_ref = refs.pop(0) if has_ws else None
  b_ref = refs.pop(0) if has_b else None
  o_ref = refs.pop(0)
  bm, bn = o_ref.shape
  weight_only = mode == "weight_only"
  acc_dtype = jnp.float32 if weight_only else jnp.int32

  def step(kk, acc):
    start = pl.multiple_of(kk * bk, bk)
    x = x_ref[:, pl.ds(start, bk)]
    w = w_ref[pl.ds(start, bk), :]
    if weight_only:
      precision = (jax.lax.Precision.HIGHEST if x.dtype == jnp.float32
                   else jax.lax.Precision.DEFAULT)
      return acc + jnp.dot(x, w.astype(x.dtype), precision=precision,
                           preferred_element_type=jnp.float32)
    return acc + jnp.dot(x, w, preferred_element_type=jnp.int32)

  acc = jax.lax.fori_loop(0, nk, step, jnp.zeros((bm, bn), acc_dtype))
  if mode == "raw":
    o_ref[...] = acc
  else:
    o_ref[...] = reference.epilogue(
        acc, None if xs_ref is None else xs_ref[...],
        None if ws_ref is None else ws_ref[...],
        None if b_ref is None else b_ref[...], o_ref.dtype)


def _pad_to(a, shape, value=0):
  pads = [(0, t - s) for s, t in zip(a.shape, shape)]
  if all(p == (0, 0) for p in pads):
    return a
  return jnp.pad(a, pads, constant_values=value)


def matmul(x2, w, x_scale, w_scale, bias, *, mode, out_dtype, block_sizes=None,
           interpret=False):
  """[M, K] x [K, N] for modes raw / dequant / dynamic / weight_only."""
  if mode == "dynamic":
    x2, x_scale = reference.quantize_xla(x2, axis=-1)
    mode = "dequant"
  m, k = x2.shape
  n = w.shape[1]
  out_dtype = jnp.dtype(jnp.int32 if mode == "raw" else out_dtype)
  bm, bk, bn, warps, stages = bs.plan_gpu(m, k, n, mode=mode,
                                          block_sizes=block_sizes)
  mp, kp, np_ = bs.round_up(m, bm), bs.round_up(k, bk), bs.round_up(n, bn)
  operands = [_pad_to(x2, (mp, kp)), _pad_to(w, (kp, np_))]
  in_specs = [pl.BlockSpec((bm, kp), lambda i, j: (i, 0)),
              pl.BlockSpec((kp, bn), lambda i, j: (0, j))]
  if x_scale is not None:
    operands.append(_pad_to(x_scale, (mp, 1), 1))
    in_specs.append(pl.BlockSpec((bm, 1), lambda i, j: (i, 0)))
  for row_vector in (w_scale, bias):
    if row_vector is not None:
      operands.append(_pad_to(row_vector, (1, np_)))
      in_specs.append(pl.BlockSpec((1, bn), lambda i, j: (0, j)))
  kernel = functools.partial(
      _matmul_kernel, mode=mode, nk=kp // bk, bk=bk,
      has_xs=x_scale is not None, has_ws=w_scale is not None,
      has_b=bias is not None)
  out = pl.pallas_call(
      kernel,
      grid=(mp // bm, np_ // bn),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
      out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
      compiler_params=_compat.gpu_compiler_params(num_warps=warps,
                                                  num_stages=stages),
      interpret=interpret,
  )(*operands)
  if (mp, np_) != (m, n):
    out = out[:m, :n]
  return out
