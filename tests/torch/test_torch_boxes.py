"""Box ops against torchvision (GIoU: its formulas written here in torch;
IoU, DIoU, CIoU and the losses: ``torchvision.ops`` itself) and the JAX ops,
forward and gradients; NMS vs a Python greedy NMS, soft-NMS vs the JAX
reference."""
from __future__ import annotations

import pytest

pytest.importorskip("torch_xla")
pytestmark = pytest.mark.torch

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torchvision.ops as tvops  # noqa: E402

import torch_bridge as tb  # noqa: E402
from torch_bridge import ops  # noqa: E402


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


# ------------------------------------------------- IoU family, soft-NMS --

_TV_PAIRWISE = {"iou": tvops.box_iou, "giou": tvops.generalized_box_iou,
                "diou": tvops.distance_box_iou,
                "ciou": tvops.complete_box_iou}
_TV_LOSS = {"giou": tvops.generalized_box_iou_loss,
            "diou": tvops.distance_box_iou_loss,
            "ciou": tvops.complete_box_iou_loss}


def _leaves(*tensors):
  """float32 copies that require grad (ours), float64 ones (torchvision)."""
  return ([t.float().requires_grad_() for t in tensors],
          [t.clone().requires_grad_() for t in tensors])


def _check_grads(got, want, ours, theirs, gen):
  """Values, then gradients of a random projection, of ``got`` (our op on
  ``ours``) against ``want`` (the reference on ``theirs``)."""
  torch.testing.assert_close(got.detach().double(), want.detach(),
                             rtol=1e-5, atol=1e-5)
  g = torch.randn(want.shape, generator=gen, dtype=torch.float64)
  grads = torch.autograd.grad(got, ours, g.to(got.dtype))
  want_grads = torch.autograd.grad(want, theirs, g)
  for a, b in zip(grads, want_grads):
    torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)


def _tv_diagonal(kind, b1, b2):
  """torchvision's pairwise ``kind`` of matching (broadcast) boxes."""
  shape = torch.broadcast_shapes(b1.shape, b2.shape)
  flat1, flat2 = b1.expand(shape).reshape(-1, 4), b2.expand(shape).reshape(
      -1, 4)
  return torch.diagonal(_TV_PAIRWISE[kind](flat1, flat2)).reshape(shape[:-1])


def _jax_value_and_grads(fn, tensors, g):
  """``pallas_kernels`` op ``fn`` on float32 copies of ``tensors``: its value
  and the gradients of ``sum(value * g)``."""
  import jax
  import jax.numpy as jnp
  arrays = [jnp.asarray(t.detach().float().numpy()) for t in tensors]
  value, pullback = jax.vjp(fn, *arrays)
  grads = pullback(jnp.asarray(g.float().numpy()))
  return (torch.from_numpy(np.array(value)),
          [torch.from_numpy(np.array(x)) for x in grads])


def _check_against_jax(op, got, ours, gen, **kwargs):
  import pallas_kernels
  g = torch.randn(got.shape, generator=gen)
  want, want_grads = _jax_value_and_grads(
      lambda *a: getattr(pallas_kernels, op)(*a, **kwargs), ours, g)
  torch.testing.assert_close(got.detach(), want, rtol=1e-6, atol=1e-6)
  for a, b in zip(torch.autograd.grad(got, ours, g), want_grads):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_eps_default_is_the_jax_ops():
  from pallas_kernels.boxes.iou import api
  assert ops._EPS == api.DEFAULT_EPS


def _slow_but(default, params):
  """``params`` with all but ``default`` marked slow (each compiles a JAX
  forward and backward: seconds on CPU)."""
  return [p if p == default else pytest.param(
      *(p if isinstance(p, tuple) else (p,)), marks=pytest.mark.slow)
          for p in params]


