"""Test setup: CPU execution, interpret mode, markers and shared fixtures."""
from __future__ import annotations

import os

from pallas_kernels import _quiet

_quiet.select_cpu_when_no_accelerator()
# Read when jax starts its backends: 8 CPU devices for the sharding tests;
# LLVM at -O0, as the suite's time is mostly compiling small interpreted
# kernels (a quarter less; no fast-math at any level, so the same numbers).
for flag, value in (("xla_force_host_platform_device_count", "8"),
                    ("xla_backend_optimization_level", "0")):
  if flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --{flag}={value}")
os.environ.setdefault("JAX_ENABLE_X64", "0")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from hypothesis import HealthCheck, settings  # noqa: E402

# Interpret-mode kernels are slow per example: keep hypothesis runs short and
# free of deadlines; CI=true keeps the same budget but derandomizes nothing.
settings.register_profile(
    "default", max_examples=12, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile(
    "thorough", max_examples=100, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def pytest_configure(config):
  config.addinivalue_line("markers", "slow: long-running; run with --runslow")
  config.addinivalue_line(
      "markers", "tpu_aot: AOT-compiles for real TPU topologies (needs libtpu)")
  config.addinivalue_line("markers", "torch: needs the torch/torch_xla stack")
  config.addinivalue_line(
      "markers", "compat: the oldest-jax tier (scripts/test.sh runs -m compat "
      "there): the torch tests and every op on every CPU backend once")


def pytest_addoption(parser):
  parser.addoption("--runslow", action="store_true", default=False,
                   help="also run tests marked slow")


# The oldest-jax environment reruns these files (plus tests/torch and the
# tests marked ``compat`` in other files: sharding in checked shard_map,
# jit and Explicit axes; ragged attention once per backend): every op on every
# CPU backend, vmap, empty inputs and each generation's AOT compile, which is
# where jax 0.7.1 and libtpu 0.0.21 differ from the newest.
COMPAT_TIER = frozenset({
    "test_backends_agree.py", "test_vmap.py", "test_empty_inputs.py",
    "test_generations_aot.py", "test_kernel_costs_aot.py",
    "test_package.py", "test_shard_helpers.py", "test_checked_shard_map.py",
    "test_write_kv_pages.py",
})
# scripts/test.sh sets PK_TEST_TIER=compat for that run: hypothesis tests
# that draw every backend's options then draw one example each.
COMPAT_RUN = os.environ.get("PK_TEST_TIER") == "compat"


def pytest_collection_modifyitems(config, items):
  for item in items:
    path = item.path
    if path.name in COMPAT_TIER or path.parent.name == "torch":
      item.add_marker(pytest.mark.compat)
  if config.getoption("--runslow"):
    return
  skip = pytest.mark.skip(reason="slow: pass --runslow")
  for item in items:
    if "slow" in item.keywords:
      item.add_marker(skip)


@pytest.fixture
def rng(request):
  """A fresh numpy Generator per test; the seed is printed on failure and
  ``PK_TEST_SEED=<seed>`` replays it."""
  seed = int(os.environ.get("PK_TEST_SEED") or
             int.from_bytes(os.urandom(4), "little"))
  request.node.user_properties.append(("seed", seed))
  print(f"numpy seed: {seed}")
  return np.random.default_rng(seed)


@pytest.fixture(scope="session")
def tpu_topologies():
  """TPU topologies the installed libtpu can compile for.

  Both test environments install libtpu, so a missing libtpu or a claimed
  generation (v5e, v6e) that cannot be compiled for is a failure, not a skip.
  """
  from pallas_kernels import tpu_aot
  if not tpu_aot.libtpu_installed():
    pytest.fail("libtpu is not installed: the AOT TPU tests need jax[tpu]")
  for required in ("v5e:2x2", "v6e:2x2"):
    tpu_aot.topology_devices(required)  # raises with libtpu's reason
  return tpu_aot.available_topologies()


def pytest_report_header(config):
  from pallas_kernels import _compat
  return (f"jax {jax.__version__}, TPU interpreter: "
          f"{_compat.HAS_TPU_INTERPRETER}")
