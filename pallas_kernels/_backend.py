"""The one place where an op's kernel is chosen: each op lists ``Kernel`` rows
("mosaic_tpu", "triton", "mosaic_gpu", "reference"), best first, and calls
``dispatch``; ``backend=None`` takes the first row that supports the call on
the platform it is lowered for. Interpret mode (``force_interpret``,
``PALLAS_KERNELS_INTERPRET``) is read at trace time. Rules in full:
docs/design/architecture.md.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, Sequence

import jax

from pallas_kernels import _compat
# The interpreter flavours, re-exported: callers name them here.
from pallas_kernels._interpret import (  # noqa: F401
    INTERPRET_ENV_VAR, INTERPRET_FLAVOURS, find_races, force_interpret,
    forced_flavour_exactly, forced_interpret_flavour, interpret_value)

KERNELS = ("mosaic_tpu", "triton", "mosaic_gpu", "reference")
BACKENDS = KERNELS + ("gpu", "interpret")
GPU_KERNELS = ("mosaic_gpu", "triton")
TPU_GENERATIONS = ("v4", "v5e", "v5p", "v6e", "tpu7x")
DEFAULT_TPU_GENERATION = "v5e"


@dataclasses.dataclass(frozen=True)
class TpuSpec:
  """Peak rates of one JAX device of a TPU generation (dense, no sparsity).

  A device is what one kernel launch runs on: the whole chip where two
  TensorCores act as one megacore (v4, v5p: "parallel" grid axes are shared
  between them), one TensorCore elsewhere (tpu7x shows each of its two as a
  device). ``int8``/``fp8`` None: no published rate. Vector rates are per
  f32 element: ``cores * valu_slots * 8 * 128 * clock_hz`` VPU operations
  and ``cores * 8 * 128 * clock_hz`` transcendentals (EUP) per second.
  Sources and assumptions: ``TPU_SPEC_SOURCES``.
  """
  bf16: float            # MXU FLOP/s
  int8: float | None     # MXU OP/s
  fp8: float | None      # MXU FLOP/s where fp8 has its own rate
  hbm: float             # bytes/s
  vmem: int              # bytes per TensorCore
  cores: int             # TensorCores per device
  mxu_width: int         # systolic array side; narrower operands pad to it
  clock_hz: float
  valu_slots: int        # f32 (8, 128) vector ALU operations per cycle

  @property
  def vpu(self) -> float:
    return self.cores * self.valu_slots * 8 * 128 * self.clock_hz

  @property
  def eup(self) -> float:
    return self.cores * 8 * 128 * self.clock_hz

TPU_SPECS = {
    "v4": TpuSpec(bf16=275e12, int8=275e12, fp8=None, hbm=1200e9,
                  vmem=16 << 20, cores=2, mxu_width=128, clock_hz=1.05e9,
                  valu_slots=2),
    "v5e": TpuSpec(bf16=197e12, int8=393e12, fp8=None, hbm=819e9,
                   vmem=128 << 20, cores=1, mxu_width=128, clock_hz=1.5e9,
                   valu_slots=4),
    "v5p": TpuSpec(bf16=459e12, int8=918e12, fp8=None, hbm=2765e9,
                   vmem=64 << 20, cores=2, mxu_width=128, clock_hz=1.75e9,
                   valu_slots=4),
    "v6e": TpuSpec(bf16=918e12, int8=1836e12, fp8=None, hbm=1638e9,
                   vmem=128 << 20, cores=1, mxu_width=256, clock_hz=1.75e9,
                   valu_slots=4),
    # Per TensorCore: half of the chip's 2307 TFLOP/s bf16, 4614 fp8, 7380 GB/s.
    "tpu7x": TpuSpec(bf16=2307e12 / 2, int8=None, fp8=4614e12 / 2,
                     hbm=7380e9 / 2, vmem=64 << 20, cores=1, mxu_width=256,
                     clock_hz=1.75e9, valu_slots=4),
}
TPU_SPEC_SOURCES = """\
Peaks per chip, from Google Cloud's TPU pages ("System architecture"):
  v4   https://cloud.google.com/tpu/docs/v4    275 TFLOP/s "bf16 or int8",
       32 GiB HBM2 at 1200 GBps, 2 TensorCores of 4 MXUs
  v5e  https://cloud.google.com/tpu/docs/v5e   197 TFLOP/s bf16, 393 TOP/s
       int8, 16 GB HBM2 at 819 GBps, 1 TensorCore of 4 MXUs
  v5p  https://cloud.google.com/tpu/docs/v5p   459 TFLOP/s bf16, 95 GB HBM2e
       at 2765 GBps (95 GB is HBM; VMEM is 64 MiB per core); int8 918 TOP/s
       from jax's tpu_info (the Cloud page lists bf16 only)
  v6e  https://cloud.google.com/tpu/docs/v6e   918 TFLOP/s bf16, 1836 TOP/s
       int8, 32 GB at 1638 GBps; one TensorCore of two 256x256 MXUs
  tpu7x https://cloud.google.com/tpu/docs/tpu7x 2307 TFLOP/s bf16, 4614
       TFLOP/s fp8, 192 GiB at 7380 GBps, 2 TensorCores (separate devices);
       no int8 rate published
