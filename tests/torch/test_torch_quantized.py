"""torch_bridge's quantized ops and decode attention against oracles.

``quantize`` is checked bit for bit against the NumPy oracle
(``oracles.quant``); ``quantized_matmul`` within the oracle's float32
rounding bound (exact int32 in raw mode); ``quantized_dense`` gradients
and ``decode_attention`` (values, dq, dsinks) against float64 torch written
here from the documented semantics. float8 tensors cross DLPack as bytes.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("torch_xla")
pytestmark = pytest.mark.torch

import torch  # noqa: E402

import torch_bridge as tb  # noqa: E402
from oracles import decode as decode_oracle  # noqa: E402
from oracles import quant as quant_oracle  # noqa: E402

FORMATS = {torch.int8: ("int8", np.int8),
           torch.float8_e4m3fn: ("float8_e4m3fn", ml_dtypes.float8_e4m3fn),
           torch.float8_e5m2: ("float8_e5m2", ml_dtypes.float8_e5m2)}


def _np(t):
  """A numpy array of ``t``'s values (float8 through its bytes)."""
  t = t.detach().cpu()
  if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
    return t.view(torch.uint8).numpy().view(FORMATS[t.dtype][1])
  return t.numpy()


@pytest.mark.parametrize("dtype", list(FORMATS))
@pytest.mark.parametrize("axis, group_size", [(-1, None), (0, None), (-1, 8)])
def test_quantize_matches_oracle_bit_for_bit(rng, dtype, axis, group_size):
  x = torch.tensor(rng.standard_normal((6, 24)) * 3, dtype=torch.float32)
  got = tb.quantize(x, dtype, axis=axis, group_size=group_size)
  assert got[0].dtype == dtype
  quant_oracle.assert_quantized([_np(g) for g in got], x.numpy(),
                                FORMATS[dtype][0], axis=axis,
                                group_size=group_size)


def test_quantize_asymmetric_int8_has_zero_points(rng):
  x = torch.tensor(rng.uniform(-1, 5, (5, 16)), dtype=torch.float32)
  got = tb.quantize(x, torch.int8, symmetric=False)
  assert len(got) == 3
  quant_oracle.assert_quantized([_np(g) for g in got], x.numpy(), "int8",
                                symmetric=False)


@pytest.mark.parametrize("dtype", list(FORMATS))
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("group_size", [None, 16])
def test_weight_only_matmul_matches_oracle(rng, dtype, layout, group_size):
  m, k, n = 7, 48, 9
  x = torch.tensor(rng.standard_normal((m, k)), dtype=torch.float32)
  w = torch.tensor(rng.standard_normal((k, n) if layout == "kn" else (n, k)),
                   dtype=torch.float32)
  axis = (0 if layout == "kn" else 1) if group_size else (
      0 if layout == "kn" else 1)
  w_q, w_scale = tb.quantize(w, dtype, axis=axis, group_size=group_size)
  if group_size is None:
    w_scale = w_scale.reshape(-1)
  out = tb.quantized_matmul(x, w_q, w_scale=w_scale, group_size=group_size,
                            weight_only=True, weight_layout=layout)
  quant_oracle.assert_matmul(_np(out), x.numpy(), _np(w_q), "float32",
                             w_scale=_np(w_scale), group_size=group_size,
                             weight_only=True, layout=layout)


@pytest.mark.parametrize("dtype", list(FORMATS))
def test_w8a8_matmul_matches_oracle(rng, dtype):
  x = torch.tensor(rng.standard_normal((5, 32)), dtype=torch.float32)
  w = torch.tensor(rng.standard_normal((32, 11)), dtype=torch.float32)
  x_q, x_scale = tb.quantize(x, dtype)
  w_q, w_scale = tb.quantize(w, dtype, axis=0)
  out = tb.quantized_matmul(x_q, w_q, x_scale=x_scale,
                            w_scale=w_scale.reshape(-1),
                            out_dtype=torch.float32)
  quant_oracle.assert_matmul(_np(out), _np(x_q), _np(w_q), "float32",
                             x_scale=_np(x_scale),
                             w_scale=_np(w_scale).reshape(-1))


