"""Differences between the supported jax releases (0.7.1 through the newest),
so kernels are written once.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import threading
from typing import Any

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())


def _first_attr(module, *names):
  for name in names:
    if hasattr(module, name):
      return getattr(module, name)
  return None


# The TPU-semantics interpreter was called TPUInterpretParams before it became
# InterpretParams; very old releases have neither.
TpuInterpretParams = _first_attr(pltpu, "InterpretParams", "TPUInterpretParams")
HAS_TPU_INTERPRETER = TpuInterpretParams is not None

_TpuCompilerParams = _first_attr(pltpu, "CompilerParams", "TPUCompilerParams")


def tpu_compiler_params(**kwargs):
  """Mosaic compiler params (dimension_semantics, vmem_limit_bytes, ...)."""
  accepted = inspect.signature(_TpuCompilerParams).parameters
  return _TpuCompilerParams(**{k: v for k, v in kwargs.items() if k in accepted})


def gpu_compiler_params(**kwargs):
  """Triton compiler params (num_warps, num_stages)."""
  from jax.experimental.pallas import triton as pltriton
  cls = _first_attr(pltriton, "CompilerParams", "TritonCompilerParams")
  accepted = inspect.signature(cls).parameters
  return cls(**{k: v for k, v in kwargs.items() if k in accepted})


@functools.cache
def _pallas_call_scopes_its_name() -> bool:
  from jax._src.pallas import pallas_call as module
  return "named_scope(name)" in inspect.getsource(module)


def pallas_call(kernel, *, name: str, **kwargs):
  """``pl.pallas_call`` whose launches carry ``name`` in HLO and profiles. Newer
  jax opens a ``named_scope(name)`` around the call itself, which names the
  custom-call instruction; older jax only records the name inside the kernel's
  config, so the instruction took its enclosing function's name
  (``branch_0_fun``). Here the scope is opened where jax does not."""
  if (JAX_VERSION < (0, 12, 0) and HAS_TPU_INTERPRETER
      and isinstance(kwargs.get("interpret"), TpuInterpretParams)):
    kwargs["compiler_params"] = _without_grid_semantics(
        kwargs.get("compiler_params"))
  call = pl.pallas_call(kernel, name=name, **kwargs)
  if _pallas_call_scopes_its_name():
    return call

  @functools.wraps(call)
  def scoped(*args):
    with jax.named_scope(name):
      return call(*args)
  return scoped


def _without_grid_semantics(params):
  """jax < 0.12's TPU interpreter zips the grid with dimension_semantics,
  and its pallas_call batching rule adds a grid axis without a semantics
  entry, so ``vmap`` of a traced call failed (``safe_zip``): there the
  interpreter runs every axis in order (it needs no semantics to be
  correct; only its randomised parallel order is lost)."""
  if params is None or getattr(params, "dimension_semantics", None) is None:
    return params
  return dataclasses.replace(params, dimension_semantics=None)


def tpu_interpret_params(detect_races: bool = False):
  """Interpret value that simulates TPU semantics (DMAs, semaphores, races)."""
  if not HAS_TPU_INTERPRETER:
    return True
  accepted = inspect.signature(TpuInterpretParams).parameters
  kwargs = {}
  if "detect_races" in accepted:
    kwargs["detect_races"] = detect_races
  return TpuInterpretParams(**kwargs)


_TPU_INTERPRETER_MODULES = (
    "jax._src.pallas.mosaic.interpret.interpret_pallas_call",  # jax >= 0.8
    "jax._src.pallas.mosaic.interpret")                        # jax 0.7


def _tpu_interpreter_module():
  """The module holding the TPU interpreter's global race-detector state."""
  for path in _TPU_INTERPRETER_MODULES:
    try:
      module = importlib.import_module(path)
    except ImportError:
      continue
    if hasattr(module, "RaceDetectionState"):
      return module
  return None


