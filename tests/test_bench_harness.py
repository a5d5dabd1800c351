"""The benchmark harness, the roofline table, and each bench's --quick run."""
from __future__ import annotations

import importlib
import json
import os
import pathlib
import re
import subprocess
import sys

import jax.numpy as jnp
import pytest

from bench import harness, roofline, run

BENCH = pathlib.Path(harness.__file__).parent


def test_steady_slope_cancels_what_every_sample_pays_once():
  calls = []

  def timed(count):  # 7 s paid once per sample, 2 s per unit
    calls.append(count)
    return 7.0 + 2.0 * count

  assert harness.steady_slope(timed, (2, 6), iters=3) == pytest.approx(2.0)
  assert calls == [2, 6, 2, 6, 2, 6]
  with pytest.raises(ValueError, match="counts"):
    harness.steady_slope(timed, (4, 4), iters=1)


def test_steady_slope_shrugs_off_one_slow_sample():
  times = iter([10.0, 30.0, 10.0, 30.0, 10.0, 900.0, 10.0, 30.0, 10.0, 30.0])
  # pairs (2, 6): slopes 5, 5, 222.5, 5, 5 -> the median is 5
  assert harness.steady_slope(lambda c: next(times), (2, 6),
                              iters=5) == pytest.approx(5.0)


def test_timer_takes_more_pairs_for_short_ops_within_its_budget():
  timer = harness.Timer(iters=7, max_iters=31, budget_s=0.3)
  assert timer._pairs(None, 1.0) == 7      # long ops: the minimum
  assert timer._pairs(None, 0.03) == 10    # as many as fit in 0.3 s
  assert timer._pairs(None, 1e-4) == 31    # capped
  assert timer._pairs(5, 1e-4) == 5        # asked for


def test_timer_jax_traces_one_call_per_copy_on_its_own_inputs():
  traced = []

  def op(x, y):
    traced.append(1)  # runs at trace time only: once per copy
    return x * y

  x, y = jnp.arange(4.0), jnp.full((4,), 3.0)
  seconds, first = harness.Timer(iters=2, programs=(1, 3)).jax(
      op, x, y, copies=3)
  assert len(traced) == 3 and abs(seconds) < 5
  assert jnp.array_equal(first, x * y)
  seconds, first = harness.Timer(quick=True).jax(op, x, y, copies=3)
  assert len(traced) == 4 and seconds > 0  # quick: one copy, one sample


def test_timer_jax_synced_reuses_the_one_copy_program():
  traced = []

  def op(x):
    traced.append(1)
    return x + 1

  timer = harness.Timer(iters=1, programs=(1, 2))
  timer.jax(op, jnp.ones(3))
  assert timer.jax_synced(op, jnp.ones(3), iters=2) >= 0
  assert len(traced) == 1


def test_timer_synced_waits_for_each_call():
  calls = []
  seconds = harness.Timer(iters=2).synced(lambda: calls.append(1) or
                                          jnp.ones(3))
  assert seconds >= 0 and len(calls) == 2 + 6  # warm-up, then 3 * iters


def test_measure_records_time_flops_and_failures():
  rows = []
  ok = harness.measure(rows, "c", "ours", lambda: 0.002, flops=4e9, d=1)
  bad = harness.measure(rows, "c", "peer", lambda: 1 / 0)
  assert ok == dict(case="c", impl="ours", ms=2.0, d=1, tflops=2.0)
  assert bad["ms"] is None and bad["error"].startswith("ZeroDivisionError")


def test_add_ratios_compares_each_ours_row_with_the_peers_of_its_case():
  rows = [dict(case="a", impl="ours", ms=2.0),
          dict(case="a", impl="ours_nk", ms=4.0),
          dict(case="a", impl="peer", ms=8.0),
          dict(case="a", impl="broken", ms=None),
          dict(case="b", impl="peer", ms=1.0)]
  harness.add_ratios(rows)
  assert rows[0]["vs_peer"] == 4.0 and rows[1]["vs_peer"] == 2.0
  assert "vs_broken" not in rows[0] and "vs_ours" not in rows[2]


