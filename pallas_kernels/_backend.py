"""The one place where an op's backend is chosen.

Backends:
  "mosaic_tpu"  the Pallas kernel compiled by Mosaic for TPU.
  "gpu"         the Pallas kernel lowered for NVIDIA GPUs (Triton / Mosaic GPU).
  "interpret"   the TPU kernel run by the Pallas interpreter (any platform).
  "reference"   plain JAX with identical semantics (XLA fuses it).
  None          chosen by the platform the computation is *lowered for*
                (``jax.lax.platform_dependent``): TPU -> mosaic_tpu,
                CUDA -> gpu, anything else (CPU) -> interpret. Because the
                choice is made at lowering time, AOT-compiling for a TPU from a
                CPU host picks the Mosaic kernel.

Interpret mode can be forced everywhere with the environment variable
``PALLAS_KERNELS_INTERPRET`` or the ``force_interpret`` context manager. Its
value picks the interpreter flavour:
  "1" / "tpu"   TPU-semantics interpreter (``pltpu.InterpretParams``), which
                simulates VMEM, DMAs and semaphores;
  "races"       the same, with data-race detection;
  "generic"     Pallas' generic interpreter (``interpret=True``).
The context is read when a function is traced: a jitted function keeps the
choice it was traced with.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Any, Callable, Mapping

import jax

from pallas_kernels import _compat

BACKENDS = ("mosaic_tpu", "gpu", "interpret", "reference")
INTERPRET_FLAVOURS = ("tpu", "races", "generic")
INTERPRET_ENV_VAR = "PALLAS_KERNELS_INTERPRET"

_forced_flavour: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "pallas_kernels_forced_interpret", default=None)


def _flavour_from_env() -> str | None:
  value = os.environ.get(INTERPRET_ENV_VAR, "").strip().lower()
  if value in ("", "0", "false", "no", "off"):
    return None
  if value in ("1", "true", "yes", "on"):
    return "tpu"
  if value not in INTERPRET_FLAVOURS:
    raise ValueError(
        f"{INTERPRET_ENV_VAR}={value!r}: expected one of 0, 1, "
        f"{', '.join(INTERPRET_FLAVOURS)}")
  return value


def forced_interpret_flavour() -> str | None:
  """The interpreter flavour forced by context or environment, else None."""
  return _forced_flavour.get() or _flavour_from_env()


@contextlib.contextmanager
def force_interpret(flavour: str = "tpu"):
  """Run every op traced inside this block in Pallas interpret mode."""
  if flavour not in INTERPRET_FLAVOURS:
    raise ValueError(
        f"force_interpret: flavour={flavour!r} is not one of {INTERPRET_FLAVOURS}")
  token = _forced_flavour.set(flavour)
  try:
    yield
  finally:
    _forced_flavour.reset(token)


def interpret_value(flavour: str | None = None) -> Any:
  """The ``interpret=`` value to pass to ``pl.pallas_call``."""
  flavour = flavour or forced_interpret_flavour() or "tpu"
  if flavour == "generic":
    return True
  return _compat.tpu_interpret_params(detect_races=(flavour == "races"))


def check_backend(op: str, backend: str | None) -> None:
  if backend is not None and backend not in BACKENDS:
    raise ValueError(
        f"{op}: backend={backend!r} is not one of None, "
        + ", ".join(repr(b) for b in BACKENDS))


Implementation = Callable[..., Any] | str


def dispatch(op: str, backend: str | None,
             implementations: Mapping[str, Implementation], *args,
             rule: Any = None) -> Any:
  """Calls ``op``'s implementation for ``backend`` on ``args`` (arrays only).

  ``implementations`` maps "mosaic_tpu", "gpu" and "reference" to callables
  taking ``args``; the TPU callable must accept ``interpret=``. A string value
  marks the backend unsupported and says why. "interpret" may be given
  explicitly; otherwise it is the TPU callable run with ``interpret=``.
  Static parameters belong in the callables (functools.partial), not in args.
  ``rule`` (a ``_sharding.Rule``) makes a kernel call compose with sharding
  (``pallas_kernels._sharding``); the reference needs none (XLA partitions
  it).
  """
  check_backend(op, backend)
  impls = _complete(op, implementations)

  if backend is None:
    if forced_interpret_flavour() is not None:
      backend = "interpret"
    else:
      call = lambda *a: _by_lowering_platform(op, impls, a)
      return _sharded(rule, call, args)
  impl = impls[backend]
  if isinstance(impl, str):
    raise ValueError(f"{op}: backend={backend!r} is not supported: {impl}")
  if backend == "reference":
    return impl(*args)
  # The TPU-semantics interpreter's ordered callbacks cannot live inside
  # custom_partitioning: under Auto axes it runs unpartitioned.
  effects = backend == "interpret" and (forced_interpret_flavour()
                                        or "tpu") != "generic"
  return _sharded(rule, impl, args, auto=not effects)


def _sharded(rule, call, args, auto=True):
  if rule is None:
    return call(*args)
  from pallas_kernels import _sharding
  return _sharding.run(rule, call, *args, auto=auto)


def _complete(op: str, implementations: Mapping[str, Implementation]):
  unknown = set(implementations) - set(BACKENDS)
  if unknown:
    raise AssertionError(f"{op}: unknown backends {sorted(unknown)}")
  impls = dict(implementations)
  if "reference" not in impls:
    raise AssertionError(f"{op}: every op needs a reference implementation")
  tpu = impls.get("mosaic_tpu", "no Mosaic TPU kernel exists for this op")
  impls["mosaic_tpu"] = tpu
  impls.setdefault("gpu", "no GPU kernel exists for this op")
  if "interpret" not in impls:
    if isinstance(tpu, str):
      impls["interpret"] = tpu
    else:
      impls["interpret"] = lambda *a: tpu(*a, interpret=interpret_value())
  return impls


def _by_lowering_platform(op, impls, args):
  """Each platform's branch; only the one lowered for is compiled."""
  def usable(name, fallback="reference"):
    impl = impls[name]
    return impls[fallback] if isinstance(impl, str) else impl

  # The CPU branch uses the generic interpreter: the TPU-semantics one emits
  # ordered callbacks, which a cond whose other branches are pruned at
  # lowering cannot carry. Forced interpret mode (tests) takes the TPU one.
  tpu = impls["mosaic_tpu"]
  cpu = (impls["reference"] if isinstance(tpu, str)
         else lambda *a: tpu(*a, interpret=interpret_value("generic")))
  branches = dict(tpu=usable("mosaic_tpu"), cuda=usable("gpu"), default=cpu)
  return jax.lax.platform_dependent(*args, **branches)


def resolve_for_platform(platform: str) -> str:
  """The backend that ``backend=None`` selects when lowering for ``platform``."""
  if forced_interpret_flavour() is not None:
    return "interpret"
  return {"tpu": "mosaic_tpu", "cuda": "gpu", "gpu": "gpu"}.get(
      platform, "interpret")
