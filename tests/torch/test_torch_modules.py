"""Attention / ViTBlock modules, torch.compile, meta tensors, graph contents."""
from __future__ import annotations

import copy
import pathlib
import sys

import pytest

pytest.importorskip("torch_xla")
pytestmark = pytest.mark.torch

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import torch_bridge as tb  # noqa: E402
from torch_bridge import modules  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "examples"))
from vit import ViTBlock  # noqa: E402  (the demo's block, built on modules)


def _pair(module_factory, seed):
  torch.manual_seed(seed)
  kernel = module_factory(use_kernel=True)
  plain = module_factory(use_kernel=False)
  plain.load_state_dict(kernel.state_dict())
  return kernel, plain


def _compare(kernel, plain, x, device, atol=2e-5):
  kernel = kernel.to(device)
  xk = x.detach().clone().to(device).requires_grad_()
  xp = x.detach().clone().requires_grad_()
  out_k, out_p = kernel(xk), plain(xp)
  torch.testing.assert_close(out_k.detach().cpu(), out_p.detach(), rtol=atol,
                             atol=atol)
  g = torch.randn(out_p.shape)
  out_k.backward(g.to(device))
  if device.type == "xla":  # one graph for all results, not one per fetch
    import torch_xla
    torch_xla.sync()
  out_p.backward(g)
  torch.testing.assert_close(xk.grad.cpu(), xp.grad, rtol=1e-4, atol=1e-4)
  grads_k = {n: p.grad.cpu() for n, p in kernel.named_parameters()}
  for n, p in plain.named_parameters():
    torch.testing.assert_close(grads_k[n], p.grad, rtol=1e-4, atol=1e-4,
                               msg=lambda m: f"{n}: {m}")


def test_attention_gqa_cpu(rng):
  kernel, plain = _pair(
      lambda **kw: modules.Attention(32, 4, num_kv_heads=2, qkv_bias=True,
                                     **kw), int(rng.integers(1000)))
  assert {"q.weight", "kv.weight", "proj.weight"} <= set(kernel.state_dict())
  _compare(kernel, plain, torch.randn(2, 9, 32), torch.device("cpu"))


def test_vit_block_causal_xla(rng, xla_device):
  kernel, plain = _pair(
      lambda **kw: ViTBlock(32, 2, causal=True, **kw),
      int(rng.integers(1000)))
  # the write-up's TPUAttentionBlock parameter names
  assert {"norm1.weight", "attn.qkv.weight", "attn.proj.bias",
          "mlp.fc1.weight", "norm2.bias"} <= set(kernel.state_dict())
  _compare(kernel, plain, torch.randn(2, 16, 32), xla_device)


def test_kernel_is_in_the_xla_graph(xla_device):
  """On XLA CPU the graph holds the interpreted Pallas kernel (its grid loop),
  not the reference; backend="reference" embeds plain XLA ops."""
  from torch_xla.core import xla_builder
  from torch_bridge import _xla
  q = torch.randn(1, 2, 8, 8, device=xla_device)
  tb.flash_attention(q, q, q, sm_scale=0.3)
  tb.flash_attention(q, q, q, sm_scale=0.3, backend="reference")
  seen = {}
  for key, computation in _xla._COMPUTATIONS.items():
    if key[0][0] == "flash_attention" and "0.3" in key[0][1]:
      text = xla_builder.get_computation_hlo(computation)
      seen["reference" if "'reference'" in key[0][1] else "kernel"] = (
          "while" in text)
  assert seen == {"kernel": True, "reference": False}


def test_torch_compile_openxla_model(xla_device):
  import torch_xla
  torch.manual_seed(0)
  model = nn.Sequential(modules.Attention(16, 2, linear=tb.Int8Linear),
                        nn.LayerNorm(16), tb.Int8Linear(16, 4)).to(xla_device)
  reference = copy.deepcopy(model)
  compiled = torch.compile(model, backend="openxla")
  x = torch.randn(2, 8, 16)
  out = compiled(x.to(xla_device))
  out.square().sum().backward()
  want = reference(x.to(xla_device))
  want.square().sum().backward()
  torch_xla.sync()
  torch.testing.assert_close(out.detach().cpu(), want.detach().cpu(),
                             rtol=1e-5, atol=1e-5)
  for (name, p), r in zip(model.named_parameters(), reference.parameters()):
    torch.testing.assert_close(p.grad.cpu(), r.grad.cpu(), rtol=1e-4,
                               atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_meta_model():
  block = ViTBlock(64, 4, linear=tb.Int8Linear,
                           num_kv_heads=2).to("meta")
  out = block(torch.empty(3, 17, 64, device="meta"))
  assert out.shape == (3, 17, 64) and out.device.type == "meta"


def test_module_errors():
  with pytest.raises(ValueError, match="divisible by num_heads"):
    modules.Attention(30, 4)
  with pytest.raises(ValueError, match="multiple of num_kv_heads"):
    modules.Attention(32, 4, num_kv_heads=3)
  with pytest.raises(ValueError, match=r"x must be \[batch, tokens, dim\]"):
    modules.Attention(32, 4)(torch.zeros(2, 32))
