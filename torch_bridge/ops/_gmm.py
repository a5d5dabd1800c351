"""grouped_matmul (and its transposed product, the d rhs of its backward)."""
from __future__ import annotations

import torch

from torch_bridge import _shards
from torch_bridge._core import JaxOp
from torch_bridge.ops._common import (
    _FLOATS, _INTS, _QUANT_DTYPES, _bytes_of, _check_devices, _check_tensor,
    _format_name, _from_bytes, _sharding)


def _grouped_matmul_jax(lhs, rhs, group_sizes, group_offset, rhs_scale, *,
                        out_dtype, rhs_format, **static):
  import pallas_kernels
  if group_offset is not None:
    group_offset = group_offset.reshape(())
  return pallas_kernels.grouped_matmul(
      lhs, _from_bytes(rhs, rhs_format), group_sizes,
      group_offset=group_offset, rhs_scale=rhs_scale,
      preferred_element_type=out_dtype, **static)


def _grouped_matmul_shards(static, spec, arrays, mesh):
  from pallas_kernels.gmm import api
  return _shards.specs(
      "grouped_matmul", api.call_rule(arrays[4], static["transpose_rhs"]),
      spec, arrays, ("lhs", "rhs", "group_sizes", "group_offset",
                     "rhs_scale"),
      lead=("the output", "m n"), what="[M, N]",
      why="group_sizes count rows of all of lhs (each group a consecutive "
      "range); only N (dim 1) can be split")


_GROUPED_MATMUL = JaxOp("grouped_matmul", _grouped_matmul_jax,
                        differentiable=(0, 1, 4),
                        shard_specs=_grouped_matmul_shards)


def _group_sizes_int32(group_sizes, m: int):
  """int32 sizes with the op's result kept: int64 values are first clamped
  to [0, M] (negative sizes count as 0, a running sum stops at M)."""
  if group_sizes.dtype == torch.int64:
    group_sizes = group_sizes.clamp(0, m)
  return group_sizes.to(torch.int32)


def _float_dtype_name(op: str, name: str, dtype):
  """A torch float dtype (or None) as the JAX dtype's name."""
  if dtype is None:
    return None
  if dtype not in _FLOATS:
    raise TypeError(f"{op}: {name} must be None or one of float32, "
                    f"bfloat16, float16, got {dtype!r}")
  return str(dtype).replace("torch.", "")


def _tiles(op: str, name: str, tiles):
  """``(tm, tk, tn)`` as a tuple of ints, or None (the JAX op checks what
  the kernel needs of them)."""
  if tiles is None:
    return None
  if (not isinstance(tiles, (tuple, list)) or len(tiles) != 3 or not all(
      isinstance(t, int) and not isinstance(t, bool) for t in tiles)):
    raise ValueError(f"{op}: {name} must be None or three ints (tm, tk, "
                     f"tn), got {tiles!r}")
  return tuple(tiles)


def _grouped_checks(op, lhs, second, group_sizes, second_name, second_ndim,
                    quantized=False):
  _check_tensor(op, "lhs", lhs, dtypes=_FLOATS, ndim=2)
  _check_tensor(op, second_name, second, ndim=second_ndim,
                dtypes=tuple(_QUANT_DTYPES) if quantized else _FLOATS)
  _check_tensor(op, "group_sizes", group_sizes, dtypes=_INTS, ndim=1)
  _check_devices(op, {"lhs": lhs, second_name: second,
                      "group_sizes": group_sizes})
  if group_sizes.shape[0] == 0:
    raise ValueError(f"{op}: group_sizes must have at least one group "
                     "(G >= 1), got shape (0,)")


