"""torch bridge tests: run only where torch_xla is installed (the txla env).

torch_xla runs on its CPU PJRT client here (one device; the FSDPv2 demo test
starts its own 4-device process). The XLA device is touched at import so
torch's autograd engine knows it before any CPU backward runs (otherwise a
later XLA backward trips an internal assert in engine.cpp).
"""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")

try:
  import torch  # noqa: F401
  import torch_xla
except ImportError:  # the newest-jax env: every module here skips itself
  torch_xla = None
else:
  torch_xla.device()


@pytest.fixture(scope="session")
def xla_device():
  if torch_xla is None:
    pytest.skip("torch_xla not installed")
  return torch_xla.device()


@pytest.fixture
def torch_gen(rng):
  """A torch Generator seeded from the test's numpy rng (seed printed)."""
  import torch
  return torch.Generator().manual_seed(int(rng.integers(2**31)))
