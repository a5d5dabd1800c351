"""How every kernel call composes with JAX sharding: one ``Rule`` per op names
each dimension with a factor and says which may be *split* (or *summed*).
:func:`run` runs the call on local shards inside ``shard_map``, through a
``shard_map`` on Explicit mesh axes, else through ``custom_partitioning``
(CPU/GPU); a sharded dimension that is not a split factor raises
ValueError. Details: docs/design/architecture.md.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from typing import Any, Callable, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_kernels import _compat

_local_only: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "pallas_kernels_local_only", default=False)


@contextlib.contextmanager
def local_only():
  """Kernel calls traced inside run on the arrays as given, unpartitioned.

  For callers that hand JAX per-device shards themselves (the torch_xla
  bridge's manual sharding), where a partitioning custom call has no meaning.
  """
  token = _local_only.set(True)
  try:
    yield
  finally:
    _local_only.reset(token)


def is_local_only() -> bool:
  """Whether a ``local_only`` block is active here."""
  return _local_only.get()


@dataclasses.dataclass(frozen=True)
class Rule:
  """Dimension factors of an op's operands and results (see module doc).

  operands: per positional argument, its name and factors (None: absent).
  results: per result, its factors.
  split: factors that may be divided across devices.
  sums: per result, the split factors it is summed over (absent from it).
  tied: groups of split factors that must be divided by the same mesh axes
    (query heads and kv heads of GQA).
  helper: what to use for shardings the rule does not allow.
  """
  op: str
  operands: tuple[tuple[str, tuple[str, ...] | None], ...]
  results: tuple[tuple[str, ...], ...]
  split: frozenset[str]
  sums: tuple[tuple[str, ...], ...]
  tied: tuple[tuple[str, ...], ...] = ()
  helper: str = "jax.shard_map"
  names: tuple[tuple[str, str], ...] = ()

  def describe(self, factor: str) -> str:
    return dict(self.names).get(factor, factor)

  def sdy_rule(self) -> str:
    present = [f for _, f in self.operands if f is not None]
    fmt = lambda fs: " ".join(fs)
    return (", ".join(fmt(f) for f in present) + " -> "
            + ", ".join(fmt(f) for f in self.results))


def make_rule(op: str, operands: Sequence[tuple[str, str | None]],
              results: Sequence[str], *, split: str,
              sums: Sequence[str] | None = None, tied: Sequence[str] = (),
              helper: str = "jax.shard_map",
              names: dict[str, str] | None = None) -> Rule:
  """A Rule from factor strings: ``("q", "b h l d")``; None: absent operand.

  ``split`` lists the divisible factors ("b h g"); ``sums[i]`` the factors
  result ``i`` is summed over; ``tied`` entries like "h g".
  """
  parse = lambda s: tuple(s.split())
  return Rule(
      op=op,
      operands=tuple((name, None if f is None else parse(f))
                     for name, f in operands),
      results=tuple(parse(r) for r in results),
      split=frozenset(parse(split)),
      sums=tuple(parse(s) for s in (sums or [""] * len(results))),
      tied=tuple(parse(t) for t in tied),
      helper=helper,
      names=tuple(sorted((names or {}).items())))


def broadcast_factors(shape, factors: str, prefix: str) -> str:
  """``factors`` with each size-1 dimension renamed to a private factor.

  A broadcast dimension (a bias of batch 1) is never split, and a result of
  that shape is a sum over the factor it broadcasts along.
  """
  names = factors.split()
  return " ".join(f"{prefix}{i}" if size == 1 else name
                  for i, (size, name) in enumerate(zip(shape, names)))


def trailing_factors(shape, factors: str, prefix: str) -> str:
  """:func:`broadcast_factors` of a ``shape`` that broadcasts against
  ``factors`` numpy-style: a shorter shape takes the trailing factors."""
  names = factors.split()
  return broadcast_factors(
      shape, " ".join(names[max(len(names) - len(shape), 0):]), prefix)


def row_factors(ndim: int, name: str = "m") -> str:
  """Factors of ``ndim`` leading row dimensions (``name``, ``name``1, ...):
  an operand ``[..., K]`` whose rows a kernel flattens into one."""
  return " ".join(([name] if ndim else []) +
                  [f"{name}{i}" for i in range(1, ndim)])


# ------------------------------------------------------------------ entry --

def run(rule: Rule, fn: Callable, *args, auto: bool = True):
  """``fn(*args)`` (a kernel call: arrays in, array or tuple out), sharded.

  ``args`` may contain None where ``rule`` marks the operand absent.
  ``auto=False`` leaves Auto-axis shardings to XLA (no custom_partitioning),
  for calls with side effects.
  """
  if len(args) != len(rule.operands):
    raise AssertionError(f"{rule.op}: {len(args)} args for "
                         f"{len(rule.operands)} operands in its rule")
  for (name, factors), arg in zip(rule.operands, args):
    if (factors is None) != (arg is None) or (
        arg is not None and len(factors) != arg.ndim):
      raise AssertionError(f"{rule.op}: operand {name} does not match its "
                           f"rule ({factors}, {getattr(arg, 'shape', None)})")
  if _compat.vma_checked():
    return _in_checked_shard_map(fn, args)
  if is_local_only() or _compat.in_manual_context():
    return fn(*args)
  explicit = _explicit_mesh(args)
  if explicit is not None:
    return _explicit(rule, fn, args, explicit)
  return _auto(rule, fn, args) if auto else fn(*args)


def _in_checked_shard_map(fn, args):
  varying = frozenset().union(
      *(_compat.varying_axes(a) for a in args if a is not None))
  # The kernel sees operands typed as varying over no axis: jax traces an
  # interpreted kernel (its grid loop, whose carries start from unvarying
  # buffers) and a custom_vmap again at lowering, with the check on, and
  # every value there must then be typed alike.
  args = [None if a is None else _compat.forget_varying(a) for a in args]
  with _compat.vma_check_disabled():
    out = fn(*args)
  return jax.tree_util.tree_map(
      lambda x: _compat.remember_varying(x, varying), out)


def shard_map(fn: Callable, *, mesh, in_specs, out_specs) -> Callable:
  """``jax.shard_map`` for the ``shard_*`` helpers: each argument is first
  placed on ``mesh`` as its spec says.

  ``jax.shard_map`` over Explicit axes (what ``jax.make_mesh`` returns on
  new jax) requires each input to be sharded as its spec already; a
  helper's caller passes plain or differently placed arrays. ``device_put``
  places (or reshards) on Explicit and Auto axes alike, eagerly and under
  ``jit``. Replication checks are off (Pallas results carry no vma). The
  call is jitted: an eager ``shard_map`` would run its body one operation
  at a time (seconds for an NMS), and jax 0.7 cannot run every operation
  eagerly over Explicit axes.
  """
  mapped = _compat.shard_map(fn, mesh=mesh, in_specs=in_specs,
                             out_specs=out_specs)

  @jax.jit
  def placed(*args):
    if len(args) != len(in_specs):
      raise AssertionError(f"{len(args)} arguments for {len(in_specs)} specs")
    return mapped(*(jax.device_put(a, NamedSharding(mesh, spec))
                    for a, spec in zip(args, in_specs)))
  return placed


def cotangents_like(primals, cotangents):
  """Each cotangent summed over the manual axes its primal does not vary over.

  Inside ``shard_map(check_vma=True)`` a custom VJP must return cotangents
  typed like its inputs: the gradient of a replicated input (a bias shared by
  every batch shard) is the sum of the shards' contributions.
  """
  def like(primal, cotangent):
    if primal is None or cotangent is None or not _compat.vma_checked():
      return cotangent
    extra = _compat.varying_axes(cotangent) - _compat.varying_axes(primal)
    return jax.lax.psum(cotangent, tuple(sorted(extra))) if extra else cotangent
  return tuple(like(p, c) for p, c in zip(primals, cotangents))


# ----------------------------------------------------- factor assignment --

def _spec_entries(spec, ndim) -> list[tuple[str, ...]]:
  entries = list(spec) + [None] * (ndim - len(spec))
  out = []
  for e in entries:
    if e is None or e == P.UNCONSTRAINED:
      out.append(())
    elif isinstance(e, (tuple, list)):
      out.append(tuple(e))
    else:
      out.append((e,))
  return out


def _assign(rule: Rule, arrays, specs, mesh_shape: dict[str, int], *,
            strict: bool) -> dict[str, tuple[str, ...]]:
  """Mesh axes per split factor, read from the operands' specs.

  Raises for a sharded non-split dimension. ``strict`` (Explicit axes)
  raises for an uneven split; otherwise such a factor is left unsplit.
  """
  axes: dict[str, tuple[str, ...]] = {}
  sizes: dict[str, int] = {}
  for (name, factors), arr, spec in zip(rule.operands, arrays, specs):
    if factors is None:
      continue
    for dim, (factor, entry) in enumerate(zip(factors, spec)):
      sizes.setdefault(factor, arr.shape[dim])
      if not entry:
        continue
      if factor not in rule.split:
        allowed = ", ".join(sorted({rule.describe(f) for f in rule.split}))
        raise ValueError(
            f"{rule.op}: {name} dimension {dim} ({rule.describe(factor)}) is "
            f"sharded over mesh axes {entry}; only its {allowed} dimensions "
            f"may be split across devices. Replicate that dimension, or use "
            f"{rule.helper} for other layouts.")
      axes.setdefault(factor, entry)
  for group in rule.tied:
    chosen = next((axes[f] for f in group if f in axes), None)
    for f in group:
      if chosen is None:
        axes.pop(f, None)
      else:
        axes[f] = chosen
  for factor, entry in list(axes.items()):
    count = math.prod(mesh_shape[a] for a in entry)
    uneven = [f for f in (_tie_of(rule, factor) or (factor,))
              if sizes.get(f, 0) % count]
    if uneven:
      if strict:
        f = uneven[0]
        raise ValueError(
            f"{rule.op}: the {rule.describe(f)} dimension ({sizes[f]}) is not "
            f"divisible by the {count} devices of mesh axes {entry}")
      for f in _tie_of(rule, factor) or (factor,):
        axes.pop(f, None)
  return axes


def _tie_of(rule, factor):
  return next((g for g in rule.tied if factor in g), None)


def _specs_for(rule: Rule, axes) -> tuple[list[P | None], list[P]]:
  def spec(factors):
    return P(*[(axes[f] if len(axes[f]) > 1 else axes[f][0])
               if f in axes else None for f in factors])
  ins = [None if f is None else spec(f) for _, f in rule.operands]
  outs = [spec(f) for f in rule.results]
  return ins, outs


def _local_with_sums(rule: Rule, fn, axes):
  def local(*args):
    out = fn(*args)
    flat, tree = jax.tree_util.tree_flatten(out)
    if len(flat) != len(rule.results):
      raise AssertionError(f"{rule.op}: {len(flat)} results, "
                           f"{len(rule.results)} in its rule")
    summed = []
    for value, over in zip(flat, rule.sums):
      names = tuple(a for f in over if f in axes for a in axes[f])
      summed.append(jax.lax.psum(value, names) if names else value)
    return jax.tree_util.tree_unflatten(tree, summed)
  return local


# ------------------------------------------------------------- Explicit --

def _explicit_mesh(args):
  for a in args:
    if a is None:
      continue
    sharding = getattr(jax.typeof(a), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not getattr(mesh, "axis_names", ()):
      continue
    if any(_compat.is_explicit_axis(mesh, axis)
           for entry in _spec_entries(sharding.spec, a.ndim) for axis in entry):
      return mesh
  return None


def _explicit(rule: Rule, fn, args, mesh):
  specs = [None if a is None else
           _spec_entries(jax.typeof(a).sharding.spec, a.ndim) for a in args]
  axes = _assign(rule, args, specs, dict(mesh.shape), strict=True)
  in_specs, out_specs = _specs_for(rule, axes)
  present = [i for i, a in enumerate(args) if a is not None]
  moved = [_compat.reshard(args[i], in_specs[i]) for i in present]

  def body(*arrays):
    full = [None] * len(args)
    for i, x in zip(present, arrays):
      full[i] = x
    return _local_with_sums(rule, fn, axes)(*full)

  out_tree = jax.tree_util.tree_structure(
      jax.eval_shape(fn, *[_unsharded_struct(a) for a in args]))
  mapped = _compat.shard_map(
      body, mesh=mesh, in_specs=tuple(in_specs[i] for i in present),
      out_specs=jax.tree_util.tree_unflatten(out_tree, out_specs))
  return mapped(*moved)


def _unsharded_struct(a):
  return None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype)


# ----------------------------------------------------------------- Auto --

def _auto(rule: Rule, fn, args):
  from jax.experimental.custom_partitioning import custom_partitioning
  present = [i for i, a in enumerate(args) if a is not None]

  def full(arrays):
    out = [None] * len(args)
    for i, x in zip(present, arrays):
      out[i] = x
    return out

  def body(*arrays):
    return fn(*full(arrays))

  # custom_partitioning's body takes no closed-over constants (a kernel's
  # block tables): they become trailing operands, replicated on every shard.
  arrays = [args[i] for i in present]
  closed, out_shape = jax.make_jaxpr(body, return_shape=True)(*arrays)
  consts = list(closed.consts)
  out_tree = jax.tree_util.tree_structure(out_shape)

  def body_with_consts(*operands):
    flat = jax.core.eval_jaxpr(closed.jaxpr, operands[len(present):],
                               *operands[:len(present)])
    return jax.tree_util.tree_unflatten(out_tree, flat)

  const_rule = dataclasses.replace(rule, operands=rule.operands + tuple(
      (f"constant {n}", tuple(f"const{n}_{d}" for d in range(c.ndim)))
      for n, c in enumerate(consts)))

  def assignment(mesh, arg_shapes):
    specs = [None] * len(args)
    for i, shape in zip(present, arg_shapes):
      specs[i] = _spec_entries(_spec_of(shape.sharding, len(shape.shape)),
                               len(shape.shape))
    return _assign(rule, full(arg_shapes), specs, dict(mesh.shape),
                   strict=False)

  def shardings(mesh, axes):
    ins, outs = _specs_for(rule, axes)
    in_sh = tuple(NamedSharding(mesh, ins[i]) for i in present) + tuple(
        NamedSharding(mesh, P()) for _ in consts)
    out_sh = [NamedSharding(mesh, s) for s in outs]
    return in_sh, out_sh

  def partition(mesh, arg_shapes, result_shape):
    axes = assignment(mesh, arg_shapes)
    in_sh, out_sh = shardings(mesh, axes)
    # Each shard traces the kernel afresh at its own shapes (and constants).
    local = _local_with_sums(
        rule, lambda *operands: body(*operands[:len(present)]), axes)
    tree = jax.tree_util.tree_structure(result_shape)
    return mesh, local, jax.tree_util.tree_unflatten(tree, out_sh), in_sh

  def infer(mesh, arg_shapes, result_shape):
    _, out_sh = shardings(mesh, assignment(mesh, arg_shapes))
    tree = jax.tree_util.tree_structure(result_shape)
    return jax.tree_util.tree_unflatten(tree, out_sh)

  partitioned = custom_partitioning(body_with_consts)
  partitioned.def_partition(partition=partition,
                            infer_sharding_from_operands=infer,
                            sharding_rule=const_rule.sdy_rule())

  @jax.custom_batching.custom_vmap
  def call(*arrays):
    # custom_partitioning does not compile for TPU (jax-ml/jax#38196): there
    # XLA places the kernel's operands itself.
    return jax.lax.platform_dependent(
        *arrays, tpu=body, default=lambda *a: partitioned(*a, *consts))

  @call.def_vmap
  def _batched(axis_size, in_batched, *arrays):
    del axis_size
    out = jax.vmap(body, in_axes=tuple(0 if b else None for b in in_batched)
                   )(*arrays)
    return out, jax.tree_util.tree_map(lambda _: True, out)

  return call(*[args[i] for i in present])


def _spec_of(sharding, ndim):
  spec = getattr(sharding, "spec", None)
  if spec is not None:
    return spec
  if sharding is None or sharding.is_fully_replicated:
    return P()
  raise ValueError(f"cannot read the partitioning of an operand sharded as "
                   f"{sharding}")