def races_found() -> bool:
  """Whether the TPU interpreter's *last* kernel launch saw a data race. The
  interpreter makes a fresh race-detector state for every launch, so an op of
  several kernels needs ``record_races`` to see them all."""
  module = _tpu_interpreter_module()
  races = getattr(module, "races", None)
  return bool(getattr(races, "races_found", False))


class RaceLog:
  """The race-detector states of the TPU interpreter's kernel launches. One
  state per interpreted ``pallas_call`` launch, in launch order (the interpreter
  makes one when a launch sets up its simulated memory)."""

  def __init__(self):
    self._states: list[Any] = []
    self._lock = threading.Lock()

  def _add(self, state) -> None:
    with self._lock:
      self._states.append(state)

  @property
  def launches(self) -> int:
    """How many interpreted kernel launches ran with race detection."""
    return len(self._states)

  @property
  def racy_launches(self) -> list[int]:
    """Indices (launch order) of the launches that saw a data race."""
    return [i for i, s in enumerate(self._states)
            if getattr(s, "races_found", False)]

  @property
  def found(self) -> bool:
    return bool(self.racy_launches)

  def __repr__(self):
    return (f"RaceLog(launches={self.launches}, "
            f"racy_launches={self.racy_launches})")


@contextlib.contextmanager
def record_races():
  """Collects the race-detector state of every TPU-interpreter launch. Yields a
  ``RaceLog``. It wraps the interpreter's ``RaceDetectionState`` constructor,
  which the interpreter calls at run time once per launch, so it sees launches
  of functions jitted before the block too. Races are recorded and logged, never
  raised (jax >= 0.8's ``on_race="raise"`` would stop at the first). Kernels
  still need race detection turned on
  (``tpu_interpret_params(detect_races=True)``, the "races" flavour)."""
  module = _tpu_interpreter_module()
  if module is None:
    raise RuntimeError("record_races: this jax has no TPU interpreter with "
                       "race detection")
  log = RaceLog()
  original = module.RaceDetectionState
  takes_on_race = "on_race" in inspect.signature(original).parameters

  def recording_state(*args, **kwargs):
    if takes_on_race:
      kwargs["on_race"] = "warn"
    state = original(*args, **kwargs)
    log._add(state)
    return state

  module.RaceDetectionState = recording_state
  try:
    yield log
  finally:
    module.RaceDetectionState = original


def shard_map(fn, *, mesh, in_specs, out_specs):
  """shard_map without replication checks (Pallas outputs carry no vma)."""
  if hasattr(jax, "shard_map"):
    params = inspect.signature(jax.shard_map).parameters
    flag = "check_vma" if "check_vma" in params else "check_rep"
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs,
                         out_specs=out_specs, **{flag: False})
  from jax.experimental.shard_map import shard_map as legacy_shard_map
  return legacy_shard_map(fn, mesh=mesh, in_specs=in_specs,
                          out_specs=out_specs, check_rep=False)


@contextlib.contextmanager
def mosaic_version_for_aot(max_version: int = 7):
  """Caps the Mosaic serialization version while AOT-compiling from a CPU host.
  jax < 0.8 picks the Mosaic IR version by asking the *running* backend's libtpu
  how old it is; on a CPU host there is none, so it emits the newest version
  (8), which the libtpu paired with jax 0.7.1 (0.0.20/0.0.21) cannot read. A
  real TPU takes the version check's own path and is not affected."""
  if JAX_VERSION >= (0, 8, 0):
    yield
    return
  from jax._src import tpu_custom_call
  original = tpu_custom_call.get_ir_version

  def capped(ctx):
    version = original(ctx)
    return max_version if version is None else min(version, max_version)

  tpu_custom_call.get_ir_version = capped
  try:
    yield
  finally:
    tpu_custom_call.get_ir_version = original


# ------------------------------------------------------------------ sharding
# jax 0.7-0.11 type values inside shard_map by their "vma" (varying manual
# axes); 0.12 by a ManualAxisType whose ``varying`` set plays that role.

