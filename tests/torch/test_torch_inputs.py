"""Inputs torch users pass by habit: int64 ids beyond int32, integer and
float64 boxes (torchvision's conventions), empty box sets."""
from __future__ import annotations

import pytest

pytest.importorskip("torch_xla")
pytestmark = pytest.mark.torch

import torch  # noqa: E402
import torchvision.ops as tvops  # noqa: E402

import torch_bridge as tb  # noqa: E402
from torch_bridge import ops  # noqa: E402

BOX = [0.0, 0.0, 10.0, 10.0]


def test_wide_class_ids_stay_distinct():
  boxes, scores = torch.tensor([BOX, BOX]), torch.tensor([0.9, 0.8])
  idx, num = tb.nms(boxes, scores, iou_threshold=0.5, max_output_size=2,
                    class_ids=torch.tensor([1, 1 + 2**32]))
  assert int(num) == 2 and sorted(idx.tolist()) == [0, 1]
  idx, num = tb.nms(boxes, scores, iou_threshold=0.5, max_output_size=2,
                    class_ids=torch.tensor([2**40, 2**40]))
  assert int(num) == 1


def test_wide_segment_ids_do_not_attend_across_segments():
  gen = torch.Generator().manual_seed(0)
  q, k, v = (torch.randn(1, 2, 8, 16, generator=gen) for _ in range(3))
  wide = torch.tensor([[0] * 4 + [2**32] * 4])
  small = torch.tensor([[0] * 4 + [1] * 4])
  torch.testing.assert_close(
      tb.flash_attention(q, k, v, segment_ids=(wide, wide)),
      tb.flash_attention(q, k, v, segment_ids=(small, small)))


@pytest.mark.parametrize("ids", [
    [[5, -2**40, 5, 2**33]], [[0, 1, 2, 3]], [[-(2**31), 2**31 - 1, 7, 7]]])
def test_ids_int32_keeps_equality_exactly(ids):
  a = torch.tensor(ids)
  b = a.flip(-1)
  a32, b32 = ops._ids_int32(a, b)
  assert a32.dtype == b32.dtype == torch.int32
  assert torch.equal(a32[..., :, None] == b32[..., None, :],
                     a[..., :, None] == b[..., None, :])
  assert torch.equal(a32[..., :, None] == a32[..., None, :],
                     a[..., :, None] == a[..., None, :])


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float64])
def test_boxes_of_other_dtypes_as_torchvision(dtype):
  gen = torch.Generator().manual_seed(1)
  xy = torch.randint(0, 20, (6, 2), generator=gen)
  boxes1 = torch.cat([xy, xy + torch.randint(1, 9, (6, 2), generator=gen)], 1)
  boxes2 = boxes1.flip(0)
  boxes1, boxes2 = boxes1.to(dtype), boxes2.to(dtype)
  want = tvops.generalized_box_iou(boxes1, boxes2)
  got = tb.pairwise_giou(boxes1, boxes2)
  assert got.dtype == want.dtype
  torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
  diag = tb.giou(boxes1, boxes2)
  torch.testing.assert_close(diag, torch.diagonal(want), rtol=1e-5,
                             atol=1e-6)
  loss = tb.giou_loss(boxes1, boxes2, reduction="sum")
  assert loss.dtype == (torch.float64 if dtype == torch.float64
                        else torch.float32)
  scores = torch.linspace(1, 0.1, 6, dtype=torch.float64 if dtype ==
                          torch.float64 else torch.float32)
  idx, num = tb.nms(boxes1, scores, iou_threshold=0.3, max_output_size=6)
  assert idx[:int(num)].tolist() == tvops.nms(
      boxes1.double(), scores.double(), 0.3).tolist()


def test_float64_loss_has_float64_gradients():
  pred = torch.tensor([BOX, [1.0, 1.0, 5.0, 6.0]], dtype=torch.float64,
                      requires_grad=True)
  target = torch.tensor([[0.0, 1.0, 9.0, 10.0], [2.0, 0.0, 5.0, 5.0]],
                        dtype=torch.float64)
  tb.giou_loss(pred, target, reduction="sum").backward()
  ref = pred.detach().clone().requires_grad_()
  tvops.generalized_box_iou_loss(ref, target, reduction="sum").backward()
  assert pred.grad.dtype == torch.float64
  torch.testing.assert_close(pred.grad, ref.grad, rtol=1e-4, atol=1e-6)


def test_batched_nms_on_no_images():
  idx, num = tb.batched_nms(torch.zeros(0, 5, 4), torch.zeros(0, 5),
                            iou_threshold=0.5, max_output_size=2)
  assert idx.shape == (0, 2) and num.shape == (0,)