def test_rel_error_scales_by_the_largest_magnitude():
  assert harness.rel_error([1.0, 2.0], [1.0, 4.0]) == pytest.approx(0.5)
  assert harness.rel_error([float("nan")], [1.0]) == float("inf")


def test_device_slug_and_table(capsys):
  assert harness.device_slug("NVIDIA H100 80GB HBM3") == "h100"
  assert harness.device_slug("TPU v5 lite") == "v5e"
  assert harness.device_slug("TPU7x") == "tpu7x"
  assert harness.device_slug("cpu") == "cpu"
  harness.print_table([{"op": "a", "ms": 1.23456}, {"op": "bbbb", "ms": 1e4}])
  lines = capsys.readouterr().out.splitlines()
  assert lines[0].split() == ["op", "ms"]
  assert "1.235" in lines[2] and "1e+04" in lines[3]


def test_roofline_bound_rates_and_vmem():
  n = 8192  # 8192^3 matmul in bf16 on v5e: compute bound
  est = roofline.roofline("v5e", 2 * n**3, 3 * n * n * 2, "bf16")
  assert est["bound"] == "compute"
  assert est["time_s"] == pytest.approx(2 * n**3 / 197e12)
  int8 = roofline.roofline("v5e", 2 * n**3, 3 * n * n, "int8")
  assert int8["time_s"] == pytest.approx(2 * n**3 / 393e12)
  copy = roofline.roofline("h100", 0, 1e9)
  assert copy["bound"] == "memory" and copy["time_s"] == pytest.approx(
      1e9 / 3.35e12)
  assert roofline.SPECS["v5p"]["vmem"] == 64 * 2**20
  with pytest.raises(ValueError, match="tpu7x.*int8"):
    roofline.roofline("tpu7x", 1e9, 1e6, "int8")
  chips = [r["chip"] for r in roofline.rows("mm", 1e12, 1e9, "int8")]
  assert chips == ["v4", "v5e", "v5p", "v6e"]  # TPU7x: no int8 rate
  [row] = roofline.rows("mm", 1e12, 1e9, chips=("v6e",), useful_flops=5e11)
  assert row["tflops"] == pytest.approx(5e11 / (1e12 / 918e12) / 1e12)
  # One tpu7x device is one TensorCore: half the chip's rates.
  assert roofline.SPECS["tpu7x"]["bf16"] == pytest.approx(2307e12 / 2)


def test_roofline_terms_arithmetic():
  """Each term is its work over its rate; the time is the largest of the
  overlapped terms plus the per-step cost; ``bound`` names the largest."""
  work = roofline.Work("w", mxu_flops=197e6, vpu_ops=6.144e6,
                       transcendentals=3.072e6, hbm_bytes=819e3,
                       grid_steps=10)
  t = roofline.terms("v5e", work)
  assert t["mxu"] == pytest.approx(1e-6)        # 197 TFLOP/s
  assert t["vpu"] == pytest.approx(1e-6)        # 4 x 8 x 128 x 1.5 GHz
  assert t["eup"] == pytest.approx(2e-6)        # 8 x 128 x 1.5 GHz
  assert t["hbm"] == pytest.approx(1e-6)        # 819 GB/s
  assert t["steps"] == pytest.approx(3.5e-6)
  assert t["time_s"] == pytest.approx(5.5e-6) and t["bound"] == "steps"
  # Megacore (v5p): two TensorCores share the steps.
  assert roofline.terms("v5p", work)["steps"] == pytest.approx(1.75e-6)
  with pytest.raises(ValueError, match="tpu7x.*int8"):
    roofline.terms("tpu7x", roofline.Work("w", mxu_flops=1, mxu_dtype="int8"))


