"""``JaxOp``: any JAX function as differentiable torch custom ops:
``pallas_kernels_impl::<name>`` (forward), ``<name>_vjp`` (recomputing
backward), ``<name>_save`` and ``<name>_restore`` (backward from the JAX
VJP's residuals). docs/design/torch_bridge.md, "_core.py", has the design.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch

from pallas_kernels import _backend
from torch_bridge import _convert, _eager

# The internal ops' namespace; ``pallas_kernels`` holds the public ones.
NAMESPACE = "pallas_kernels_impl"
_OPS: dict[str, "JaxOp"] = {}


def _literal(value) -> str:
  # Plain string building (no json module): dynamo traces it as constants.
  # Symbolic ints and floats are specialized (f-strings guard in Dynamo,
  # int()/float() in plain tracing): a static parameter is a constant of the
  # JAX function, so another value recompiles.
  if isinstance(value, (tuple, list)):
    return "(" + "".join(_literal(v) + "," for v in value) + ")"
  if isinstance(value, (bool, torch.SymBool)) or value is None:
    return f"{bool(value)}" if value is not None else "None"
  if isinstance(value, (int, np.integer, torch.SymInt)):
    return f"{int(value)}"
  if isinstance(value, (float, np.floating, torch.SymFloat)):
    value = float(value)
    if value != value:
      raise ValueError("static parameter is NaN")
    if value in (float("inf"), float("-inf")):
      return "1e999" if value > 0 else "-1e999"  # literal_eval reads inf
    return f"{value!r}"
  if isinstance(value, str):
    return repr(value)
  if isinstance(value, dict):
    return "{" + "".join(repr(k) + ":" + _literal(value[k]) + ","
                         for k in sorted(value)) + "}"
  raise TypeError(f"static parameter of type {type(value).__name__} "
                  f"({value!r}) cannot be passed to a torch op")


def encode_static(static: dict[str, Any]) -> str:
  """Static parameters as a Python literal (sorted keys; lists -> tuples)."""
  return "{" + "".join(repr(k) + ":" + _literal(static[k]) + ","
                       for k in sorted(static)) + "}"


_KEY_TYPES = (bool, int, float, str, type(None))


def _typed(value):
  """``value`` with its types (``1``, ``1.0``, ``True`` apart) for a scalar
  or tuple of scalars, else None, as for float zeros and NaN (-0.0 == 0.0,
  NaN != NaN)."""
  if type(value) is float and (value == 0 or value != value):
    return None
  if type(value) in _KEY_TYPES:
    return type(value), value
  if type(value) is tuple and all(type(v) in _KEY_TYPES for v in value):
    return tuple, tuple(map(type, value)), value
  return None


@functools.lru_cache(maxsize=4096)
def _encoded(key: tuple) -> str:
  return encode_static({name: typed[-1] for name, typed in key})


def encode_static_cached(static: dict[str, Any]) -> str:
  """``encode_static(static)``, cached when every value is a scalar or a
  tuple of scalars (the common case)."""
  key = []
  for name, value in static.items():
    typed = _typed(value)
    if typed is None:
      return encode_static(static)
    key.append((name, typed))
  return _encoded(tuple(key))


@functools.lru_cache(maxsize=4096)
def decode_static(text: str) -> dict[str, Any]:
  return ast.literal_eval(text)


def _kernel_kwargs(static: dict[str, Any]) -> dict[str, Any]:
  return {k: v for k, v in static.items() if not k.startswith("_")}


def _is_float(t) -> bool:
  return t is not None and (t.dtype.is_floating_point
                            if isinstance(t, torch.Tensor)
                            else jnp.issubdtype(t.dtype, jnp.floating))


ShardSpecsFn = Callable[[dict, tuple, Sequence[Any], Any], tuple]


class UnshardedWarning(UserWarning):
  """A bridge op on XLA tensors under SPMD was given no ``partition_spec``,
  so its kernel runs unsharded (shown once per op)."""


_WARNED_UNSHARDED: set[str] = set()


def _warn_unsharded(name: str) -> None:
  if name in _WARNED_UNSHARDED:
    return
  _WARNED_UNSHARDED.add(name)
  warnings.warn(
      f"{name}: torch_xla SPMD is on but no partition_spec was given, so the "
      "kernel runs unsharded (whole operands on every device). Pass "
      "partition_spec= (and mesh=; modules: batch_axis=) to run it per "
      "shard, or an all-None partition_spec to replicate it on purpose. "
      "Shown once per op.", UnshardedWarning, stacklevel=4)


@dataclasses.dataclass
class JaxOp:
  """A JAX function registered as ``torch.ops.pallas_kernels_impl.<name>``.

  ``fn(*arrays, **static)`` takes its arrays positionally (None for absent
  optional ones; the custom ops get the present ones, ``_layout`` says
  where). ``differentiable``: the positions that may get gradients
  (default: every floating-point one). ``shard_specs(static,
  partition_spec, arrays, mesh) -> (in_specs, out_specs)``: one spec per
  input position and output (``_shards.specs``), raising ValueError for a
  dimension that cannot be split, or whose padding (``_xla.call_sharded``)
  would change the real rows; ``mesh`` is None when only the spec's
  structure is checked (every call that has a spec).
  """
  name: str
  fn: Callable
  differentiable: tuple[int, ...] | None = None
  shard_specs: ShardSpecsFn | None = None

  def __post_init__(self):
    if self.name in _OPS:
      raise AssertionError(f"op {self.name} registered twice")
    _OPS[self.name] = self
    self.forward_op = _register_forward(self)
    self.vjp_op = _register_vjp(self)
    self.save_op = _register_save(self)
    self.restore_op = _register_restore(self)

  def jax_forward(self, static_text: str) -> Callable:
    """``(*present arrays) -> tuple of arrays`` for these static params."""
    return _jax_forward(self.name, static_text)

  def jax_vjp(self, static_text: str, mask: tuple[bool, ...]) -> Callable:
    """``(*present arrays, *float cotangents) -> grads of masked arrays``."""
    return _jax_vjp(self.name, static_text, mask)

  def grad_mask(self, static_text: str, arrays) -> tuple[bool, ...]:
    """Which present arrays get gradients."""
    return self._mask(_layout(static_text), arrays)

  def _mask(self, layout, arrays) -> tuple[bool, ...]:
    positions = [i for i, here in enumerate(layout) if here]
    allowed = (positions if self.differentiable is None
               else self.differentiable)
    return tuple(i in allowed and _is_float(a)
                 for i, a in zip(positions, arrays))

  def __call__(self, arrays: Sequence[torch.Tensor | None],
               **static) -> list[torch.Tensor]:
    static["_layout"] = tuple(a is not None for a in arrays)
    flavour = None
    if not torch.compiler.is_compiling():  # dynamo cannot read a ContextVar
      flavour = _backend.forced_interpret_flavour()
      static["_interpret"] = flavour
    present = [a for a in arrays if a is not None]
    spec = static.get("_partition_spec")
    if spec is not None:
      if self.shard_specs is None:
        raise TypeError(f"{self.name} takes no partition_spec")
      self.shard_specs(static, tuple(spec), list(arrays), None)
    static_text = encode_static_cached(static)
    mask = self._mask(static["_layout"], present)
    device = _eager.plain_device(present)
    if device is not None:
      # As the custom ops: an input that requires grad gives outputs that do
      # (with None gradients where the op has none).
      if torch.is_grad_enabled() and any(t.requires_grad for t in present):
        return list(_eager.apply_residuals(
            (self.name, static_text, mask, device, flavour), *present))
      return _eager.forward(self.name, static_text, flavour, present,
                            device)
    if spec is None and any(a.device.type == "xla" for a in present):
      from torch_bridge import _xla
      if _xla.spmd_active():
        _warn_unsharded(self.name)
    wants_grad = torch.is_grad_enabled() and any(
        m and t.requires_grad for m, t in zip(mask, present))
    if wants_grad:
      saved = self.save_op(static_text, present)
      return list(saved[:_saved_n_outputs(self.name, static_text)])
    return list(self.forward_op(static_text, present))


def _layout(static_text: str) -> tuple[bool, ...]:
  return decode_static(static_text)["_layout"]


def _fill(layout, present) -> list:
  it = iter(present)
  return [next(it) if here else None for here in layout]


@functools.lru_cache(maxsize=None)
def _jax_forward(name: str, static_text: str) -> Callable:
  op = _OPS[name]
  layout = _layout(static_text)
  kwargs = _kernel_kwargs(decode_static(static_text))

  def forward(*present):
    out = op.fn(*_fill(layout, present), **kwargs)
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)
  return forward


@functools.lru_cache(maxsize=None)
def _jax_vjp(name: str, static_text: str, mask: tuple[bool, ...]) -> Callable:
  forward = _jax_forward(name, static_text)
  n_arrays = len(mask)
  diff_index = [i for i, m in enumerate(mask) if m]

  def vjp(*flat):
    arrays, cotangents = list(flat[:n_arrays]), iter(flat[n_arrays:])

    def of_differentiable(*diff):
      full = list(arrays)
      for i, a in zip(diff_index, diff):
        full[i] = a
      return forward(*full)

    outs, pullback = jax.vjp(of_differentiable,
                             *[arrays[i] for i in diff_index])
    cts = tuple(next(cotangents).astype(out.dtype)
                if jnp.issubdtype(out.dtype, jnp.inexact)
                else np.zeros(out.shape, jax.dtypes.float0) for out in outs)
    return tuple(pullback(cts))
  return vjp


@dataclasses.dataclass(frozen=True)
class _Plan:
  """How the pullback of one traced ``jax.vjp`` is rebuilt from tensors:
  its pytree ``tree``, each leaf's source (``("in", i)`` present input,
  ``("out", i)`` output, ``("saved", j)`` residual after the outputs,
  ``("const", value)``), the residuals' and outputs' (shape, dtype)."""
  tree: Any
  sources: tuple
  saved: tuple
  outputs: tuple


_PLANS: dict[Any, _Plan] = {}


def _specs_of(arrays) -> tuple:
  return tuple((tuple(a.shape), jnp.dtype(a.dtype).name) for a in arrays)


def _trace_context() -> tuple:
  """What, besides the arguments, can change the traced pullback."""
  return _backend.trace_context()


@functools.lru_cache(maxsize=None)
def _jax_save(name: str, static_text: str, mask: tuple[bool, ...]
              ) -> Callable:
  """``(*present arrays) -> (*outputs, *residuals)`` of ``jax.vjp``."""
  forward = _jax_forward(name, static_text)
  diff_index = [i for i, m in enumerate(mask) if m]

  def save(*arrays):
    def of_differentiable(*diff):
      full = list(arrays)
      for i, a in zip(diff_index, diff):
        full[i] = a
      return forward(*full)

    outs, pullback = jax.vjp(of_differentiable,
                             *[arrays[i] for i in diff_index])
    leaves, tree = jax.tree_util.tree_flatten(pullback)
    inputs = {id(a): i for i, a in enumerate(arrays)}
    outputs = {id(o): i for i, o in enumerate(outs)}
    saved, where, sources = [], {}, []
    for leaf in leaves:
      if id(leaf) in inputs:
        sources.append(("in", inputs[id(leaf)]))
      elif id(leaf) in outputs:
        sources.append(("out", outputs[id(leaf)]))
      elif isinstance(leaf, jax.core.Tracer):
        if id(leaf) not in where:
          where[id(leaf)] = len(saved)
          saved.append(leaf)
        sources.append(("saved", where[id(leaf)]))
      else:
        sources.append(("const", leaf))
    _PLANS[(name, static_text, mask, _specs_of(arrays),
            _trace_context())] = _Plan(
        tree, tuple(sources), _specs_of(saved),
        tuple((tuple(o.shape), o.dtype) for o in outs))
    return tuple(outs) + tuple(saved)
  return save


def _plan(name, static_text, mask, arrays) -> _Plan:
  """The plan recorded when the save op was traced on arrays like these
  (traced again, abstractly, if this process has not traced it here)."""
  specs = _specs_of(arrays)
  key = (name, static_text, mask, specs, _trace_context())
  if key not in _PLANS:
    jax.eval_shape(_jax_save(name, static_text, mask),
                   *[jax.ShapeDtypeStruct(s, d) for s, d in specs])
  return _PLANS[key]


@functools.lru_cache(maxsize=None)
def _jax_restore(name: str, static_text: str, mask: tuple[bool, ...]
                 ) -> Callable:
  """``(*present arrays, *outputs, *residuals, *float cotangents) -> grads
  of the masked arrays``: the pullback rebuilt from the saved arrays,
  applied."""
  n_arrays = len(mask)

  def restore(*flat):
    arrays = flat[:n_arrays]
    plan = _plan(name, static_text, mask, arrays)
    n_out = len(plan.outputs)
    outs = flat[n_arrays:n_arrays + n_out]
    saved = flat[n_arrays + n_out:n_arrays + n_out + len(plan.saved)]
    if _specs_of(saved) != plan.saved:
      raise RuntimeError(
          f"{name}: the saved residuals {_specs_of(saved)} do not match the "
          f"backward's trace {plan.saved} (was force_interpret or the "
          "target changed between forward and backward?)")
    cotangents = iter(flat[n_arrays + n_out + len(plan.saved):])
    where = dict(saved=saved, out=outs)
    where["in"] = arrays
    leaves = [value if kind == "const" else where[kind][value]
              for kind, value in plan.sources]
    pullback = jax.tree_util.tree_unflatten(plan.tree, leaves)
    cts = tuple(next(cotangents).astype(dtype)
                if jnp.issubdtype(dtype, jnp.inexact)
                else np.zeros(shape, jax.dtypes.float0)
                for shape, dtype in plan.outputs)
    return tuple(pullback(cts))
  return restore


def _jax_fn(name, static_text, kind, mask) -> Callable:
  if kind == "forward":
    return _jax_forward(name, static_text)
  if kind == "vjp":
    return _jax_vjp(name, static_text, mask)
  if kind == "save":
    return _jax_save(name, static_text, mask)
  return _jax_restore(name, static_text, mask)


# ---- execution on each kind of device ---------------------------------------
# ``kind``: "forward", "vjp" (recomputing), "save" (forward + residuals) or
# "restore" (backward from residuals); ``mask``: the present inputs that get
# gradients (None for "forward").

@functools.lru_cache(maxsize=None)
def _jitted(name: str, static_text: str, flavour: str | None, kind: str,
            mask: tuple[bool, ...] | None) -> Callable:
  """The jitted ``kind`` function, traced with ``flavour`` forced (None:
  none), whichever thread or context first calls it."""
  fn = _jax_fn(name, static_text, kind, mask)

  def under_flavour(*arrays):
    with _backend.forced_flavour_exactly(flavour):
      return fn(*arrays)
  return jax.jit(under_flavour)


@functools.lru_cache(maxsize=4096)
def _recorded_flavour(static_text: str) -> tuple[bool, str | None]:
  static = decode_static(static_text)
  return "_interpret" in static, static.get("_interpret")


def flavour_of(static_text: str) -> str | None:
  """The interpreter flavour a call runs with: the one recorded in its
  static parameters (see ``JaxOp``), else (a custom op called directly)
  the one forced now."""
  recorded, flavour = _recorded_flavour(static_text)
  return flavour if recorded else _backend.forced_interpret_flavour()


def _device_of(tensors) -> torch.device:
  for t in tensors:
    if t is not None:
      return t.device
  raise ValueError("an op needs at least one tensor argument")


def _check_same_device(name: str, tensors) -> torch.device:
  device = _device_of(tensors)
  for t in tensors:
    if t is not None and t.device.type != device.type:
      raise ValueError(f"{name}: all tensors must be on one device; got "
                       f"{device} and {t.device}")
  return device


def _run_eager(name, static_text, kind, mask, tensors, device):
  fn = _jitted(name, static_text, flavour_of(static_text), kind, mask)
  # A custom op's outputs may not alias its inputs (jit can hand an input
  # buffer straight back): to_torch copies those.
  return _convert.to_torch(fn(*_convert.to_jax(tensors, device)), device,
                           tensors)


def _run_xla(op, static_text, kind, mask, tensors, shard):
  # The graph is built (traced) now: with the call's recorded flavour.
  with _backend.forced_flavour_exactly(flavour_of(static_text)):
    return _build_xla(op, static_text, kind, mask, tensors, shard)


def _build_xla(op, static_text, kind, mask, tensors, shard):
  from torch_bridge import _xla
  fn = _jax_fn(op.name, static_text, kind, mask)
  key = (op.name, static_text, kind, mask)
  if shard is None:
    return _xla.call(key, fn, tensors)
  if kind in ("save", "restore"):
    return _run_xla_residuals(op, static_text, kind, mask, tensors, shard)
  shard, partial = shard
  out_shapes = None
  if _xla.needs_padding(tensors, shard):
    specs = tuple(_convert.shape_dtype(t) for t in tensors)
    out_shapes = _out_shapes(op.name, static_text, kind, mask, specs)
  return _sharded_with_partials(key, fn, tensors, shard, partial, out_shapes)


def _sharded_with_partials(key, fn, tensors, shard, partial, out_shapes,
                           n_leading=0):
  """``_xla.call_sharded`` where the outputs from ``n_leading`` on may be
  per-device partial sums (``partial``: the mesh axes to sum each over)."""
  from torch_bridge import _xla
  partial = ((),) * n_leading + tuple(partial)
  if not any(partial):
    return _xla.call_sharded(key, fn, tensors, shard, out_shapes)
  # A gradient of an input replicated over mesh axes that other inputs are
  # split on is a per-device partial sum: stack the partials on a new leading
  # axis sharded over those axes and sum it outside the manual region, where
  # the SPMD partitioner turns the sum into an all-reduce.
  def stacked(*arrays):
    return tuple(g[None] if axes else g
                 for g, axes in zip(fn(*arrays), partial))
  if out_shapes is not None:
    out_shapes = [((_xla.entry_size(shard.mesh, axes),) + s) if axes else s
                  for s, axes in zip(out_shapes, partial)]
  outs = _xla.call_sharded(key + (partial,), stacked, tensors, shard,
                           out_shapes)
  return [o.sum(0) if axes else o for o, axes in zip(outs, partial)]


def _local_specs(tensors, specs, mesh):
  """Per-device ShapeDtypeStructs of ``tensors`` split (and padded) as
  ``specs``."""
  from torch_bridge import _xla
  out = []
  for t, spec in zip(tensors, specs):
    shape = _xla.padded_shape(t.shape, spec, mesh)
    local = tuple(n // _xla.entry_size(mesh, e) for n, e in zip(shape, spec))
    out.append(jax.ShapeDtypeStruct(local, _convert.jax_dtype(t.dtype)))
  return out


def _run_xla_residuals(op, static_text, kind, mask, tensors, shard):
  """The save/restore ops under SPMD: residuals are stacked per device on a
  leading axis split over ``stack`` (the mesh axes the inputs use)."""
  from torch_bridge import _xla
  shard, partial, stack = shard
  key = (op.name, static_text, kind, mask)
  n_arrays = len(mask)
  arrays = tensors[:n_arrays]
  fn = _jax_fn(op.name, static_text, kind, mask)
  if kind == "save":
    padded = _xla.needs_padding(tensors, shard)
    n_out = len(shard.outputs)
    local = _local_specs(arrays, shard.inputs, shard.mesh)
    res_shapes = [tuple(s.shape) for s in jax.eval_shape(fn, *local)[n_out:]]
    lead = (_xla.entry_size(shard.mesh, stack),) if stack else ()
    res_specs = tuple(((stack,) if stack else ()) + (None,) * len(s)
                      for s in res_shapes)
    shard = _xla.ShardSpec(shard.mesh, shard.inputs,
                           shard.outputs + res_specs)

    def stacked(*a):
      outs = fn(*a)
      return tuple(outs[:n_out]) + tuple(
          r[None] if stack else r for r in outs[n_out:])
    out_shapes = None
    if padded:
      specs = tuple(_convert.shape_dtype(t) for t in arrays)
      out_shapes = (_out_shapes(op.name, static_text, "forward", None, specs)
                    + [lead + s for s in res_shapes])
    return _xla.call_sharded(key + (stack,), stacked, tensors, shard,
                             out_shapes)
  # restore: inputs are arrays, residuals (specs "residual"), cotangents.
  is_res = [s == "residual" for s in shard.inputs]

  def unstacked(*flat):
    return fn(*[a[0] if res and stack else a for a, res in zip(flat, is_res)])
  lead = (stack,) if stack else ()
  ins = tuple(lead + (None,) * (t.dim() - len(lead)) if res else s
              for t, s, res in zip(tensors, shard.inputs, is_res))
  shard = _xla.ShardSpec(shard.mesh, ins, shard.outputs)
  out_shapes = None
  if _xla.needs_padding(tensors, shard):
    out_shapes = [tuple(t.shape) for t, m in zip(arrays, mask) if m]
  return _sharded_with_partials(key + (stack,), unstacked, tensors, shard,
                                partial, out_shapes)


@functools.lru_cache(maxsize=None)
def _out_shapes(name, static_text, kind, mask, specs) -> list[tuple[int, ...]]:
  """Global output shapes of the ``kind`` function on ``specs``."""
  fn = _jax_fn(name, static_text, kind, mask)
  return [tuple(o.shape) for o in jax.eval_shape(fn, *specs)]


def _axes_of(spec) -> set:
  axes = set()
  for entry in spec or ():
    if entry is None:
      continue
    axes.update(entry if isinstance(entry, (tuple, list)) else (entry,))
  return axes


def _shard_for(op: JaxOp, static_text: str, arrays, kind="forward",
               float_outputs=None, mask=None, n_residuals=0):
  """None (run unsharded) or, for ``kind``:

    forward   (ShardSpec, partial-sum axes per output)
    vjp       the same; inputs are arrays then float cotangents
    save      (ShardSpec of arrays -> outputs, (), stack axes)
    restore   (ShardSpec, partials, stack axes); inputs are arrays,
              outputs, residuals (spec: the marker "residual", which
              ``_run_xla_residuals`` fills in) and float cotangents

  ``arrays`` are the present inputs; ``float_outputs`` marks the forward
  outputs that have cotangents and ``mask`` the inputs that get gradients.
  """
  static = decode_static(static_text)
  spec = static.get("_partition_spec")
  if spec is None or op.shard_specs is None:
    return None
  from torch_bridge import _xla
  if not _xla.spmd_active():
    return None
  mesh = _mesh_from(static.get("_mesh"))
  _check_axes(op.name, spec, mesh)
  layout = static["_layout"]
  full_ins, outs = op.shard_specs(static, tuple(spec), _fill(layout, arrays),
                                  mesh)
  ins = [s for s, here in zip(full_ins, layout) if here]
  ins = [tuple(s) if s is not None else (None,) * a.dim()
         for s, a in zip(ins, arrays)]
  used = set().union(*(_axes_of(s) for s in ins))
  stack = tuple(sorted(used, key=str)) or None
  if kind == "forward":
    return _xla.ShardSpec(mesh, tuple(ins), tuple(outs)), ((),) * len(outs)
  if kind == "save":
    return _xla.ShardSpec(mesh, tuple(ins), tuple(outs)), (), stack
  grads, partial = [], []
  for s, m in zip(ins, mask):
    if m:
      axes = tuple(sorted(used - _axes_of(s), key=str))
      grads.append(((axes,) + s) if axes else s)
      partial.append(axes)
  ct_specs = [s for s, f in zip(outs, float_outputs) if f]
  res_specs = [] if kind == "vjp" else (
      [tuple(s) for s in outs] + ["residual"] * n_residuals)
  spec = _xla.ShardSpec(mesh, tuple(ins) + tuple(res_specs) + tuple(ct_specs),
                        tuple(grads))
  if kind == "vjp":
    return spec, tuple(partial)
  return spec, tuple(partial), stack


def _check_axes(name, spec, mesh):
  """Every mesh axis named in ``spec`` exists and splits one dimension."""
  from torch_bridge import _xla
  seen = {}
  for dim, entry in enumerate(spec):
    for axis in _xla._axes(entry):
      try:
        _xla.axis_size(mesh, axis)
      except ValueError as e:
        raise ValueError(f"{name}: partition_spec {tuple(spec)!r}: {e}"
                         ) from None
      if axis in seen:
        raise ValueError(f"{name}: partition_spec {tuple(spec)!r} uses mesh "
                         f"axis {axis!r} for dims {seen[axis]} and {dim}")
      seen[axis] = dim


def _mesh_from(text):
  import torch_xla.distributed.spmd as xs
  if text is None:
    mesh = xs.get_global_mesh()
    if mesh is None:
      raise ValueError("partition_spec given but no mesh: pass mesh= or call "
                       "torch_xla.distributed.spmd.set_global_mesh")
    return mesh
  return xs.Mesh.from_str(text)


def _fake_outputs(fn, tensors, device):
  specs = [jax.ShapeDtypeStruct(_concrete(t.shape),
                                _convert.jax_dtype(t.dtype)) for t in tensors]
  shapes = jax.eval_shape(fn, *specs)
  return [torch.empty(tuple(s.shape), dtype=_convert.torch_dtype(s.dtype),
                      device=device) for s in shapes]


def _cotangents(grads, float_outputs, output_meta, device):
  """One cotangent per floating-point output (zeros where torch has none)."""
  cotangents = []
  for g, is_float, (shape, dtype) in zip(grads, float_outputs, output_meta):
    if is_float:
      cotangents.append(g if g is not None else torch.zeros(
          shape, dtype=dtype, device=device))
  return cotangents


def _register_forward(op: JaxOp):
  qualname = f"{NAMESPACE}::{op.name}"

  def impl(static: str, arrays: list[torch.Tensor]):
    device = _check_same_device(op.name, arrays)
    if device.type == "xla":
      return _run_xla(op, static, "forward", None, arrays,
                      _shard_for(op, static, arrays))
    return _run_eager(op.name, static, "forward", None, arrays, device)

  custom = torch.library.custom_op(
      qualname, impl, mutates_args=(),
      schema="(str static, Tensor[] arrays) -> Tensor[]")

  @custom.register_fake
  def _(static, arrays):
    return _fake_outputs(op.jax_forward(static), arrays, _device_of(arrays))

  def setup_context(ctx, inputs, output):
    static, arrays = inputs
    ctx.static = static
    ctx.mask = op.grad_mask(static, arrays)
    ctx.float_outputs = tuple(o.dtype.is_floating_point for o in output)
    ctx.output_meta = [(o.shape, o.dtype) for o in output]
    ctx.save_for_backward(*arrays)

  def backward(ctx, grads):
    arrays = ctx.saved_tensors
    return _input_grads(ctx, grads, arrays, lambda cotangents: op.vjp_op(
        ctx.static, list(arrays), cotangents))

  torch.library.register_autograd(qualname, backward,
                                  setup_context=setup_context)
  return custom


def _input_grads(ctx, grads, arrays, vjp):
  """An autograd formula's result: (None for ``static``, a grad per array,
  None where ``ctx.mask`` says the array takes none). ``vjp(cotangents)``
  returns the grads of the masked arrays in order."""
  if not any(ctx.mask):
    return None, [None] * len(arrays)
  cotangents = _cotangents(grads, ctx.float_outputs, ctx.output_meta,
                           arrays[0].device)
  diff = iter(vjp(cotangents))
  return None, [next(diff) if m else None for m in ctx.mask]


def _register_vjp(op: JaxOp):
  qualname = f"{NAMESPACE}::{op.name}_vjp"

  def impl(static: str, arrays: list[torch.Tensor],
           cotangents: list[torch.Tensor]):
    device = _check_same_device(op.name, arrays)
    mask = op.grad_mask(static, arrays)
    tensors = list(arrays) + list(cotangents)
    if device.type == "xla":
      float_outputs = _float_outputs(op, static, arrays)
      shard = _shard_for(op, static, arrays, "vjp", float_outputs, mask)
      return _run_xla(op, static, "vjp", mask, tensors, shard)
    return _run_eager(op.name, static, "vjp", mask, tensors, device)

  custom = torch.library.custom_op(
      qualname, impl, mutates_args=(),
      schema="(str static, Tensor[] arrays, Tensor[] cotangents) "
             "-> Tensor[]")

  @custom.register_fake
  def _(static, arrays, cotangents):
    fn = op.jax_vjp(static, op.grad_mask(static, arrays))
    return _fake_outputs(fn, list(arrays) + list(cotangents),
                         _device_of(arrays))
  return custom


def _register_save(op: JaxOp):
  qualname = f"{NAMESPACE}::{op.name}_save"

  def impl(static: str, arrays: list[torch.Tensor]):
    device = _check_same_device(op.name, arrays)
    mask = op.grad_mask(static, arrays)
    if device.type == "xla":
      outs = _run_xla(op, static, "save", mask, arrays,
                      _shard_for(op, static, arrays, "save"))
    else:
      outs = _run_eager(op.name, static, "save", mask, arrays, device)
    _record_n_outputs(op, static, arrays)
    return outs

  custom = torch.library.custom_op(
      qualname, impl, mutates_args=(),
      schema="(str static, Tensor[] arrays) -> Tensor[]")

  @custom.register_fake
  def _fake(static, arrays):
    fn = _jax_save(op.name, static, op.grad_mask(static, arrays))
    _record_n_outputs(op, static, arrays)
    return _fake_outputs(fn, arrays, _device_of(arrays))

  def setup_context(ctx, inputs, output):
    static, arrays = inputs
    n_out = len(_float_outputs(op, static, arrays))
    outs, residuals = output[:n_out], output[n_out:]
    ctx.static = static
    ctx.mask = op.grad_mask(static, arrays)
    ctx.n_arrays = len(arrays)
    ctx.float_outputs = tuple(o.dtype.is_floating_point for o in outs)
    ctx.output_meta = [(o.shape, o.dtype) for o in outs]
    ctx.save_for_backward(*arrays, *outs, *residuals)

  def backward(ctx, grads):
    # grads of the residual outputs (after the op's outputs) are unused.
    saved = ctx.saved_tensors
    arrays, residuals = saved[:ctx.n_arrays], saved[ctx.n_arrays:]
    return _input_grads(ctx, grads, arrays, lambda cotangents: op.restore_op(
        ctx.static, list(arrays), list(residuals), cotangents))

  torch.library.register_autograd(qualname, backward,
                                  setup_context=setup_context)
  return custom


def _register_restore(op: JaxOp):
  qualname = f"{NAMESPACE}::{op.name}_restore"

  def impl(static: str, arrays: list[torch.Tensor],
           residuals: list[torch.Tensor], cotangents: list[torch.Tensor]):
    device = _check_same_device(op.name, arrays)
    mask = op.grad_mask(static, arrays)
    tensors = list(arrays) + list(residuals) + list(cotangents)
    if device.type == "xla":
      float_outputs = _float_outputs(op, static, arrays)
      shard = _shard_for(op, static, arrays, "restore", float_outputs, mask,
                         n_residuals=len(residuals) - len(float_outputs))
      return _run_xla(op, static, "restore", mask, tensors, shard)
    return _run_eager(op.name, static, "restore", mask, tensors, device)

  custom = torch.library.custom_op(
      qualname, impl, mutates_args=(),
      schema="(str static, Tensor[] arrays, Tensor[] residuals, "
             "Tensor[] cotangents) -> Tensor[]")

  @custom.register_fake
  def _(static, arrays, residuals, cotangents):
    device = _device_of(arrays)
    return [torch.empty(tuple(a.shape), dtype=a.dtype, device=device)
            for a, m in zip(arrays, op.grad_mask(static, arrays)) if m]
  return custom


# The forward's output count per (op name, static text), recorded by the
# save op's implementations (real and fake): the static parameters fix it.
_N_OUTPUTS: dict[tuple[str, str], int] = {}


def _record_n_outputs(op, static, arrays) -> None:
  _N_OUTPUTS[(op.name, static)] = len(_float_outputs(op, static, arrays))


@torch.compiler.assume_constant_result
def _saved_n_outputs(name: str, static: str) -> int:
  """How many of the save op's tensors, just returned, are outputs (the
  residuals follow them): a constant for torch.compile that takes no sizes,
  which are symbolic under dynamic shapes."""
  return _N_OUTPUTS[(name, static)]


def _n_outputs(name: str, static: str, shapes: tuple) -> int:
  """How many outputs the forward has on inputs of concrete ``shapes``
  ((shape, dtype) pairs; residuals follow the outputs in the save op's
  list)."""
  specs = tuple(jax.ShapeDtypeStruct(s, _convert.jax_dtype(d))
                for s, d in shapes)
  return len(_float_outputs_cached(name, static, specs))


_eager.use_programs(_jitted, _n_outputs)


def _concrete(shape) -> tuple[int, ...]:
  """``shape`` as ints: symbolic sizes specialized (``jax.eval_shape`` needs
  them; a SymInt cannot key a cache)."""
  return tuple(int(n) for n in shape)


def _float_outputs(op, static, arrays) -> tuple[bool, ...]:
  specs = tuple(jax.ShapeDtypeStruct(_concrete(t.shape),
                                     _convert.jax_dtype(t.dtype))
                for t in arrays)
  return _float_outputs_cached(op.name, static, specs)


@functools.lru_cache(maxsize=None)
def _float_outputs_cached(name, static, specs) -> tuple[bool, ...]:
  outs = jax.eval_shape(_jax_forward(name, static), *specs)
  return tuple(bool(jnp.issubdtype(o.dtype, jnp.inexact)) for o in outs)


def registered_ops() -> dict[str, JaxOp]:
  return dict(_OPS)
