"""GIoU ops vs torchvision's formulas (written here in torch) and NMS vs a
Python greedy NMS."""
from __future__ import annotations

import pytest

pytest.importorskip("torch_xla")
pytestmark = pytest.mark.torch

import torch  # noqa: E402

import torch_bridge as tb  # noqa: E402


def _boxes(gen, *shape, dtype=torch.float64):
  xy = torch.rand(*shape, 2, generator=gen, dtype=dtype) * 10
  wh = torch.rand(*shape, 2, generator=gen, dtype=dtype) * 5 + 0.1
  return torch.cat([xy, xy + wh], -1)


def _area(b):
  return (b[..., 2] - b[..., 0]) * (b[..., 3] - b[..., 1])


def _tv_giou(b1, b2):
  """torchvision.ops.generalized_box_iou's formula, elementwise."""
  inter_wh = (torch.minimum(b1[..., 2:], b2[..., 2:]) -
              torch.maximum(b1[..., :2], b2[..., :2])).clamp(min=0)
  inter = inter_wh[..., 0] * inter_wh[..., 1]
  union = _area(b1) + _area(b2) - inter
  hull_wh = (torch.maximum(b1[..., 2:], b2[..., 2:]) -
             torch.minimum(b1[..., :2], b2[..., :2])).clamp(min=0)
  hull = hull_wh[..., 0] * hull_wh[..., 1]
  return inter / union - (hull - union) / hull


def _tv_giou_loss(pred, target, eps=1e-7):
  """torchvision.ops.generalized_box_iou_loss (reduction "none")."""
  inter_wh = (torch.minimum(pred[..., 2:], target[..., 2:]) -
              torch.maximum(pred[..., :2], target[..., :2])).clamp(min=0)
  inter = inter_wh[..., 0] * inter_wh[..., 1]
  union = _area(pred) + _area(target) - inter
  iou = inter / (union + eps)
  hull_wh = (torch.maximum(pred[..., 2:], target[..., 2:]) -
             torch.minimum(pred[..., :2], target[..., :2]))
  hull = hull_wh[..., 0] * hull_wh[..., 1]
  return 1 - (iou - (hull - union) / (hull + eps))


def _check_giou_loss(gen, device, reduction):
  p64, t64 = _boxes(gen, 3, 37), _boxes(gen, 3, 37)
  p64[0, :3] = t64[0, :3]  # identical boxes
  pred = p64.float().to(device).requires_grad_()
  target = t64.float().to(device).requires_grad_()
  loss = tb.giou_loss(pred, target, reduction=reduction)
  rp, rt = p64.clone().requires_grad_(), t64.clone().requires_grad_()
  want = _tv_giou_loss(rp, rt)
  want = {"none": want, "mean": want.mean(), "sum": want.sum()}[reduction]
  torch.testing.assert_close(loss.detach().cpu().double(), want.detach(),
                             rtol=1e-5, atol=1e-5)
  g = torch.randn(want.shape, generator=gen, dtype=torch.float64)
  grads = torch.autograd.grad(loss, (pred, target), g.float().to(device))
  if device.type == "xla":  # one graph, not one per fetched tensor
    import torch_xla
    torch_xla.sync()
  want_grads = torch.autograd.grad(want, (rp, rt), g)
  for got, ref in zip(grads, want_grads):
    torch.testing.assert_close(got.cpu().double(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_giou_loss_cpu(torch_gen, reduction):
  _check_giou_loss(torch_gen, torch.device("cpu"), reduction)


def test_giou_loss_xla(torch_gen, xla_device):
  _check_giou_loss(torch_gen, xla_device, "sum")


def test_giou_and_pairwise(torch_gen):
  b1, b2 = _boxes(torch_gen, 2, 9), _boxes(torch_gen, 2, 5)
  torch.testing.assert_close(
      tb.giou(b1.float(), b2[:, :1].expand(2, 9, 4).float()).double(),
      _tv_giou(b1, b2[:, :1]), rtol=1e-5, atol=1e-5)
  pairwise = tb.pairwise_giou(b1.float(), b2.float())
  assert pairwise.shape == (2, 9, 5)
  torch.testing.assert_close(pairwise.double(),
                             _tv_giou(b1[:, :, None], b2[:, None]),
                             rtol=1e-5, atol=1e-5)


def test_giou_loss_module(torch_gen):
  pred, target = _boxes(torch_gen, 11).float(), _boxes(torch_gen, 11).float()
  loss = tb.GIoULoss()(pred, target)
  torch.testing.assert_close(loss.double(),
                             _tv_giou_loss(pred.double(),
                                           target.double()).mean(),
                             rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="reduction"):
    tb.GIoULoss(reduction="max")


@pytest.mark.parametrize("call, error, match", [
    (lambda: tb.giou(torch.zeros(3, 5), torch.zeros(3, 5)), ValueError,
     "boxes1 must have a last dimension of 4"),
    (lambda: tb.giou_loss(torch.zeros(3, 4), torch.zeros(3, 4,
                                                          dtype=torch.complex64)),
     TypeError, "target"),
    (lambda: tb.giou_loss(torch.zeros(3, 4), torch.zeros(3, 4),
                          reduction="max"), ValueError, "reduction"),
])
def test_giou_bad_input(call, error, match):
  with pytest.raises(error, match=match):
    call()


# ------------------------------------------------------------------- NMS --

def _greedy_nms(boxes, scores, iou_threshold, max_out, score_threshold=None,
                class_ids=None):
  """Textbook greedy NMS in float64 (torchvision.ops.nms semantics)."""
  boxes, scores = boxes.double(), scores.double()
  order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))
  keep = []
  for i in order:
    if score_threshold is not None and scores[i] <= score_threshold:
      continue
    suppressed = False
    for j in keep:
      if class_ids is not None and class_ids[i] != class_ids[j]:
        continue
      inter_wh = (torch.minimum(boxes[i, 2:], boxes[j, 2:]) -
                  torch.maximum(boxes[i, :2], boxes[j, :2])).clamp(min=0)
      inter = inter_wh[0] * inter_wh[1]
      iou = inter / (_area(boxes[i]) + _area(boxes[j]) - inter)
      if iou > iou_threshold:
        suppressed = True
        break
    if not suppressed:
      keep.append(i)
    if len(keep) == max_out:
      break
  return keep


