"""Real TPU compilation on a machine without a TPU: with ``libtpu`` installed,
compile-only TPU devices (``jax.experimental.topologies``) let ``.compile()``
run the real XLA/Mosaic TPU compiler, which rejects what a TPU VM would.

Example::

    result = tpu_aot.compile_for_tpu(
        my_fn, jax.ShapeDtypeStruct((8, 128), jnp.float32), topology="v6e:2x2")
    print(result.memory, result.cost)
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import sys
import tempfile
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from pallas_kernels import _backend, _compat, _quiet

# Topologies the test-suite compiles for; each is (generation, chips).
KNOWN_TOPOLOGIES = ("v5e:2x2", "v6e:2x2", "v4:2x2x1", "v5p:2x2x1",
                    "tpu7x:2x2x1")
GENERATIONS = ("v4", "v5e", "v5p", "v6e", "tpu7x")
# One small topology per generation (tpu7x: libtpu of jax >= 0.8 only).
GENERATION_TOPOLOGY = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1",
                       "v6e": "v6e:2x2", "tpu7x": "tpu7x:2x2x1"}


class TpuCompileError(RuntimeError):
  """The TPU compiler rejected a function; the message says why."""


class LibtpuUnavailable(RuntimeError):
  """libtpu is missing or does not know the requested topology."""


@dataclasses.dataclass
class CompileResult:
  topology: str
  compiled: Any
  memory: Any           # CompiledMemoryStats
  cost: dict            # XLA's cost analysis (flops, bytes accessed, ...)
  hlo_text: str

  @property
  def kernel_vmem_bytes(self) -> dict[str, int]:
    """Scoped VMEM the compiler reserved for each Mosaic kernel (custom
    call name -> bytes), from its ``used_scoped_memory_configs``."""
    out = {}
    for line in self.hlo_text.splitlines():
      if 'custom_call_target="tpu_custom_call"' not in line:
        continue
      name = re.match(r"\s*(?:ROOT\s+)?%?([^\s=]+)\s*=", line).group(1)
      config = re.search(r"used_scoped_memory_configs\W+\[(.*?)\]", line)
      sizes = re.findall(r'memory_space\W+1\W+offset\W+\d+\W+size\W+(\d+)',
                         config.group(1)) if config else []
      out[name] = sum(int(s) for s in sizes)
    return out

  @property
  def kernel_grids(self) -> dict[str, tuple[int, ...]]:
    """The grid each Mosaic kernel was compiled with (custom call name ->
    the ``iteration_bounds`` of its serialized Mosaic module)."""
    import base64
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    out = {}
    for line in self.hlo_text.splitlines():
      if 'custom_call_target="tpu_custom_call"' not in line:
        continue
      name = re.match(r"\s*(?:ROOT\s+)?%?([^\s=]+)\s*=", line).group(1)
      body = base64.b64decode(re.search(r'"body":"([^"]+)"', line).group(1))
      context = mlir.make_ir_context()
      context.allow_unregistered_dialects = True
      with context:
        module = ir.Module.parse(body)
        for op in module.body.operations:
          if "iteration_bounds" in op.attributes:
            out[name] = tuple(op.attributes["iteration_bounds"])
    return out

  @property
  def peak_bytes(self) -> int:
    m = self.memory
    return int(m.argument_size_in_bytes + m.output_size_in_bytes
               + m.temp_size_in_bytes - m.alias_size_in_bytes)


def libtpu_installed() -> bool:
  try:
    import libtpu  # noqa: F401
    return True
  except ImportError:
    return False


@contextlib.contextmanager
def _captured_stderr():
  """Holds back what libtpu prints on stderr (it expects a TPU VM's env)."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile(mode="w+b") as sink:
    os.dup2(sink.fileno(), 2)
    captured = []
    try:
      yield captured
    finally:
      os.dup2(saved, 2)
      os.close(saved)
      sink.seek(0)
      captured.append(sink.read().decode(errors="replace"))


@functools.cache
def topology_devices(topology: str = "v5e:2x2") -> tuple:
  """Compile-only TPU devices for a topology name such as "v6e:2x2"."""
  if not libtpu_installed():
    raise LibtpuUnavailable(
        "libtpu is not installed: pip install \"jax[tpu]==%s\"" % jax.__version__)
  from jax.experimental import topologies
  if not _quiet.tpu_attached():
    # Compile-only use needs no exclusive TPU: let parallel processes (pytest
    # workers, helpers) each load libtpu instead of failing on its lockfile.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  with _captured_stderr() as log:
    try:
      _compat.load_tpu_plugin_for_aot()
      desc = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    except Exception as e:  # libtpu raises plain RuntimeErrors
      error = e
    else:
      error = None
  if error is not None:
    raise LibtpuUnavailable(
        f"topology {topology!r} is not available from the installed libtpu: "
        f"{error}\n{''.join(log)[-2000:]}") from error
  return tuple(desc.devices)


def topology_generation(topology: str) -> str:
  """The TPU generation of a topology's chips ("v5e", "v6e", ...), from the
  device kind libtpu reports for it."""
  return _backend.generation_from_device_kind(
      topology_devices(topology)[0].device_kind)


def topology_mesh(topology: str, axis_names: Sequence[str],
                  mesh_shape: Sequence[int] | None = None) -> Mesh:
  devices = np.array(topology_devices(topology))
  if mesh_shape is None:
    mesh_shape = (devices.size,) + (1,) * (len(axis_names) - 1)
  return Mesh(devices.reshape(tuple(mesh_shape)), tuple(axis_names))


def _readable(error: Exception) -> str:
  text = str(error)
  # Mosaic errors carry an MLIR dump after the diagnosis: keep the diagnosis.
  lines = [l for l in text.splitlines() if l.strip()]
  head = []
  for line in lines:
    if re.match(r"^\s*(module|func\.func|%|\^bb|})", line):
      break
    head.append(line)
    if len(head) >= 12:
      break
  return "\n".join(head) if head else text[:2000]


def compile_for_tpu(fn: Callable, *args: jax.ShapeDtypeStruct,
                    topology: str = "v5e:2x2",
                    mesh_axes: Sequence[str] | None = None,
                    mesh_shape: Sequence[int] | None = None,
                    in_specs: Sequence[PartitionSpec] | None = None,
                    out_specs: Any = None,
                    static_kwargs: dict | None = None,
                    donate_argnums: Sequence[int] = ()) -> CompileResult:
  """AOT-compiles ``fn(*args)`` for ``topology``; ``donate_argnums`` as in
  ``jax.jit`` (a donated buffer that an output aliases is updated in place).

  Kernels are lowered with the topology's generation as their target
  (``_backend.target_override``), so they pick that chip's block tables.
  Without ``mesh_axes`` the arguments live on the topology's first chip.
  With ``mesh_axes`` (and ``in_specs``/``out_specs``), ``fn`` runs per shard
  under ``shard_map`` over all chips of the topology: Mosaic kernels cannot be
  partitioned automatically, so multi-chip use always shards them manually.
  """
  devices = topology_devices(topology)
  call = functools.partial(fn, **(static_kwargs or {}))
  if mesh_axes is None:
    sharding = SingleDeviceSharding(devices[0])
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
             for a in args]
  else:
    mesh = topology_mesh(topology, mesh_axes, mesh_shape)
    if in_specs is None or out_specs is None:
      raise ValueError("compile_for_tpu: mesh_axes needs in_specs and out_specs")
    call = _compat.shard_map(call, mesh=mesh, in_specs=tuple(in_specs),
                             out_specs=out_specs)
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype,
                                  sharding=NamedSharding(mesh, spec))
             for a, spec in zip(args, in_specs)]
  generation = topology_generation(topology)
  with _captured_stderr(), _compat.mosaic_version_for_aot(), \
      _backend.target_override(tpu_generation=generation):
    try:
      lowered = jax.jit(call, donate_argnums=tuple(donate_argnums)).lower(
          *specs)
      compiled = lowered.compile()
    except Exception as e:
      error = e
    else:
      error = None
  if error is not None:
    raise TpuCompileError(
        f"TPU compilation for {topology} failed: {_readable(error)}") from error
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  return CompileResult(topology=topology, compiled=compiled,
                       memory=compiled.memory_analysis(), cost=dict(cost or {}),
                       hlo_text=compiled.as_text() or "")


def available_topologies(candidates: Sequence[str] = KNOWN_TOPOLOGIES) -> list[str]:
  out = []
  for name in candidates:
    try:
      topology_devices(name)
    except LibtpuUnavailable:
      continue
    out.append(name)
  return out