@pytest.mark.parametrize("op", ["quantized_matmul", "int8_matmul"])
def test_weight_only_matmul_gradients_match_float64(rng, op):
  # As the JAX ops: d x and d bias through the frozen, dequantized weight.
  m, k, n = 6, 40, 9
  x = torch.tensor(rng.standard_normal((m, k)), dtype=torch.float32,
                   requires_grad=True)
  bias = torch.tensor(rng.standard_normal(n), dtype=torch.float32,
                      requires_grad=True)
  w_q = torch.tensor(rng.integers(-127, 128, (k, n)), dtype=torch.int8)
  w_scale = torch.tensor(rng.uniform(1e-3, 2e-2, n), dtype=torch.float32)
  out = getattr(tb, op)(x, w_q, w_scale=w_scale, bias=bias, weight_only=True)
  cotangent = rng.standard_normal((m, n))
  out.backward(torch.tensor(cotangent, dtype=torch.float32))
  w64 = w_q.numpy().astype(np.float64) * w_scale.numpy().astype(np.float64)
  # float32 sums of n (m) products: each term's cast and the weight's
  # dequantization round once more. Bounded by the terms' magnitudes, not by
  # a fixed atol, which cancellation beats on some seeds.
  unit = 2.0 ** -24
  bound = (n + 2) * unit * (np.abs(cotangent) @ np.abs(w64).T)
  assert np.all(np.abs(x.grad.numpy() - cotangent @ w64.T) <= bound)
  bound = (m + 1) * unit * np.abs(cotangent).sum(0)
  assert np.all(np.abs(bias.grad.numpy() - cotangent.sum(0)) <= bound)
  assert w_q.grad is None


def test_dynamic_quantized_matmul_refuses_a_gradient_in_x():
  # Raised when the call records its backward (the forward, in eager mode).
  x = torch.ones((3, 32), requires_grad=True)
  w_q = torch.ones((32, 4), dtype=torch.int8)
  with pytest.raises(TypeError, match="dynamic mode"):
    tb.quantized_matmul(x, w_q, w_scale=torch.ones(4)).sum().backward()
  with torch.no_grad():   # no gradient asked for: it runs
    assert tb.quantized_matmul(x, w_q, w_scale=torch.ones(4)).shape == (3, 4)


def test_quantized_dense_gradients_match_float64(rng):
  m, k, n, r = 6, 32, 10, 3
  x = torch.tensor(rng.standard_normal((m, k)), dtype=torch.float32,
                   requires_grad=True)
  w_q, w_scale = tb.quantize(
      torch.tensor(rng.standard_normal((k, n)), dtype=torch.float32),
      torch.float8_e4m3fn, axis=0)
  w_scale = w_scale.reshape(-1)
  bias = torch.tensor(rng.standard_normal(n), dtype=torch.float32,
                      requires_grad=True)
  a = torch.tensor(rng.standard_normal((k, r)), dtype=torch.float32,
                   requires_grad=True)
  b = torch.tensor(rng.standard_normal((r, n)), dtype=torch.float32,
                   requires_grad=True)
  cot = torch.tensor(rng.standard_normal((m, n)), dtype=torch.float32)
  out = tb.quantized_dense(x, w_q, w_scale, bias, lora=(a, b),
                           lora_scale=0.5)
  grads = torch.autograd.grad(out, (x, bias, a, b), cot)
  w64 = torch.from_numpy(_np(w_q).astype(np.float64)) * w_scale.double()
  leaves = [t.detach().double().requires_grad_() for t in (x, bias, a, b)]
  x64, bias64, a64, b64 = leaves
  want_out = x64 @ w64 + bias64 + 0.5 * (x64 @ a64) @ b64
  want = torch.autograd.grad(want_out, leaves, cot.double())
  torch.testing.assert_close(out.double(), want_out.detach(), rtol=1e-4,
                             atol=1e-4)
  for g, w in zip(grads, want):
    torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-4)
  assert w_q.grad is None


def _decode64(q, k, v, lengths, sinks, sm_scale):
  """[B, H, T, Dv] float64 decode attention (GQA, sinks, v's head_dim Dv),
  differentiable."""
  b_n, h_n, t_n, d = q.shape
  group = h_n // k.shape[1]
  k = k.repeat_interleave(group, 1)
  v = v.repeat_interleave(group, 1)
  logits = torch.einsum("bhtd,bhsd->bhts", q, k) * sm_scale
  pos = torch.arange(k.shape[2])
  query_pos = lengths.view(-1, 1, 1, 1) - t_n + torch.arange(t_n).view(
      1, 1, -1, 1)
  logits = logits.masked_fill(pos.view(1, 1, 1, -1) > query_pos,
                              -math.inf)
  sink = sinks.view(1, -1, 1, 1).expand(b_n, h_n, t_n, 1)
  weights = torch.softmax(torch.cat([logits, sink], -1), -1)[..., :-1]
  return weights @ v