def _check_nms(gen, device, n=60, max_out=20, **kwargs):
  boxes = _boxes(gen, n).float()
  scores = torch.rand(n, generator=gen)
  class_ids = kwargs.pop("class_ids", None)
  idx, num = tb.nms(boxes.to(device), scores.to(device), iou_threshold=0.3,
                    max_output_size=max_out, class_ids=None if class_ids is None
                    else class_ids.to(device), **kwargs)
  idx, num = idx.cpu(), int(num.cpu())
  want = _greedy_nms(boxes, scores, 0.3, max_out, class_ids=class_ids,
                     **kwargs)
  assert idx.dtype == torch.int32 and idx.shape == (max_out,)
  assert num == len(want)
  assert idx[:num].tolist() == want
  assert torch.all(idx[num:] == -1)


def test_nms_cpu(torch_gen):
  _check_nms(torch_gen, torch.device("cpu"))


def test_nms_classes_and_threshold_cpu(torch_gen):
  class_ids = torch.randint(0, 3, (60,), generator=torch_gen)  # int64 in
  _check_nms(torch_gen, torch.device("cpu"), class_ids=class_ids,
             score_threshold=0.2)


def test_nms_xla(torch_gen, xla_device):
  _check_nms(torch_gen, xla_device, n=40, max_out=8)


def test_batched_nms(torch_gen):
  boxes = _boxes(torch_gen, 3, 30).float()
  scores = torch.rand(3, 30, generator=torch_gen)
  idx, num = tb.batched_nms(boxes, scores, iou_threshold=0.5,
                            max_output_size=10)
  assert idx.shape == (3, 10) and num.shape == (3,)
  for b in range(3):
    want = _greedy_nms(boxes[b], scores[b], 0.5, 10)
    assert idx[b, :int(num[b])].tolist() == want


@pytest.mark.parametrize("xla", [False, True], ids=["cpu", "xla"])
def test_batched_nms_with_classes_is_torchvisions(torch_gen, xla, request):
  """Per image, class-aware NMS: torchvision.ops.batched_nms (classes
  never suppress each other) on that image's boxes, int64 class ids."""
  torchvision = pytest.importorskip("torchvision")
  device = (request.getfixturevalue("xla_device") if xla
            else torch.device("cpu"))
  boxes = _boxes(torch_gen, 3, 25).float()
  scores = torch.rand(3, 25, generator=torch_gen)
  classes = torch.randint(0, 3, (3, 25), generator=torch_gen)
  idx, num = tb.batched_nms(boxes.to(device), scores.to(device),
                            class_ids=classes.to(device), iou_threshold=0.3,
                            max_output_size=25, score_threshold=None)
  idx, num = idx.cpu(), num.cpu()
  for b in range(3):
    want = torchvision.ops.batched_nms(boxes[b], scores[b], classes[b], 0.3)
    assert idx[b, :int(num[b])].tolist() == want.tolist()
    assert torch.all(idx[b, int(num[b]):] == -1)


@pytest.mark.parametrize("images,count", [(0, 5), (2, 0)])
def test_batched_nms_empty(images, count):
  idx, num = tb.batched_nms(torch.zeros(images, count, 4),
                            torch.zeros(images, count), iou_threshold=0.5,
                            max_output_size=3,
                            class_ids=torch.zeros(images, count,
                                                  dtype=torch.int64))
  assert idx.shape == (images, 3) and num.shape == (images,)
  assert torch.all(idx == -1) and torch.all(num == 0)


@pytest.mark.parametrize("shapes", [((5, 4), (0, 4)), ((0, 4), (3, 4)),
                                    ((0, 5, 4), (0, 3, 4))], ids=str)
def test_pairwise_giou_empty(shapes):
  a = torch.ones(shapes[0], requires_grad=True)
  b = torch.zeros(shapes[1], requires_grad=True)
  out = tb.pairwise_giou(a, b)
  assert out.shape == shapes[0][:-2] + (shapes[0][-2], shapes[1][-2])
  out.sum().backward()
  assert a.grad.shape == a.shape and b.grad.shape == b.shape
  assert not a.grad.any() and not b.grad.any()


def test_giou_loss_reduction_none_is_refused():
  with pytest.raises(ValueError, match="reduction.*'none', 'mean'.*'sum'"):
    tb.giou_loss(torch.zeros(3, 4), torch.zeros(3, 4), reduction=None)


def test_nms_meta_and_errors():
  idx, num = tb.nms(torch.empty(100, 4, device="meta"),
                    torch.empty(100, device="meta"), iou_threshold=0.5,
                    max_output_size=7)
  assert idx.shape == (7,) and num.shape == ()
  with pytest.raises(ValueError, match="scores must have shape"):
    tb.nms(torch.zeros(5, 4), torch.zeros(4), iou_threshold=0.5,
           max_output_size=3)
  with pytest.raises(TypeError, match="static"):
    tb.nms(torch.zeros(5, 4), torch.zeros(5), iou_threshold=torch.tensor(0.5),
           max_output_size=3)
  with pytest.raises(ValueError, match="max_output_size"):
    tb.nms(torch.zeros(5, 4), torch.zeros(5), iou_threshold=0.5,
           max_output_size=-1)
