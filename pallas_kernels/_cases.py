"""Cases the main job (``python -m pallas_kernels``) runs: one per op and size,
listed by each family's ``<family>/cases.py`` as ``main_job_cases(size)``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
from typing import Any, Callable

import jax
import numpy as np

from pallas_kernels import _registry

# Family name (as given to --families) -> its cases module.
FAMILIES = {f.name: f.module("cases") for f in _registry.FAMILIES}
SIZES = ("small", "medium", "large")


def max_abs_error(out, ref) -> float:
  """Largest |out - ref| over all leaves, computed in float64."""
  errors = [0.0]
  for o, r in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)):
    o = np.asarray(o, dtype=np.float64)
    r = np.asarray(r, dtype=np.float64)
    if o.shape != r.shape:
      return float("inf")
    if o.size:
      diff = np.abs(o - r)
      both_nan = np.isnan(o) & np.isnan(r)
      diff = np.where(both_nan, 0.0, diff)
      errors.append(float(np.nanmax(np.where(np.isnan(diff), np.inf, diff))))
  return max(errors)


@dataclasses.dataclass
class Case:
  op: str                          # public op name
  shape: str                       # human-readable problem size
  fn: Callable[..., Any]           # fn(*args, backend=...) -> arrays
  args: tuple                      # concrete inputs
  tolerance: float                 # accepted max error vs the reference
  error: Callable[[Any, Any], float] = max_abs_error


def abstract(shape, dtype=None) -> jax.ShapeDtypeStruct:
  """An abstract array (bfloat16 unless ``dtype``) for ``jax.eval_shape``."""
  return jax.ShapeDtypeStruct(shape, dtype or jax.numpy.bfloat16)


def x64(enabled: bool):
  """float64 inside the block when ``enabled`` (jax < 0.8:
  ``jax.experimental.enable_x64``)."""
  if not enabled:
    return contextlib.nullcontext()
  if hasattr(jax, "enable_x64"):
    return jax.enable_x64(True)
  from jax.experimental import enable_x64
  return enable_x64()


def _broken_family(family: str, error: Exception) -> Case:
  def fail(*_, backend=None):
    raise RuntimeError(f"could not load the {family} cases: {error}")
  return Case(op=family, shape="-", fn=fail, args=(), tolerance=0.0)


def load_cases(size: str, families=FAMILIES) -> list[Case]:
  """Every family's cases; a family that fails to load becomes an ERROR row."""
  cases = []
  for family in families:
    try:
      module = importlib.import_module(FAMILIES[family])
      cases.extend(module.main_job_cases(size))
    except Exception as e:  # report it in the table, run the other families
      cases.append(_broken_family(family, e))
  return cases
