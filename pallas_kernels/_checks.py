"""Argument checks the ops' APIs share; errors name the op and argument."""
from __future__ import annotations

import math
import numbers

import jax
import numpy as np


def is_static_number(x) -> bool:
  """A Python/NumPy real known at trace time (bools excluded)."""
  return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_array(op: str, name: str, x, ndim: int) -> None:
  """Raises unless ``x`` is an array of ``ndim`` dimensions."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{op}: {name} must be an array, got {type(x).__name__}")
  if x.ndim != ndim:
    dims = "dimension" if ndim == 1 else "dimensions"
    raise ValueError(f"{op}: {name} must have {ndim} {dims}, got shape "
                     f"{tuple(x.shape)}")


def integer_cotangent(x):
  """The cotangent of an integer input of a ``custom_vjp`` (float0 zeros),
  or None for None."""
  return None if x is None else np.zeros(x.shape, jax.dtypes.float0)


def scale_and_cap(op: str, sm_scale, logit_soft_cap, head_dim: int):
  """(sm_scale, logit_soft_cap) of an attention op, checked: static finite
  numbers, the scale defaulting to ``1 / sqrt(head_dim)``, the cap > 0 or
  None."""
  if sm_scale is None:
    sm_scale = 1.0 / math.sqrt(head_dim) if head_dim else 1.0
  elif not is_static_number(sm_scale):
    raise TypeError(f"{op}: sm_scale must be a Python number (it is static), "
                    f"got {type(sm_scale).__name__}")
  if not math.isfinite(sm_scale):
    raise ValueError(f"{op}: sm_scale must be finite, got {sm_scale}")
  if logit_soft_cap is not None:
    if not is_static_number(logit_soft_cap):
      raise TypeError(f"{op}: logit_soft_cap must be a Python number, got "
                      f"{type(logit_soft_cap).__name__}")
    if not (logit_soft_cap > 0 and math.isfinite(logit_soft_cap)):
      raise ValueError(f"{op}: logit_soft_cap must be > 0 and finite, got "
                       f"{logit_soft_cap}")
    logit_soft_cap = float(logit_soft_cap)
  return sm_scale, logit_soft_cap
