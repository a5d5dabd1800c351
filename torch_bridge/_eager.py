"""The eager fast path: plain CPU/CUDA tensors straight to the jitted JAX op,
``forward`` without gradients, ``Residuals`` (over the jitted save/restore
functions) with them; the custom ops' own jitted functions (``use_programs``),
so the same bits. When it runs: docs/torch.md.
"""
from __future__ import annotations

import functools

import torch
from torch.autograd import forward_ad

from torch_bridge import _convert

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def transformed() -> bool:
  """Whether something records or reinterprets torch calls right now."""
  return (torch.compiler.is_compiling()
          or torch._C._are_functorch_transforms_active()
          or torch._C._len_torch_dispatch_stack() > 0
          or torch._C._get_tracing_state() is not None
          or getattr(forward_ad, "_current_level", -1) >= 0)


def plain_device(tensors) -> torch.device | None:
  """The one CPU/CUDA device of ``tensors`` when the fast path may run
  them, else None (the custom ops take the call)."""
  if not tensors or transformed():
    return None
  device = tensors[0].device
  if device.type not in ("cpu", "cuda"):
    return None
  for t in tensors:
    if type(t) not in _PLAIN_TYPES or t.device != device:
      return None
  return device


# The jitted JAX functions of the ops and their output counts, from the
# module that builds them (``_core`` sets these when it is imported).
_programs: dict = {}


def use_programs(jitted, n_outputs) -> None:
  """``jitted(name, static_text, flavour, kind, mask)`` -> the jitted
  function; ``n_outputs(name, static_text, shapes)`` -> how many outputs."""
  _programs.update(jitted=jitted, n_outputs=n_outputs)


def _jitted(name, static_text, flavour, kind, mask):
  return _programs["jitted"](name, static_text, flavour, kind, mask)


def forward(name: str, static_text: str, flavour, tensors, device) -> list:
  """The op's outputs, no autograd (``flavour``: the interpreter flavour
  forced at the call)."""
  fn = _jitted(name, static_text, flavour, "forward", None)
  return _convert.to_torch(fn(*_convert.to_jax(tensors, device)), device,
                           tensors)


@functools.lru_cache(maxsize=None)
def _n_outputs(name: str, static_text: str, signature: tuple) -> int:
  return _programs["n_outputs"](name, static_text, signature)


def _save(ctx, tensors) -> list:
  """The outputs of the jitted save function; its arrays, the inputs' JAX
  views and (for autograd's in-place checks) the tensors go on ``ctx``."""
  name, static_text, mask, device, flavour = ctx.call
  arrays = _convert.to_jax(tensors, device)
  flat = _jitted(name, static_text, flavour, "save", mask)(*arrays)
  n_out = _n_outputs(name, static_text,
                     tuple((t.shape, t.dtype) for t in tensors))
  outs = _convert.to_torch(flat[:n_out], device, tensors)
  ctx.save_for_backward(*tensors, *outs)
  ctx.arrays, ctx.saved = arrays, flat
  ctx.float_outputs = [o.dtype.is_floating_point for o in outs]
  return outs


class Residuals(torch.autograd.Function):
  """``apply((name, static_text, mask, device, flavour), *tensors)``: the
  op's outputs, with a backward from the saved residuals (``mask``: which
  tensors get gradients; none: the plain forward, and None gradients;
  ``flavour``: the interpreter flavour forced at the call, which the
  backward keeps although autograd may run it on another thread)."""

  @staticmethod
  def forward(ctx, call, *tensors):
    ctx.call = call
    if any(call[2]):
      outs = _save(ctx, tensors)
    else:  # no input takes a gradient: nothing to save
      outs = forward(call[0], call[1], call[4], tensors, call[3])
    ctx.mark_non_differentiable(
        *[o for o in outs if not o.dtype.is_floating_point])
    return tuple(outs)

  @staticmethod
  def backward(ctx, *grads):
    name, static_text, mask, device, flavour = ctx.call
    if not any(mask):
      return (None,) * (1 + len(mask))
    saved = ctx.saved_tensors  # raises if one was modified in place
    cotangents = _convert.to_jax(
        [g for g, f in zip(grads, ctx.float_outputs) if f], device)
    fn = _jitted(name, static_text, flavour, "restore", mask)
    diff = _convert.to_torch(fn(*ctx.arrays, *ctx.saved, *cotangents),
                             device)
    if torch.is_grad_enabled():  # create_graph=True
      watched = [t for t in saved + grads if t.requires_grad]
      if watched:
        diff = FirstOrderOnly.apply(name, len(diff), *diff, *watched)
    diff = iter(diff)
    return (None,) + tuple(next(diff) if m else None for m in mask)


# ``Function.apply`` without its Python wrapper, which only matters under
# functorch transforms (``plain_device`` sends those to the custom ops).
apply_residuals = super(torch.autograd.Function, Residuals).apply


class FirstOrderOnly(torch.autograd.Function):
  """``apply(name, n, *grads, *watched)``: the ``n`` grads, whose own
  backward raises (the bridge has no second derivatives; without this node
  a second backward would silently treat them as constants)."""

  @staticmethod
  def forward(ctx, name, n, *tensors):
    ctx.name = name
    return tuple(t.view_as(t) for t in tensors[:n])

  @staticmethod
  def backward(ctx, *grads):
    raise RuntimeError(
        f"{ctx.name}: torch_bridge ops have no second derivative; "
        "differentiating their gradients (create_graph=True) is not "
        "supported")
