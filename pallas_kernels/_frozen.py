"""Differentiation of matmuls with frozen quantized weights: ``frozen`` wraps a
kernel call in a ``jax.custom_jvp`` whose tangent is plain JAX, linear in the
operands named in ``linear``; a tangent of any other float operand raises a
TypeError naming it (not JAX's "Linearization failed").
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero


def frozen(op, run, names, operands, linear, reasons):
  """``run(*operands)``, differentiable in the operands ``linear`` names."""
  floats = [a is not None and jnp.issubdtype(a.dtype, jnp.inexact)
            for a in operands]
  if not any(floats):  # nothing to differentiate (integer operands only)
    return run(*operands)

  @jax.custom_jvp
  def call(*arrays):
    return run(*arrays)

  def jvp(primals, tangents):
    out = call(*primals)
    total = None
    for name, primal, tangent in zip(names, primals, tangents):
      if primal is None or isinstance(tangent, SymbolicZero):
        continue
      if name not in linear:
        raise TypeError(
            f"{op}: cannot differentiate with respect to {name}: "
            f"{reasons.get(name, 'it is part of the quantized weight')}")
      term = linear[name](tangent, *primals).astype(jnp.float32)
      total = term if total is None else total + term
    if total is None:
      total = jnp.zeros(out.shape, jnp.float32)
    return out, total.astype(out.dtype)

  call.defjvp(jvp, symbolic_zeros=True)
  return call(*operands)
