"""Pallas interpret mode: which interpreter runs the TPU kernels ("tpu",
"races", "generic"), forced per context (``force_interpret``) or by
``PALLAS_KERNELS_INTERPRET``.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Any, Callable

import jax

from pallas_kernels import _compat

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
  with forced_flavour_exactly(flavour):
    yield


@contextlib.contextmanager
def forced_flavour_exactly(flavour: str | None):
  """Sets the forced flavour to ``flavour``, None included, whatever the
  enclosing context forces (to trace later work, such as a backward on
  another thread, as the call that recorded ``flavour`` was traced)."""
  token = _forced_flavour.set(flavour)
  try:
    yield
  finally:
    _forced_flavour.reset(token)


def find_races(fn: Callable[..., Any], *args, **kwargs):
  """Runs ``fn(*args, **kwargs)`` with every TPU kernel it launches in the
  race-detecting TPU interpreter; returns ``(outputs, RaceLog)``.

  The log covers every launch (an attention gradient launches forward, dq
  and dk/dv kernels), not only the last. ``fn`` is traced inside, so a
  function jitted before keeps the interpreter it was traced with.
  """
  with force_interpret("races"), _compat.record_races() as log:
    out = jax.block_until_ready(fn(*args, **kwargs))
  return out, log


def interpret_value(flavour: str | None = None) -> Any:
  """The ``interpret=`` value that runs a TPU kernel in the interpreter."""
  flavour = flavour or forced_interpret_flavour() or "tpu"
  if flavour == "generic":
    return True
  return _compat.tpu_interpret_params(detect_races=(flavour == "races"))
