"""torch_bridge.ragged_paged_attention and custom_kernel.ragged_paged_attention.

Oracles: the float64 per-sequence loop ``tests/oracles/ragged.py`` (mixed
query lengths including 0, shuffled page tables, GQA, sliding window, soft
cap, sinks, 8-bit caches, padding tokens past the last sequence), and
torch_xla 2.9's own ``custom_kernel.ragged_paged_attention`` with
``use_kernel=False`` (its torch implementation). Its Pallas kernel cannot be
run here: under Pallas' generic interpreter (jax 0.7.1) its DMA while-loop
has no discharge rule (NotImplementedError), and the TPU-semantics
interpreter fails on its reshaped refs (``RefReshaper``), so the
``txla_interpret`` route used for flash_attention and gmm does not apply.
"""
from __future__ import annotations

import inspect

import numpy as np
import pytest

pytest.importorskip("torch_xla")
pytestmark = pytest.mark.torch

import torch  # noqa: E402

import torch_bridge as tb  # noqa: E402
from tests.oracles import ragged as oracle  # noqa: E402
from torch_bridge import custom_kernel  # noqa: E402

# float32: softmax-weighted sums of O(1) values, errors ~1e-6 seen; bfloat16
# inputs and output: a few bfloat16 ulps (2^-8) of O(1) values.
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def _case(rng, q_lens, *, heads=4, kv_heads=2, head_dim=8, page_size=4,
          pages_per_seq=3, extra_tokens=0, num_seqs=None,
          dtype=torch.float32, kv_dtype=None):
  """Inputs for sequences with ``q_lens`` new tokens each (kv lengths at
  least that, up to the page table's reach ``pages_per_seq * page_size``,
  which must hold the longest query), pages in random order,
  ``extra_tokens`` padding rows at the end of q."""
  s = len(q_lens)
  cap = pages_per_seq * page_size
  kv_lens = [int(rng.integers(max(n, 1), cap + 1)) for n in q_lens]
  num_pages = s * pages_per_seq + 1
  tokens = sum(q_lens) + extra_tokens
  q = torch.from_numpy(rng.standard_normal((tokens, heads, head_dim))).to(
      dtype)
  kv = rng.standard_normal((num_pages, page_size, 2 * kv_heads, head_dim))
  if kv_dtype == torch.int8:
    kv_pages = torch.from_numpy(np.round(kv * 40).clip(-127, 127)).to(
        torch.int8)
  else:
    kv_pages = torch.from_numpy(kv).to(kv_dtype or dtype)
  page_indices = torch.from_numpy(
      rng.permutation(num_pages)[:s * pages_per_seq].reshape(
          s, pages_per_seq).astype(np.int32))
  cu = torch.from_numpy(np.concatenate([[0], np.cumsum(q_lens)]).astype(
      np.int32))
  return (q, kv_pages, torch.tensor(kv_lens, dtype=torch.int32),
          page_indices, cu,
          torch.tensor([s if num_seqs is None else num_seqs],
                       dtype=torch.int32))


def _oracle(args, sinks=None, **kw):
  return oracle.ragged_paged_attention(
      *[a.float().numpy() if a.is_floating_point() else a.numpy()
        for a in args], sinks=None if sinks is None else sinks.numpy(), **kw)


def _close(out, want, dtype=torch.float32):
  np.testing.assert_allclose(out.float().numpy(), want, atol=TOL[dtype],
                             rtol=TOL[dtype])


# Decode (1), prefill (6), empty (0), chunked prefill (3).
MIXED = [1, 6, 0, 3]


@pytest.mark.parametrize("sliding_window, soft_cap", [
    (5, 2.0), pytest.param(None, None, marks=pytest.mark.slow),
    pytest.param(5, None, marks=pytest.mark.slow),
    pytest.param(None, 2.0, marks=pytest.mark.slow)])
def test_matches_float64_oracle(rng, sliding_window, soft_cap):
  args = _case(rng, MIXED, extra_tokens=2)
  kw = dict(sm_scale=0.4, sliding_window=sliding_window, soft_cap=soft_cap)
  out = tb.ragged_paged_attention(*args, **kw)
  assert out.shape == args[0].shape and out.dtype == torch.float32
  _close(out, _oracle(args, **kw))
  assert not out[-2:].any()   # padding tokens past the last sequence