def test_roofline_exp_term_can_bound_on_v5e():
  """An f32 softmax over VMEM-resident scores on v5e (one exp and 3 VPU
  operations per element, a small matmul): the EUP term bounds it, above
  the MXU and VPU; without the transcendentals the roofline would call it
  VPU-bound, faster. (Attention at head_dim >= 64 stays MXU-bound:
  the MXU pads the contraction to 128, see the next test.)"""
  rows, cols = 4096, 8192
  work = roofline.Work("softmax", mxu_flops=2 * rows * cols * 8,
                       vpu_ops=3 * rows * cols, transcendentals=rows * cols,
                       hbm_bytes=2 * (rows + cols) * 8 * 2, grid_steps=32)
  t = roofline.terms("v5e", work)
  assert t["bound"] == "eup" and t["eup"] > 1.3 * max(t["mxu"], t["vpu"])
  assert t["eup"] == pytest.approx(rows * cols / (1024 * 1.5e9))
  no_exp = roofline.terms("v5e", roofline.Work(
      "softmax", mxu_flops=work.mxu_flops, vpu_ops=work.vpu_ops,
      hbm_bytes=work.hbm_bytes, grid_steps=32))
  assert no_exp["bound"] == "vpu" and no_exp["vpu"] < 0.8 * t["eup"]
  assert no_exp["time_s"] < t["time_s"]


def test_roofline_attention_terms_and_blocks():
  """Attention forward on v5e at head_dim 128: MXU-bound with the exp at
  a quarter of it; larger blocks cut the per-step term; v6e's 256-wide MXU
  pads head_dim 128 (twice the MXU flops of v5e's count)."""
  shape = dict(batch=1, heads=8, length=8192, head_dim=128)
  small = roofline.total("v5e", roofline.attention("v5e", blocks=(512, 512),
                                                   **shape))
  large = roofline.total("v5e", roofline.attention("v5e", blocks=(1024, 1024),
                                                   **shape))
  assert small["bound"] == large["bound"] == "mxu"
  assert small["mxu"] == pytest.approx(4 * 8 * 8192**2 * 128 / 197e12)
  assert small["eup"] == pytest.approx(8 * 8192**2 / (1024 * 1.5e9))
  assert large["steps"] == pytest.approx(small["steps"] / 4)
  assert large["time_s"] < small["time_s"]
  [v6e] = roofline.attention("v6e", blocks=(512, 512), **shape)
  assert v6e.mxu_flops == pytest.approx(2 * 4 * 8 * 8192**2 * 128)
  bwd = roofline.attention("v5e", blocks=(512, 512), backward=True, **shape)
  assert [w.name for w in bwd] == ["dq", "dkv"]
  assert sum(w.mxu_flops for w in bwd) == pytest.approx(
      14 * 8 * 8192**2 * 128)


def test_roofline_main_prints_every_term(capsys):
  assert roofline.main(["--generation", "v5e"]) == 0
  out = capsys.readouterr().out
  header = next(l for l in out.splitlines() if l.startswith("op |"))
  for term in roofline.TERMS + ("bound",):
    assert term in header
  assert "flash_attention fwd | v5e" in out and "cloud.google.com" in out


def test_run_rejects_unknown_and_reports_failures(monkeypatch, capsys):
  assert run.main(["no_such_bench"]) == 2
  commands = []
  monkeypatch.setattr(run.subprocess, "call",
                      lambda cmd: commands.append(cmd) or ("nms" in cmd[2]))
  assert run.main(["--", "--quick"]) == 1
  assert [c[2:] for c in commands] == [[f"bench.{op}", "--quick"]
                                       for op in run.OPS]
  assert "failed: nms" in capsys.readouterr().out


def test_plot_draws_ratios_and_rooflines(tmp_path):
  pytest.importorskip("matplotlib")
  rows = [dict(case="a", impl="ours", ms=1.0, vs_peer=2.0),
          dict(case="a", impl="peer", ms=2.0)]
  png = harness.plot(str(tmp_path / "x.png"), rows,
                     roofline.rows("mm", 1e12, 1e9))
  assert png and (tmp_path / "x.png").stat().st_size > 0


