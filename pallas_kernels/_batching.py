"""How every kernel call composes with ``jax.vmap``: the mapped axis is folded
into the first split factor of the op's sharding ``Rule`` (one kernel call on
the whole batch); where no fold exists, one call per mapped index
(``jax.lax.map``). Details: docs/design/architecture.md.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import custom_batching

from pallas_kernels import _interpret


def fold_factor(rule) -> str | None:
  """The split factor a mapped axis folds into, or None where none fits."""
  present = [f for _, f in rule.operands if f is not None]
  if not present:
    return None
  for factor in present[0]:
    if factor in rule.split and all(factor in r for r in rule.results):
      return factor
  return None


def vmappable(rule, fn: Callable[..., Any]) -> Callable[..., Any]:
  """``fn`` (arrays, or None for absent operands, in rule order -> an array
  or a tuple) with the batching rule of the module docstring."""
  factor = fold_factor(rule)
  operand_axes = [None if f is None or factor not in f else f.index(factor)
                  for _, f in rule.operands]
  result_axes = [None if factor is None else r.index(factor)
                 for r in rule.results]

  @custom_batching.custom_vmap
  def call(*args):
    return fn(*args)

  @call.def_vmap
  def rule_(axis_size, in_batched, *args):
    batched = [a is not None and bool(b) for a, b in zip(args, in_batched)]
    if axis_size == 0:
      out = _empty(fn, args, batched)
      return out, jax.tree.map(lambda _: True, out)
    foldable = factor is not None and all(
        axis is not None for axis, b in zip(operand_axes, batched) if b)
    if not foldable:
      out = _per_index(call, args, batched, axis_size)
    else:
      folded = [a if axis is None else _merge(a, b, axis, axis_size)
                for a, b, axis in zip(args, batched, operand_axes)]
      out = call(*folded)
      single = not isinstance(out, (tuple, list))
      outs = [out] if single else list(out)
      axes = iter(result_axes)  # absent (None) results have no factors
      outs = [None if o is None else _split(o, next(axes), axis_size)
              for o in outs]
      out = outs[0] if single else type(out)(outs)
    return out, jax.tree.map(lambda _: True, out)

  return call


def _merge(a, batched, axis, size):
  """The mapped axis (leading; repeated where not mapped) merged into
  ``axis`` of the unmapped shape, mapped index major."""
  if not batched:
    a = jnp.broadcast_to(a[None], (size,) + a.shape)
  a = jnp.moveaxis(a, 0, axis)
  shape = a.shape[:axis] + (size * a.shape[axis + 1],) + a.shape[axis + 2:]
  return a.reshape(shape)


def _split(a, axis, size):
  shape = a.shape[:axis] + (size, a.shape[axis] // size) + a.shape[axis + 1:]
  return jnp.moveaxis(a.reshape(shape), axis, 0)


def _empty(fn, args, batched):
  """The results of a call mapped over no index: empty arrays."""
  avals = [None if a is None else
           jax.ShapeDtypeStruct(a.shape[1:] if b else a.shape, a.dtype)
           for a, b in zip(args, batched)]
  shapes = jax.eval_shape(fn, *avals)
  return jax.tree.map(lambda s: jnp.zeros((0,) + s.shape, s.dtype), shapes)


def _per_index(call, args, batched, size):
  mapped = [a for a, b in zip(args, batched) if b]

  def one(slices):
    it = iter(slices)
    return call(*(next(it) if b else a for a, b in zip(args, batched)))

  if _interpret.forced_interpret_flavour() in ("tpu", "races"):
    # The TPU-semantics interpreter's ordered callbacks cannot be lowered
    # inside a loop by every jax (0.7): one call per index, unrolled.
    outs = [one([a[i] for a in mapped]) for i in range(size)]
    return jax.tree.map(lambda *o: jnp.stack(o), *outs)
  return jax.lax.map(one, mapped)