def test_kernel_interpreted_matches_oracle(rng):
  """The Pallas kernel (interpreted), GQA 4:1, sinks, num_seqs below S."""
  args = _case(rng, MIXED, heads=8, kv_heads=2, num_seqs=3, page_size=8,
               pages_per_seq=2)
  sinks = torch.from_numpy(rng.standard_normal(8).astype(np.float32))
  out = tb.ragged_paged_attention(*args, sm_scale=0.3, sinks=sinks,
                                  sliding_window=6, backend="interpret",
                                  num_queries_per_block=4,
                                  num_kv_pages_per_block=1)
  _close(out, _oracle(args, sinks, sm_scale=0.3, sliding_window=6))
  assert not out[sum(MIXED[:3]):].any()   # the 4th sequence is ignored


def test_int64_metadata_and_int8_cache(rng):
  args = _case(rng, [2, 1, 4], kv_dtype=torch.int8)
  args64 = args[:2] + tuple(a.long() for a in args[2:])
  out = tb.ragged_paged_attention(*args64, k_scale=0.02, v_scale=0.03)
  _close(out, _oracle(args, k_scale=0.02, v_scale=0.03))


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8])
def test_mla_matches_float64_oracle(rng, kv_dtype):
  """MLA's latent pool [P, page_size, D] (D 80, latent 64), int64
  metadata, a window; the int8 pool with scales."""
  args = _case(rng, MIXED, heads=3, kv_heads=1, head_dim=80, extra_tokens=1,
               kv_dtype=kv_dtype)
  pool = args[1][:, :, 0]   # one row of the pair per token
  args = (args[0], pool) + args[2:]
  kw = dict(latent_dim=64, sm_scale=0.1, sliding_window=5)
  if kv_dtype == torch.int8:
    kw.update(k_scale=0.02, v_scale=0.03)
  out = tb.mla_ragged_paged_attention(
      args[0], pool, *(a.long() for a in args[2:]), **kw)
  assert out.shape == (args[0].shape[0], 3, 64)
  want = oracle.mla_ragged_paged_attention(
      *[a.float().numpy() if a.is_floating_point() else a.numpy()
        for a in args], **kw)
  _close(out, want)
  assert not out[-1:].any()


@pytest.mark.slow
def test_xla_tensors(rng, xla_device):
  args = _case(rng, MIXED)
  out = tb.ragged_paged_attention(*[a.to(xla_device) for a in args],
                                  soft_cap=3.0)
  assert out.device.type == "xla"
  _close(out.cpu(), _oracle(args, soft_cap=3.0))


def test_no_gradient(rng):
  """Forward only: q gets no gradient (None), sinks neither."""
  args = _case(rng, MIXED, extra_tokens=2)
  q = args[0].requires_grad_()
  out = tb.ragged_paged_attention(q, *args[1:], sm_scale=0.4,
                                  sliding_window=5, soft_cap=2.0)
  assert torch.autograd.grad(out.sum(), q, allow_unused=True) == (None,)


@pytest.mark.parametrize("change, match", [
    (dict(q=torch.zeros(3, 4)), "q must have 3 dimensions"),
    (dict(kv_pages=torch.zeros(2, 4, 3, 8)), "kv_pages must be"),
    (dict(kv_lens=torch.zeros(2, 2, dtype=torch.int32)), "kv_lens"),
    (dict(kv_lens=torch.zeros(3, dtype=torch.int32)), r"kv_lens must be \[S\]"),
    (dict(page_indices=torch.zeros(2, 3)), "page_indices"),
    (dict(cu_q_lens=torch.zeros(2, dtype=torch.int32)),
     r"cu_q_lens must be \[S \+ 1\]"),
    (dict(num_seqs=torch.tensor([1, 2], dtype=torch.int32)),
     r"num_seqs must be \[1\]"),
    (dict(q=torch.zeros(3, 3, 8)), "multiple of the kv heads"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(soft_cap=-1.0), "soft_cap"),
    (dict(k_scale=torch.tensor(1.0)), "k_scale must be a Python float"),
    (dict(sinks=torch.zeros(3)), "sinks"),
])
def test_bad_arguments_name_the_argument(change, match):
  args = dict(q=torch.zeros(3, 4, 8), kv_pages=torch.zeros(5, 4, 4, 8),
              kv_lens=torch.tensor([2, 3], dtype=torch.int32),
              page_indices=torch.zeros(2, 2, dtype=torch.int32),
              cu_q_lens=torch.tensor([0, 1, 3], dtype=torch.int32),
              num_seqs=torch.tensor([2], dtype=torch.int32))
  args.update(change)
  with pytest.raises((ValueError, TypeError), match=match):
    tb.ragged_paged_attention(**args)


