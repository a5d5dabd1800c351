"""partition_spec / mesh on every bridge op and module.

In this process (no SPMD): every spec is checked on any device, splitting a
dimension an op needs whole raises ValueError naming the argument, the dim
and the mesh axis, and a spec changes no result. Under SPMD (own processes,
since SPMD is global and the device count fixed per process):
``spmd_cases.py`` runs every op sharded with batches the mesh does not
divide, on 4 CPU devices by default and on 8 with --runslow (the FSDPv2
training demo with an odd batch: test_torch_train_demo.py).
"""
from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest

pytest.importorskip("torch_xla")
pytestmark = pytest.mark.torch

import torch  # noqa: E402

import torch_bridge as tb  # noqa: E402
from torch_bridge import modules  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))

_Q = torch.zeros(3, 2, 8, 8)
_BOXES = torch.tensor([[0.0, 0.0, 2.0, 2.0]] * 3)


@pytest.mark.parametrize("call, match", [
    (lambda: tb.flash_attention(_Q, _Q, _Q,
                                partition_spec=("fsdp", None, "sp", None)),
     "splits q's dim 2 \\(sequence\\) over mesh axis 'sp'"),
    (lambda: tb.flash_attention(_Q, _Q, _Q,
                                partition_spec=(None, None, None, "m")),
     "splits q's dim 3 \\(head_dim\\) over mesh axis 'm'"),
    (lambda: tb.flash_attention(_Q, _Q, _Q, partition_spec=("fsdp", None)),
     "one entry per dimension of q"),
    (lambda: tb.int8_dense(torch.zeros(3, 4), torch.zeros(5, 4),
                           partition_spec=("fsdp", "model")),
     "splits x's dim 1 \\(in_features\\) over mesh axis 'model'"),
    (lambda: tb.int8_matmul(torch.zeros(3, 4, dtype=torch.int8),
                            torch.zeros(4, 5, dtype=torch.int8),
                            partition_spec=(None, "model")),
     "splits x's dim 1 \\(K\\)"),
    (lambda: tb.grouped_matmul(torch.zeros(3, 4), torch.zeros(2, 4, 5),
                               torch.tensor([1, 2]),
                               partition_spec=("fsdp", "model")),
     "splits the output's dim 0 \\(rows\\) over mesh axis 'fsdp'"),
    (lambda: tb.quantize_int8(torch.zeros(3, 4), axis=0,
                              partition_spec=("fsdp", None)),
     "dim 0 \\(axis=0\\) over mesh axis 'fsdp'"),
    (lambda: tb.quantize_int8(torch.zeros(3, 4), axis=None,
                              partition_spec=("fsdp", None)),
     "axis=None"),
    (lambda: tb.giou(_BOXES, _BOXES, partition_spec=("fsdp", "model")),
     "dim 1 \\(coordinates\\) over mesh axis 'model'"),
    (lambda: tb.giou_loss(_BOXES, _BOXES[:1], partition_spec=("fsdp",)),
     "one entry per dimension of the boxes"),
    (lambda: tb.pairwise_giou(_BOXES, _BOXES, partition_spec=("fsdp",)),
     "one entry per dimension of the output"),
    (lambda: tb.nms(_BOXES, torch.ones(3), iou_threshold=0.5,
                    max_output_size=2, partition_spec=("fsdp", None)),
     "splits boxes' dim 0 \\(boxes\\) over mesh axis 'fsdp'"),
    (lambda: tb.batched_nms(_BOXES[None], torch.ones(1, 3), iou_threshold=0.5,
                            max_output_size=2,
                            partition_spec=("fsdp", "model", None)),
     "splits boxes' dim 1 \\(boxes\\) over mesh axis 'model'"),
    (lambda: tb.soft_nms(_BOXES, torch.ones(3), max_output_size=2,
                         partition_spec=("fsdp", None)),
     "soft_nms: .*splits boxes' dim 0 \\(boxes\\)"),
    (lambda: tb.ciou(_BOXES, _BOXES, partition_spec=(None, "m")),
     "ciou: .*dim 1 \\(coordinates\\) over mesh axis 'm'"),
    (lambda: tb.box_iou(_BOXES, _BOXES, partition_spec=("fsdp",)),
     "box_iou: .*one entry per dimension of the output"),
    (lambda: tb.diou_loss(_BOXES, _BOXES[:1], partition_spec=("fsdp",)),
     "diou_loss: .*one entry per dimension of the boxes"),
])
def test_unsplittable_dims_raise(call, match):
  with pytest.raises(ValueError, match=match):
    call()


