"""The FSDPv2 ViT demo on 4 and 8 CPU XLA devices (own process: SPMD is
global), with a batch the "fsdp" axis does not divide.

A (n/2, 2) (fsdp, model) mesh: batch split over "fsdp", attention heads over
"model", so the kernels' manual sharding covers both axes, the odd batch is
padded inside every kernel, and the int8 weights' gradients take the
cross-shard partial-sum path.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch_xla")
pytestmark = pytest.mark.torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def _run_demo(tmp_path, devices, batch):
  out = tmp_path / "summary.json"
  env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices),
             JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "examples", "train_vit_fsdp.py"),
       "--steps", "3", "--depth", "1", "--batch", str(batch), "--devices",
       str(devices), "--model-axis", "2", "--json", str(out)],
      env=env, capture_output=True, text=True, timeout=600)
  assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
  summary = json.loads(out.read_text())
  assert summary["devices"] == devices
  assert summary["config"]["model_axis"] == 2
  assert summary["config"]["batch"] == batch
  checks = summary["checks"]
  assert checks["grads_ok_attention"], checks
  assert checks["grads_ok_int8"], checks
  assert checks["losses_ok_attention"], checks
  assert checks["losses_ok_int8"], checks
  assert summary["unsharded_warnings"] == []
  assert summary["transfers_from_device_in_loop"] == 0
  assert not summary["recompiled_after_step_2"], summary["compiles_after_step"]
  assert summary["ok"] and proc.returncode == 0


def test_fsdpv2_vit_matches_plain_torch(tmp_path):
  """(2, 2) mesh, batch 7: padded to 8 inside each kernel."""
  _run_demo(tmp_path, 4, 7)


@pytest.mark.slow
def test_fsdpv2_vit_8_devices(tmp_path):
  """(4, 2) mesh, batch 13: padded to 16 inside each kernel."""
  _run_demo(tmp_path, 8, 13)
