"""The eager fast path (``torch_bridge._eager``) against the custom ops.

Plain CPU tensors take the fast path; the same call with it switched off
(``custom_ops_only``) takes ``torch.ops.pallas_kernels_impl.*``. The two must
give the same bits, and match float64 oracles (float32 tolerances below).
``fast_path`` records which jitted functions the fast path runs: "forward"
without gradients; "save" in the forward and "restore" in the backward
with them (never the forward again); nothing under torch.compile, fake or
meta tensors, dispatch modes and XLA tensors.
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch_xla")
pytestmark = pytest.mark.torch

import torch  # noqa: E402

import torch_bridge as tb  # noqa: E402
from oracles import attention as attention_oracle  # noqa: E402
from oracles import boxes as boxes_oracle  # noqa: E402
from torch_bridge import _eager  # noqa: E402

# float32 kernels against float64 oracles.
ATTENTION_TOL = dict(rtol=2e-5, atol=2e-5)
GRAD_TOL = dict(rtol=1e-4, atol=1e-4)
# The boxes oracle's gradients are central differences.
BOX_GRAD_TOL = dict(rtol=1e-3, atol=1e-4)


@pytest.fixture
def fast_path(monkeypatch):
  kinds = []
  real = _eager._jitted

  def spy(name, static_text, flavour, kind, mask):
    kinds.append(kind)
    return real(name, static_text, flavour, kind, mask)
  monkeypatch.setattr(_eager, "_jitted", spy)
  return kinds


@pytest.fixture
def custom_ops_only(monkeypatch):
  """Calls ``fn()`` with the fast path off."""
  def run(fn):
    with monkeypatch.context() as patch:
      patch.setattr(_eager, "plain_device", lambda tensors: None)
      return fn()
  return run


def _qkv(rng, shape=(2, 3, 17, 8), kv_heads=3, requires_grad=False):
  b, h, s, d = shape
  shapes = (shape, (b, kv_heads, s + 4, d), (b, kv_heads, s + 4, d))
  return [torch.tensor(rng.standard_normal(x), dtype=torch.float32
                       ).requires_grad_(requires_grad) for x in shapes]


def _attention(q, k, v):
  return tb.flash_attention(q, k, v, causal=True, logit_soft_cap=20.0)


def test_forward_takes_fast_path(rng, fast_path, custom_ops_only):
  q, k, v = _qkv(rng, kv_heads=1)
  out = _attention(q, k, v)
  assert fast_path == ["forward"]
  assert torch.equal(out, custom_ops_only(lambda: _attention(q, k, v)))
  assert fast_path == ["forward"]
  want, _ = attention_oracle.attention(q.numpy(), k.numpy(), v.numpy(),
                                       causal=True, logit_soft_cap=20.0)
  torch.testing.assert_close(out.double(), torch.from_numpy(want),
                             **ATTENTION_TOL)


def test_grad_mode_off_takes_forward(rng, fast_path):
  q, k, v = _qkv(rng, requires_grad=True)
  with torch.no_grad():
    out = _attention(q, k, v)
  assert fast_path == ["forward"] and not out.requires_grad


def test_backward_from_residuals(rng, fast_path, custom_ops_only):
  """Forward saves residuals, backward runs only the restore function; the
  gradients equal the custom ops' bit for bit and match the oracle."""
  q, k, v = _qkv(rng, requires_grad=True)
  d_out = torch.tensor(rng.standard_normal(q.shape), dtype=torch.float32)

  def grads():
    return torch.autograd.grad((_attention(q, k, v) * d_out).sum(),
                               (q, k, v))
  got = grads()
  assert fast_path == ["save", "restore"]
  want = custom_ops_only(grads)
  assert fast_path == ["save", "restore"]
  for g, w in zip(got, want):
    assert torch.equal(g, w)
  _, _, (dq, dk, dv, _) = attention_oracle.attention(
      *(t.detach().numpy() for t in (q, k, v)), causal=True,
      logit_soft_cap=20.0, d_out=d_out.numpy())
  for g, w in zip(got, (dq, dk, dv)):
    torch.testing.assert_close(g.double(), torch.from_numpy(w), **GRAD_TOL)


def _boxes(rng, n):
  xy = rng.uniform(0, 50, (n, 2))
  wh = rng.uniform(1, 20, (n, 2))
  return torch.tensor(np.concatenate([xy, xy + wh], -1), dtype=torch.float32)


