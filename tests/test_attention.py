"""Flash attention: Mosaic TPU kernels in interpret mode vs a float64 NumPy model.

Tolerances (max abs error against float64, inputs ~N(0, 1)):
  float32 inputs: out/lse 2e-5, gradients 1e-4 (scaled by the gradient's max).
  bfloat16 inputs: out 2e-2, lse 2e-2, gradients 5e-2 relative to their max
  (the kernels feed bf16 probabilities to the MXU, as every flash kernel does).
Most cases use Pallas' generic interpreter (fast); a few run the
TPU-semantics interpreter (``backend="interpret"``) that simulates VMEM and DMA.
"""
from __future__ import annotations

import functools
import math

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given

import pallas_kernels
from pallas_kernels import force_interpret
from pallas_kernels.attention import BlockSizes, block_sizes, mosaic_tpu
from pallas_kernels.attention import reference as attn_reference

F32_TOL = 2e-5
F32_GRAD_TOL = 1e-4
BF16_TOL = 2e-2
BF16_GRAD_TOL = 5e-2
SMALL_BLOCKS = (128, 128)


# ------------------------------------------------------ float64 NumPy model --

def _np_mask(b, lq, lk, causal, window, q_seg, kv_seg):
  left, right = attn_reference.normalize_window(window, causal)
  rows = np.arange(lq)[:, None] + (lk - lq)
  cols = np.arange(lk)[None, :]
  mask = np.ones((lq, lk), bool)
  if right is not None:
    mask &= cols <= rows + right
  if left is not None:
    mask &= cols >= rows - left
  mask = np.broadcast_to(mask, (b, lq, lk)).copy()
  if q_seg is not None:
    mask &= np.asarray(q_seg)[:, :, None] == np.asarray(kv_seg)[:, None, :]
  return mask[:, None]                                   # [B, 1, Lq, Lk]


