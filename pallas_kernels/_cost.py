"""``pl.CostEstimate`` figures (flops, transcendentals, HBM bytes) for the
kernels' ``pallas_call``s, which XLA's scheduler cannot see into; elementwise
formulas are counted from their jaxpr on scalars.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np

from pallas_kernels._compat import pl

# Primitives the hardware evaluates as transcendental functions (EUP on TPU,
# SFU on GPU); division and square root count as ordinary flops, as in XLA.
TRANSCENDENTAL = frozenset({
    "exp", "exp2", "expm1", "log", "log1p", "logistic", "tanh", "sin", "cos",
    "tan", "atan", "atan2", "asin", "acos", "erf", "erf_inv", "pow", "cbrt"})
# Primitives that move or retype data without arithmetic.
_FREE = frozenset({
    "broadcast_in_dim", "convert_element_type", "reshape", "squeeze",
    "copy", "copy_p", "expand_dims", "transpose", "stop_gradient"})


def estimate(*, flops, bytes_accessed, transcendentals=0) -> pl.CostEstimate:
  """A ``pl.CostEstimate`` with every figure rounded to a Python int."""
  return pl.CostEstimate(flops=int(flops), transcendentals=int(transcendentals),
                         bytes_accessed=int(bytes_accessed))


def nbytes(*arrays: Any) -> int:
  """Total bytes of arrays or ShapeDtypeStructs (None entries count 0)."""
  return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
             for a in arrays if a is not None)


def _count(jaxpr) -> tuple[int, int]:
  flops = transcendentals = 0
  for eqn in jaxpr.eqns:
    subs = [v for v in eqn.params.values()
            if hasattr(v, "eqns") or hasattr(v, "jaxpr")]
    if subs:
      for sub in subs:
        f, t = _count(getattr(sub, "jaxpr", sub))
        flops, transcendentals = flops + f, transcendentals + t
      continue
    name = eqn.primitive.name
    if name in TRANSCENDENTAL:
      transcendentals += 1
    elif name not in _FREE:
      flops += 1
  return flops, transcendentals


def scalar_ops(fn: Callable[..., Any], num_args: int) -> tuple[int, int]:
  """(flops, transcendentals) of one evaluation of elementwise ``fn`` on
  ``num_args`` float32 scalars: one per arithmetic primitive in its jaxpr
  (sub-jaxprs included). Traces ``fn``: callers cache the result."""
  scalar = jax.ShapeDtypeStruct((), np.float32)
  jaxpr = jax.make_jaxpr(fn)(*([scalar] * num_args))
  return _count(jaxpr.jaxpr)
