"""The main job (python -m pallas_kernels) and its options."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pallas_kernels import _cases

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _main(*args, timeout=600):
  env = dict(os.environ, PYTHONPATH=ROOT)
  # As a user starts it: no interpret forcing, no platform chosen.
  for name in ("PALLAS_KERNELS_INTERPRET", "JAX_PLATFORMS", "JAX_PLATFORM_NAME"):
    env.pop(name, None)
  return subprocess.run([sys.executable, "-m", "pallas_kernels", *args],
                        capture_output=True, text=True, cwd=ROOT, env=env,
                        timeout=timeout)


def test_help_explains_options():
  result = _main("--help")
  assert result.returncode == 0
  for option in ("--size", "--ops", "--backend", "--json"):
    assert option in result.stdout


def test_small_run_prints_table_and_every_case_matches(tmp_path):
  report = tmp_path / "rows.json"
  result = _main("--size", "small", "--iters", "1", "--json", str(report))
  assert "max error" in result.stdout and "speed-up" in result.stdout
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  rows = json.loads(report.read_text())["rows"]
  ops = {r["op"] for r in rows}
  for family_op in ("flash_attention", "int8_matmul", "giou_loss", "nms"):
    assert family_op in ops, f"main job lacks {family_op}: {sorted(ops)}"
  assert all(r["status"] == "ok" and r["backend"] == "interpret" for r in rows)
  # libtpu is installed for AOT compiles; its TPU-VM warnings stay hidden.
  assert "TPU_WORKER_HOSTNAMES" not in result.stderr
  assert "libtpu" not in result.stderr


def test_unknown_op_is_rejected_with_the_valid_names():
  result = _main("--ops", "nmss", "--families", "iou")
  assert result.returncode == 2
  assert "unknown op(s) nmss" in result.stderr
  assert "flash_attention" in result.stderr and "batched_nms" in result.stderr


def _script(*args):
  """scripts/main.sh with an environment directory that does not exist: the
  answer must come before any environment is built."""
  env = dict(os.environ, PALLAS_KERNELS_VENVS="/nonexistent/venvs")
  return subprocess.run(["bash", os.path.join(ROOT, "scripts", "main.sh"),
                         *args], capture_output=True, text=True, env=env,
                        timeout=60)


def test_script_answers_help_and_bad_arguments_before_installing():
  result = _script("--help")
  assert result.returncode == 0 and "--ops" in result.stdout
  assert "[setup]" not in result.stderr
  result = _script("--ops", "nmss")
  assert result.returncode == 2 and "the ops are:" in result.stderr
  assert "[setup]" not in result.stderr
  result = _script("--size", "huge")
  assert result.returncode == 2 and "invalid choice" in result.stderr


def test_cli_ops_are_the_main_job_cases():
  from pallas_kernels import _cli
  cases = _cases.load_cases("small")
  assert set(_cli.OPS) == {c.op for c in cases}
  import inspect
  import pallas_kernels as pk
  exported = {name for name in dir(pk) if inspect.isfunction(getattr(pk, name))
              and not name.startswith(("shard_", "force_"))
              and name != "write_kv_pages"}  # a cache update, not a case
  assert exported | {"int8_dense", "quantized_dense"} == set(_cli.OPS), \
      "every exported op is a main-job case"
  assert tuple(_cli.FAMILIES) == tuple(_cases.FAMILIES)
  assert tuple(_cli.SIZES) == tuple(_cases.SIZES)
  from pallas_kernels import _backend
  assert set(_cli.BACKENDS) == set(_backend.BACKENDS) - {"reference"}


def test_broken_family_becomes_error_row(monkeypatch):
  def boom(name):
    raise ImportError("simulated")
  monkeypatch.setattr(_cases.importlib, "import_module", boom)
  (case,) = _cases.load_cases("small", families=("nms",))
  with pytest.raises(RuntimeError, match="could not load the nms cases"):
    case.fn(backend=None)


def test_max_abs_error_handles_nan_and_shape():
  import numpy as np
  assert _cases.max_abs_error(np.array([1.0, np.nan]), np.array([1.5, np.nan])) == 0.5
  assert _cases.max_abs_error(np.array([np.nan]), np.array([1.0])) == float("inf")
  assert _cases.max_abs_error(np.zeros(2), np.zeros(3)) == float("inf")


def test_import_on_a_cpu_host_prints_no_tpu_noise():
  env = dict(os.environ, PYTHONPATH=ROOT)
  for name in ("JAX_PLATFORMS", "JAX_PLATFORM_NAME"):
    env.pop(name, None)
  for order in ("import pallas_kernels, jax", "import jax, pallas_kernels"):
    result = subprocess.run(
        [sys.executable, "-c", order + "; print(jax.devices()[0].platform)"],
        capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    if not any(os.path.exists(p) for p in ("/dev/accel0", "/dev/nvidia0")):
      assert result.stdout.strip() == "cpu"
    assert "libtpu" not in result.stderr and "TPU_" not in result.stderr, (
        result.stderr[-2000:])