VMEM per TensorCore: jax/_src/tpu_info.py (also the Pallas "TPU Hardware
Reference", docs.jax.dev/en/latest/pallas/tpu/hardware.html): v4 16 MiB,
v5e 128, v5p 64, v6e 128, tpu7x 64.
Clocks: v5e 1.5 GHz (jax-ml/scaling-book, "How to Think About TPUs": 5e13
FLOP/s per 128x128 MXU at 1.5 GHz); v4 1.05 GHz and v5p 1.75 GHz follow from
their peaks at that rate per MXU (cores x 4 MXUs). Assumed: v6e and tpu7x
1.75 GHz (unpublished).
VPU: (8, 128) lanes; 2 ALU slots per lane on v4, 4 on v5 (scaling-book,
Appendix C); assumed 4 on v6e and tpu7x. Kernels keep vector math in f32.
Assumed: the EUP issues one (8, 128) f32 vreg of transcendentals per cycle.
Assumed: ~0.35 us of fixed cost per grid step (pipeline bookkeeping, DMA
issue and wait), split between the cores of a megacore.
"""
TPU_STEP_OVERHEAD_S = 0.35e-6
# VMEM per TensorCore: what one kernel launch can address.
TPU_VMEM_BYTES = {g: s.vmem for g, s in TPU_SPECS.items()}

_PLATFORM = {"mosaic_tpu": "tpu", "triton": "cuda", "mosaic_gpu": "cuda",
             "reference": None}

def _mosaic_gpu_interpreter() -> Any:
  from pallas_kernels import _mosaic_gpu
  return _mosaic_gpu.interpret_params()


_INTERPRETERS: dict[str, Callable[[], Any]] = {
    "mosaic_tpu": interpret_value,
    "triton": lambda: True,
    "mosaic_gpu": _mosaic_gpu_interpreter,
}


# ------------------------------------------------------------ hardware facts
@dataclasses.dataclass(frozen=True)
class Target:
  """The chip a kernel is lowered for, as far as kernels care."""
  tpu_generation: str = DEFAULT_TPU_GENERATION
  gpu_capability: str | None = None   # "9.0" for Hopper; None: unknown

  @property
  def hopper(self) -> bool:
    return (self.gpu_capability or "").startswith("9")


_override: contextvars.ContextVar[dict] = contextvars.ContextVar(
    "pallas_kernels_target_override", default={})


@contextlib.contextmanager
def target_override(*, tpu_generation: str | None = None,
                    gpu_capability: str | None = None):
  """Lower for this chip whatever is attached (AOT compiles, tests)."""
  if tpu_generation is not None and tpu_generation not in TPU_GENERATIONS:
    raise ValueError(f"target_override: tpu_generation={tpu_generation!r} is "
                     f"not one of {TPU_GENERATIONS}")
  values = dict(_override.get())
  if tpu_generation is not None:
    values["tpu_generation"] = tpu_generation
  if gpu_capability is not None:
    values["gpu_capability"] = str(gpu_capability)
  token = _override.set(values)
  try:
    yield
  finally:
    _override.reset(token)


def trace_context() -> tuple:
  """What, besides its arguments, changes how a kernel call traces: the
  forced interpreter flavour, the ``target_override`` and whether calls run
  ``_sharding.local_only``. A hashable key for caches of traced functions."""
  from pallas_kernels import _sharding
  return (forced_interpret_flavour(), tuple(sorted(_override.get().items())),
          _sharding.is_local_only())


def generation_from_device_kind(kind: str) -> str:
  """"TPU v5 lite" -> "v5e", "TPU v5" -> "v5p", "TPU v6 lite" -> "v6e",
  "TPU7x" -> "tpu7x"."""
  kind = kind.lower().replace(" ", "")
  if "7x" in kind or "ironwood" in kind:
    return "tpu7x"
  if "v6" in kind or "trillium" in kind:
    return "v6e"
  if "v5lite" in kind or "v5e" in kind:
    return "v5e"
  if "v5" in kind:          # "TPU v5" is how libtpu names v5p
    return "v5p"
  if "v4" in kind:
    return "v4"
  return DEFAULT_TPU_GENERATION


def _attached(platform: str):
  try:
    return jax.devices(platform)[0]
  except Exception:  # no such backend here
    return None


def target() -> Target:
  """The hardware facts of the current lowering target."""
  values = dict(_override.get())
  if "tpu_generation" not in values:
    device = _attached("tpu")
    if device is not None:
      values["tpu_generation"] = generation_from_device_kind(
          device.device_kind)
  if "gpu_capability" not in values:
    device = _attached("gpu")
    capability = getattr(device, "compute_capability", None)
    if capability is not None:
      values["gpu_capability"] = str(capability)
  return Target(**values)


# ------------------------------------------------------------------- chooser
def _supported(target: Target) -> str | None:
  del target
  return None


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One implementation of an op for one call.

  ``run(*arrays, interpret=None)`` runs it (``interpret`` is the interpreter
  value, or None to compile for the chip; the reference takes no
  ``interpret``). ``supports()`` and ``hardware(target)`` return None when
  the kernel can run the call, else the reason it cannot.
  """
  name: str
  run: Callable[..., Any]
  supports: Callable[[], str | None] = lambda: None
  hardware: Callable[[Target], str | None] = _supported

  def __post_init__(self):
    if self.name not in KERNELS:
      raise AssertionError(f"unknown kernel name {self.name!r}")

  @property
  def platform(self) -> str | None:
    return _PLATFORM[self.name]

  def reason(self, target: Target | None, interpreted: bool = False):
    """Why this kernel cannot run the call (on ``target``), else None."""
    why = self.supports()
    if why is None and not interpreted and target is not None:
      why = self.hardware(target)
    return why

  def call(self, args, interpret=None):
    if self.name == "reference":
      return self.run(*args)
    return self.run(*args, interpret=interpret)


def check_backend(op: str, backend: str | None) -> None:
  if backend is not None and backend not in BACKENDS:
    raise ValueError(
        f"{op}: backend={backend!r} is not one of None, "
        + ", ".join(repr(b) for b in BACKENDS))


def choose(op: str, backend: str | None, kernels: Sequence[Kernel],
           platform: str | None = None) -> tuple[Kernel, Any]:
  """The kernel (and interpret value) ``dispatch`` runs for a named backend,
  or for ``backend=None`` on ``platform`` ("tpu", "cuda", "cpu")."""
  check_backend(op, backend)
  table = _table(op, kernels)
  flavour = forced_interpret_flavour()
  if backend is None and flavour is not None:
    # An op without a TPU kernel (soft_nms), or whose TPU kernel refuses
    # the call, has nothing to interpret: the reference runs.
    tpu = table.get("mosaic_tpu")
    usable = tpu is not None and tpu.reason(None, interpreted=True) is None
    backend = "interpret" if usable else "reference"
  if backend is None:
    if platform is None:
      raise TypeError("choose: backend=None needs the platform")
    return _for_platform(table, platform)
  if backend == "interpret":
    kernel = _named(op, table, "mosaic_tpu", backend, None, True)
    return kernel, interpret_value()
  if backend == "gpu":
    reasons = []
    for name in GPU_KERNELS:
      kernel = table.get(name)
      if kernel is None:
        continue
      why = kernel.reason(target())  # a choice: by the target's chip
      value = _INTERPRETERS[name]() if flavour else None
      if why is None and flavour and value is None:
        why = "this jax has no interpreter for it"
      if why is None:
        return kernel, value
      reasons.append(f"{name}: {why}")
    raise ValueError(f"{op}: backend='gpu' has no GPU kernel for this call ("
                     + ("; ".join(reasons) or "no GPU kernel exists") + ")")
  kernel = _named(op, table, backend, backend, target(), flavour is not None)
  if backend == "reference" or flavour is None:
    return kernel, None
  value = _INTERPRETERS[backend]()
  if value is None:
    raise ValueError(f"{op}: backend={backend!r} cannot be interpreted: this "
                     "jax has no interpreter for it")
  return kernel, value


def only_reference(backend: str | None, kernels: Sequence[Kernel]) -> bool:
  """Whether the call runs the reference on every platform: ``backend`` is
  "reference", or None while no kernel row supports the call. Such a call
  is plain JAX, so callers may let JAX differentiate it (both modes)."""
  if backend == "reference":
    return True
  return backend is None and all(
      k.supports() is not None for k in kernels if k.name != "reference")


def dispatch(op: str, backend: str | None, kernels: Sequence[Kernel], *args,
             rule: Any = None, auto_partition: bool = True,
             batch_reference: bool = False) -> Any:
  """Runs ``op`` on ``args`` (arrays only) with the kernel ``backend`` picks.

  ``kernels`` lists the op's rows, best first; static parameters belong in
  the rows' callables (functools.partial), not in ``args``. ``rule`` (a
  ``_sharding.Rule``) makes a kernel call compose with sharding
  (``pallas_kernels._sharding``) and with ``jax.vmap``
  (``pallas_kernels._batching``); the reference needs none (XLA partitions
  and batches it) unless ``batch_reference``: its XLA ops do not batch
  every mapped operand (``ragged_dot``), so it takes the rule's batching. ``auto_partition=False``: under Auto mesh axes XLA places
  the operands itself (for calls whose static parameters are per-split
  values, such as one attention mask per head).
  """
  check_backend(op, backend)
  table = _table(op, kernels)
  if only_reference(backend, kernels):
    reference = table["reference"].call
    if batch_reference and rule is not None and _batched(args):
      from pallas_kernels import _batching
      return _batching.vmappable(rule, lambda *a: reference(a))(*args)
    return reference(args)
  if rule is None or (_effects_outlive_custom_vmap(op, backend, kernels)
                      and not _batched(args)):
    return _dispatch_kernel(op, backend, kernels, table, rule, args,
                            auto_partition)
  from pallas_kernels import _batching
  return _batching.vmappable(
      rule, lambda *a: _dispatch_kernel(op, backend, kernels, table, rule, a,
                                        auto_partition))(*args)


def _effects_outlive_custom_vmap(op, backend, kernels) -> bool:
  """jax < 0.12 lowers ``custom_vmap`` without threading ordered effects,
  which the TPU-semantics and Mosaic GPU interpreters' callbacks have: there
  such a call is wrapped only when ``jax.vmap`` is tracing it (the rule is
  applied then, and nothing of ``custom_vmap`` is left to lower)."""
  if _compat.JAX_VERSION >= (0, 12, 0):
    return False
  return runs_with_callbacks(op, backend, kernels)


def runs_with_callbacks(op: str, backend: str | None,
                        kernels: Sequence[Kernel]) -> bool:
  """Whether the call runs in an interpreter that works through ordered host
  callbacks (the TPU-semantics and Mosaic GPU ones). The TPU-semantics one
  also waits for every device of the enclosing ``shard_map`` at each kernel
  launch."""
  if backend is None and forced_interpret_flavour() is None:
    return False
  kernel, interpret = choose(op, backend, kernels)
  return kernel.name != "reference" and interpret not in (None, True)


def _batched(args) -> bool:
  from jax._src.interpreters import batching
  return any(isinstance(a, batching.BatchTracer) for a in args)


def _dispatch_kernel(op, backend, kernels, table, rule, args,
                     auto_partition=True):
  if backend is None and forced_interpret_flavour() is None:

    def by_platform(*a):
      branches = {}
      for key, platform in (("tpu", "tpu"), ("cuda", "cuda"),
                            ("default", "cpu")):
        kernel, interpret = _for_platform(table, platform)
        branches[key] = _bound(kernel, interpret)
      return jax.lax.platform_dependent(*a, **branches)

    return _sharded(rule, by_platform, args, auto=auto_partition)
  kernel, interpret = choose(op, backend, kernels)
  if kernel.name == "reference":
    return kernel.call(args)
  # The TPU-semantics and Mosaic GPU interpreters' ordered callbacks cannot
  # live inside custom_partitioning: under Auto axes they run unpartitioned.
  effects = interpret not in (None, True)
  return _sharded(rule, _bound(kernel, interpret), args,
                  auto=auto_partition and not effects)


def _bound(kernel: Kernel, interpret):
  return lambda *a: kernel.call(a, interpret)


def _sharded(rule, call, args, auto=True):
  if rule is None:
    return call(*args)
  from pallas_kernels import _sharding
  return _sharding.run(rule, call, *args, auto=auto)


def _table(op: str, kernels: Sequence[Kernel]) -> dict[str, Kernel]:
  table = {}
  for kernel in kernels:
    if kernel.name in table:
      raise AssertionError(f"{op}: kernel {kernel.name!r} listed twice")
    table[kernel.name] = kernel
  if "reference" not in table:
    raise AssertionError(f"{op}: every op needs a reference implementation")
  return table


def _named(op, table, name, backend, target_, interpreted):
  kernel = table.get(name)
  if kernel is None:
    raise ValueError(f"{op}: backend={backend!r} is not supported: no "
                     f"{name} kernel exists for this op")
  why = kernel.reason(target_, interpreted)
  if why is not None:
    raise ValueError(f"{op}: backend={backend!r} cannot run this call: {why}")
  return kernel


def _for_platform(table: dict[str, Kernel], platform: str):
  """The first row that supports the call on ``platform``, else the
  reference. CPU runs the TPU kernel in the generic interpreter: the
  TPU-semantics one emits ordered callbacks, which a cond whose other
  branches are pruned at lowering cannot carry."""
  if platform == "cpu":
    tpu = table.get("mosaic_tpu")
    if tpu is not None and tpu.reason(None, interpreted=True) is None:
      return tpu, interpret_value("generic")
    return table["reference"], None
  hw = target()
  for kernel in table.values():
    if kernel.platform == platform and kernel.reason(hw) is None:
      return kernel, None
  return table["reference"], None


def resolve_for_platform(platform: str, kernels: Sequence[Kernel] | None = None
                         ) -> str:
  """The backend name ``backend=None`` selects when lowering for
  ``platform`` ("tpu", "cuda"/"gpu", "cpu"); without ``kernels``, the
  family of kernel a platform gets."""
  if forced_interpret_flavour() is not None:
    return "interpret"
  platform = {"gpu": "cuda"}.get(platform, platform)
  if kernels is None:
    return {"tpu": "mosaic_tpu", "cuda": "gpu"}.get(platform, "interpret")
  kernel, interpret = _for_platform(_table("resolve", kernels), platform)
  return "interpret" if interpret is not None else kernel.name