def test_loss_grads_and_partial_requires_grad(rng, fast_path,
                                              custom_ops_only):
  """Only ``pred`` requires grad; ``target`` gets none."""
  pred, target = _boxes(rng, 13).requires_grad_(), _boxes(rng, 13)

  def run():
    loss = tb.giou_loss(pred, target, reduction="mean")
    return (loss,) + torch.autograd.grad(loss * 3, pred)
  loss, grad = run()
  assert fast_path == ["save", "restore"]
  want_loss, want_grad = custom_ops_only(run)
  assert torch.equal(loss, want_loss) and torch.equal(grad, want_grad)
  torch.testing.assert_close(
      loss.double(), torch.tensor(boxes_oracle.loss(
          "giou", pred.detach().numpy(), target.numpy(), reduction="mean")),
      **ATTENTION_TOL)
  oracle_grad, _ = boxes_oracle.loss_grads(
      "giou", pred.detach().numpy(), target.numpy(), 3.0, reduction="mean")
  torch.testing.assert_close(grad.double(), torch.from_numpy(oracle_grad),
                             **BOX_GRAD_TOL)


def test_integer_outputs(rng, fast_path, custom_ops_only):
  boxes = _boxes(rng, 37)
  scores = torch.tensor(rng.uniform(size=37), dtype=torch.float32)

  def run():
    return tb.nms(boxes, scores, iou_threshold=0.4, max_output_size=11)
  got = run()
  assert fast_path == ["forward"]
  for g, w in zip(got, custom_ops_only(run)):
    assert g.dtype == w.dtype and torch.equal(g, w)
  want, count, close = boxes_oracle.nms(boxes.numpy(), scores.numpy(), 0.4,
                                        11)
  if not close:  # no IoU within float32 rounding of the threshold
    assert got[0].tolist() == want.tolist() and int(got[1]) == count


@pytest.mark.parametrize("path", ["fast", "custom ops"])
def test_second_derivative_refused(rng, path, custom_ops_only):
  """Both paths raise rather than treat the gradient as a constant."""
  q, k, v = _qkv(rng, requires_grad=True)

  def backward_twice():
    (dq,) = torch.autograd.grad(_attention(q, k, v).sum(), q,
                                create_graph=True)
    (dq.sum() + q.sum()).backward()
  with pytest.raises(RuntimeError, match="derivative|no autograd formula"):
    backward_twice() if path == "fast" else custom_ops_only(backward_twice)


def test_input_modified_after_forward_refused(rng):
  q, k, v = _qkv(rng, requires_grad=True)
  q2 = q * 1.0
  out = _attention(q2, k, v)
  q2.add_(1.0)
  with pytest.raises(RuntimeError, match="modified by an inplace"):
    out.sum().backward()


def _fake_mode():
  from torch._subclasses.fake_tensor import FakeTensorMode
  return FakeTensorMode(allow_non_fake_inputs=True)


def _flop_counter():
  from torch.utils.flop_counter import FlopCounterMode
  return FlopCounterMode(display=False)


@pytest.mark.parametrize("mode", [_fake_mode, _flop_counter])
def test_not_taken_under_dispatch_modes(rng, fast_path, mode):
  q, k, v = _qkv(rng)
  with mode():
    out = _attention(q, k, v)
  assert fast_path == [] and tuple(out.shape) == tuple(q.shape)


def test_not_taken_for_meta_tensors(fast_path):
  q, k, v = (torch.empty(1, 2, 9, 8, device="meta") for _ in range(3))
  assert tuple(_attention(q, k, v).shape) == (1, 2, 9, 8)
  assert fast_path == []


def test_not_taken_under_torch_compile(rng, fast_path):
  q, k, v = _qkv(rng, requires_grad=True)
  compiled = torch.compile(_attention, backend="aot_eager", fullgraph=True)
  got = compiled(q, k, v)
  (dq,) = torch.autograd.grad(got.sum(), q)
  assert fast_path == []
  want = _attention(q, k, v)
  assert fast_path == ["save"]
  torch.testing.assert_close(got, want, **ATTENTION_TOL)
  (want_dq,) = torch.autograd.grad(want.sum(), q)
  torch.testing.assert_close(dq, want_dq, **GRAD_TOL)


def test_not_taken_for_xla_tensors(rng, fast_path, xla_device):
  q, k, v = _qkv(rng, requires_grad=True)
  xq, xk, xv = (t.detach().to(xla_device).requires_grad_() for t in (q, k, v))
  got = _attention(xq, xk, xv)
  (dq,) = torch.autograd.grad(got.sum(), xq)
  got, dq = got.cpu(), dq.cpu()
  assert fast_path == []
  want = _attention(q, k, v)
  (want_dq,) = torch.autograd.grad(want.sum(), q)
  torch.testing.assert_close(got, want, **ATTENTION_TOL)
  torch.testing.assert_close(dq, want_dq, **GRAD_TOL)