# ------------------------------------------------- torch_xla's drop-in --

def test_signature_matches_torch_xla():
  from torch_xla.experimental import custom_kernel as ck
  theirs = inspect.signature(ck.ragged_paged_attention).parameters
  ours = inspect.signature(custom_kernel.ragged_paged_attention).parameters
  assert list(ours) == list(theirs)
  for arg in theirs:
    assert ours[arg].kind == theirs[arg].kind, arg
    assert ours[arg].default == theirs[arg].default, arg


def _theirs(args, **kw):
  """torch_xla's result (its torch implementation: ``use_kernel=False``),
  padded with zero rows to q's length as ours is."""
  from torch_xla.experimental import custom_kernel as ck
  out = ck.ragged_paged_attention(*args, use_kernel=False, **kw)
  pad = torch.zeros(args[0].shape[0] - out.shape[0], *out.shape[1:],
                    dtype=out.dtype)
  return torch.cat([out, pad])


@pytest.mark.parametrize("kw", [
    dict(sliding_window=4, soft_cap=2.5),
    pytest.param(dict(sm_scale=0.35), marks=pytest.mark.slow)])
def test_drop_in_matches_torch_xla(rng, xla_device, kw):
  # torch_xla's masking fills every masked logit, so a query row must see a
  # key (always true for causal rows); it returns only the sequences' rows.
  args = _case(rng, [1, 5, 0, 2], heads=6, kv_heads=2, extra_tokens=3)
  ours = custom_kernel.ragged_paged_attention(
      *[a.to(xla_device) for a in args], **kw)
  theirs = _theirs(args, **kw)
  assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
  np.testing.assert_allclose(ours.cpu().numpy(), theirs.numpy(),
                             atol=TOL[torch.float32], rtol=TOL[torch.float32])
  _close(ours.cpu(), _oracle(args, **kw))


def test_drop_in_use_kernel_false_and_bad_use_kernel(rng):
  args = _case(rng, [3, 1])
  out = custom_kernel.ragged_paged_attention(*args, use_kernel=False,
                                             vmem_limit_bytes=1 << 20)
  _close(out, _oracle(args))
  with pytest.raises(TypeError, match="use_kernel must be a bool"):
    custom_kernel.ragged_paged_attention(*args, use_kernel="yes")


# ----------------------------------------------------------------- slow --

@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("backend", ["reference", "interpret"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sweep_matches_float64_oracle(seed, backend, dtype):
  rng = np.random.default_rng(seed)
  q_lens = [int(n) for n in rng.integers(0, 7, size=int(rng.integers(1, 6)))]
  kv_heads, page_size = int(rng.choice([1, 2])), int(rng.choice([4, 8]))
  # Enough pages for the longest query (its keys include its tokens).
  pages_per_seq = max(int(rng.integers(1, 4)), -(-max(q_lens) // page_size))
  args = _case(rng, q_lens, heads=kv_heads * int(rng.choice([1, 3])),
               kv_heads=kv_heads, head_dim=int(rng.choice([8, 128])),
               page_size=page_size, pages_per_seq=pages_per_seq,
               extra_tokens=int(rng.integers(0, 3)), dtype=dtype)
  kw = dict(sm_scale=float(rng.uniform(0.1, 1.0)),
            sliding_window=[None, 3][seed % 2],
            soft_cap=[None, 4.0][seed // 2 % 2])
  out = tb.ragged_paged_attention(*args, backend=backend, **kw)
  _close(out, _oracle(args, **kw), dtype)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_drop_in_matches_torch_xla_sweep(seed, xla_device):
  rng = np.random.default_rng(seed)
  q_lens = [int(n) for n in rng.integers(0, 6, size=int(rng.integers(1, 5)))]
  args = _case(rng, q_lens, heads=4, kv_heads=int(rng.choice([1, 2, 4])),
               page_size=int(rng.choice([2, 4])), pages_per_seq=3,
               extra_tokens=1)
  kw = dict(sm_scale=0.5, sliding_window=[None, 2][seed % 2],
            soft_cap=[None, 3.0][seed // 2 % 2])
  ours = custom_kernel.ragged_paged_attention(
      *[a.to(xla_device) for a in args], **kw)
  np.testing.assert_allclose(ours.cpu().numpy(), _theirs(args, **kw).numpy(),
                             atol=TOL[torch.float32], rtol=TOL[torch.float32])