def grouped_matmul(lhs, rhs, group_sizes, *, transpose_rhs=False,
                   preferred_element_type=None, group_offset=None,
                   rhs_scale=None, block_sizes=None, backend=None,
                   partition_spec=None, mesh=None):
  """``pallas_kernels.grouped_matmul`` (``jax.lax.ragged_dot``): the rows of
  ``lhs [M, K]`` come in consecutive groups of ``group_sizes [G]`` (an
  integer tensor; changing it does not recompile) and group ``g``'s rows
  are multiplied by ``rhs[g]`` (``rhs [G, K, N]``, ``[G, N, K]`` with
  ``transpose_rhs``) -> ``[M, N]``; rows past the last group are zeros.
  Sizes are clamped to the rows that exist (negative ones count as 0).

  ``group_offset`` (expert parallelism): None, an int, or an integer
  tensor of one element; ``rhs`` then holds groups ``group_offset ..
  group_offset + G - 1`` of ``group_sizes [G_total]`` and rows of other
  groups give zeros. A tensor offset may change without recompiling.

  ``rhs_scale`` (quantized experts): ``rhs`` holds int8 or float8 codes and
  ``rhs_scale`` float32 their scales, ``[G, 1, N]`` per output channel or
  ``[G, K / group, N]`` per K group (``[G, N, 1]`` / ``[G, N, K / group]``
  with ``transpose_rhs``), as ``quantize`` makes them along K. Gradients
  reach lhs and rhs_scale.

  ``preferred_element_type``: the output dtype (a torch float dtype;
  default lhs's); sums are float32. Gradients in lhs and rhs (d lhs by the
  same kernel on the transposed weights, d rhs by the transposed grouped
  matmul); group_sizes takes none.

  ``partition_spec``: 2 entries for the output ``[M, N]``; only N may be
  split (rhs's N dimension follows it, lhs and group_sizes are replicated
  and d lhs is summed over the N shards). Rows cannot be split: the group
  sizes count rows of all of lhs.
  """
  op = "grouped_matmul"
  _grouped_checks(op, lhs, rhs, group_sizes, "rhs", 3,
                  quantized=rhs_scale is not None)
  _check_tensor(op, "rhs_scale", rhs_scale, dtypes=_FLOATS, ndim=3,
                optional=True)
  if not isinstance(transpose_rhs, bool):
    raise TypeError(f"{op}: transpose_rhs must be a bool, got "
                    f"{transpose_rhs!r}")
  k_axis = 2 if transpose_rhs else 1
  if rhs.shape[k_axis] != lhs.shape[1]:
    raise ValueError(f"{op}: rhs.shape[{k_axis}]={rhs.shape[k_axis]} must "
                     f"equal lhs's K={lhs.shape[1]} (rhs is "
                     f"{'[G, N, K]' if transpose_rhs else '[G, K, N]'} with "
                     f"transpose_rhs={transpose_rhs})")
  offset = _group_offset(op, group_offset, group_sizes, rhs.shape[0])
  if offset is None and group_sizes.shape[0] != rhs.shape[0]:
    raise ValueError(f"{op}: group_sizes must have shape ({rhs.shape[0]},) "
                     f"(one size per group of rhs), got "
                     f"{tuple(group_sizes.shape)}")
  static = dict(transpose_rhs=transpose_rhs, rhs_format=_format_name(rhs),
                out_dtype=_float_dtype_name(op, "preferred_element_type",
                                            preferred_element_type),
                block_sizes=_tiles(op, "block_sizes", block_sizes),
                backend=backend)
  static = _sharding(static, partition_spec, mesh, op)
  return _GROUPED_MATMUL([lhs, _bytes_of(rhs), _group_sizes_int32(
      group_sizes, lhs.shape[0]), offset, rhs_scale], **static)[0]


