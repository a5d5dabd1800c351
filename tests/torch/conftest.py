"""torch bridge tests: run only where torch_xla is installed (the txla env).

torch_xla runs on its CPU PJRT client here (one device; the FSDPv2 demo test
starts its own 4-device process). Before the first test of this folder the
XLA device is touched, so torch's autograd engine knows it before any CPU
backward runs (otherwise a later XLA backward trips an internal assert in
engine.cpp). Nothing is imported at collection time, so other families'
tests in the same process are unaffected until these run.
"""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")


@pytest.fixture(scope="session", autouse=True)
def _xla_runtime_first():
  try:
    import torch_xla
  except ImportError:  # the newest-jax env: every module here skips itself
    yield None
    return
  yield torch_xla.device()


@pytest.fixture(scope="session")
def xla_device(_xla_runtime_first):
  if _xla_runtime_first is None:
    pytest.skip("torch_xla not installed")
  return _xla_runtime_first


@pytest.fixture
def torch_gen(rng):
  """A torch Generator seeded from the test's numpy rng (seed printed)."""
  import torch
  return torch.Generator().manual_seed(int(rng.integers(2**31)))
