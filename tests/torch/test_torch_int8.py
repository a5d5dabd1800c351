"""int8 ops and Int8Linear vs torch integer / float semantics."""
from __future__ import annotations

import pytest

pytest.importorskip("torch_xla")
pytestmark = pytest.mark.torch

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import torch_bridge as tb  # noqa: E402


def _torch_quantize(x, dim=-1):
  """Symmetric per-row int8 (scale = amax * (1/127), half-to-even)."""
  x = x.float()
  amax = x.abs().amax(dim=dim, keepdim=True)
  scale = torch.where(amax == 0, torch.ones_like(amax),
                      amax * torch.tensor(1 / 127, dtype=torch.float32))
  q = torch.round(x / scale).clamp(-127, 127).to(torch.int8)
  return q, scale


def _int_matmul(x, w):
  """Exact int8 x int8 -> int32 matmul (what torch._int_mm computes)."""
  return (x.long() @ w.long()).to(torch.int32)


def test_quantize_matches_torch(torch_gen):
  x = torch.randn(5, 33, generator=torch_gen) * 3
  x[1] = 0  # all-zero row: scale 1
  q, scale = tb.quantize_int8(x)
  want_q, want_scale = _torch_quantize(x)
  assert q.dtype == torch.int8 and scale.dtype == torch.float32
  torch.testing.assert_close(scale, want_scale)
  torch.testing.assert_close(q, want_q, rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(7, 40, 9), (1, 1, 1), (2, 3, 130, 5)])
def test_raw_matmul_is_exact(torch_gen, shape):
  *lead, k, n = shape
  x = torch.randint(-128, 128, (*lead, k), generator=torch_gen,
                    dtype=torch.int8)
  w = torch.randint(-128, 128, (k, n), generator=torch_gen, dtype=torch.int8)
  out = tb.int8_matmul(x, w)
  assert out.dtype == torch.int32 and out.shape == (*lead, n)
  torch.testing.assert_close(out, _int_matmul(x, w), rtol=0, atol=0)
  if hasattr(torch, "_int_mm") and len(lead) == 1 and lead[0] > 16 and (
      k % 8 == 0 and n % 8 == 0):
    torch.testing.assert_close(out, torch._int_mm(x, w), rtol=0, atol=0)


def test_dequant_matmul(torch_gen):
  x = torch.randint(-127, 128, (6, 24), generator=torch_gen, dtype=torch.int8)
  w = torch.randint(-127, 128, (24, 10), generator=torch_gen, dtype=torch.int8)
  x_scale = (torch.rand(6, 1, generator=torch_gen) + 0.1).requires_grad_()
  w_scale = (torch.rand(10, generator=torch_gen) + 0.1).requires_grad_()
  bias = torch.randn(10, generator=torch_gen).requires_grad_()
  out = tb.int8_matmul(x, w, x_scale=x_scale, w_scale=w_scale, bias=bias,
                       out_dtype=torch.float32)
  acc = _int_matmul(x, w).double()
  leaves = [t.detach().double().requires_grad_()
            for t in (x_scale, w_scale, bias)]
  want = acc * leaves[0] * leaves[1] + leaves[2]
  torch.testing.assert_close(out.double(), want.detach(), rtol=1e-6,
                             atol=1e-4)
  # As the JAX op: bias gets its gradient, the frozen scales none
  # (int8_dense is the trainable op)
  out.sum().backward()
  assert x_scale.grad is None and w_scale.grad is None
  torch.testing.assert_close(bias.grad, torch.full((10,), 6.0))


def _dense_case(gen, device):
  x = torch.randn(3, 5, 48, generator=gen)
  linear = nn.Linear(48, 20)
  with torch.no_grad():
    linear.weight.copy_(torch.randn(20, 48, generator=gen) / 7)
    linear.bias.copy_(torch.randn(20, generator=gen))
  layer = tb.Int8Linear.from_linear(linear).to(device)
  return x, linear, layer


def _check_dense(gen, device):
  x, linear, layer = _dense_case(gen, device)
  xd = x.to(device).requires_grad_()
  out = layer(xd)
  xr = x.clone().requires_grad_()
  want = linear(xr)
  # int8 forward: error bounded by both operands' rounding (half a step each)
  x_step = x.abs().amax(-1, keepdim=True) / 127
  w_step = linear.weight.abs().amax(-1) / 127
  bound = 0.5 * (x_step * linear.weight.abs().sum(-1) +
                 x.abs() @ w_step[:, None].expand(-1, 48).T) * 1.05 + 1e-5
  err = (out.detach().cpu() - want.detach()).abs()
  assert torch.all(err <= bound.detach()), float((err - bound).max())
  # straight-through backward: exactly the float layer's gradients
  g = torch.randn(out.shape, generator=gen)
  grads = torch.autograd.grad(out, (xd, layer.weight, layer.bias), g.to(device))
  if device.type == "xla":  # one graph, not one per fetched tensor
    import torch_xla
    torch_xla.sync()
  want_grads = torch.autograd.grad(want, (xr, linear.weight, linear.bias), g)
  for got, ref in zip(grads, want_grads):
    torch.testing.assert_close(got.cpu(), ref, rtol=1e-5, atol=1e-5)


def test_int8_linear_cpu(torch_gen):
  _check_dense(torch_gen, torch.device("cpu"))


def test_int8_linear_xla(torch_gen, xla_device):
  _check_dense(torch_gen, xla_device)


def test_int8_linear_is_drop_in(torch_gen):
  linear = nn.Linear(16, 8)
  layer = tb.Int8Linear(16, 8)
  layer.load_state_dict(linear.state_dict())
  assert isinstance(layer, nn.Linear)
  assert set(layer.state_dict()) == {"weight", "bias"}
  plain = tb.Int8Linear(16, 8, use_kernel=False)
  plain.load_state_dict(linear.state_dict())
  x = torch.randn(4, 16, generator=torch_gen)
  torch.testing.assert_close(plain(x), F.linear(x, linear.weight, linear.bias))
  meta = tb.Int8Linear(16, 8, device="meta")
  assert meta(torch.empty(2, 3, 16, device="meta")).shape == (2, 3, 8)


@pytest.mark.parametrize("call, error, match", [
    (lambda: tb.int8_matmul(torch.zeros(2, 3), torch.zeros(3, 2)), TypeError,
     "w must have dtype int8"),
    (lambda: tb.int8_matmul(torch.zeros(2, 3, dtype=torch.int32),
                            torch.zeros(3, 2, dtype=torch.int8)),
     TypeError, "x must have dtype"),
    (lambda: tb.int8_matmul(torch.zeros(2, 4, dtype=torch.int8),
                            torch.zeros(3, 2, dtype=torch.int8)),
     ValueError, "last dimension"),
    (lambda: tb.int8_dense(torch.zeros(2, 4), torch.zeros(3, 5)),
     ValueError, "in_features"),
    (lambda: tb.int8_dense(torch.zeros(2, 4), torch.zeros(3, 4),
                           torch.zeros(2)), ValueError, "bias"),
    (lambda: tb.quantize_int8(torch.zeros(3, dtype=torch.int8)), TypeError,
     "x must have dtype"),
])
def test_bad_input_raises(call, error, match):
  with pytest.raises(error, match=match):
    call()
