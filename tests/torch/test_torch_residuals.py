"""The bridge's backward runs only the backward kernels (no recomputation).

Evidence from torch_xla's own graph: the bridge is made to lower its JAX
functions for TPU (Mosaic kernels become ``tpu_custom_call``s) while
torch_xla runs on its CPU client, and the pending graph's HLO
(``_get_xla_tensors_hlo``; nothing executes) of the outputs and the
gradients together is searched for kernel calls.
Flash attention forward: 1 kernel; forward + backward: 3 (forward, dq,
dk/dv), where recomputing the forward (the plain op's autograd formula)
gives 4. Ops whose backward needs no kernel of its own (GIoU loss: the
forward kernel fuses value and gradient; int8_dense: straight-through
float matmuls) add none. Grouped matmul: 1, then 3 (d lhs by gmm, d rhs by
tgmm).
"""
from __future__ import annotations

import pytest

pytest.importorskip("torch_xla")
pytestmark = pytest.mark.torch

import torch  # noqa: E402

import torch_bridge as tb  # noqa: E402
from torch_bridge import _core, _xla  # noqa: E402


@pytest.fixture
def lowered_for_tpu(monkeypatch, xla_device):
  monkeypatch.setattr(_xla, "lowering_platform", lambda: "tpu")
  monkeypatch.setattr(_xla, "lowering_target",
                      lambda: dict(tpu_generation="v5e"))
  import torch_xla

  def kernels(tensors):
    hlo = torch_xla._XLAC._get_xla_tensors_hlo(list(tensors))
    return hlo.count('custom_call_target="tpu_custom_call"')
  return kernels


def _qkv(dev, gen):
  return [torch.randn(2, 2, 256, 128, generator=gen).to(dev).requires_grad_()
          for _ in range(3)]


def test_attention_backward_runs_only_backward_kernels(lowered_for_tpu,
                                                       xla_device, torch_gen):
  kernels = lowered_for_tpu
  q, k, v = _qkv(xla_device, torch_gen)
  out = tb.flash_attention(q, k, v, causal=True)
  assert kernels([out]) == 1
  out.sum().backward()
  assert kernels([out, q.grad, k.grad, v.grad]) == 3


def test_recomputing_formula_would_show(lowered_for_tpu, xla_device,
                                        torch_gen):
  """The count can fail: the plain op (which recomputes) shows 4."""
  kernels = lowered_for_tpu
  q, k, v = _qkv(xla_device, torch_gen)
  static = dict(causal=True, sm_scale=None, sliding_window=None,
                logit_soft_cap=None, return_lse=False, block_sizes=None,
                backend=None, _layout=(True,) * 3 + (False,) * 4)
  (out,) = torch.ops.pallas_kernels_impl.flash_attention(
      _core.encode_static(static), [q, k, v])
  out.sum().backward()
  assert kernels([out, q.grad, k.grad, v.grad]) == 4


def test_attention_saves_out_and_lse_once():
  """The save op returns the output, then only the log-sum-exp (q, k, v and
  out are taken from what autograd saves anyway)."""
  q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
  static = dict(causal=False, sm_scale=None, sliding_window=None,
                logit_soft_cap=None, return_lse=False, block_sizes=None,
                backend=None, _layout=(True,) * 3 + (False,) * 4)
  outs = torch.ops.pallas_kernels_impl.flash_attention_save(
      _core.encode_static(static), [q, k, v])
  assert [tuple(o.shape) for o in outs] == [(1, 2, 16, 8), (1, 2, 16)]


def _boxes(gen, n):
  xy = torch.rand(n, 2, generator=gen)
  return torch.cat([xy, xy + 0.1 + torch.rand(n, 2, generator=gen)], -1)


@pytest.mark.parametrize("op", ["giou_loss", "int8_dense"])
def test_backward_adds_no_kernel(op, lowered_for_tpu, xla_device, torch_gen):
  kernels = lowered_for_tpu
  if op == "giou_loss":
    x = _boxes(torch_gen, 1000).to(xla_device).requires_grad_()
    y = tb.giou_loss(x, _boxes(torch_gen, 1000).to(xla_device),
                     reduction="sum")
    leaves = [x]
  else:
    x = torch.randn(64, 256, generator=torch_gen).to(
        xla_device).requires_grad_()
    w = torch.randn(128, 256, generator=torch_gen).to(
        xla_device).requires_grad_()
    y = tb.int8_dense(x, w).sum()
    leaves = [x, w]
  forward = kernels([y])
  assert forward >= 1
  y.backward()
  assert kernels([y] + [t.grad for t in leaves]) == forward


def test_grouped_matmul_backward_runs_two_kernels(lowered_for_tpu, xla_device,
                                                  torch_gen):
  """Forward 1 kernel (gmm); with the backward 3: d lhs (gmm, transposed
  rhs) and d rhs (tgmm) from the saved inputs, the forward not rerun."""
  kernels = lowered_for_tpu
  lhs = torch.randn(256, 128, generator=torch_gen).to(
      xla_device).requires_grad_()
  rhs = torch.randn(4, 128, 256, generator=torch_gen).to(
      xla_device).requires_grad_()
  sizes = torch.tensor([100, 0, 120, 36], dtype=torch.int32).to(xla_device)
  out = tb.grouped_matmul(lhs, rhs, sizes)
  assert kernels([out]) == 1
  out.sum().backward()
  assert kernels([out, lhs.grad, rhs.grad]) == 3