@pytest.mark.parametrize("queries,dv", [(1, 16), (3, 40)])  # 40: MLA
def test_decode_attention_and_its_gradients_match_float64(rng, queries, dv):
  b, h, hkv, d, s = 3, 4, 2, 16, 37
  q = torch.tensor(rng.standard_normal((b, h, queries, d)),
                   dtype=torch.float32, requires_grad=True)
  k, v = (torch.tensor(rng.standard_normal((b, hkv, s, dim)),
                       dtype=torch.float32) for dim in (d, dv))
  sinks = torch.tensor(rng.standard_normal(h), dtype=torch.float32,
                       requires_grad=True)
  lengths = torch.tensor([queries, 20, s], dtype=torch.int64)
  out = tb.decode_attention(q, k, v, lengths, sinks=sinks)
  assert out.shape == (b, h, queries, dv)
  cot = torch.tensor(rng.standard_normal(out.shape), dtype=torch.float32)
  dq, dsinks = torch.autograd.grad(out, (q, sinks), cot)
  leaves = [t.detach().double().requires_grad_() for t in (q, sinks)]
  want = _decode64(leaves[0], k.double(), v.double(), lengths, leaves[1],
                   d ** -0.5)
  want_dq, want_dsinks = torch.autograd.grad(want, leaves, cot.double())
  torch.testing.assert_close(out.double(), want.detach(), rtol=2e-5,
                             atol=2e-5)
  torch.testing.assert_close(dq.double(), want_dq, rtol=1e-4, atol=1e-4)
  torch.testing.assert_close(dsinks.double(), want_dsinks, rtol=1e-4,
                             atol=1e-4)


@pytest.mark.parametrize("dtype", list(FORMATS))
def test_decode_attention_8bit_paged_cache_matches_oracle(rng, dtype):
  b, h, hkv, d, page, pages = 2, 4, 2, 16, 8, 3
  q = torch.tensor(rng.standard_normal((b, h, 1, d)), dtype=torch.float32)
  pool = 7
  k, v = (torch.tensor(rng.standard_normal((pool, hkv, page, d)),
                       dtype=torch.float32) for _ in range(2))
  k_q, k_scale = tb.quantize(k, dtype, axis=None)
  v_q, v_scale = tb.quantize(v, dtype, axis=None)
  k_scale = k_scale.reshape(1).expand(hkv).contiguous()
  v_scale = v_scale.reshape(1).expand(hkv).contiguous()
  table = torch.tensor(rng.permutation(pool)[:b * pages].reshape(b, pages),
                       dtype=torch.int32)
  lengths = torch.tensor([5, 24], dtype=torch.int32)
  out = tb.decode_attention(q, k_q, v_q, lengths, page_table=table,
                            k_scale=k_scale, v_scale=v_scale)
  want = decode_oracle.decode_attention(
      q.numpy(), _np(k_q), _np(v_q), lengths.numpy(),
      page_table=table.numpy(), k_scale=k_scale.numpy(),
      v_scale=v_scale.numpy())
  np.testing.assert_allclose(out.numpy(), want, rtol=2e-5, atol=2e-5)


def test_bad_inputs_name_the_argument():
  x = torch.randn(4, 8)
  with pytest.raises(TypeError, match="dtype must be one of.*int4"):
    tb.quantize(x, torch.int16)
  with pytest.raises(TypeError, match="w must be one of"):
    tb.quantized_matmul(x, torch.zeros(8, 3, dtype=torch.int32),
                        weight_only=True)
  q = torch.randn(1, 2, 1, 8)
  with pytest.raises(TypeError, match="k_cache and v_cache must share"):
    tb.decode_attention(q, torch.zeros(1, 2, 4, 8, dtype=torch.int8),
                        torch.zeros(1, 2, 4, 8), torch.tensor([4]))
  with pytest.raises(TypeError, match="lora must be"):
    tb.quantized_dense(x, torch.zeros(8, 3, dtype=torch.int8),
                       torch.ones(3), lora=torch.ones(8, 2))


def test_quantized_linear_trains_only_its_adapter_and_bias(rng):
  linear = torch.nn.Linear(32, 12)
  layer = tb.QuantizedLinear.from_linear(linear, torch.float8_e4m3fn,
                                         group_size=8, lora_rank=4)
  assert {n for n, _ in layer.named_parameters()} == {"bias", "lora_a",
                                                      "lora_b"}
  x = torch.tensor(rng.standard_normal((3, 5, 32)), dtype=torch.float32)
  out = layer(x)  # lora_b starts at zero: the quantized layer alone
  w = torch.from_numpy(quant_oracle.dequantized_weight(
      _np(layer.w_q).T, _np(layer.w_scale).T, None, 8, "float32"))
  want = x.double() @ w + linear.bias.detach().double()
  torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)
  out.sum().backward()
  assert layer.lora_b.grad is not None and layer.bias.grad is not None
  assert layer.lora_b.grad.abs().sum() > 0