# The default cases share their shapes and static arguments with
# test_torch_opcheck.py's default samples (compiled JAX functions are reused
# when both run in one process).
@pytest.mark.parametrize("kind", _slow_but("diou", ["iou", "diou", "ciou"]))
def test_matching_boxes_vs_torchvision_and_jax(torch_gen, kind):
  b1, b2 = _boxes(torch_gen, 3, 7), _boxes(torch_gen, 1, 7)
  b1[0, :2] = b2[0, :2]  # identical boxes
  ours, theirs = _leaves(b1, b2)
  got = getattr(tb, kind)(*ours)
  assert got.shape == (3, 7) and got.dtype == torch.float32
  _check_grads(got, _tv_diagonal(kind, *theirs), ours, theirs, torch_gen)
  _check_against_jax(kind, getattr(tb, kind)(*ours), ours, torch_gen)


@pytest.mark.parametrize("kind", _slow_but("iou", ["iou", "diou", "ciou"]))
def test_pairwise_vs_torchvision_and_jax(torch_gen, kind):
  b1, b2 = _boxes(torch_gen, 2, 5), _boxes(torch_gen, 2, 3)
  b2[:, 0] = b1[:, 1]
  ours, theirs = _leaves(b1, b2)
  got = getattr(tb, f"pairwise_{kind}")(*ours)
  assert got.shape == (2, 5, 3)
  want = torch.stack([_TV_PAIRWISE[kind](a, b) for a, b in zip(*theirs)])
  _check_grads(got, want, ours, theirs, torch_gen)
  _check_against_jax(f"pairwise_{kind}",
                     getattr(tb, f"pairwise_{kind}")(*ours), ours, torch_gen)


@pytest.mark.parametrize("kind", ["iou", "giou", "diou", "ciou"])
def test_box_iou_kinds_vs_torchvision(torch_gen, kind):
  b1, b2 = _boxes(torch_gen, 5), _boxes(torch_gen, 3)
  got = tb.box_iou(b1, b2, iou_kind=kind)  # float64 in, float64 out
  assert got.dtype == torch.float64
  torch.testing.assert_close(got, _TV_PAIRWISE[kind](b1, b2), rtol=1e-5,
                             atol=1e-6)


@pytest.mark.parametrize("kind, reduction", _slow_but(("ciou", "sum"), [
    ("iou", "none"), ("diou", "mean"), ("ciou", "sum")]))
def test_losses_vs_torchvision_and_jax(torch_gen, kind, reduction):
  pred, target = _boxes(torch_gen, 4, 9), _boxes(torch_gen, 4, 9)
  pred[1, :3] = target[1, :3]
  ours, theirs = _leaves(pred, target)
  got = getattr(tb, f"{kind}_loss")(*ours, reduction=reduction)
  if kind == "iou":  # torchvision has no IoU loss: 1 - box_iou's diagonal
    want = 1 - _tv_diagonal("iou", *theirs)
    want = {"none": want, "mean": want.mean(), "sum": want.sum()}[reduction]
  else:
    want = _TV_LOSS[kind](*theirs, reduction=reduction)
  _check_grads(got, want, ours, theirs, torch_gen)
  _check_against_jax(f"{kind}_loss", getattr(tb, f"{kind}_loss")(
      *ours, reduction=reduction), ours, torch_gen, reduction=reduction)