def varying_axes(x) -> frozenset:
  """The manual mesh axes ``x`` varies over (empty outside shard_map)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()) or ())


def make_varying(x, axes) -> Any:
  """``x`` typed as varying over ``axes`` too (pvary / pcast to varying)."""
  missing = tuple(sorted(frozenset(axes) - varying_axes(x)))
  if not missing:
    return x
  if hasattr(jax.lax, "pcast"):
    return jax.lax.pcast(x, missing, to="varying")
  return jax.lax.pvary(x, missing)


def cotangent_like(ct, primal) -> Any:
  """A cotangent typed as its primal varies: summed (psum) over the manual
  axes the primal is replicated over (a replicated weight's gradient adds
  every device's part), marked varying over the axes the primal varies
  over."""
  extra = tuple(sorted(varying_axes(ct) - varying_axes(primal)))
  if extra:
    ct = jax.lax.psum(ct, extra)
  return make_varying(ct, varying_axes(primal))


def _typed_varying(aval, axes):
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None:                       # jax >= 0.12
    return aval.update_manual_axis_type(mat.update(varying=frozenset(axes)))
  if hasattr(aval, "vma"):
    return aval.update(vma=frozenset(axes))
  return aval


@functools.cache
def _vary_cast_p():
  """A no-op cast that retypes a value's varying manual axes to ``axes``.
  ``pvary`` casts an *invariant* value (its transpose sums over the axes); this
  one only changes the type of a value that varies over ``axes`` anyway, both
  ways, so its transpose is the reverse cast. Its abstract evaluation sets the
  type whatever ``check_vma`` says, so a jaxpr traced from it stays consistently
  typed when jax traces it again with the check on (lowering a ``custom_vmap``,
  or Pallas' generic interpreter lowering a kernel)."""
  from jax.extend.core import Primitive
  from jax.interpreters import ad, batching, mlir
  prim = Primitive("pallas_kernels_vary_cast")
  prim.def_impl(lambda x, *, axes, back: x)
  prim.def_abstract_eval(
      lambda aval, *, axes, back: _typed_varying(aval, axes))
  mlir.register_lowering(prim, lambda ctx, x, *, axes, back: [x])
  batching.primitive_batchers[prim] = (
      lambda args, dims, **params: (prim.bind(args[0], **params), dims[0]))
  ad.deflinear2(prim, lambda ct, x, *, axes, back: [
      prim.bind(ct, axes=back, back=axes)])
  return prim


def forget_varying(x) -> Any:
  """``x`` typed as varying over no manual axis (its values unchanged). For a
  computation local to each device (a kernel call) that jax cannot type: its
  results must get their type back with ``remember_varying`` before they meet
  anything else."""
  axes = varying_axes(x)
  if not axes:
    return x
  return _vary_cast_p().bind(x, axes=(), back=tuple(sorted(axes)))


def remember_varying(x, axes) -> Any:
  """``x``, computed on each device from values varying over ``axes``,
  typed as varying over them (the reverse of ``forget_varying``)."""
  have = varying_axes(x)
  axes = frozenset(axes) | have
  if axes == have:
    return x
  return _vary_cast_p().bind(x, axes=tuple(sorted(axes)),
                             back=tuple(sorted(have)))


def vma_checked() -> bool:
  """Whether we are tracing inside a shard_map with check_vma=True."""
  from jax._src import config
  return bool(config._check_vma.value)


def vma_check_disabled():
  """Context in which Pallas out_shapes need no varying-axes type."""
  from jax._src import config
  return config._check_vma(False)


def in_manual_context() -> bool:
  """Whether the current abstract mesh has manual axes (inside shard_map)."""
  mesh = jax.sharding.get_abstract_mesh()
  return bool(getattr(mesh, "manual_axes", ()))


def is_explicit_axis(mesh, axis) -> bool:
  return axis in getattr(mesh, "explicit_axes", ())


def reshard(x, spec):
  """``x`` resharded to ``spec`` on its Explicit mesh (no-op if equal)."""
  if tuple(jax.typeof(x).sharding.spec) == tuple(spec):
    return x
  return jax.sharding.reshard(x, spec)


def load_tpu_plugin_for_aot() -> None:
  """Loads libtpu's PJRT plugin for compile-only use, with JAX's callbacks. On a
  CPU host (JAX_PLATFORMS=cpu) jax loads the plugin only to build a topology and
  skips the callbacks it gives discovered plugins, among them the
  custom-partitioning callbacks; a sharded program using ``custom_partitioning``
  then fails to compile ("Custom emitter for CustomSPMDPartitioning not found").
  Loading it here first runs them."""
  import jax.experimental.custom_partitioning  # noqa: F401  (its callbacks)
  from jax._src import xla_bridge
  from jax._src.lib import xla_client
  if xla_client.pjrt_plugin_loaded("tpu"):
    return
  path = xla_bridge.get_tpu_library_path()
  if path is None:
    return
  c_api = xla_client.load_pjrt_plugin_dynamically("tpu", path)
  with xla_bridge._plugin_callback_lock:
    callbacks = [c for c in xla_bridge._plugin_callbacks
                 if "partitioner" in getattr(getattr(c, "func", c), "__name__", "")]
    for callback in callbacks:
      callback(c_api=c_api)
# ---------------------------------------------- Mosaic GPU, GPU lowering --

def mosaic_gpu_load(ref, idx=(), *, layout=None, optimized=True):
  """``plgpu.load`` of ``ref[idx]`` into registers in ``layout``. jax 0.12
  dropped load's index argument (slice the ref with ``.at``)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  if "idx" in inspect.signature(plgpu.load).parameters:
    return plgpu.load(ref, idx, layout=layout, optimized=optimized)
  if not isinstance(idx, tuple) or idx:
    ref = ref.at[idx]
  return plgpu.load(ref, layout=layout, optimized=optimized)


# What GPU kernels lower for on a host without one: an sm_90 (Hopper) GPU,
# the one the Mosaic GPU kernels are written for.
ABSTRACT_GPU_KIND = "NVIDIA H100 80GB HBM3"


@contextlib.contextmanager
def abstract_gpu_target(device_kind: str = ABSTRACT_GPU_KIND):
  """Lets GPU (Triton) kernels lower for ``device_kind`` without that GPU. jax
  >= 0.12's Triton lowering reads the target's compute capability from the
  device and raises without a GPU unless an abstract GPU device is set through
  an abstract mesh; older jax picks a default target itself. The abstract mesh
  is part of the trace context: trace inside the context too."""
  sharding = jax.sharding
  if not hasattr(sharding, "AbstractDevice"):
    yield
    return
  device = sharding.AbstractDevice(device_kind=device_kind, num_cores=None,
                                   platform="cuda")
  # No axes: only the device is set, nothing gets sharded.
  with sharding.use_abstract_mesh(
      sharding.AbstractMesh((), (), abstract_device=device)):
    yield


def lower_for_cuda(fn, *args, device_kind: str = ABSTRACT_GPU_KIND):
  """``jax.jit(fn)`` traced for ``args`` and lowered for CUDA on any host
  (no GPU needed); returns jax's ``Lowered``."""
  with abstract_gpu_target(device_kind):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


__all__ = [
    "JAX_VERSION", "HAS_TPU_INTERPRETER", "TpuInterpretParams", "pl", "pltpu",
    "tpu_compiler_params", "gpu_compiler_params", "pallas_call",
    "tpu_interpret_params",
    "races_found", "RaceLog", "record_races", "shard_map",
    "mosaic_version_for_aot", "varying_axes",
    "make_varying", "forget_varying", "remember_varying", "vma_checked",
    "vma_check_disabled",
    "in_manual_context",
    "is_explicit_axis", "reshard", "load_tpu_plugin_for_aot",
    "mosaic_gpu_load", "ABSTRACT_GPU_KIND", "abstract_gpu_target",
    "lower_for_cuda",
]
