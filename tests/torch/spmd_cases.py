"""Every bridge op under torch_xla SPMD, on a batch the mesh does not divide.

Not collected by itself: ``test_torch_spmd.py`` runs this module in a child
pytest with ``TORCH_BRIDGE_SPMD_DEVICES`` CPU XLA devices (SPMD is global
and the device count is fixed per process). Two meshes: ``flat`` ("fsdp"
over every device) and ``grid`` ("fsdp", "model") with "model" of size 2.
Sizes are chosen so that no split dimension is a multiple of its axis: the
bridge must pad inside and return the unsharded shapes and values. Results
are compared with plain torch (float64), torchvision, or (int8) the same op
on CPU tensors.
"""
from __future__ import annotations

import math
import os
import warnings

import pytest

DEVICES = int(os.environ.get("TORCH_BRIDGE_SPMD_DEVICES", "0"))
if not DEVICES:
  pytest.skip("run by test_torch_spmd.py in its own process",
              allow_module_level=True)
pytest.importorskip("torch_xla")
pytestmark = pytest.mark.torch

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402
import torchvision.ops as tvops  # noqa: E402

xr.use_spmd()

import torch_bridge as tb  # noqa: E402
from torch_bridge import _core  # noqa: E402

ODD = DEVICES + 1  # a multiple of neither DEVICES nor DEVICES // 2
MESHES = {
    "flat": xs.Mesh(np.arange(DEVICES), (DEVICES,), ("fsdp",)),
    "grid": xs.Mesh(np.arange(DEVICES), (DEVICES // 2, 2),
                    ("fsdp", "model")),
}
xs.set_global_mesh(MESHES["flat"])
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def dev():
  assert xr.global_runtime_device_count() == DEVICES
  return torch_xla.device()


def _gen(seed=0):
  return torch.Generator().manual_seed(seed)


def _boxes(gen, *shape):
  xy = torch.rand(*shape, 2, generator=gen) * 10
  wh = torch.rand(*shape, 2, generator=gen) * 5 + 0.1
  return torch.cat([xy, xy + wh], -1)


def _run(fn, inputs, cotangents, device):
  """``fn(*inputs)`` on ``device`` with the gradients of the float inputs
  for ``cotangents`` (one per output): CPU tensors out."""
  moved = [t.detach().to(device).requires_grad_(t.dtype.is_floating_point)
           for t in inputs]
  outs = fn(*moved)
  outs = outs if isinstance(outs, tuple) else (outs,)
  leaves = [t for t in moved if t.requires_grad]
  grads = torch.autograd.grad(outs, leaves,
                              [g.to(device) for g in cotangents])
  if device.type == "xla":
    torch_xla.sync()
  return ([o.detach().cpu() for o in outs], [g.cpu() for g in grads])


def _assert_same(got, want, **tol):
  for g, w in zip(got, want):
    assert g.shape == w.shape
    torch.testing.assert_close(g, w, **(tol or TOL))


# ------------------------------------------------------------- attention --

@pytest.mark.parametrize("mesh, spec, batch, heads, kv_heads", [
    ("grid", ("fsdp", "model", None, None), DEVICES, 2, 2),  # divisible
    ("grid", ("fsdp", "model", None, None), ODD, 3, 3),  # odd heads: padded
    ("grid", ("fsdp", "model", None, None), ODD, 4, 2),  # GQA over "model"
    pytest.param("flat", ("fsdp", None, None, None), ODD, 2, 2,
                 marks=pytest.mark.slow),
    pytest.param("flat", ("fsdp", None, None, None), DEVICES - 1, 2, 1,
                 marks=pytest.mark.slow),  # fewer rows than devices; GQA
])
def test_flash_attention(dev, mesh, spec, batch, heads, kv_heads):
  gen, seq, dim = _gen(1), 16, 8
  q = torch.randn(batch, heads, seq, dim, generator=gen, dtype=torch.float64)
  k = torch.randn(batch, kv_heads, seq, dim, generator=gen,
                  dtype=torch.float64)
  v = torch.randn(batch, kv_heads, seq, dim, generator=gen,
                  dtype=torch.float64)
  bias = torch.randn(1, heads, seq, seq, generator=gen,
                     dtype=torch.float64)  # batch-broadcast: grads summed
  seg = (torch.arange(seq)[None] >= torch.arange(batch)[:, None] % 5).int()
  cts = [torch.randn(batch, heads, seq, dim, generator=gen,
                     dtype=torch.float64),
         torch.randn(batch, heads, seq, generator=gen, dtype=torch.float64)]

  def reference(q, k, v, bias, seg):
    group = heads // kv_heads
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    allowed = (torch.ones(seq, seq, dtype=torch.bool).tril()[None, None] &
               (seg[:, None, :, None] == seg[:, None, None, :]))
    logits = (q @ k.transpose(-1, -2) / math.sqrt(dim) + bias).masked_fill(
        ~allowed, float("-inf"))
    return torch.softmax(logits, -1) @ v, logits.logsumexp(-1)

  want = _run(reference, [q, k, v, bias, seg], cts, torch.device("cpu"))
  got = _run(lambda q, k, v, bias, seg: tb.flash_attention(
      q, k, v, causal=True, bias=bias, segment_ids=(seg, seg),
      return_lse=True, partition_spec=spec, mesh=MESHES[mesh]),
             [t.float() if t.is_floating_point() else t
              for t in (q, k, v, bias, seg)],
             [c.float() for c in cts], dev)
  _assert_same([t.double() for t in got[0]], want[0], rtol=2e-5, atol=2e-5)
  _assert_same([t.double() for t in got[1]], want[1], rtol=1e-4, atol=1e-4)


def test_attention_module_odd_batch(dev):
  torch.manual_seed(2)
  kernel = tb.modules.Attention(24, 3, batch_axis="fsdp", head_axis="model",
                                mesh=MESHES["grid"])
  plain = tb.modules.Attention(24, 3, use_kernel=False)
  plain.load_state_dict(kernel.state_dict())
  x = torch.randn(ODD, 5, 24, generator=_gen(3))
  got = kernel.to(dev)(x.to(dev)).cpu()
  assert got.shape == (ODD, 5, 24)
  torch.testing.assert_close(got, plain(x).detach(), **TOL)


@pytest.mark.parametrize("spec, heads, kv_heads, match", [
    (("fsdp", "model", None, None), 2, 1,
     "mesh axis 'model' of size 2, which does not divide k/v's 1 heads"),
    (("data", None, None, None), 2, 2, "'data'"),
    (("fsdp", "fsdp", None, None), 2, 2, "uses mesh axis 'fsdp' for dims"),
    ((None, None, "fsdp", None), 2, 2, "dim 2 \\(sequence\\)"),
])
def test_flash_attention_refuses(dev, spec, heads, kv_heads, match):
  q = torch.zeros(ODD, heads, 8, 8, device=dev)
  kv = torch.zeros(ODD, kv_heads, 8, 8, device=dev)
  with pytest.raises(ValueError, match=match):
    tb.flash_attention(q, kv, kv, partition_spec=spec, mesh=MESHES["grid"])


# ---------------------------------- torch_xla's flash_attention drop-in --

def _txla_reference(q, k, v, causal, q_seg, kv_seg, sm_scale, ab):
  """float64 attention with torch_xla's conventions: the causal diagonal
  starts at (query 0, key 0); rows with no allowed key are 0."""
  group = q.shape[-3] // k.shape[-3]
  k, v = (t.repeat_interleave(group, -3) for t in (k, v))
  logits = sm_scale * q @ k.transpose(-1, -2) + ab
  q_len, kv_len = q.shape[-2], k.shape[-2]
  ok = torch.ones(q_len, kv_len, dtype=torch.bool)
  if causal:
    ok = ok.tril()  # j <= i, whatever kv_len - q_len is
  ok = ok & (q_seg[..., None, :, None] == kv_seg[..., None, None, :])
  weights = torch.softmax(logits.masked_fill(~ok, float("-inf")), -1)
  return weights.nan_to_num(0.0) @ v


# name: (batch dims, heads, kv_heads, q_len, causal, ab's batch/heads dims
# (1: broadcast), partition_spec, mesh= (None: left out, the global "flat"
# mesh)). kv_len is 16.
TXLA_CASES = {
    # heads split over "model", mesh given: the grid
    "grid_tuple": ((ODD,), 2, 2, 16, True, (ODD, 2),
                   ("fsdp", "model", None, None), "grid"),
    # the spec as its string, the global mesh; q_len < kv_len (the queries
    # are padded inside), GQA, ab broadcast over the batch
    "global_string": ((ODD,), 2, 1, 12, True, (1, 2),
                      "('fsdp', None, None, None)", None),
    # two batch dims, one per mesh axis (flattened into one dim split over
    # both), ab broadcast over the second; the mesh as its string; causal
    # with q_len > kv_len
    "five_dims": ((3, 2), 2, 2, 19, True, (3, 1, 2),
                  ("fsdp", "model", None, None, None), "grid_str"),
}


@pytest.mark.parametrize("name", sorted(TXLA_CASES))
def test_custom_kernel_flash_attention(dev, name, monkeypatch):
  """torch_bridge.custom_kernel.flash_attention called as torch_xla users
  do (positional arguments, ab=, partition_spec=, mesh=) on sharded
  batches the mesh does not divide: out and the gradients of q, k, v, ab."""
  from torch_bridge import custom_kernel
  batch, heads, kv_heads, q_len, causal, ab_lead, spec, mesh = (
      TXLA_CASES[name])
  gen, kv_len, dim, scale = _gen(16), 16, 8, 0.4
  rand = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
  q = rand(*batch, heads, q_len, dim)
  k, v = (rand(*batch, kv_heads, kv_len, dim) for _ in range(2))
  ab = rand(*ab_lead, q_len, kv_len)
  rows = torch.arange(math.prod(batch)).reshape(*batch, 1)
  # a different segment split per row (with causal, each query still sees
  # a key), and a last query whose segment no key has: it sees none
  q_seg = (torch.arange(q_len) >= rows % 4 + 3).int()
  q_seg[..., -1] = 2
  kv_seg = (torch.arange(kv_len) >= rows % 4 + 3).int()
  ct = rand(*q.shape)
  kwargs = dict(partition_spec=spec)
  if mesh is not None:
    kwargs["mesh"] = (str(MESHES["grid"]) if mesh == "grid_str"
                      else MESHES[mesh])
  want = _run(lambda q, k, v, ab, qs, ks: _txla_reference(
      q, k, v, causal, qs, ks, scale, ab), [q, k, v, ab, q_seg, kv_seg],
              [ct], torch.device("cpu"))
  monkeypatch.setattr(_core, "_WARNED_UNSHARDED", set())
  with warnings.catch_warnings():
    # the spec reaches the op: it runs per shard, not unsharded
    warnings.simplefilter("error", tb.UnshardedWarning)
    got = _run(lambda q, k, v, ab, qs, ks: custom_kernel.flash_attention(
        q, k, v, causal, qs, ks, scale, ab=ab, **kwargs),
               [t.float() for t in (q, k, v, ab)] + [q_seg, kv_seg],
               [ct.float()], dev)
  _assert_same([t.double() for t in got[0]], want[0], rtol=2e-5, atol=2e-5)
  _assert_same([t.double() for t in got[1]], want[1], rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ int8 --

def test_quantize_int8(dev):
  x = torch.randn(ODD, 3, 33, generator=_gen(4))
  for axis, spec in ((-1, ("fsdp", "model", None)), (0, (None, "fsdp", None))):
    want = tb.quantize_int8(x, axis=axis)
    got = tb.quantize_int8(x.to(dev), axis=axis, partition_spec=spec,
                           mesh=MESHES["grid"] if axis == -1 else None)
    for g, w in zip(got, want):
      assert g.shape == w.shape
      torch.testing.assert_close(g.cpu(), w, rtol=0, atol=0)


def test_int8_matmul(dev):
  gen = _gen(5)
  x = torch.randint(-127, 128, (ODD, 3, 64), generator=gen, dtype=torch.int8)
  w = torch.randint(-127, 128, (64, 16), generator=gen, dtype=torch.int8)
  x_scale = torch.rand(ODD, 3, 1, generator=gen) + 0.5
  w_scale = torch.rand(16, generator=gen) + 0.5
  bias = torch.randn(16, generator=gen)
  want = tb.int8_matmul(x, w, x_scale=x_scale, w_scale=w_scale, bias=bias)
  got = tb.int8_matmul(x.to(dev), w.to(dev), x_scale=x_scale.to(dev),
                       w_scale=w_scale.to(dev), bias=bias.to(dev),
                       partition_spec=("fsdp", "model", None),
                       mesh=MESHES["grid"]).cpu()
  assert got.shape == (ODD, 3, 16)
  torch.testing.assert_close(got, want, **TOL)
  raw = tb.int8_matmul(x.to(dev), w.to(dev), partition_spec=("fsdp", None,
                                                             None)).cpu()
  torch.testing.assert_close(raw, (x.long() @ w.long()).int(), rtol=0, atol=0)
  with pytest.raises(ValueError, match="dim 2 \\(K\\) over mesh axis 'model'"):
    tb.int8_matmul(x.to(dev), w.to(dev), partition_spec=(None, None, "model"),
                   mesh=MESHES["grid"])


@pytest.mark.parametrize("mesh, shape, kwargs", [
    ("flat", (ODD, 32), dict(batch_axis="fsdp")),
    ("grid", (ODD, 3, 32), dict(partition_spec=("fsdp", "model", None))),
])
def test_int8_linear(dev, mesh, shape, kwargs):
  torch.manual_seed(6)
  kernel = tb.Int8Linear(32, 16, mesh=MESHES[mesh], **kwargs)
  plain = tb.Int8Linear(32, 16)
  plain.load_state_dict(kernel.state_dict())
  x = torch.randn(*shape, generator=_gen(7))
  g = torch.randn(*shape[:-1], 16, generator=_gen(8))
  xp = x.clone().requires_grad_()
  want = plain(xp)
  want.backward(g)
  kernel = kernel.to(dev)
  xk = x.to(dev).requires_grad_()
  got = kernel(xk)
  got.backward(g.to(dev))
  torch_xla.sync()
  assert got.shape == want.shape
  torch.testing.assert_close(got.detach().cpu(), want.detach(), **TOL)
  for a, b in ((xk, xp), (kernel.weight, plain.weight),
               (kernel.bias, plain.bias)):
    torch.testing.assert_close(a.grad.cpu(), b.grad, rtol=1e-4, atol=1e-4)


# -------------------------------------------------------- grouped matmul --

@pytest.mark.parametrize("mesh, axis, transpose_rhs", [
    ("grid", "model", False), ("flat", "fsdp", True)])
def test_grouped_matmul(dev, mesh, axis, transpose_rhs):
  """N split (a size the axis does not divide: padded); d lhs is summed
  over the N shards, d rhs stays split. Groups: one empty, rows past the
  last."""
  gen = _gen(18)
  m, k, n, g = 13, 6, ODD, 3
  rand = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
  lhs = rand(m, k)
  rhs = rand(g, n, k) if transpose_rhs else rand(g, k, n)
  sizes = torch.tensor([4, 0, 7])
  ct = rand(m, n)

  def reference(lhs, rhs):
    w = rhs.transpose(1, 2) if transpose_rhs else rhs
    rows = torch.cat([torch.full((int(s),), i) for i, s in enumerate(sizes)])
    out = torch.einsum("mk,mkn->mn", lhs[:len(rows)], w[rows])
    return torch.cat([out, out.new_zeros(m - len(rows), n)])

  want = _run(reference, [lhs, rhs], [ct], torch.device("cpu"))
  got = _run(lambda a, b: tb.grouped_matmul(
      a, b, sizes.to(dev), transpose_rhs=transpose_rhs,
      partition_spec=(None, axis), mesh=MESHES[mesh]),
      [lhs.float(), rhs.float()], [ct.float()], dev)
  for g_list, w_list in zip(got, want):
    _assert_same([t.double() for t in g_list], w_list, rtol=1e-4, atol=1e-4)
  with pytest.raises(ValueError, match="dim 0 \\(rows\\) over mesh axis"):
    tb.grouped_matmul(lhs.float().to(dev), rhs.float().to(dev),
                      sizes.to(dev), transpose_rhs=transpose_rhs,
                      partition_spec=(axis, None), mesh=MESHES[mesh])


# ----------------------------------------------------------------- boxes --

def test_giou_broadcast_and_pairwise(dev):
  gen = _gen(9)
  b1, b2, b3 = _boxes(gen, ODD), _boxes(gen, 1), _boxes(gen, 3)
  # giou of every box with one broadcast box: b2's gradient sums all shards
  ct = torch.randn(ODD, generator=gen)
  want = _run(lambda a, b: tvops.generalized_box_iou(a, b)[:, 0],
              [b1.double(), b2.double()], [ct.double()], torch.device("cpu"))
  got = _run(lambda a, b: tb.giou(a, b, partition_spec=("fsdp", None)),
             [b1, b2], [ct], dev)
  _assert_same([t.double() for t in got[0]], want[0])
  _assert_same([t.double() for t in got[1]], want[1], rtol=1e-4, atol=1e-5)
  # the pairwise matrix split over both of its dims
  ct = torch.randn(ODD, 3, generator=gen)
  want = _run(tvops.generalized_box_iou, [b1.double(), b3.double()],
              [ct.double()], torch.device("cpu"))
  got = _run(lambda a, b: tb.pairwise_giou(
      a, b, partition_spec=("fsdp", "model"), mesh=MESHES["grid"]),
             [b1, b3], [ct], dev)
  _assert_same([t.double() for t in got[0]], want[0])
  _assert_same([t.double() for t in got[1]], want[1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_giou_loss(dev, reduction):
  gen = _gen(10)
  pred, target = _boxes(gen, ODD, 3), _boxes(gen, ODD, 3)
  pred[0, 0] = target[0, 0]
  ref_p = pred.double().requires_grad_()
  ref_t = target.double().requires_grad_()
  want = tvops.generalized_box_iou_loss(ref_p, ref_t, reduction=reduction)
  ct = torch.randn(want.shape, generator=gen, dtype=torch.float64)
  want_grads = torch.autograd.grad(want, (ref_p, ref_t), ct)
  out, grads = _run(lambda p, t: tb.giou_loss(
      p, t, reduction=reduction, partition_spec=("fsdp", "model", None),
      mesh=MESHES["grid"]), [pred, target], [ct.float()], dev)
  assert out[0].shape == want.shape
  torch.testing.assert_close(out[0].double(), want.detach(), **TOL)
  for g, w in zip(grads, want_grads):
    torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-5)


def test_giou_loss_module_cxcywh(dev):
  gen = _gen(11)
  pred, target = _boxes(gen, ODD), _boxes(gen, ODD)
  as_cxcywh = lambda b: tvops.box_convert(b, "xyxy", "cxcywh")
  loss_fn = tb.GIoULoss(box_format="cxcywh", batch_axis="fsdp")
  got = loss_fn(as_cxcywh(pred).to(dev), as_cxcywh(target).to(dev)).cpu()
  want = tvops.generalized_box_iou_loss(pred, target, reduction="mean")
  torch.testing.assert_close(got, want, **TOL)


def test_giou_loss_refuses_reduced_op_per_shard(dev):
  boxes = torch.zeros(ODD, 4, device=dev)
  static = _core.encode_static(dict(
      reduction="mean", eps=1e-7, box_format="xyxy", backend=None,
      _layout=(True, True), _partition_spec=("fsdp", None)))
  with pytest.raises(ValueError, match="reduced loss"):
    torch.ops.pallas_kernels_impl.giou_loss(static, [boxes, boxes])


def test_iou_family(dev):
  """The other IoU kinds share giou's sharding rules: a broadcast matching
  op, a pairwise matrix split over both dims, a reduced loss, a module."""
  gen = _gen(15)
  b1, b2, b3 = _boxes(gen, ODD, 3), _boxes(gen, 1, 3), _boxes(gen, 5)
  b1[0] = b2[0]
  cases = [
      (lambda a, b: tb.diou(a, b, partition_spec=("fsdp", "model", None),
                            mesh=MESHES["grid"]),
       lambda a, b: tvops.distance_box_iou(
           a.reshape(-1, 4), b.expand_as(a).reshape(-1, 4)).diagonal(
               ).reshape(a.shape[:-1]), [b1, b2]),
      (lambda a, b: tb.pairwise_ciou(a, b, partition_spec=("fsdp", "model"),
                                     mesh=MESHES["grid"]),
       tvops.complete_box_iou, [b1[:, 0], b3]),
      (lambda a, b: tb.ciou_loss(a, b, reduction="mean",
                                 partition_spec=("fsdp", None, None)),
       lambda a, b: tvops.complete_box_iou_loss(a, b, reduction="mean"),
       [b1, b2.expand_as(b1)]),
  ]
  for ours, theirs, inputs in cases:
    ct = torch.randn(theirs(*inputs).shape, generator=gen)
    want = _run(theirs, [t.double() for t in inputs], [ct.double()],
                torch.device("cpu"))
    got = _run(ours, inputs, [ct], dev)
    _assert_same([t.double() for t in got[0]], want[0])
    _assert_same([t.double() for t in got[1]], want[1], rtol=1e-4,
                 atol=1e-5)
  loss = tb.DIoULoss(reduction="sum", batch_axis="fsdp")
  torch.testing.assert_close(
      loss(b1.to(dev), b1.flip(0).to(dev)).cpu(),
      tvops.distance_box_iou_loss(b1, b1.flip(0), reduction="sum"), **TOL)
  torch.testing.assert_close(
      tb.box_iou(b3.to(dev), b3.to(dev), partition_spec=(None, "fsdp")).cpu(),
      tvops.box_iou(b3, b3), **TOL)
  # soft_nms: one image, nothing to split; an all-None spec replicates it
  scores = torch.rand(5, generator=gen)
  got = tb.soft_nms(b3.to(dev), scores.to(dev), max_output_size=4,
                    partition_spec=(None, None))
  want = tb.soft_nms(b3, scores, max_output_size=4)
  for g, w in zip(got, want):
    torch.testing.assert_close(g.cpu(), w)


def test_batched_nms_and_nms(dev):
  gen = _gen(12)
  boxes, scores = _boxes(gen, ODD, 30), torch.rand(ODD, 30, generator=gen)
  idx, num = tb.batched_nms(boxes.to(dev), scores.to(dev), iou_threshold=0.3,
                            max_output_size=8,
                            partition_spec=("fsdp", None, None))
  idx, num = idx.cpu(), num.cpu()
  assert idx.shape == (ODD, 8) and num.shape == (ODD,)
  for b in range(ODD):
    want = tvops.nms(boxes[b], scores[b], 0.3)[:8].tolist()
    assert idx[b, :int(num[b])].tolist() == want
  # one image: nothing to split, an all-None spec replicates it
  idx, num = tb.nms(boxes[0].to(dev), scores[0].to(dev), iou_threshold=0.3,
                    max_output_size=8, partition_spec=(None, None))
  assert idx.cpu()[:int(num.cpu())].tolist() == tvops.nms(
      boxes[0], scores[0], 0.3)[:8].tolist()
  with pytest.raises(ValueError, match="batched_nms can split images"):
    tb.nms(boxes[0].to(dev), scores[0].to(dev), iou_threshold=0.3,
           max_output_size=8, partition_spec=("fsdp", None))


# --------------------------------------------------------------- warning --

def test_unsharded_warning_once_per_op(dev, monkeypatch):
  monkeypatch.setattr(_core, "_WARNED_UNSHARDED", set())
  x = torch.randn(ODD, 16, generator=_gen(13))
  boxes = _boxes(_gen(14), ODD)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    first = tb.quantize_int8(x.to(dev))
    tb.quantize_int8(x.to(dev))
    tb.quantize_int8(x.to(dev), partition_spec=("fsdp", None))
    tb.giou(boxes.to(dev), boxes.to(dev))
    tb.giou(boxes, boxes)  # CPU tensors: SPMD does not apply
  messages = [str(w.message) for w in caught
              if issubclass(w.category, tb.UnshardedWarning)]
  assert len(messages) == 2, messages
  assert messages[0].startswith("quantize_int8: torch_xla SPMD is on")
  assert "runs unsharded" in messages[0]
  assert messages[1].startswith("giou:")
  for g, w in zip(first, tb.quantize_int8(x)):  # unsharded, still right
    torch.testing.assert_close(g.cpu(), w, rtol=0, atol=0)


def test_public_ops_on_sharded_inputs(dev, monkeypatch):
  """torch.ops.pallas_kernels.* take no partition_spec: on inputs sharded
  with xs.mark_sharding they run unsharded, as documented (ops.py), warn
  UnshardedWarning once per op, and give the right values (and, for
  flash_attention, gradients)."""
  monkeypatch.setattr(_core, "_WARNED_UNSHARDED", set())
  mesh, gen = MESHES["grid"], _gen(17)
  rand = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)

  def sharded(t, spec):  # an XLA tensor split over the mesh
    t = t.to(dev)
    xs.mark_sharding(t, mesh, spec)
    return t

  q, k, v = (rand(ODD, 2, 16, 8) for _ in range(3))
  ct = rand(ODD, 2, 16, 8)
  pred, target = _boxes(gen, ODD, 3), _boxes(gen, ODD, 3)
  x = torch.randint(-127, 128, (ODD, 64), generator=gen, dtype=torch.int8)
  w = torch.randint(-127, 128, (64, 16), generator=gen, dtype=torch.int8)
  ops = torch.ops.pallas_kernels
  attention_spec = ("fsdp", "model", None, None)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    leaves = [sharded(t.float(), attention_spec).requires_grad_()
              for t in (q, k, v)]
    out = ops.flash_attention(*leaves, causal=True)
    grads = torch.autograd.grad(out, leaves, sharded(ct.float(),
                                                     attention_spec))
    loss = ops.giou_loss(sharded(pred, ("fsdp", "model", None)),
                         sharded(target, ("fsdp", "model", None)),
                         reduction="sum")
    product = ops.int8_matmul(sharded(x, ("fsdp", None)), w.to(dev))
    ops.int8_matmul(sharded(x, ("fsdp", None)), w.to(dev))  # warned already
    torch_xla.sync()
  messages = [str(m.message) for m in caught
              if issubclass(m.category, tb.UnshardedWarning)]
  assert [m.split(":")[0] for m in messages] == [
      "flash_attention", "giou_loss", "int8_matmul"], messages
  assert all("runs unsharded" in m for m in messages)

  ref = [t.clone().requires_grad_() for t in (q, k, v)]
  logits = (ref[0] @ ref[1].transpose(-1, -2) / math.sqrt(8)).masked_fill(
      ~torch.ones(16, 16, dtype=torch.bool).tril(), float("-inf"))
  want = torch.softmax(logits, -1) @ ref[2]
  want_grads = torch.autograd.grad(want, ref, ct)
  torch.testing.assert_close(out.detach().cpu().double(), want.detach(),
                             rtol=2e-5, atol=2e-5)
  for g, r in zip(grads, want_grads):
    torch.testing.assert_close(g.cpu().double(), r, rtol=1e-4, atol=1e-4)
  torch.testing.assert_close(
      loss.cpu().double(), tvops.generalized_box_iou_loss(
          pred.double(), target.double(), reduction="sum"), **TOL)
  torch.testing.assert_close(product.cpu(), (x.long() @ w.long()).int(),
                             rtol=0, atol=0)
