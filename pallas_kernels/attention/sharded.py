"""``shard_flash_attention``: flash attention under ``shard_map``, batch and
heads split, or the sequence too (ring attention, ``attention.ring``)."""
from __future__ import annotations

from jax.sharding import PartitionSpec as P

from pallas_kernels import _sharding
from pallas_kernels.attention import api, ring
from pallas_kernels.attention.api import _check_array


def shard_flash_attention(mesh, q, k, v, *, batch_axis="data",
                          head_axis="model", sequence_axis=None,
                          sequence_layout="contiguous", segment_ids=None,
                          bias=None, **kwargs):
  """``flash_attention`` with batch, heads and sequence sharded over ``mesh``.

  Mosaic kernels cannot be partitioned by XLA, so this wraps the op in
  ``shard_map``: batch is split over mesh axis ``batch_axis`` and the query
  and kv heads over ``head_axis`` (either may be None to replicate). Each
  device runs the kernel on its shard with no communication; GQA groups stay
  intact because both head counts are split evenly. ``segment_ids`` follow
  the batch; a bias with a size-1 batch or head dimension is replicated
  along it; ``sinks`` follow the heads. A per-head mask list needs the heads
  unsplit (``head_axis=None``). Other keyword arguments are passed to
  ``flash_attention``.

  ``sequence_axis`` (context parallelism) also splits q/k/v and the segment
  ids along their lengths over that mesh axis and runs ring attention
  (``pallas_kernels.attention.ring``): K/V slices travel around the axis'
  devices, forward and backward. ``q_len`` and ``kv_len`` may differ (ends
  aligned, as without sharding: e.g. chunked prefill against a longer
  cache); each must be divisible by the axis size (causal attention of
  equal lengths, or a window/mask/unequal causal on zig-zag inputs: twice
  the axis size). A ``bias`` is split along its query rows (each device
  holds every key column of its rows; the bias never travels). Sliding
  windows, segment ids and static masks apply at global positions: each
  step's (query slice, key slice) pair gets its part of the mask, and
  pairs it empties are skipped; sinks join the merged result once.
  ``sequence_layout="contiguous"`` (default) takes plain sequence slices;
  causal attention (and masks whose work it balances) then moves them to
  the load-balanced zig-zag order and back inside the op. ``"zigzag"``
  takes tensors already in that order (``ring.zigzag_order(q_len, N)`` for
  q and ``ring.zigzag_order(kv_len, N)`` for k/v; a bias permuted along both
  axes), saving those moves.

  Example::

      mesh = jax.make_mesh((2, 4), ("data", "model"))
      out = shard_flash_attention(mesh, q, k, v, causal=True)
  """
  for name, x in (("q", q), ("k", k), ("v", v)):
    _check_array(name, x, 4)
  def axis_size(axis):
    if axis is None:
      return 1
    if axis not in mesh.shape:
      raise ValueError(f"shard_flash_attention: mesh has no axis {axis!r} "
                       f"(axes: {tuple(mesh.shape)})")
    return mesh.shape[axis]
  n_batch, n_head = axis_size(batch_axis), axis_size(head_axis)
  if q.shape[0] % n_batch:
    raise ValueError(f"shard_flash_attention: batch {q.shape[0]} is not "
                     f"divisible by mesh axis {batch_axis!r} ({n_batch})")
  if q.shape[1] % n_head or k.shape[1] % n_head:
    raise ValueError(f"shard_flash_attention: heads ({q.shape[1]}) and "
                     f"kv_heads ({k.shape[1]}) must be divisible by mesh axis "
                     f"{head_axis!r} ({n_head})")
  if sequence_axis is None and sequence_layout != "contiguous":
    raise ValueError("shard_flash_attention: sequence_layout needs "
                     "sequence_axis")
  if (isinstance(kwargs.get("mask"), (list, tuple)) and n_head > 1):
    raise ValueError("shard_flash_attention: a per-head mask list cannot be "
                     f"split over mesh axis {head_axis!r}; pass head_axis=None "
                     "or one mask shared by every head")
  if sequence_axis is not None:
    axis_size(sequence_axis)
    return ring.shard_ring_attention(
        mesh, q, k, v, batch_axis=batch_axis, head_axis=head_axis,
        sequence_axis=sequence_axis, sequence_layout=sequence_layout,
        segment_ids=segment_ids, bias=bias, **kwargs)
  sinks = kwargs.pop("sinks", None)
  return_lse = kwargs.get("return_lse", False)
  qkv_spec = P(batch_axis, head_axis, None, None)
  in_specs = [qkv_spec, qkv_spec, qkv_spec]
  args = [q, k, v]
  has_segments = segment_ids is not None
  if has_segments:
    if not isinstance(segment_ids, (tuple, list)) or len(segment_ids) != 2:
      raise TypeError("shard_flash_attention: segment_ids must be a pair")
    in_specs += [P(batch_axis, None), P(batch_axis, None)]
    args += list(segment_ids)
  if bias is not None:
    _check_array("bias", bias, 4)
    in_specs.append(P(batch_axis if bias.shape[0] > 1 else None,
                      head_axis if bias.shape[1] > 1 else None, None, None))
    args.append(bias)
  if sinks is not None:
    _check_array("sinks", sinks, 1)
    in_specs.append(P(head_axis))
    args.append(sinks)

  def local(*arrays):
    q, k, v, *rest = arrays
    segs = (rest.pop(0), rest.pop(0)) if has_segments else None
    local_bias = rest.pop(0) if bias is not None else None
    local_sinks = rest.pop(0) if sinks is not None else None
    return api.flash_attention(q, k, v, segment_ids=segs, bias=local_bias,
                           sinks=local_sinks, **kwargs)

  out_spec = P(batch_axis, head_axis, None, None)
  out_specs = (out_spec, P(batch_axis, head_axis, None)) if return_lse else out_spec
  return _sharding.shard_map(local, mesh=mesh, in_specs=tuple(in_specs),
                             out_specs=out_specs)(*args)