@pytest.mark.parametrize("spec", ["fsdp", ("fsdp", 1.5), (["a", None],)])
def test_malformed_spec_raises(spec):
  with pytest.raises(TypeError, match="partition_spec must be a tuple"):
    tb.giou(_BOXES, _BOXES, partition_spec=spec)


def test_module_axis_arguments_exclusive():
  with pytest.raises(ValueError, match="not both"):
    tb.Int8Linear(4, 4, batch_axis="fsdp", partition_spec=("fsdp", None))
  with pytest.raises(ValueError, match="not both"):
    modules.Attention(8, 2, head_axis="model",
                      partition_spec=(None, "model", None, None))
  with pytest.raises(ValueError, match="not both"):
    tb.GIoULoss(batch_axis="fsdp", partition_spec=("fsdp", None))
  with pytest.raises(ValueError, match="box_format"):
    tb.GIoULoss(box_format="xywh")


def _boxes(gen, *shape):
  xy = torch.rand(*shape, 2, generator=gen) * 10
  return torch.cat([xy, xy + torch.rand(*shape, 2, generator=gen) * 5 + 0.1],
                   -1)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_spec_changes_no_result_off_spmd(torch_gen, reduction):
  """Off SPMD the spec is only checked; a reduced loss with a spec is
  reduced in torch (as under SPMD) and equals the kernel's reduction."""
  import torchvision.ops as tvops
  pred, target = _boxes(torch_gen, 6, 3), _boxes(torch_gen, 6, 3)
  want = tvops.generalized_box_iou_loss(pred.double(), target.double(),
                                        reduction=reduction)
  for spec in (None, ("fsdp", None, None)):
    got = tb.giou_loss(pred, target, reduction=reduction, partition_spec=spec)
    assert got.shape == () and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
  q = torch.randn(3, 2, 8, 8, generator=torch_gen)
  torch.testing.assert_close(
      tb.flash_attention(q, q, q, partition_spec=("fsdp", "model", None,
                                                  None)),
      tb.flash_attention(q, q, q), rtol=0, atol=0)


def test_giou_loss_module_box_format(torch_gen):
  import torchvision.ops as tvops
  pred, target = _boxes(torch_gen, 7), _boxes(torch_gen, 7)
  loss = tb.GIoULoss(reduction="sum", box_format="cxcywh")(
      tvops.box_convert(pred, "xyxy", "cxcywh"),
      tvops.box_convert(target, "xyxy", "cxcywh"))
  torch.testing.assert_close(
      loss, tvops.generalized_box_iou_loss(pred, target, reduction="sum"),
      rtol=1e-5, atol=1e-5)


def test_no_unsharded_warning_without_spmd(xla_device):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    tb.giou(_BOXES.to(xla_device), _BOXES.to(xla_device))
  assert not [w for w in caught if issubclass(w.category, tb.UnshardedWarning)]


# ---------------------------------------------------- SPMD, own processes --

def _env(devices):
  return dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices),
              JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
              TORCH_BRIDGE_SPMD_DEVICES=str(devices))


def _spmd_ops(devices, config, select=()):
  runslow = ["--runslow"] if config.getoption("--runslow") else []
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
       os.path.join(ROOT, "tests", "torch", "spmd_cases.py"), *select]
      + runslow,
      env=_env(devices), cwd=ROOT, capture_output=True, text=True,
      timeout=900)
  assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
  assert " passed" in proc.stdout and " failed" not in proc.stdout


# Two processes, so that two test workers share them (NMS takes half).
@pytest.mark.parametrize("select", ["nms", "not nms"])
def test_spmd_ops_4_devices(pytestconfig, select):
  """(a few attention cases only with --runslow)"""
  _spmd_ops(4, pytestconfig, ("-k", select))


@pytest.mark.slow
def test_spmd_ops_8_devices(pytestconfig):
  _spmd_ops(8, pytestconfig)
