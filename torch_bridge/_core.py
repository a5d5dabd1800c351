"""One mechanism that turns any JAX function into a differentiable torch op.

``JaxOp(name, fn)`` registers two ``torch.library`` custom ops:

  pallas_kernels::<name>(str static, Tensor?[] arrays) -> Tensor[]
  pallas_kernels::<name>_vjp(str static, Tensor?[] arrays,
                             Tensor?[] cotangents) -> Tensor[]

``fn(*arrays, **static)`` is a JAX function returning an array or a tuple of
arrays; ``static`` holds the non-array parameters, JSON-encoded into the
``static`` string so the ops have a fixed schema that ``torch.compile`` can
trace. Keys starting with ``_`` are the bridge's own (``_partition_spec``,
``_mesh``) and are not passed to ``fn``.

Where the arrays live decides how ``fn`` runs:
  XLA tensors   embedded into the torch_xla graph (``_xla.py``); nothing
                leaves the device and nothing runs eagerly.
  CPU / CUDA    handed to a jitted ``fn`` via DLPack and back (``_convert``).
  meta / fake   ``jax.eval_shape`` gives the output shapes (``register_fake``).

Autograd: the backward op evaluates ``jax.vjp`` of ``fn`` on the saved inputs,
so it recomputes the forward (activation-checkpoint style: only the inputs are
saved, the JAX op's own residuals are rebuilt) and then runs the op's VJP
(the Pallas backward kernels where the op has them). Gradients flow to the
floating-point inputs listed in ``differentiable`` (all by default); integer
outputs take no cotangent.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch

from pallas_kernels import _backend
from torch_bridge import _convert

NAMESPACE = "pallas_kernels"
_OPS: dict[str, "JaxOp"] = {}


def _to_json(value):
  if isinstance(value, (tuple, list)):
    return [_to_json(v) for v in value]
  if isinstance(value, dict):
    return {k: _to_json(v) for k, v in value.items()}
  if isinstance(value, (np.integer,)):
    return int(value)
  if isinstance(value, (np.floating,)):
    return float(value)
  return value


def _from_json(value):
  if isinstance(value, list):
    return tuple(_from_json(v) for v in value)
  if isinstance(value, dict):
    return {k: _from_json(v) for k, v in value.items()}
  return value


def encode_static(static: dict[str, Any]) -> str:
  return json.dumps(_to_json(static), sort_keys=True)


@functools.lru_cache(maxsize=4096)
def decode_static(text: str) -> dict[str, Any]:
  return _from_json(json.loads(text))


def _kernel_kwargs(static: dict[str, Any]) -> dict[str, Any]:
  return {k: v for k, v in static.items() if not k.startswith("_")}


def _is_float(t) -> bool:
  return t is not None and (t.dtype.is_floating_point
                            if isinstance(t, torch.Tensor)
                            else jnp.issubdtype(t.dtype, jnp.floating))


ShardSpecsFn = Callable[[dict, Sequence[Any], Sequence[Any]], tuple]


@dataclasses.dataclass
class JaxOp:
  """A JAX function registered as ``torch.ops.pallas_kernels.<name>``.

  ``shard_specs(static, partition_spec, arrays) -> (in_specs, out_specs)``
  maps the user's ``partition_spec`` (for the op's main operand) to one spec
  per input and output; ops without it run unsharded under SPMD (the
  partitioner then gathers their operands).
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

  # ---- JAX side -----------------------------------------------------------
  def jax_forward(self, static_text: str) -> Callable:
    """``(*arrays) -> tuple of arrays`` for the given static parameters."""
    return _jax_forward(self.name, static_text)

  def jax_vjp(self, static_text: str, mask: tuple[bool, ...],
              n_arrays: int) -> Callable:
    return _jax_vjp(self.name, static_text, mask, n_arrays)

  def grad_mask(self, arrays) -> tuple[bool, ...]:
    allowed = (range(len(arrays)) if self.differentiable is None
               else self.differentiable)
    return tuple(i in allowed and _is_float(a) for i, a in enumerate(arrays))

  # ---- torch side ---------------------------------------------------------
  def __call__(self, arrays: Sequence[torch.Tensor | None],
               **static) -> list[torch.Tensor]:
    return list(self.forward_op(encode_static(static), list(arrays)))


@functools.lru_cache(maxsize=None)
def _jax_forward(name: str, static_text: str) -> Callable:
  op = _OPS[name]
  kwargs = _kernel_kwargs(decode_static(static_text))

  def forward(*arrays):
    out = op.fn(*arrays, **kwargs)
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)
  return forward


@functools.lru_cache(maxsize=None)
def _jax_vjp(name: str, static_text: str, mask: tuple[bool, ...],
             n_arrays: int) -> Callable:
  forward = _jax_forward(name, static_text)
  diff_index = [i for i, m in enumerate(mask) if m]

  def vjp(*flat):
    arrays, cotangents = list(flat[:n_arrays]), flat[n_arrays:]

    def of_differentiable(*diff):
      full = list(arrays)
      for i, a in zip(diff_index, diff):
        full[i] = a
      return forward(*full)

    outs, pullback = jax.vjp(of_differentiable,
                             *[arrays[i] for i in diff_index])
    cts = []
    for out, ct in zip(outs, cotangents):
      if not jnp.issubdtype(out.dtype, jnp.inexact):
        cts.append(np.zeros(out.shape, jax.dtypes.float0))
      elif ct is None:
        cts.append(jnp.zeros_like(out))
      else:
        cts.append(ct.astype(out.dtype))
    return tuple(pullback(tuple(cts)))
  return vjp


