"""torch_bridge.flash_attention vs torch's scaled_dot_product_attention."""
from __future__ import annotations

import math

import pytest

pytest.importorskip("torch_xla")
pytestmark = pytest.mark.torch

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import torch_bridge as tb  # noqa: E402

# float32 kernels vs a float64 SDPA reference.
TOL = dict(rtol=2e-5, atol=2e-5)


def _allowed(q_len, kv_len, *, causal, window=None, q_seg=None, kv_seg=None):
  """Boolean [B or 1, 1, q, kv] mask with pallas_kernels' semantics."""
  i = torch.arange(q_len)[:, None] + (kv_len - q_len)  # ends aligned
  j = torch.arange(kv_len)[None, :]
  ok = torch.ones(q_len, kv_len, dtype=torch.bool)
  if causal:
    ok &= j <= i
  if window is not None:
    left, right = window
    ok &= j >= i - left
    ok &= j <= i + right
  ok = ok[None, None]
  if q_seg is not None:
    ok = ok & (q_seg[:, None, :, None] == kv_seg[:, None, None, :])
  return ok


def _sdpa(q, k, v, mask, bias=None, scale=None):
  group = q.shape[1] // k.shape[1]
  k = k.repeat_interleave(group, dim=1)
  v = v.repeat_interleave(group, dim=1)
  attn_mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(
      ~mask, float("-inf"))
  if bias is not None:
    attn_mask = attn_mask + bias
  return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                        scale=scale)


CASES = {
    # name: (B, H, KV_H, Sq, Skv, D, causal, window, segments, bias)
    "causal_mha": (2, 2, 2, 16, 16, 16, True, None, False, False),
    "gqa_bias_cross": (1, 4, 2, 8, 24, 8, False, None, False, True),
    "segments_window": (2, 2, 1, 24, 24, 16, True, (5, 0), True, False),
    # v's head dim (last entry) != q's: MLA
    "mla_gqa_segments_causal": (2, 4, 2, 19, 27, 16, True, None, True, False,
                                24),
}


