"""A JAX function spliced into the torch_xla lazy graph, lowered for torch_xla's
platform; with a ``ShardSpec``, run per shard in manual-sharding mode (odd
sizes zero-padded and cut back). docs/design/torch_bridge.md, "_xla.py".
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


def lowering_target() -> dict:
  """The chip facts for ``_backend.target_override``, from torch_xla (JAX
  has no device of its own here: torch_xla holds the accelerator)."""
  platform = lowering_platform()
  if platform == "cpu":
    return {}
  try:
    import torch_xla.core.xla_model as xm
    kind = str(xm.xla_device_kind())
  except Exception:  # an older torch_xla: the defaults apply
    return {}
  if platform == "tpu":
    return dict(tpu_generation=_backend.generation_from_device_kind(kind))
  import torch
  if torch.cuda.is_available():
    major, minor = torch.cuda.get_device_capability()
    return dict(gpu_capability=f"{major}.{minor}")
  return {}


def interpret_flavour_for_graph() -> str | None:
  flavour = _backend.forced_interpret_flavour()
  return None if flavour is None else "generic"


def _computation(key, fn: Callable, present: Sequence[torch.Tensor],
                 layout: tuple[bool, ...]):
  jax = _jax()
  platform = lowering_platform()
  flavour = interpret_flavour_for_graph()
  target = lowering_target()
  specs = tuple(_convert.shape_dtype(t) for t in present)
  cache_key = (key, specs, layout, platform, tuple(sorted(target.items())),
               flavour,
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
  from pallas_kernels import _sharding
  # The arrays are already per-device shards (manual sharding), so the
  # kernels run as given, with no partitioning custom call of their own.
  with scope, _sharding.local_only(), \
      _backend.target_override(**target):
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


def _axes(entry) -> tuple:
  """A partition-spec entry as a tuple of mesh axes (None: ())."""
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def axis_size(mesh, axis) -> int:
  """Devices along mesh axis ``axis`` (a name, or an index into the mesh)."""
  sizes = mesh.shape()
  if axis in sizes:
    return int(sizes[axis])
  if (isinstance(axis, int) and not isinstance(axis, bool)
      and 0 <= axis < len(mesh.mesh_shape)):
    return int(mesh.mesh_shape[axis])
  raise ValueError(f"mesh axis {axis!r} is not in the mesh (axes "
                   f"{tuple(sizes)}, shape {tuple(mesh.mesh_shape)})")


def entry_size(mesh, entry) -> int:
  """Devices a dimension is split over: the product of its axes' sizes."""
  return math.prod(axis_size(mesh, a) for a in _axes(entry))


def padded_shape(shape, spec, mesh) -> tuple[int, ...]:
  """``shape`` with each sharded dimension rounded up to a multiple of the
  number of devices it is split over."""
  return tuple(-(-size // n) * n for size, n in
               ((size, entry_size(mesh, e)) for size, e in zip(shape, spec)))


def _full_shape(local_shape, spec, mesh) -> tuple[int, ...]:
  return tuple(size * entry_size(mesh, e)
               for size, e in zip(local_shape, spec))


def _pad(t: torch.Tensor, shape) -> torch.Tensor:
  """``t`` zero-padded at the end of each dimension up to ``shape``."""
  pads = []
  for size, target in reversed(list(zip(t.shape, shape))):
    pads += [0, target - size]
  return torch.nn.functional.pad(t, pads)


def _crop(xs, t: torch.Tensor, shape, spec, mesh) -> torch.Tensor:
  """``t``'s leading ``shape`` block, still split as ``spec`` (unevenly)."""
  if tuple(t.shape) == tuple(shape):
    return t
  t = t[tuple(slice(0, s) for s in shape)].clone()
  return xs.mark_sharding(t, mesh, spec).global_tensor


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


def needs_padding(tensors: Sequence[torch.Tensor | None],
                  shard: ShardSpec) -> bool:
  """Whether some sharded dimension is not a multiple of its devices."""
  return any(t is not None and spec is not None and
             padded_shape(t.shape, spec, shard.mesh) != tuple(t.shape)
             for t, spec in zip(tensors, shard.inputs))


def call_sharded(key, fn: Callable, tensors: Sequence[torch.Tensor | None],
                 shard: ShardSpec, out_shapes=None) -> list[torch.Tensor]:
  """``call`` with each input/output manually sharded over ``shard.mesh``.

  Inputs whose sharded dimensions the mesh does not divide are zero-padded
  (``needs_padding``); then ``out_shapes`` (the outputs' unpadded global
  shapes) is required and the outputs are cut back to it.
  """
  if out_shapes is None and needs_padding(tensors, shard):
    raise AssertionError(f"{key}: padded inputs need out_shapes")
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
    target = padded_shape(t.shape, spec, shard.mesh)
    if target != tuple(t.shape):
      t = _pad(t, target)
    local.append(_enter_manual(torch_xla, xs, t, spec, shard.mesh))
  outs = call(key, fn, local)
  if len(outs) != len(shard.outputs):
    raise AssertionError(f"{key}: {len(outs)} outputs, "
                         f"{len(shard.outputs)} specs")
  result = []
  for i, (r, spec) in enumerate(zip(outs, shard.outputs)):
    spec = tuple(spec) if spec is not None else (None,) * r.dim()
    r = xs.disable_manual_sharding(
        r, spec, _full_shape(r.shape, spec, shard.mesh),
        mesh=shard.mesh).global_tensor
    if out_shapes is not None:
      r = _crop(xs, r, out_shapes[i], spec, shard.mesh)
    result.append(r)
  return result