def np_attention(q, k, v, *, causal=False, sm_scale=None, segment_ids=None,
                 sliding_window=None, logit_soft_cap=None, bias=None,
                 d_out=None, d_lse=None):
  """float64 (out, lse) and, with d_out, (dq, dk, dv, dbias)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, h, lq, d = q.shape
  hk, lk = k.shape[1], k.shape[2]
  g = h // hk
  kr, vr = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
  scale = 1 / math.sqrt(d) if sm_scale is None else sm_scale
  t = np.einsum("bhqd,bhkd->bhqk", q, kr) * scale
  s = logit_soft_cap * np.tanh(t / logit_soft_cap) if logit_soft_cap else t
  if bias is not None:
    s = s + np.asarray(bias, np.float64)
  q_seg, kv_seg = segment_ids if segment_ids is not None else (None, None)
  mask = np.broadcast_to(
      _np_mask(b, lq, lk, causal, sliding_window, q_seg, kv_seg), s.shape)
  mask = mask & ~(s == -np.inf)        # -inf bias entries count as masked
  m = np.max(np.where(mask, s, -np.inf), axis=-1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0)
  e = np.where(mask, np.exp(np.where(mask, s, 0) - m), 0)
  l = e.sum(-1, keepdims=True)
  p = e / np.where(l != 0, l, 1)
  out = np.einsum("bhqk,bhkd->bhqd", p, vr)
  lse = np.where(l[..., 0] != 0, m[..., 0] + np.log(np.where(l > 0, l, 1))[..., 0],
                 -np.inf)
  if d_out is None:
    return out, lse
  do = np.asarray(d_out, np.float64)
  dp = np.einsum("bhqd,bhkd->bhqk", do, vr)
  di = np.sum(do * out, -1, keepdims=True)
  if d_lse is not None:
    di = di - np.asarray(d_lse, np.float64)[..., None]
  ds = p * (dp - di)
  dbias = None
  if bias is not None:
    dbias = ds.sum(axis=tuple(a for a in (0, 1) if np.shape(bias)[a] == 1),
                   keepdims=True)
  if logit_soft_cap:
    ds = ds * (1 - np.tanh(t / logit_soft_cap) ** 2)
  dq = np.einsum("bhqk,bhkd->bhqd", ds, kr) * scale
  dk = np.einsum("bhqk,bhqd->bhkd", ds, q).reshape(b, hk, g, lk, d).sum(2) * scale
  dv = np.einsum("bhqk,bhqd->bhkd", p, do).reshape(b, hk, g, lk, d).sum(2)
  return out, lse, (dq, dk, dv, dbias)


# ----------------------------------------------------------------- helpers --

def _inputs(rng, b, h, hk, lq, lk, d, dtype=jnp.float32):
  q = rng.standard_normal((b, h, lq, d))
  k = rng.standard_normal((b, hk, lk, d))
  v = rng.standard_normal((b, hk, lk, d))
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def _segments(rng, b, lq, lk, n=3):
  # Sorted ids, like packed sequences, plus a few random ones.
  qs = np.sort(rng.integers(0, n, (b, lq)), axis=1)
  ks = np.sort(rng.integers(0, n, (b, lk)), axis=1)
  return jnp.asarray(qs, jnp.int32), jnp.asarray(ks, jnp.int32)


def _assert_close(actual, expected, tol, what=""):
  actual = np.asarray(actual, np.float64)
  expected = np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
  same_inf = np.isinf(expected)
  np.testing.assert_array_equal(np.isinf(actual), same_inf, err_msg=what)
  np.testing.assert_array_equal(actual[same_inf], expected[same_inf],
                                err_msg=what)
  with np.errstate(invalid="ignore"):
    err = np.max(np.abs(np.where(same_inf, 0, actual - expected)), initial=0)
  assert err <= tol, f"{what}: max abs error {err} > {tol}"


def _assert_grad_close(actual, expected, tol, what=""):
  scale = max(1.0, float(np.max(np.abs(expected), initial=0)))
  _assert_close(actual, expected, tol * scale, what)


def _run(q, k, v, flavour="generic", **kw):
  with force_interpret(flavour):
    return pallas_kernels.flash_attention(q, k, v, return_lse=True, **kw)


def _grads(q, k, v, bias, d_out, flavour="generic", d_lse=None, **kw):
  def loss(q, k, v, bias):
    out, lse = pallas_kernels.flash_attention(q, k, v, bias=bias,
                                              return_lse=True, **kw)
    total = jnp.sum(out.astype(jnp.float32) * d_out)
    if d_lse is not None:
      total += jnp.sum(jnp.where(jnp.isinf(lse), 0.0, lse) * d_lse)
    return total
  argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)
  with force_interpret(flavour):
    grads = jax.jit(jax.grad(loss, argnums=argnums))(q, k, v, bias)
  return tuple(grads) + ((None,) if bias is None else ())


def _check_forward(q, k, v, tol=F32_TOL, flavour="generic", **kw):
  out, lse = _run(q, k, v, flavour=flavour, **kw)
  kw.pop("block_sizes", None)
  ref_out, ref_lse = np_attention(q, k, v, **kw)
  assert out.dtype == q.dtype and out.shape == q.shape
  assert lse.dtype == jnp.float32 and lse.shape == q.shape[:3]
  _assert_close(out, ref_out, tol, "out")
  _assert_close(lse, ref_lse, tol * max(1, np.max(np.abs(
      np.where(np.isinf(ref_lse), 0, ref_lse)), initial=0)), "lse")


def _check_grads(rng, q, k, v, tol=F32_GRAD_TOL, flavour="generic",
                 with_lse=False, **kw):
  bias = kw.pop("bias", None)
  d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  d_lse = (jnp.asarray(rng.standard_normal(q.shape[:3]), jnp.float32)
           if with_lse else None)
  grads = _grads(q, k, v, bias, d_out, flavour=flavour, d_lse=d_lse, **kw)
  kw.pop("block_sizes", None)
  kw.pop("backend", None)
  *_, ref = np_attention(q, k, v, bias=bias, d_out=d_out, d_lse=d_lse, **kw)
  for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, ref):
    if r is None:
      assert g is None
      continue
    assert np.all(np.isfinite(np.asarray(g, np.float64))), name
    _assert_grad_close(g, r, tol, name)


# ------------------------------------------------------------ forward tests --

FEATURES = {
    "plain": {},
    "causal": dict(causal=True),
    "window_int": dict(sliding_window=40),
    "window_pair": dict(sliding_window=(70, 5)),
    "window_left_only": dict(sliding_window=(30, None)),
    "causal_window": dict(causal=True, sliding_window=50),
    "soft_cap": dict(logit_soft_cap=2.5),
    "segments": "segments",
    "bias_full": "bias_full",
    "bias_broadcast": "bias_broadcast",
    "bias_batch": "bias_batch",
    "everything": "everything",
}


def _feature_kwargs(name, rng, b, h, lq, lk):
  spec = FEATURES[name]
  if not isinstance(spec, str):
    return dict(spec)
  if spec == "segments":
    return dict(segment_ids=_segments(rng, b, lq, lk))
  bias_shapes = {"bias_full": (b, h), "bias_broadcast": (1, 1),
                 "bias_batch": (b, 1), "everything": (1, h)}
  bias = jnp.asarray(rng.standard_normal(bias_shapes[spec] + (lq, lk)),
                     jnp.float32)
  kw = dict(bias=bias)
  if spec == "everything":
    kw.update(causal=True, sliding_window=(90, 0), logit_soft_cap=3.0,
              segment_ids=_segments(rng, b, lq, lk), sm_scale=0.2)
  return kw


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_each_feature_matches_float64(feature, rng):
  b, h, hk, lq, lk, d = 2, 4, 2, 200, 270, 40
  q, k, v = _inputs(rng, b, h, hk, lq, lk, d)
  kw = _feature_kwargs(feature, rng, b, h, lq, lk)
  _check_forward(q, k, v, block_sizes=SMALL_BLOCKS, **kw)


@pytest.mark.parametrize("lq,lk,causal", [
    (1, 1, False), (7, 7, True), (1, 129, True), (129, 7, False),
    (129, 7, True), (7, 1000, False), (1000, 129, True)])
def test_odd_lengths(lq, lk, causal, rng):
  q, k, v = _inputs(rng, 1, 2, 1, lq, lk, 24)
  _check_forward(q, k, v, causal=causal, block_sizes=SMALL_BLOCKS)


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2), (8, 1)])
def test_gqa_ratios(heads, kv_heads, rng):
  q, k, v = _inputs(rng, 1, heads, kv_heads, 150, 150, 32)
  _check_forward(q, k, v, causal=True, block_sizes=SMALL_BLOCKS)
  if heads // kv_heads > 1:
    _check_grads(rng, q, k, v, causal=True, block_sizes=SMALL_BLOCKS)


@pytest.mark.parametrize("head_dim", [1, 64, 128, 200])
def test_head_dims(head_dim, rng):
  q, k, v = _inputs(rng, 1, 1, 1, 40, 140, head_dim)
  _check_forward(q, k, v, causal=True)


def test_default_block_sizes_long_sequence(rng):
  q, k, v = _inputs(rng, 1, 1, 1, 1100, 1100, 16)
  _check_forward(q, k, v, causal=True, sliding_window=(600, 0))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_inputs(dtype, rng):
  q, k, v = _inputs(rng, 1, 4, 2, 300, 200, 64, dtype)
  segs = _segments(rng, 1, 300, 200)
  _check_forward(q, k, v, tol=BF16_TOL, causal=True, segment_ids=segs,
                 block_sizes=SMALL_BLOCKS)
  _check_grads(rng, q, k, v, tol=BF16_GRAD_TOL, causal=True, segment_ids=segs,
               block_sizes=SMALL_BLOCKS)


# ------------------------------------------------------- fully masked rows --

def _fully_masked_cases(rng):
  b, lq, lk = 2, 20, 150
  qs = np.zeros((b, lq), np.int32)
  qs[:, 5:9] = 7                                   # id 7 never among keys
  ks = np.zeros((b, lk), np.int32)
  yield "segments", lq, lk, dict(segment_ids=(jnp.asarray(qs), jnp.asarray(ks)))
  # q longer than kv with a causal mask: the first rows see no key at all.
  yield "causal_long_query", 160, 140, dict(causal=True)
  bias = np.zeros((1, 1, lq, lk), np.float32)
  bias[..., 3, :] = -np.inf                        # a row masked by the bias
  yield "bias_minus_inf", lq, lk, dict(bias=jnp.asarray(bias))


@pytest.mark.parametrize("case", ["segments", "causal_long_query",
                                  "bias_minus_inf"])
def test_fully_masked_rows_are_zero_without_nan(case, rng):
  name, lq, lk, kw = next(c for c in _fully_masked_cases(rng) if c[0] == case)
  q, k, v = _inputs(rng, 2, 2, 1, lq, lk, 16)
  out, lse = _run(q, k, v, block_sizes=SMALL_BLOCKS, **kw)
  ref_out, ref_lse = np_attention(q, k, v, **kw)
  empty = np.isneginf(ref_lse)
  assert empty.any(), "the case must contain fully masked rows"
  assert np.all(np.isfinite(np.asarray(out)))
  np.testing.assert_array_equal(np.asarray(out)[empty], 0.0)
  assert np.all(np.isneginf(np.asarray(lse)[empty]))
  _assert_close(out, ref_out, F32_TOL, "out")
  _assert_close(lse, ref_lse, 1e-4, "lse")
  # The float64 model's gradients are exactly zero on the empty rows.
  _check_grads(rng, q, k, v, block_sizes=SMALL_BLOCKS, **kw)


@pytest.mark.parametrize("flavour", ["generic", "tpu"])
def test_blocks_with_disjoint_segments_are_skipped(flavour, rng):
  """A kv block whose ids never meet the query block's is not computed: its
  NaN values would otherwise reach the output through 0 * NaN."""
  q, k, v = _inputs(rng, 1, 1, 1, 100, 256, 16)
  k = k.at[:, :, 128:].set(jnp.nan)
  v = v.at[:, :, 128:].set(jnp.nan)
  q_seg = jnp.zeros((1, 100), jnp.int32)
  kv_seg = jnp.asarray(np.repeat([[0, 1]], 128, axis=1), jnp.int32)
  out, lse = _run(q, k, v, flavour=flavour, segment_ids=(q_seg, kv_seg),
                  block_sizes=SMALL_BLOCKS)
  ref_out, ref_lse = np_attention(q, k[:, :, :128], v[:, :, :128])
  _assert_close(out, ref_out, F32_TOL, "out")
  _assert_close(lse, ref_lse, 1e-4, "lse")


def test_nan_in_one_query_row_stays_in_that_row(rng):
  q, k, v = _inputs(rng, 1, 1, 1, 30, 50, 16)
  q = q.at[0, 0, 4, 0].set(jnp.nan)
  out, _ = _run(q, k, v)
  out = np.asarray(out)
  assert np.all(np.isnan(out[0, 0, 4]))
  keep = np.ones(30, bool)
  keep[4] = False
  ref_out, _ = np_attention(np.asarray(q)[:, :, keep], k, v)
  _assert_close(out[:, :, keep], ref_out, F32_TOL)


def test_empty_sequences():
  q = jnp.ones((1, 2, 0, 8))
  k = v = jnp.ones((1, 1, 5, 8))
  out, lse = pallas_kernels.flash_attention(q, k, v, return_lse=True)
  assert out.shape == (1, 2, 0, 8) and lse.shape == (1, 2, 0)
  q = jnp.ones((1, 2, 3, 8))
  k = v = jnp.ones((1, 1, 0, 8))
  out, lse = pallas_kernels.flash_attention(q, k, v, return_lse=True)
  np.testing.assert_array_equal(out, 0)
  assert np.all(np.isneginf(lse))
  grads = jax.grad(lambda q: pallas_kernels.flash_attention(q, k, v).sum())(q)
  np.testing.assert_array_equal(grads, 0)


# ------------------------------------------------------------- gradients --

@pytest.mark.parametrize("feature", ["bias_full", "causal_window", "soft_cap",
                                     "bias_broadcast", "everything"])
def test_gradients_match_float64(feature, rng):
  b, h, hk, lq, lk, d = 1, 4, 2, 180, 260, 24
  q, k, v = _inputs(rng, b, h, hk, lq, lk, d)
  kw = _feature_kwargs(feature, rng, b, h, lq, lk)
  _check_grads(rng, q, k, v, block_sizes=SMALL_BLOCKS, **kw)


@pytest.mark.slow
def test_gradients_long_odd_length_everything(rng):
  b, h, hk, lq, lk, d = 1, 4, 2, 1000, 1000, 40
  q, k, v = _inputs(rng, b, h, hk, lq, lk, d)
  kw = _feature_kwargs("everything", rng, b, h, lq, lk)
  _check_forward(q, k, v, **dict(kw))
  _check_grads(rng, q, k, v, **kw)


def test_gradient_through_lse(rng):
  q, k, v = _inputs(rng, 1, 2, 1, 140, 140, 16)
  _check_grads(rng, q, k, v, with_lse=True, causal=True,
               block_sizes=SMALL_BLOCKS)


def test_separate_backward_block_sizes(rng):
  q, k, v = _inputs(rng, 1, 2, 2, 300, 300, 16)
  blocks = BlockSizes(block_q=256, block_kv=128, block_q_bwd=128,
                      block_kv_bwd=256)
  _check_forward(q, k, v, causal=True, block_sizes=blocks)
  _check_grads(rng, q, k, v, causal=True, block_sizes=blocks)


# ------------------------------------------- TPU-semantics interpreter --

def test_tpu_interpreter_forward_and_backward(rng):
  """The same kernels under the interpreter that simulates VMEM and DMAs."""
  b, h, hk, lq, lk, d = 1, 2, 1, 130, 250, 32
  q, k, v = _inputs(rng, b, h, hk, lq, lk, d)
  kw = dict(causal=True, sliding_window=(100, 0),
            segment_ids=_segments(rng, b, lq, lk, n=2),
            bias=jnp.asarray(rng.standard_normal((1, h, lq, lk)), jnp.float32),
            block_sizes=SMALL_BLOCKS)
  _check_forward(q, k, v, flavour="tpu", **dict(kw))
  _check_grads(rng, q, k, v, flavour="tpu", **dict(kw))


def test_no_data_races_in_tpu_interpreter(rng):
  from pallas_kernels import _compat
  q, k, v = _inputs(rng, 1, 2, 1, 130, 130, 16)
  with force_interpret("races"):
    out = pallas_kernels.flash_attention(q, k, v, causal=True,
                                         block_sizes=SMALL_BLOCKS)
    grads = jax.grad(lambda q, k, v: pallas_kernels.flash_attention(
        q, k, v, causal=True, block_sizes=SMALL_BLOCKS).sum(),
                     argnums=(0, 1, 2))(q, k, v)
  jax.block_until_ready((out, grads))
  assert not _compat.races_found()
  ref, _ = np_attention(q, k, v, causal=True)
  _assert_close(out, ref, F32_TOL)


def test_explicit_interpret_backend(rng):
  q, k, v = _inputs(rng, 1, 2, 2, 7, 129, 8)
  out = pallas_kernels.flash_attention(q, k, v, causal=True,
                                       backend="interpret")
  ref, _ = np_attention(q, k, v, causal=True)
  _assert_close(out, ref, F32_TOL)


# --------------------------------------------------------------- hypothesis --

@st.composite
def _problems(draw):
  hk = draw(st.sampled_from([1, 2]))
  return dict(
      b=draw(st.integers(1, 2)), hk=hk, h=hk * draw(st.sampled_from([1, 2, 4])),
      lq=draw(st.integers(1, 260)), lk=draw(st.integers(1, 260)),
      d=draw(st.sampled_from([1, 8, 33, 64])),
      causal=draw(st.booleans()),
      window=draw(st.one_of(st.none(), st.integers(0, 200),
                            st.tuples(st.one_of(st.none(), st.integers(0, 200)),
                                      st.one_of(st.none(),
                                                st.integers(0, 200))))),
      segments=draw(st.booleans()),
      cap=draw(st.sampled_from([None, 1.5])),
      blocks=draw(st.sampled_from([(128, 128), (256, 128), (128, 256)])),
      seed=draw(st.integers(0, 2**31 - 1)))


def _problem_inputs(p):
  """(rng, q, k, v, flash_attention kwargs) for a drawn problem."""
  rng = np.random.default_rng(p["seed"])
  q, k, v = _inputs(rng, p["b"], p["h"], p["hk"], p["lq"], p["lk"], p["d"])
  kw = dict(causal=p["causal"], sliding_window=p["window"],
            logit_soft_cap=p["cap"], block_sizes=p["blocks"])
  if p["segments"]:
    kw["segment_ids"] = _segments(rng, p["b"], p["lq"], p["lk"], n=2)
  return rng, q, k, v, kw


@given(_problems())
def test_property_random_shapes_and_masks(problem):
  _, q, k, v, kw = _problem_inputs(problem)
  _check_forward(q, k, v, **kw)


@pytest.mark.slow
@given(_problems())
def test_property_gradients(problem):
  rng, q, k, v, kw = _problem_inputs(problem)
  _check_grads(rng, q, k, v, **kw)


@given(lq=st.integers(1, 2000), lk=st.integers(1, 2000),
       bq=st.sampled_from([128, 256, 512]), bk=st.sampled_from([128, 256, 512]),
       causal=st.booleans(),
       left=st.one_of(st.none(), st.integers(0, 2500)),
       right=st.one_of(st.none(), st.integers(0, 2500)))
def test_block_skipping_is_conservative_and_tight(lq, lk, bq, bk, causal, left,
                                                  right):
  """Skipped blocks hold no allowed entry, visited ones at least one, and
  blocks run without the element mask are fully allowed."""
  if causal:
    right = 0 if right is None else min(right, 0)
  geom = mosaic_tpu._Geometry(q_len=lq, kv_len=lk, block_q=bq, block_kv=bk,
                              left=left, right=right, has_segments=False)
  mask = _np_mask(1, lq, lk, False, (left, right), None, None)[0, 0]
  padded = np.zeros((geom.q_pad, geom.kv_pad), bool)
  padded[:lq, :lk] = mask
  blocks = padded.reshape(geom.num_q, bq, geom.num_kv, bk).transpose(0, 2, 1, 3)
  any_allowed = blocks.any(axis=(2, 3))
  real_rows = (np.arange(geom.q_pad) < lq).reshape(geom.num_q, 1, bq, 1)
  full = (blocks | ~real_rows).all(axis=(2, 3))
  qi, kj = np.arange(geom.num_q), np.arange(geom.num_kv)
  lo, hi = (np.broadcast_to(x, qi.shape) for x in geom.kv_range(jnp.asarray(qi)))
  visited = (kj[None, :] >= lo[:, None]) & (kj[None, :] <= hi[:, None])
  np.testing.assert_array_equal(visited, any_allowed)
  lo, hi = (np.broadcast_to(x, kj.shape) for x in geom.q_range(jnp.asarray(kj)))
  visited = (qi[:, None] >= lo[None, :]) & (qi[:, None] <= hi[None, :])
  np.testing.assert_array_equal(visited, any_allowed)
  unmasked = ~np.broadcast_to(np.asarray(geom.needs_mask(
      jnp.asarray(qi)[:, None], jnp.asarray(kj)[None, :])), full.shape)
  assert not np.any(unmasked & ~full)


# ------------------------------------------------- transforms and sharding --

def test_jit_and_default_backend_on_cpu(rng):
  q, k, v = _inputs(rng, 1, 2, 2, 100, 100, 16)
  fn = jax.jit(functools.partial(pallas_kernels.flash_attention, causal=True))
  ref, _ = np_attention(q, k, v, causal=True)
  _assert_close(fn(q, k, v), ref, F32_TOL)
  ref_fn = pallas_kernels.reference.flash_attention
  _assert_close(ref_fn(q, k, v, causal=True), ref, F32_TOL)


def test_vmap_over_an_extra_axis(rng):
  q, k, v = _inputs(rng, 3, 2, 1, 50, 60, 8)
  qs = q[:, None]
  fn = jax.vmap(lambda q, k, v: pallas_kernels.flash_attention(
      q, k, v, causal=True), in_axes=(0, 0, 0))
  with force_interpret("generic"):
    out = jax.jit(fn)(qs, k[:, None], v[:, None])[:, 0]
    grads = jax.jit(jax.grad(
        lambda q: fn(q, k[:, None], v[:, None]).sum()))(qs)
  ref, _, (dq, *_ignored) = np_attention(q, k, v, causal=True,
                                         d_out=np.ones(q.shape))
  _assert_close(out, ref, F32_TOL)
  _assert_grad_close(grads[:, 0], dq, F32_GRAD_TOL)


def test_shard_helper_on_cpu_mesh(rng):
  from jax.sharding import Mesh
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
  q, k, v = _inputs(rng, 2, 4, 2, 40, 60, 16)
  segs = _segments(rng, 2, 40, 60)
  bias = jnp.asarray(rng.standard_normal((1, 4, 40, 60)), jnp.float32)
  def loss(q):
    out, lse = pallas_kernels.shard_flash_attention(
        mesh, q, k, v, causal=True, segment_ids=segs, bias=bias,
        return_lse=True)
    return jnp.sum(out), (out, lse)
  with force_interpret("generic"):
    grads, (out, lse) = jax.jit(jax.grad(loss, has_aux=True))(q)
  ref, ref_lse, (dq, *_ignored) = np_attention(
      q, k, v, causal=True, segment_ids=segs, bias=bias,
      d_out=np.ones(q.shape))
  _assert_close(out, ref, F32_TOL)
  _assert_close(lse, ref_lse, 1e-4)
  _assert_grad_close(grads, dq, F32_GRAD_TOL)


def test_shard_helper_rejects_indivisible_heads():
  from jax.sharding import Mesh
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
  q = jnp.ones((1, 2, 8, 8))
  with pytest.raises(ValueError, match="no axis 'heads'"):
    pallas_kernels.shard_flash_attention(mesh, q, q, q, head_axis="heads")


def test_reference_backend_gradients(rng):
  q, k, v = _inputs(rng, 1, 2, 1, 33, 65, 8)
  _check_grads(rng, q, k, v, causal=True, backend="reference")


# ------------------------------------------------------------------ errors --

def _qkv(lq=8, lk=8, h=2, hk=1, d=8, dtype=jnp.float32):
  return (jnp.ones((1, h, lq, d), dtype), jnp.ones((1, hk, lk, d), dtype),
          jnp.ones((1, hk, lk, d), dtype))


@pytest.mark.parametrize("make,kwargs,error,match", [
    (lambda: (jnp.ones((2, 8, 8)),) + _qkv()[1:], {}, ValueError,
     "q must have 4 dimensions"),
    (lambda: _qkv(h=3, hk=2), {}, ValueError, "multiple of kv_heads"),
    (lambda: _qkv()[:2] + (jnp.ones((1, 1, 9, 8)),), {}, ValueError,
     "same shape"),
    (lambda: (jnp.ones((1, 2, 8, 4)),) + _qkv()[1:], {}, ValueError,
     "head_dim"),
    (lambda: (jnp.ones((2, 2, 8, 8)),) + _qkv()[1:], {}, ValueError, "batch"),
    (lambda: _qkv(dtype=jnp.int32), {}, TypeError, "bfloat16, float16"),
    (lambda: (_qkv()[0].astype(jnp.bfloat16),) + _qkv()[1:], {}, TypeError,
     "share a dtype"),
    (_qkv, dict(sliding_window=-1), ValueError, "sliding_window size"),
    (_qkv, dict(sliding_window=(1, 2, 3)), ValueError, "pair"),
    (_qkv, dict(sliding_window=(4, -2)), ValueError, "right must be >= 0"),
    (_qkv, dict(sliding_window=2.5), TypeError, "sliding_window size"),
    (_qkv, dict(logit_soft_cap=0.0), ValueError, "logit_soft_cap"),
    (_qkv, dict(logit_soft_cap=jnp.float32(1.0)), TypeError, "logit_soft_cap"),
    (_qkv, dict(sm_scale=jnp.float32(1.0)), TypeError, "sm_scale"),
    (_qkv, dict(causal="yes"), TypeError, "causal"),
    (_qkv, dict(segment_ids=jnp.zeros((1, 8), jnp.int32)), TypeError,
     "segment_ids"),
    (_qkv, dict(segment_ids=(jnp.zeros((1, 7), jnp.int32),
                             jnp.zeros((1, 8), jnp.int32))), ValueError,
     r"q_segment_ids must have shape \(1, 8\)"),
    (_qkv, dict(segment_ids=(jnp.zeros((1, 8)), jnp.zeros((1, 8)))),
     TypeError, "must be integers"),
    (_qkv, dict(bias=jnp.zeros((1, 3, 8, 8))), ValueError, "bias must have"),
    (_qkv, dict(bias=jnp.zeros((1, 1, 8, 8), jnp.int32)), TypeError, "bias"),
    (_qkv, dict(block_sizes=(100, 128)), ValueError, "multiple of 128"),
    (_qkv, dict(block_sizes={"block_x": 128}), ValueError, "unknown keys"),
    (_qkv, dict(block_sizes="big"), TypeError, "block_sizes"),
    (_qkv, dict(backend="cuda"), ValueError, "backend"),
])
def test_bad_arguments_raise(make, kwargs, error, match):
  with pytest.raises(error, match=match):
    pallas_kernels.flash_attention(*make(), **kwargs)


# ------------------------------------------------------------- block sizes --

def test_cost_model_counts_skipped_blocks():
  full = mosaic_tpu.cost(4, 16, 4096, 4096, 128, 2, block_q=256,
                         block_kv=256)
  causal = mosaic_tpu.cost(4, 16, 4096, 4096, 128, 2, causal=True,
                           block_q=256, block_kv=256)
  assert full["visited_blocks"] == full["total_blocks"] == 256
  assert causal["visited_blocks"] == 16 * 17 // 2
  assert 0.5 < causal["flops"] / full["flops"] < 0.54
  assert full["flops"] == 4 * 4 * 16 * 4096 * 4096 * 128
  window = mosaic_tpu.cost(1, 1, 32768, 32768, 128, 2, causal=True,
                           window_left=1024)
  assert window["visited_blocks"] <= 3 * 64
  # The table's blocks keep every step inside the default scoped VMEM.
  for generation, scoped_mib in (("v5e", 16), ("v6e", 32)):
    blocks = block_sizes.table_block_sizes(generation, 128)
    for bq, bk in ((blocks.block_q, blocks.block_kv),
                   (blocks.block_q_bwd, blocks.block_kv_bwd)):
      assert mosaic_tpu.vmem_bytes(bq, bk, 128, 2) < scoped_mib * 2**20
  backward = mosaic_tpu.cost(4, 16, 4096, 4096, 128, 2, backward=True)
  assert backward["flops"] == 3.5 * mosaic_tpu.cost(
      4, 16, 4096, 4096, 128, 2)["flops"]


def test_block_size_table_and_fitting():
  chosen = block_sizes.choose(4096, 4096, 128, generation="v5e")
  assert (chosen.fwd_q, chosen.fwd_kv) == (512, 512)
  chosen = block_sizes.choose(4096, 4096, 128, generation="v6e")
  assert (chosen.fwd_q, chosen.fwd_kv) == (1024, 512)
  assert (chosen.bwd_q, chosen.bwd_kv) == (512, 1024)
  # Short or awkward lengths shrink the block instead of padding a lot.
  assert block_sizes.fit_block(512, 1) == 128
  assert block_sizes.fit_block(512, 600) == 128
  assert block_sizes.fit_block(512, 1000) == 512
  chosen = block_sizes.choose(4096, 4096, 128, BlockSizes(block_kv=256),
                              generation="v5e")
  assert (chosen.fwd_kv, chosen.bwd_kv) == (256, 256)
  # Another backend's block sizes pass through and leave the table in charge.
  from pallas_kernels.attention import triton as gpu
  gpu_blocks = block_sizes.as_block_sizes(gpu.GpuBlockSizes(block_q=64))
  assert isinstance(gpu_blocks, gpu.GpuBlockSizes)
  assert block_sizes.choose(4096, 4096, 128, gpu_blocks,
                            generation="v5e") == block_sizes.choose(
                                4096, 4096, 128, generation="v5e")
  assert block_sizes.padded_head_dim(64) == 64
  assert block_sizes.padded_head_dim(65) == 128