def _inputs(gen, case, device, dtype=torch.float32):
  b, h, kvh, sq, skv, d, causal, window, segments, bias, *dv = case
  def rand(*shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)
  q, k, v = rand(b, h, sq, d), rand(b, kvh, skv, d), rand(b, kvh, skv,
                                                          *(dv or [d]))
  q_seg = kv_seg = None
  if segments:  # two segments per row, split at different points
    q_seg = (torch.arange(sq)[None] >= torch.tensor([[sq // 3], [sq // 2]])[
        :b]).long()
    kv_seg = (torch.arange(skv)[None] >= torch.tensor([[skv // 3],
                                                       [skv // 2]])[:b]).long()
  bias_t = rand(1, h, sq, skv) if bias else None
  mask = _allowed(sq, skv, causal=causal, window=window, q_seg=q_seg,
                  kv_seg=kv_seg)
  def to(t):
    return None if t is None else t.to(device=device, dtype=dtype)
  kernel_args = dict(q=to(q), k=to(k), v=to(v), bias=to(bias_t),
                     segment_ids=None if q_seg is None else
                     (q_seg.to(device), kv_seg.to(device)),
                     causal=causal, sliding_window=window)
  return (q, k, v, bias_t, mask), kernel_args


def _sync(device):
  """One XLA graph for every result (else each .cpu() compiles its own)."""
  if device.type == "xla":
    import torch_xla
    torch_xla.sync()


def _check(gen, case, device, with_grad=True):
  (q, k, v, bias, mask), args = _inputs(gen, case, device)
  diff = [args[n] for n in ("q", "k", "v", "bias") if args[n] is not None]
  for t in diff:
    t.requires_grad_()
  out, lse = tb.flash_attention(args.pop("q"), args.pop("k"), args.pop("v"),
                                return_lse=True, **args)
  g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
  grads = torch.autograd.grad(out, diff, g.to(out), retain_graph=True)
  _sync(device)
  ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)] + (
      [bias.clone().requires_grad_()] if bias is not None else [])
  rq, rk, rv = ref_leaves[:3]
  rbias = ref_leaves[3] if bias is not None else None
  want = _sdpa(rq, rk, rv, mask, rbias)
  torch.testing.assert_close(out.detach().cpu().double(), want.detach(), **TOL)
  # lse = logsumexp of the masked, scaled logits
  scale = 1 / math.sqrt(q.shape[-1])
  group = q.shape[1] // k.shape[1]
  logits = scale * q @ k.repeat_interleave(group, 1).transpose(-1, -2)
  if bias is not None:
    logits = logits + bias
  want_lse = logits.masked_fill(~mask, float("-inf")).logsumexp(-1)
  torch.testing.assert_close(lse.detach().cpu().double(), want_lse, **TOL)
  if not with_grad:
    return
  want_grads = torch.autograd.grad(want, ref_leaves, g)
  for got, ref in zip(grads, want_grads):
    torch.testing.assert_close(got.cpu().double(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_sdpa_cpu(torch_gen, name):
  _check(torch_gen, CASES[name], torch.device("cpu"))


def test_matches_sdpa_xla(torch_gen, xla_device):
  _check(torch_gen, CASES["gqa_bias_cross"], xla_device)


def test_bfloat16(torch_gen):
  (q, k, v, _, mask), args = _inputs(torch_gen, CASES["causal_mha"],
                                     torch.device("cpu"), torch.bfloat16)
  out = tb.flash_attention(args["q"], args["k"], args["v"], causal=True)
  assert out.dtype == torch.bfloat16
  want = _sdpa(q, k, v, mask)
  torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)


def test_fully_masked_rows_are_zero(torch_gen):
  q = torch.randn(1, 1, 4, 8, generator=torch_gen)
  k = torch.randn(1, 1, 4, 8, generator=torch_gen)
  q_seg = torch.tensor([[0, 0, 7, 7]])
  kv_seg = torch.tensor([[0, 0, 1, 1]])
  out = tb.flash_attention(q, k, k, segment_ids=(q_seg, kv_seg),
                           backend="reference")
  assert torch.all(out[0, 0, 2:] == 0)
  assert torch.all(torch.isfinite(out))


def test_meta_shapes():
  q = torch.empty(2, 8, 128, 64, device="meta", dtype=torch.bfloat16)
  k = torch.empty(2, 2, 256, 64, device="meta", dtype=torch.bfloat16)
  out, lse = tb.flash_attention(q, k, k, causal=True, return_lse=True)
  assert out.device.type == "meta"
  assert out.shape == q.shape and out.dtype == torch.bfloat16
  assert lse.shape == (2, 8, 128) and lse.dtype == torch.float32
  # MLA: out takes v's head dim
  q = torch.empty(2, 8, 128, 192, device="meta", dtype=torch.bfloat16)
  k = torch.empty(2, 2, 256, 192, device="meta", dtype=torch.bfloat16)
  v = torch.empty(2, 2, 256, 128, device="meta", dtype=torch.bfloat16)
  assert tb.flash_attention(q, k, v, causal=True).shape == (2, 8, 128, 128)


def test_op_registered():
  """The public typed op, and the internal ops it runs."""
  assert hasattr(torch.ops.pallas_kernels, "flash_attention")
  assert hasattr(torch.ops.pallas_kernels_impl, "flash_attention")
  assert hasattr(torch.ops.pallas_kernels_impl, "flash_attention_vjp")


@pytest.mark.parametrize("bad, error, match", [
    (dict(q=torch.zeros(1, 1, 4, 8, dtype=torch.int32)), TypeError, "q"),
    (dict(k=torch.zeros(1, 4, 8)), ValueError, "k must have 4 dimensions"),
    (dict(v=[[1.0]]), TypeError, "v must be a torch.Tensor"),
    (dict(segment_ids=torch.zeros(1, 4)), TypeError, "segment_ids"),
    (dict(k=torch.zeros(1, 3, 4, 8), v=torch.zeros(1, 3, 4, 8)), ValueError,
     "multiple of kv_heads"),
    (dict(bias=torch.zeros(1, 1, 4, 8, dtype=torch.int64)), TypeError,
     "bias"),
    (dict(partition_spec="fsdp"), TypeError, "partition_spec"),
])
def test_bad_input_raises(bad, error, match):
  args = dict(q=torch.zeros(1, 2, 4, 8), k=torch.zeros(1, 2, 4, 8),
              v=torch.zeros(1, 2, 4, 8))
  args.update(bad)
  with pytest.raises(error, match=match):
    tb.flash_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def test_mixed_devices_named(xla_device):
  q = torch.zeros(1, 1, 4, 8)
  with pytest.raises(ValueError, match="k is on xla"):
    tb.flash_attention(q, q.to(xla_device), q)


from hypothesis import given, strategies as st  # noqa: E402


@given(batch=st.integers(1, 3), kv_heads=st.integers(1, 3),
       group=st.integers(1, 3), q_len=st.integers(1, 300),
       kv_len=st.integers(1, 300), head_dim=st.sampled_from([8, 64, 96, 128]),
       causal=st.booleans(), return_lse=st.booleans())
def test_meta_shape_property(batch, kv_heads, group, q_len, kv_len, head_dim,
                             causal, return_lse):
  heads = kv_heads * group
  q = torch.empty(batch, heads, q_len, head_dim, device="meta",
                  dtype=torch.bfloat16)
  k = torch.empty(batch, kv_heads, kv_len, head_dim, device="meta",
                  dtype=torch.bfloat16)
  out = tb.flash_attention(q, k, k, causal=causal, return_lse=return_lse)
  if return_lse:
    out, lse = out
    assert lse.shape == (batch, heads, q_len) and lse.dtype == torch.float32
  assert out.shape == q.shape and out.dtype == q.dtype


@pytest.mark.parametrize("kind", ["tpu", "gpu"])
def test_block_size_dataclasses_cross_the_op_schema(kind):
  from pallas_kernels.attention import BlockSizes
  from pallas_kernels.attention.triton import GpuBlockSizes
  blocks = (BlockSizes(block_q=128, block_kv=128) if kind == "tpu"
            else GpuBlockSizes(block_q=16, block_k=16))
  gen = torch.Generator().manual_seed(3)
  q, k, v = (torch.randn(1, 2, 150, 8, generator=gen) for _ in range(3))
  out = tb.flash_attention(q, k, v, causal=True, block_sizes=blocks)
  want = _sdpa(q.double(), k.double(), v.double(),
               _allowed(150, 150, causal=True)).float()
  torch.testing.assert_close(out, want, **TOL)
