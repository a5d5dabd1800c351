"""The benchmark harness: timing, results files, tables, roofline."""
from __future__ import annotations

import json
import os
import sys

import jax.numpy as jnp
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import harness, roofline  # noqa: E402


def test_time_jax_waits_for_results():
  seconds = harness.time_jax(lambda x: x @ x, jnp.ones((64, 64)), warmup=1,
                             iters=3)
  assert 0 < seconds < 5


def test_time_jax_reps_dispatches_all_calls_and_waits_once():
  calls = []

  def counted(x):
    calls.append(1)
    return x + 1

  harness.time_jax(counted, jnp.ones(4), warmup=2, iters=3, reps=5)
  # 2 warm-up calls, then 3 samples of 5 back-to-back calls each.
  assert len(calls) == 2 + 3 * 5


def test_time_replicated_jax_traces_one_call_per_copy_on_its_own_inputs():
  seen = []

  def traced(x, y):
    seen.append(1)   # runs at trace time only: once per copy
    return x * y

  x, y = jnp.arange(4.0), jnp.full((4,), 3.0)
  seconds, first = harness.time_replicated_jax(traced, (x, y), copies=3,
                                               iters=2, host_reps=2)
  assert len(seen) == 3 and 0 < seconds < 5
  assert jnp.array_equal(first, x * y)


def test_steady_slope_cancels_what_every_sample_pays_once():
  # 7 s paid once per sample, 2 s per unit: the slope is the 2 s alone.
  calls = []

  def run(count):
    calls.append(count)
    return 7.0 + 2.0 * count

  assert harness.steady_slope(run, (2, 6), iters=3) == pytest.approx(2.0)
  assert calls == [2, 6, 2, 6, 2, 6]
  with pytest.raises(ValueError, match="counts"):
    harness.steady_slope(run, (4, 4))


def test_steady_slope_shrugs_off_one_slow_sample():
  times = iter([10.0, 30.0, 10.0, 30.0, 10.0, 900.0, 10.0, 30.0, 10.0, 30.0])
  # pairs (2, 6): slopes 5, 5, 222.5, 5, 5 -> the median is 5
  assert harness.steady_slope(lambda c: next(times), (2, 6),
                              iters=5) == pytest.approx(5.0)


def test_time_replicated_jax_steady_runs_both_program_counts():
  x = jnp.arange(4.0)
  seconds, first = harness.time_replicated_jax(lambda v: v + 1, (x,),
                                               copies=2, iters=2,
                                               steady=(1, 3))
  assert abs(seconds) < 5 and jnp.array_equal(first, x + 1)


def test_results_file_records_device_versions_date(tmp_path):
  rows = [{"shape": "4x4", "ours_ms": 1.0, "peer_ms": 2.0,
           "speedup": harness.ratio(2.0, 1.0)}]
  path = harness.write_results("demo", rows, extra={"note": "x"},
                               directory=str(tmp_path))
  data = json.loads(open(path).read())
  assert data["benchmark"] == "demo" and data["rows"] == rows
  assert data["jax"] and data["device"] and data["date"][:4].isdigit()
  assert os.path.basename(path).startswith("demo-cpu-")
  assert rows[0]["speedup"] == 2.0
  assert harness.ratio(None, 1.0) is None


def test_print_table_aligns_columns(capsys):
  harness.print_table([{"op": "a", "ms": 1.23456}, {"op": "bbbb", "ms": 12345.0}])
  lines = capsys.readouterr().out.splitlines()
  assert lines[0].startswith("op  ") and len({len(l.rstrip()) for l in lines[2:]}) >= 1
  assert "1.235" in lines[2] and "1.23e+04" in lines[3]


def test_roofline_bound_and_int8_rate():
  # 8192^3 matmul in bf16 on v5e: compute bound, 2*n^3 / 197e12 s.
  n = 8192
  est = roofline.roofline("v5e", 2 * n**3, 3 * n * n * 2, "bf16")
  assert est["bound"] == "compute"
  assert est["time_s"] == pytest.approx(2 * n**3 / 197e12)
  int8 = roofline.roofline("v5e", 2 * n**3, 3 * n * n, "int8")
  assert int8["time_s"] == pytest.approx(est["time_s"] / 2)
  copy = roofline.roofline("h100", 0, 1e9)
  assert copy["bound"] == "memory" and copy["time_s"] == pytest.approx(1e9 / 3.35e12)


def test_run_lists_and_rejects_unknown(capsys):
  from bench import run
  assert run.main(["no_such_bench"]) == 2


def test_run_counts_only_int_codes_as_failures(tmp_path, monkeypatch):
  from bench import run
  scripts = {"rows": "def main(argv):\n  return [{'a': 1}]\n",
             "fails": "def main(argv):\n  return 3\n",
             "ok": "def main(argv):\n  return None\n"}
  for name, body in scripts.items():
    (tmp_path / f"bench_{name}.py").write_text(body)
  monkeypatch.setattr(run, "HERE", str(tmp_path))
  assert run.main(["rows", "ok"]) == 0
  assert run.main(["rows", "fails"]) == 1


def test_device_kernel_times_reports_a_total():
  # On the CPU there is no GPU stream, so the total is zero kernels.
  times = harness.device_kernel_times(lambda x: x * 2, jnp.ones(8), reps=2)
  assert times["(device total)"][0] >= 0 and "(device total)" in times


def test_module_settings_reads_named_attributes():
  import types
  module = types.SimpleNamespace(TILE=(8, 128), WARPS=2, OTHER="x")
  assert harness.module_settings(module, ("TILE", "WARPS")) == {
      "TILE": (8, 128), "WARPS": 2}
  with pytest.raises(AttributeError):
    harness.module_settings(module, ("MISSING",))