def _group_offset(op, group_offset, group_sizes, local_groups):
  """group_offset as an int32 tensor of shape (1,) on group_sizes' device,
  or None."""
  if group_offset is None:
    return None
  if group_sizes.shape[0] < local_groups:
    raise ValueError(f"{op}: with group_offset, group_sizes [G_total] must "
                     f"have at least rhs's {local_groups} groups, got "
                     f"{tuple(group_sizes.shape)}")
  if isinstance(group_offset, torch.Tensor):
    if group_offset.numel() != 1 or group_offset.dim() > 1 or (
        group_offset.dtype not in _INTS):
      raise ValueError(f"{op}: group_offset must be an int or an integer "
                       f"tensor of one element, got {group_offset.dtype} of "
                       f"shape {tuple(group_offset.shape)}")
    offset = group_offset.reshape(1).to(torch.int32)
  elif isinstance(group_offset, int) and not isinstance(group_offset, bool):
    total = group_sizes.shape[0]
    if not 0 <= group_offset <= total - local_groups:
      raise ValueError(f"{op}: group_offset={group_offset} must be in [0, "
                       f"{total - local_groups}] (group_sizes has {total} "
                       f"groups, rhs {local_groups})")
    offset = torch.tensor([group_offset], dtype=torch.int32)
  else:
    raise TypeError(f"{op}: group_offset must be None, an int or an integer "
                    f"tensor, got {type(group_offset).__name__}")
  return offset.to(group_sizes.device)


def _tgmm_jax(lhs, dout, group_sizes, group_offset, *, out_dtype,
              num_groups, block_sizes, backend):
  import jax.numpy as jnp

  from pallas_kernels import _backend
  from pallas_kernels.gmm import api
  _backend.check_backend(api.OP, backend)
  offset = (jnp.zeros((), jnp.int32) if group_offset is None
            else group_offset.reshape(()))
  return api._run_tgmm(lhs, dout.astype(lhs.dtype), group_sizes, offset,
                       num_groups, jnp.dtype(out_dtype or lhs.dtype),
                       api._check_tiles(block_sizes), backend)


# No gradient: torch_xla's tgmm has none, and the kernels have no VJP.
_TGMM = JaxOp("grouped_matmul_tgmm", _tgmm_jax, differentiable=())


def _grouped_matmul_tgmm(lhs, dout, group_sizes, *, out_dtype=None,
                         block_sizes=None, group_offset=None, num_groups=None,
                         backend=None):
  """The transposed grouped matmul, ``grouped_matmul``'s d rhs: ``lhs [M,
  K]``, ``dout [M, N]`` -> ``[G, K, N]`` with ``out[g] = lhs_g^T @ dout_g``
  over group ``g``'s rows (grouped as by ``grouped_matmul``; rows past the
  last group add nothing, a group with no rows gives zeros). dout is cast
  to lhs's dtype, sums are float32, the output is ``out_dtype`` (default
  lhs's). With ``group_offset`` / ``num_groups`` (default 0 / G - offset
  for an int offset, G for a tensor one), the output holds groups
  ``group_offset .. group_offset + num_groups - 1``. No gradient."""
  op = "tgmm"
  _grouped_checks(op, lhs, dout, group_sizes, "dout", 2)
  if dout.shape[0] != lhs.shape[0]:
    raise ValueError(f"{op}: dout has {dout.shape[0]} rows, lhs has "
                     f"{lhs.shape[0]}; they must be equal (M)")
  total = group_sizes.shape[0]
  if num_groups is None:
    num_groups = total - group_offset if isinstance(group_offset, int) and (
        not isinstance(group_offset, bool)) else total
  if (isinstance(num_groups, bool) or not isinstance(num_groups, int)
      or not 1 <= num_groups <= total):
    raise ValueError(f"{op}: num_groups must be an int in [1, {total}] (the "
                     f"groups of group_sizes), got {num_groups!r}")
  offset = _group_offset(op, group_offset, group_sizes, num_groups)
  static = dict(out_dtype=_float_dtype_name(op, "out_dtype", out_dtype),
                num_groups=num_groups,
                block_sizes=_tiles(op, "block_sizes", block_sizes),
                backend=backend)
  return _TGMM([lhs, dout, _group_sizes_int32(group_sizes, lhs.shape[0]),
                offset], **static)[0]
