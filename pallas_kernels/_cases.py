"""Cases the main job (``python -m pallas_kernels``) runs: one per op and size.

Each kernel family lists its cases in ``<family>/cases.py`` as
``main_job_cases(size) -> list[Case]``.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

import jax
import numpy as np

# Family name (as given to --families) -> its package.
FAMILIES = {
    "attention": "pallas_kernels.attention",
    "decode": "pallas_kernels.decode",
    "int8": "pallas_kernels.int8",
    "quant": "pallas_kernels.quant",
    "iou": "pallas_kernels.boxes.iou",
    "nms": "pallas_kernels.boxes.nms",
    "gmm": "pallas_kernels.gmm",
    "ragged": "pallas_kernels.ragged",
}
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


def _broken_family(family: str, error: Exception) -> Case:
  def fail(*_, backend=None):
    raise RuntimeError(f"could not load the {family} cases: {error}")
  return Case(op=family, shape="-", fn=fail, args=(), tolerance=0.0)


def load_cases(size: str, families=FAMILIES) -> list[Case]:
  """Every family's cases; a family that fails to load becomes an ERROR row."""
  cases = []
  for family in families:
    try:
      module = importlib.import_module(f"{FAMILIES[family]}.cases")
      cases.extend(module.main_job_cases(size))
    except Exception as e:  # report it in the table, run the other families
      cases.append(_broken_family(family, e))
  return cases
