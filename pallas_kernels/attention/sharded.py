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

  Wraps the op in ``shard_map`` (XLA cannot partition Mosaic kernels); each
  device runs the kernel on its shard. GQA groups stay intact: both head
  counts are split evenly.

  Args:
    mesh: the device mesh.
    q, k, v: as for ``flash_attention``.
    batch_axis: mesh axis splitting the batch and ``segment_ids`` (None:
      replicated).
    head_axis: mesh axis splitting query and kv heads and ``sinks`` (None:
      replicated); a per-head mask list needs None.
    sequence_axis: None, or a mesh axis splitting q/k/v and segment ids along
      their lengths: ring attention (``attention.ring``), forward and
      backward. ``q_len`` and ``kv_len`` may differ (ends aligned) and must
      each be divisible by the axis size (twice it for causal attention of
      equal lengths, and for a window, mask or unequal causal on zig-zag
      inputs). Windows, segment ids and masks apply at global positions;
      pairs a mask empties are skipped; sinks join the merged result once.
    sequence_layout: "contiguous": plain slices (causal attention, and masks
      whose work it balances, move to zig-zag order and back inside the op);
      "zigzag": already in ``ring.zigzag_order(q_len, N)`` order for q and
      ``ring.zigzag_order(kv_len, N)`` for k/v (a bias permuted along both).
    segment_ids: as for ``flash_attention``.
    bias: as for ``flash_attention``; a size-1 batch or head dimension is
      replicated; with ``sequence_axis`` it is split along its query rows
      (every key column local, never sent).
    **kwargs: passed to ``flash_attention``.

  Returns:
    As ``flash_attention``, sharded like q.

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