def test_benches_use_only_the_public_api():
  # The same scripts time the package before and after a refactor.
  allowed = {"pallas_kernels.attention", "pallas_kernels.attention.mosaic_tpu",
             "pallas_kernels.attention.block_sizes",
             "pallas_kernels.decode", "pallas_kernels.tpu_aot",
             "pallas_kernels.boxes.nms",
             # tile searches and the bundle walk call the gmm kernels
             "pallas_kernels.gmm",
             # the bundle walk gives ragged attention's work items
             "pallas_kernels.ragged"}
  # The roofline models the kernels from their own tile tables; the runner
  # reads the bench list from the op registry.
  models = {"roofline.py"}
  for path in BENCH.glob("*.py"):
    text = path.read_text()
    if path.name in models:
      continue
    if path.name == "run.py":
      text = text.replace("from pallas_kernels import _registry", "")
    modules = set(re.findall(r"from (pallas_kernels[\w.]*) import", text))
    modules |= set(re.findall(r"import (pallas_kernels[\w.]+)", text))
    assert modules <= allowed, (path.name, modules - allowed)
    assert "torch_bridge._" not in text and "sys.path" not in text
    assert "os.environ[" not in text and "environ.setdefault" not in text


def _quick(op, tmp_path):
  """``python -m bench.<op> --quick``'s results, run in a subprocess: its
  torch peers run CPU backwards, which must not reach torch's autograd
  engine before the torch tests' XLA device does in this worker."""
  module = importlib.import_module(f"bench.{op}")
  root = pathlib.Path(__file__).resolve().parents[1]
  subprocess.run([sys.executable, "-m", f"bench.{op}", "--quick", "--out",
                  str(tmp_path)], cwd=root, check=True, timeout=900,
                 env=dict(os.environ, PYTHONPATH=str(root)))
  (path,) = tmp_path.glob(f"{op}-*.json")
  data = json.loads(pathlib.Path(path).read_text())
  assert pathlib.Path(path).name.startswith(f"{op}-cpu-")
  for key in ("benchmark", "date", "device", "jax", "platform", "timing",
              "tpu_roofline", "rows"):
    assert key in data, key
  assert data["quick"] is True and data["benchmark"] == op
  for case in module.QUICK:  # every case ran (attention adds the mode)
    assert any(r["case"].startswith(module.label(case))
               for r in data["rows"]), case
  ours = [r for r in data["rows"] if r["impl"].startswith("ours")]
  assert ours and all(r["ms"] and r["ms"] > 0 for r in ours), ours
  return data


@pytest.mark.parametrize("op", ["attention", "decode_attention",
                                "int8_matmul", "quantized_matmul", "giou"])
def test_quick_run_times_ours_against_a_jax_peer(op, tmp_path):
  data = _quick(op, tmp_path)
  ours = [r for r in data["rows"] if r["impl"].startswith("ours")]
  assert all(any(k.startswith("vs_") for k in r) for r in ours)
  assert all(r["err"] < 2e-2 for r in ours)


def test_quick_run_nms(tmp_path):
  data = _quick("nms", tmp_path)
  assert all(r.get("synced_ms") for r in data["rows"] if r["impl"] == "ours")
  for row in data["rows"]:
    if row["impl"] == "ours" and "same" in row:
      assert row["same"], row


def test_quick_run_torch_bridge(tmp_path):
  pytest.importorskip("torch")
  pytest.importorskip("torchvision")
  data = _quick("torch_bridge", tmp_path)
  ours = [r for r in data["rows"] if r["impl"] == "ours"]
  assert all("vs_jax" in r and "vs_torch" in r for r in ours)
  assert all(r.get("same", True) and r.get("err", 0) < 1e-3 for r in ours)


def test_quick_run_ring_attention(tmp_path):
  data = _quick("ring_attention", tmp_path)
  ours = [r for r in data["rows"] if r["impl"] == "ours_ring"]
  assert sorted({r["devices"] for r in ours}) == [2, 4]
  for row in ours:
    assert "vs_head_parallel" in row and "vs_one_device" in row, row
    assert row["efficiency"] == pytest.approx(row["speedup"] / row["devices"])
    assert row["err"] < 1e-5, row   # float32 against the unsharded op


def test_quick_run_attention_masks(tmp_path):
  data = _quick("attention_masks", tmp_path)
  ours = [r for r in data["rows"] if r["impl"] == "ours"]
  assert all(("vs_dense" in r) or ("vs_no_sinks" in r) for r in ours), ours
  assert all(0 < r["kept"] <= 1 for r in ours)
