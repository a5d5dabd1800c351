"""The guide's PyTorch examples run: docs/torch.md in this process, the
PyTorch/XLA SPMD example of docs/sharding.md on 4 CPU devices in its own."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch_xla")
pytestmark = pytest.mark.torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from test_docs import page_blocks, sharding_blocks  # noqa: E402


def test_torch_spmd_example_runs():
  _, torch_blocks = sharding_blocks()
  assert len(torch_blocks) == 1
  env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4",
             JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  proc = subprocess.run([sys.executable, "-c", torch_blocks[0]], env=env,
                        cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  # out, y shapes; the loss of identical boxes; one box kept per image.
  assert proc.stdout.strip().splitlines()[-1] == (
      "torch.Size([7, 4, 128, 64]) torch.Size([7, 512]) 0.0 "
      "[1, 1, 1, 1, 1, 1, 1]")


def test_torch_page_runs(capsys):
  blocks = page_blocks("torch.md")
  assert blocks, "docs/torch.md lost its example"
  namespace: dict = {}
  for block in blocks:
    exec(compile(block, "docs/torch.md", "exec"), namespace)  # noqa: S102
  assert namespace["q"].grad.shape == (2, 4, 128, 64)
  assert int(namespace["count"]) == 2
  # The public typed ops: their schema, NMS keeping one of two overlapping
  # boxes, GIoU as the function gives it, a compiled attention call.
  printed = capsys.readouterr().out
  assert ("pallas_kernels::giou(Tensor boxes1, Tensor boxes2, *, "
          'str box_format="xyxy", str? backend=None) -> Tensor') in printed
  assert "\n1 True\nTrue\n" in printed
  # The grouped matmul drop-ins: values and the op's d rhs.
  assert "\nTrue True\n" in printed
  # The ragged paged attention drop-in: padding tokens get zeros.
  assert "torch.Size([12, 4, 128]) True" in printed