def test_cxcywh_boxes(torch_gen):
  pred, target = _boxes(torch_gen, 13), _boxes(torch_gen, 13)
  c_pred, c_target = (tvops.box_convert(b, "xyxy", "cxcywh").float()
                      for b in (pred, target))
  torch.testing.assert_close(
      tb.ciou_loss(c_pred, c_target, box_format="cxcywh", reduction="mean",
                   eps=1e-6).double(),
      tvops.complete_box_iou_loss(pred, target, reduction="mean", eps=1e-6),
      rtol=1e-5, atol=1e-5)
  torch.testing.assert_close(
      tb.pairwise_diou(c_pred, c_target, box_format="cxcywh").double(),
      tvops.distance_box_iou(pred, target), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("module, kind", [
    (tb.IoULoss, "iou"), (tb.GIoULoss, "giou"), (tb.DIoULoss, "diou"),
    (tb.CIoULoss, "ciou")])
def test_loss_modules(torch_gen, module, kind):
  pred, target = _boxes(torch_gen, 11), _boxes(torch_gen, 11)
  loss_fn = module(reduction="sum", eps=1e-6)
  got = loss_fn(pred.float(), target.float())
  want = getattr(tb, f"{kind}_loss")(pred.float(), target.float(),
                                     reduction="sum", eps=1e-6)
  torch.testing.assert_close(got, want)
  if kind in _TV_LOSS:
    torch.testing.assert_close(got.double(), _TV_LOSS[kind](
        pred, target, reduction="sum", eps=1e-6), rtol=1e-5, atol=1e-4)
  assert "box_format='xyxy'" in repr(loss_fn)
  with pytest.raises(ValueError, match=f"{module.__name__}: box_format"):
    module(box_format="xywh")


def _soft_nms_case(gen, n=23):
  boxes = _boxes(gen, n)
  boxes[5] = boxes[2] + 0.5  # heavy overlaps
  boxes[9] = boxes[2]
  scores = torch.rand(n, generator=gen, dtype=torch.float64)
  return boxes, scores


@pytest.mark.parametrize("method, classes", [("gaussian", False),
                                             ("linear", True)])
def test_soft_nms_vs_jax_reference(torch_gen, method, classes):
  from pallas_kernels import reference
  import jax.numpy as jnp
  boxes, scores = _soft_nms_case(torch_gen)
  class_ids = (torch.randint(0, 3, (23,), generator=torch_gen) if classes
               else None)
  kwargs = dict(max_output_size=15, method=method, sigma=0.4,
                iou_threshold=0.2, score_threshold=0.05)
  idx, decayed, count = tb.soft_nms(boxes.float(), scores.float(),
                                    class_ids=class_ids, **kwargs)
  want = reference.soft_nms(
      jnp.asarray(boxes.float().numpy()), jnp.asarray(scores.float().numpy()),
      class_ids=None if class_ids is None else jnp.asarray(
          class_ids.int().numpy()), **kwargs)
  assert idx.dtype == torch.int32 and idx.shape == (15,)
  assert decayed.dtype == torch.float32 and count.shape == ()
  assert idx.tolist() == np.asarray(want[0]).tolist()
  torch.testing.assert_close(decayed, torch.from_numpy(np.array(want[1])))
  assert int(count) == int(want[2]) > 0
  # float64 in (torchvision's convention): float64 decayed scores.
  idx64, decayed64, _ = tb.soft_nms(boxes, scores, class_ids=class_ids,
                                    **kwargs)
  assert decayed64.dtype == torch.float64 and torch.equal(idx64, idx)


@pytest.mark.parametrize("call, error, match", [
    (lambda: tb.box_iou(torch.zeros(2, 4), torch.zeros(2, 4), iou_kind="x"),
     ValueError, "iou_kind must be one of"),
    (lambda: tb.pairwise_ciou(torch.zeros(4), torch.zeros(2, 4)), ValueError,
     "boxes1 must have at least 2"),
    (lambda: tb.diou_loss(torch.zeros(3, 4), torch.zeros(3, 4),
                          reduction="max"), ValueError,
     "diou_loss: reduction must be"),
    (lambda: tb.iou(torch.zeros(3, 4), torch.zeros(2, 4)), Exception,
     "broadcast"),
    (lambda: tb.soft_nms(torch.zeros(3, 4), torch.zeros(3),
                         max_output_size=2, sigma=torch.tensor(0.5)),
     TypeError, "soft_nms: sigma must be a Python number"),
    (lambda: tb.soft_nms(torch.zeros(3, 4), torch.zeros(3),
                         max_output_size=2, method="hard"), ValueError,
     "method must be 'gaussian' or 'linear'"),
    (lambda: tb.soft_nms(torch.zeros(3, 4), torch.zeros(2),
                         max_output_size=2), ValueError,
     "scores must have shape"),
])
def test_new_box_ops_bad_input(call, error, match):
  with pytest.raises(error, match=match):
    call()


def test_exports_match_the_modules():
  from torch_bridge import modules
  assert set(tb._OPS) == set(ops.__all__)
  assert set(tb._MODULES) == set(modules.__all__)
  for name in tb._OPS + tb._MODULES:
    assert getattr(tb, name) is not None
