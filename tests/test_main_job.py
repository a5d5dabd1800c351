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


def test_unknown_op_is_rejected():
  result = _main("--ops", "no_such_op", "--families", "iou")
  assert result.returncode == 2
  assert "unknown op" in result.stderr


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
