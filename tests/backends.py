"""Every backend an op's shared test suite runs on a CPU host.

A suite takes the ``backend`` fixture (``tests/conftest.py``) and calls the
op through ``backend.run(op, *args, **kwargs)``; adding a backend here gives
it every suite. Kernels for other chips run in their interpreter:

  interpret        the TPU kernel, TPU-semantics interpreter (VMEM, DMAs);
  interpret_generic the TPU kernel, Pallas' generic interpreter (what
                   ``backend=None`` runs on a CPU);
  triton           the Triton GPU kernel, generic interpreter;
  mosaic_gpu       the Mosaic GPU kernel, Mosaic GPU interpreter (jax >= 0.10);
  reference        plain JAX.

A suite whose op has no kernel of a kind gets a skip, not a pass: the op's
chooser raises "no ... kernel exists", which ``run`` turns into a skip.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import pytest

from pallas_kernels import _backend, _mosaic_gpu


@dataclasses.dataclass(frozen=True)
class Backend:
  name: str
  backend: str | None     # the op's backend= argument
  flavour: str | None     # forced interpreter flavour, None for none

  def context(self):
    if self.flavour is None:
      return contextlib.nullcontext()
    return _backend.force_interpret(self.flavour)

  def run(self, op: Callable[..., Any], *args, **kwargs):
    """``op(*args, backend=..., **kwargs)`` under this backend's interpreter;
    skips the test where the op has no kernel of this kind."""
    with self.context():
      try:
        return op(*args, backend=self.backend, **kwargs)
      except ValueError as e:
        if "kernel exists for this op" in str(e):
          pytest.skip(str(e))
        raise

  def __str__(self):
    return self.name


ALL = (
    Backend("interpret", "interpret", "tpu"),
    Backend("interpret_generic", None, "generic"),
    Backend("triton", "triton", "generic"),
    Backend("mosaic_gpu", "mosaic_gpu", "generic"),
    Backend("reference", "reference", None),
)
REFERENCE = ALL[-1]


def params(names=None, every_flavour=False):
  """pytest params for the named backends (default: all), each skipped
  where this jax cannot run it. Beside "interpret", "interpret_generic"
  (the same kernel, the less strict interpreter) runs with --runslow only,
  unless ``every_flavour``: test_backends_agree and test_empty_inputs run
  every op on it, and the docs' examples run on it (backend=None)."""
  selected = [b.name for b in ALL if names is None or b.name in names]
  out = []
  for b in ALL:
    if b.name not in selected:
      continue
    marks = []
    if (b.name == "interpret_generic" and "interpret" in selected
        and not every_flavour):
      marks.append(pytest.mark.slow)
    if b.name == "mosaic_gpu" and _mosaic_gpu.interpret_params() is None:
      marks.append(pytest.mark.skip(
          reason="this jax has no Mosaic GPU Pallas interpreter"))
    out.append(pytest.param(b, id=b.name, marks=marks))
  return out