# ---- execution on each kind of device ---------------------------------------

@functools.lru_cache(maxsize=None)
def _jitted(name: str, static_text: str, flavour: str | None, kind: str,
            extra=None) -> Callable:
  del flavour  # part of the cache key only: it changes what is traced
  if kind == "forward":
    fn = _jax_forward(name, static_text)
  else:
    fn = _jax_vjp(name, static_text, *extra)
  return jax.jit(fn)


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


def _run_eager(name, static_text, kind, extra, tensors, device):
  flavour = _backend.forced_interpret_flavour()
  fn = _jitted(name, static_text, flavour, kind, extra)
  jax_device = _convert.jax_device_for(device)
  arrays = [_convert.to_jax(t, jax_device) for t in tensors]
  outs = fn(*arrays)
  result = [_convert.to_torch(o, device) for o in outs]
  # A custom op's outputs may not alias its inputs (jit can hand an input
  # buffer straight back): copy those.
  in_ptrs = {t.data_ptr() for t in tensors if t is not None and t.numel()}
  return [r.clone() if r.numel() and r.data_ptr() in in_ptrs else r
          for r in result]


def _run_xla(op, static_text, kind, extra, tensors, shard):
  from torch_bridge import _xla
  if kind == "forward":
    fn = op.jax_forward(static_text)
  else:
    fn = op.jax_vjp(static_text, *extra)
  key = (op.name, kind, static_text, extra)
  if shard is not None:
    return _xla.call_sharded(key, fn, tensors, shard)
  return _xla.call(key, fn, tensors)


def _shard_for(op: JaxOp, static: dict, arrays, kind: str, mask=None):
  spec = static.get("_partition_spec")
  if spec is None or op.shard_specs is None:
    return None
  from torch_bridge import _xla
  if not _xla.spmd_active():
    return None
  mesh = _mesh_from(static.get("_mesh"))
  ins, outs = op.shard_specs(static, spec, arrays)
  if kind == "forward":
    return _xla.ShardSpec(mesh, tuple(ins), tuple(outs))
  grads = tuple(s for s, m in zip(ins, mask) if m)
  return _xla.ShardSpec(mesh, tuple(ins) + tuple(outs), grads)


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
  specs = [None if t is None else _convert.shape_dtype(t) for t in tensors]
  shapes = jax.eval_shape(fn, *specs)
  return [torch.empty(tuple(s.shape), dtype=_convert.torch_dtype(s.dtype),
                      device=device) for s in shapes]


def _register_forward(op: JaxOp):
  qualname = f"{NAMESPACE}::{op.name}"

  def impl(static: str, arrays: list[torch.Tensor | None]):
    device = _check_same_device(op.name, arrays)
    if device.type == "xla":
      shard = _shard_for(op, decode_static(static), arrays, "forward")
      return _run_xla(op, static, "forward", None, arrays, shard)
    return _run_eager(op.name, static, "forward", None, arrays, device)

  custom = torch.library.custom_op(
      qualname, impl, mutates_args=(),
      schema="(str static, Tensor?[] arrays) -> Tensor[]")

  @custom.register_fake
  def _(static, arrays):
    return _fake_outputs(op.jax_forward(static), arrays, _device_of(arrays))

  def setup_context(ctx, inputs, output):
    static, arrays = inputs
    ctx.static = static
    ctx.layout = tuple(a is not None for a in arrays)
    ctx.mask = op.grad_mask(arrays)
    ctx.save_for_backward(*[a for a in arrays if a is not None])

  def backward(ctx, grads):
    n = len(ctx.layout)
    if not any(ctx.mask):
      return None, [None] * n
    saved = iter(ctx.saved_tensors)
    arrays = [next(saved) if here else None for here in ctx.layout]
    cotangents = [g if g is not None and g.dtype.is_floating_point else None
                  for g in grads]
    diff = op.vjp_op(ctx.static, arrays, cotangents)
    it = iter(diff)
    return None, [next(it) if m else None for m in ctx.mask]

  torch.library.register_autograd(qualname, backward,
                                  setup_context=setup_context)
  return custom


def _register_vjp(op: JaxOp):
  qualname = f"{NAMESPACE}::{op.name}_vjp"

  def impl(static: str, arrays: list[torch.Tensor | None],
           cotangents: list[torch.Tensor | None]):
    device = _check_same_device(op.name, arrays)
    mask = op.grad_mask(arrays)
    extra = (mask, len(arrays))
    tensors = list(arrays) + list(cotangents)
    if device.type == "xla":
      shard = _shard_for(op, decode_static(static), arrays, "vjp", mask)
      return _run_xla(op, static, "vjp", extra, tensors, shard)
    return _run_eager(op.name, static, "vjp", extra, tensors, device)

  custom = torch.library.custom_op(
      qualname, impl, mutates_args=(),
      schema="(str static, Tensor?[] arrays, Tensor?[] cotangents) "
             "-> Tensor[]")

  @custom.register_fake
  def _(static, arrays, cotangents):
    mask = op.grad_mask(arrays)
    fn = op.jax_vjp(static, mask, len(arrays))
    return _fake_outputs(fn, list(arrays) + list(cotangents),
                         _device_of(arrays))
  return custom


def registered_ops() -> dict[str, JaxOp]:
  return dict(_OPS)
