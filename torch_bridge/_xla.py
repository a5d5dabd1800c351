"""Embedding a JAX function into the torch_xla lazy graph, with SPMD sharding.

``call(key, fn, tensors)`` lowers ``fn`` once per (key, input shapes/dtypes,
platform) to an HLO module and splices it into the graph torch_xla is building
(the mechanism of ``torch_xla.core.xla_builder.call_jax``). Unlike ``call_jax``
it lowers for the platform torch_xla runs on (``tpu`` for PJRT_DEVICE=TPU,
``cpu`` for PJRT_DEVICE=CPU) rather than JAX's default backend, so
``backend=None`` inside ``fn`` picks the Mosaic kernel on TPU and the generic
Pallas interpreter on CPU even when JAX itself could not claim the TPU.

The TPU-semantics interpreter (``force_interpret("tpu")``) runs host
callbacks, which cannot live inside a torch_xla graph: under torch_xla a
forced TPU/races flavour is replaced by the generic interpreter.

Sharding: a Pallas kernel cannot be partitioned by the SPMD partitioner, so
with a ``ShardSpec`` the inputs enter manual-sharding mode
(``xs.enable_manual_sharding``), the kernel runs on each device's shard and
the outputs leave it again (``xs.disable_manual_sharding``), as torch_xla's
own ``custom_kernel.flash_attention`` does. Only dimensions the op treats
independently (batch, heads) may be sharded.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import torch

from pallas_kernels import _backend
from torch_bridge import _convert

_COMPUTATIONS: dict[Any, Any] = {}


def _torch_xla():
  import torch_xla  # noqa: F401  (imported only when XLA tensors appear)
  return torch_xla


def _jax():
  # torch_xla's guard claims the TPU before JAX can lock it and keeps the GSPMD
  # partitioner's sharding format (torch_xla does not read Shardy's).
  from torch_xla._internal import jax_workarounds
  return jax_workarounds.maybe_get_jax()


def lowering_platform() -> str:
  import torch_xla.runtime as xr
  kind = xr.device_type() or "CPU"
  return {"TPU": "tpu", "CUDA": "cuda", "GPU": "cuda"}.get(kind.upper(), "cpu")


def interpret_flavour_for_graph() -> str | None:
  flavour = _backend.forced_interpret_flavour()
  return None if flavour is None else "generic"


def _computation(key, fn: Callable, present: Sequence[torch.Tensor],
                 layout: tuple[bool, ...]):
  jax = _jax()
  platform = lowering_platform()
  flavour = interpret_flavour_for_graph()
  specs = tuple(_convert.shape_dtype(t) for t in present)
  cache_key = (key, specs, layout, platform, flavour,
               jax.config.jax_enable_x64)
  found = _COMPUTATIONS.get(cache_key)
  if found is not None:
    return found

  def flat_fn(*arrays):
    it = iter(arrays)
    full = [next(it) if here else None for here in layout]
    return tuple(fn(*full))

  import contextlib
  scope = (_backend.force_interpret(flavour) if flavour
           else contextlib.nullcontext())
  with scope:
    traced = jax.jit(flat_fn, keep_unused=True).trace(*specs)
    lowered = traced.lower(lowering_platforms=(platform,))
  proto = lowered.compiler_ir("hlo").as_serialized_hlo_module_proto()
  from torch_xla.core import xla_builder
  name = "pallas_kernels_" + str(key[0] if isinstance(key, tuple) else key)
  computation = xla_builder.computation_from_module_proto(name, proto)
  _COMPUTATIONS[cache_key] = computation
  return computation


def call(key, fn: Callable, tensors: Sequence[torch.Tensor | None]
         ) -> list[torch.Tensor]:
  """Runs ``fn(*arrays) -> sequence of arrays`` on XLA tensors, lazily.

  ``key`` must identify ``fn`` (op name and static parameters): the lowered
  computation is cached under it, so a training step traces JAX only once.
  """
  torch_xla = _torch_xla()
  present = [t for t in tensors if t is not None]
  layout = tuple(t is not None for t in tensors)
  computation = _computation(key, fn, present, layout)
  return list(torch_xla._XLAC._xla_user_computation(
      "xla::pallas_kernels", present, computation))


@dataclasses.dataclass(frozen=True)
class ShardSpec:
  """Per-array partition specs (tuples of mesh axis names or None)."""
  mesh: Any
  inputs: tuple[Any, ...]
  outputs: tuple[Any, ...]


def spmd_active() -> bool:
  try:
    import torch_xla.runtime as xr
  except ImportError:
    return False
  return bool(xr.is_spmd())


def _full_shape(local_shape, spec, mesh) -> tuple[int, ...]:
  sizes = mesh.shape()
  full = []
  for size, axes in zip(local_shape, spec):
    if axes is None:
      axes = ()
    elif isinstance(axes, (str, int)):
      axes = (axes,)
    full.append(size * math.prod(sizes[a] for a in axes))
  return tuple(full)


def _enter_manual(torch_xla, xs, t, spec, mesh):
  """``t``'s local shard under ``spec``, in manual-sharding mode."""
  if torch_xla._XLAC._get_xla_sharding_spec(t):
    # Already sharded (an FSDP parameter, a marked input): mark_sharding
    # would refuse to re-annotate, so annotate a copy with a custom-sharding
    # node instead (XLA elides the copy).
    t = xs.annotate_custom_sharding(t.clone(), mesh, spec).global_tensor
  else:
    t = xs.mark_sharding(t, mesh, spec).global_tensor
  return torch_xla._XLAC._spmd_full_to_shard_shape(t)


def call_sharded(key, fn: Callable, tensors: Sequence[torch.Tensor | None],
                 shard: ShardSpec) -> list[torch.Tensor]:
  """``call`` with each input/output manually sharded over ``shard.mesh``."""
  import torch_xla.distributed.spmd as xs
  if len(shard.inputs) != len(tensors):
    raise AssertionError(f"{key}: {len(tensors)} inputs, "
                         f"{len(shard.inputs)} specs")
  torch_xla = _torch_xla()
  local = []
  for t, spec in zip(tensors, shard.inputs):
    if t is None:
      local.append(None)
      continue
    spec = (None,) * t.dim() if spec is None else tuple(spec)
    local.append(_enter_manual(torch_xla, xs, t, spec, shard.mesh))
  outs = call(key, fn, local)
  if len(outs) != len(shard.outputs):
    raise AssertionError(f"{key}: {len(outs)} outputs, "
                         f"{len(shard.outputs)} specs")
  result = []
  for r, spec in zip(outs, shard.outputs):
    spec = tuple(spec) if spec is not None else (None,) * r.dim()
    result.append(xs.disable_manual_sharding(
        r, spec, _full_shape(r.shape, spec, shard.mesh),
        mesh=shard.mesh).global_tensor)
  return result
