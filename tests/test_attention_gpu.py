"""The GPU (Pallas/Triton) flash attention kernels, run by Pallas' interpreter.

Forward and backward are compared with a float64 numpy implementation of the
shared semantics (pallas_kernels/attention/reference.py's docstring). Small
block sizes force several kv/q blocks so the loop bounds, block skipping and
masked/unmasked split are exercised. Tolerances: float32 inputs 2e-5 absolute
on O(1) values (the interpreter does float32 math); bfloat16 inputs 2e-2
relative (the output is rounded to bfloat16).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from pallas_kernels import _compat
from pallas_kernels.attention import triton as gpu

SMALL = gpu.GpuBlockSizes(block_q=16, block_k=16, block_q_dq=16,
                          block_k_dq=32, block_q_dkv=32, block_k_dkv=16)


# ---------------------------------------------------------------------------
# float64 reference


def _mask(lq, lk, q_seg, kv_seg, causal, left, right):
  right = (0 if right is None else min(right, 0)) if causal else right
  i = np.arange(lq)[:, None] + (lk - lq)
  j = np.arange(lk)[None, :]
  ok = np.ones((lq, lk), bool)
  if right is not None:
    ok &= j <= i + right
  if left is not None:
    ok &= j >= i - left
  ok = ok[None, None]
  if q_seg is not None:
    ok = ok & (q_seg[:, None, :, None] == kv_seg[:, None, None, :])
  return ok


def reference(q, k, v, q_seg=None, kv_seg=None, bias=None, d_out=None, *,
              sm_scale, causal=False, left=None, right=None, cap=None,
              d_lse=None):
  """float64 (out, lse) and, given d_out, (dq, dk, dv, dbias)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, h, lq, _ = q.shape
  hkv, lk = k.shape[1], k.shape[2]
  g = h // hkv
  kr, vr = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
  x = np.einsum("bhid,bhjd->bhij", q, kr) * sm_scale
  t = None
  s = x
  if cap is not None:
    t = np.tanh(x / cap)
    s = cap * t
  if bias is not None:
    s = s + np.asarray(bias, np.float64)
  ok = np.broadcast_to(_mask(lq, lk, q_seg, kv_seg, causal, left, right),
                       s.shape)
  s = np.where(ok, s, -np.inf)
  m = s.max(-1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0.0)
  e = np.where(ok, np.exp(s - m), 0.0)
  total = e.sum(-1, keepdims=True)
  p = e / np.where(total > 0, total, 1.0)
  out = np.einsum("bhij,bhjd->bhid", p, vr)
  lse = np.where(total[..., 0] > 0,
                 m[..., 0] + np.log(np.where(total > 0, total, 1.0))[..., 0],
                 -np.inf)
  if d_out is None:
    return out, lse
  do = np.asarray(d_out, np.float64)
  dv = np.einsum("bhij,bhid->bhjd", p, do)
  dp = np.einsum("bhid,bhjd->bhij", do, vr)
  ds = p * (dp - (do * out).sum(-1, keepdims=True))
  if d_lse is not None:
    ds = ds + p * np.asarray(d_lse, np.float64)[..., None]
  dbias = None
  if bias is not None:
    axes = tuple(a for a in (0, 1) if np.shape(bias)[a] == 1)
    dbias = ds.sum(axis=axes, keepdims=True) if axes else ds
  dx = ds if t is None else ds * (1 - t * t)
  dq = np.einsum("bhij,bhjd->bhid", dx, kr) * sm_scale
  dk = np.einsum("bhij,bhid->bhjd", dx, q) * sm_scale
  fold = lambda a: a.reshape(b, hkv, g, *a.shape[2:]).sum(2)  # noqa: E731
  return out, lse, (dq, fold(dk), fold(dv), dbias)


# ---------------------------------------------------------------------------
# helpers


def _inputs(rng, b, h, hkv, lq, lk, d, dtype=np.float32, segments=False,
            bias_shape=None, n_segments=3):
  q = rng.standard_normal((b, h, lq, d)).astype(dtype)
  k = rng.standard_normal((b, hkv, lk, d)).astype(dtype)
  v = rng.standard_normal((b, hkv, lk, d)).astype(dtype)
  do = rng.standard_normal((b, h, lq, d)).astype(dtype)
  q_seg = kv_seg = bias = None
  if segments:
    q_seg = np.sort(rng.integers(0, n_segments, (b, lq)), 1).astype(np.int32)
    kv_seg = np.sort(rng.integers(0, n_segments, (b, lk)), 1).astype(np.int32)
  if bias_shape is not None:
    bias = rng.standard_normal(bias_shape).astype(np.float32)
  return q, k, v, do, q_seg, kv_seg, bias


def _kernel_kwargs(sm_scale, causal=False, left=None, right=None, cap=None,
                   sizes=SMALL):
  return dict(sm_scale=sm_scale, causal=causal, window_left=left,
              window_right=right, logit_soft_cap=cap, block_sizes=sizes,
              interpret=True)


@functools.lru_cache(maxsize=None)
def _jitted(kwargs_items):
  kw = dict(kwargs_items)
  fwd = jax.jit(lambda *a: gpu.forward(*a, **kw))
  bwd = jax.jit(lambda *a: gpu.backward(*a, **kw))
  return fwd, bwd


def run_kernels(q, k, v, q_seg, kv_seg, bias, do, **kw):
  fwd, bwd = _jitted(tuple(sorted(kw.items(), key=lambda kv: kv[0])))
  out, lse = fwd(q, k, v, q_seg, kv_seg, bias)
  grads = None
  if do is not None:
    grads = bwd(q, k, v, q_seg, kv_seg, bias, out, lse, do, None)
  return out, lse, grads


def _assert_lse(lse, ref_lse, atol):
  lse = np.asarray(lse)
  assert lse.dtype == np.float32
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
  finite = np.isfinite(ref_lse)
  np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=atol)


def check_case(rng, b, h, hkv, lq, lk, d, *, causal=False, left=None,
               right=None, cap=None, segments=False, bias_shape=None,
               grads=True, sizes=SMALL, atol=2e-5):
  q, k, v, do, q_seg, kv_seg, bias = _inputs(
      rng, b, h, hkv, lq, lk, d, segments=segments, bias_shape=bias_shape)
  scale = 1.0 / np.sqrt(d)
  feats = dict(causal=causal, left=left, right=right, cap=cap)
  out, lse, got = run_kernels(q, k, v, q_seg, kv_seg, bias,
                              do if grads else None,
                              **_kernel_kwargs(scale, sizes=sizes, **feats))
  ref = reference(q, k, v, q_seg, kv_seg, bias, do if grads else None,
                  sm_scale=scale, **feats)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert lse.shape == (b, h, lq)
  np.testing.assert_allclose(np.asarray(out), ref[0], atol=atol)
  _assert_lse(lse, ref[1], atol)
  if grads:
    dq, dk, dv, dbias = got
    for name, value, expected in zip(("dq", "dk", "dv"), (dq, dk, dv),
                                     ref[2]):
      assert value.shape == expected.shape, name
      np.testing.assert_allclose(np.asarray(value), expected, atol=atol * 5,
                                 err_msg=name)
    if bias is None:
      assert dbias is None
    else:
      assert dbias.shape == bias.shape and dbias.dtype == bias.dtype
      np.testing.assert_allclose(np.asarray(dbias), ref[2][3],
                                 atol=atol * 5, err_msg="dbias")
  return out, lse, got


# ---------------------------------------------------------------------------
# forward + backward against float64

CASES = {
    "plain": dict(b=1, h=2, hkv=2, lq=33, lk=33, d=16),
    "len1": dict(b=1, h=2, hkv=1, lq=1, lk=1, d=8),
    "q1_decode_causal": dict(b=2, h=2, hkv=1, lq=1, lk=40, d=16, causal=True),
    "len7_d5": dict(b=1, h=1, hkv=1, lq=7, lk=7, d=5),
    "causal_129": dict(b=1, h=2, hkv=2, lq=129, lk=129, d=32, causal=True),
    "causal_lq_lt_lk": dict(b=1, h=2, hkv=1, lq=33, lk=70, d=16, causal=True),
    "causal_lq_gt_lk": dict(b=1, h=2, hkv=2, lq=70, lk=33, d=16, causal=True),
    "gqa8_causal": dict(b=1, h=8, hkv=1, lq=40, lk=40, d=16, causal=True),
    "gqa2_window": dict(b=2, h=4, hkv=2, lq=64, lk=64, d=16, left=9),
    "window_causal_offset": dict(b=1, h=2, hkv=2, lq=20, lk=90, d=16,
                                 causal=True, left=30),
    "window_two_sided": dict(b=1, h=2, hkv=1, lq=50, lk=50, d=16, left=5,
                             right=17),
    "negative_right": dict(b=1, h=1, hkv=1, lq=48, lk=48, d=16, left=20,
                           right=-4),
    "segments": dict(b=2, h=2, hkv=1, lq=45, lk=45, d=16, segments=True),
    "segments_causal_gqa": dict(b=2, h=4, hkv=2, lq=33, lk=50, d=16,
                                segments=True, causal=True),
    "bias_full": dict(b=2, h=2, hkv=2, lq=20, lk=37, d=16,
                      bias_shape=(2, 2, 20, 37)),
    "bias_bcast_batch_causal": dict(b=2, h=4, hkv=2, lq=33, lk=33, d=16,
                                    bias_shape=(1, 4, 33, 33), causal=True),
    "bias_bcast_both": dict(b=2, h=2, hkv=1, lq=17, lk=30, d=16,
                            bias_shape=(1, 1, 17, 30)),
    "bias_bcast_heads": dict(b=2, h=4, hkv=1, lq=17, lk=30, d=16,
                             bias_shape=(2, 1, 17, 30)),
    "softcap": dict(b=1, h=2, hkv=2, lq=40, lk=40, d=16, cap=1.5),
    "softcap_bias_window": dict(b=1, h=2, hkv=1, lq=40, lk=60, d=24, cap=3.0,
                                bias_shape=(1, 2, 40, 60), left=7, right=3),
}


# The rest run with --runslow (each case costs a few seconds of compiling).
DEFAULT_CASES = ("len1", "q1_decode_causal", "len7_d5", "causal_129",
                 "causal_lq_gt_lk", "gqa8_causal", "window_two_sided",
                 "segments_causal_gqa", "bias_bcast_heads",
                 "softcap_bias_window")


@pytest.mark.parametrize("name", [
    name if name in DEFAULT_CASES else pytest.param(name,
                                                    marks=pytest.mark.slow)
    for name in sorted(CASES)])
def test_matches_float64(rng, name):
  check_case(rng, **CASES[name])


def test_default_block_sizes_odd_lengths(rng):
  # Default (large) tiles: one block each, padded 129 -> 256 and 33 -> 64.
  check_case(rng, 1, 2, 1, 129, 33, 24, causal=True, sizes=None)


def test_other_block_size_types_are_ignored(rng):
  # The TPU kernel's block sizes reach this module too; they must not break it.
  check_case(rng, 1, 1, 1, 20, 20, 16, sizes=object(), grads=False)


def test_fully_masked_rows_are_zero_with_zero_gradients(rng):
  q, k, v, do, _, _, _ = _inputs(rng, 1, 2, 1, 24, 40, 16)
  q_seg = np.zeros((1, 24), np.int32)
  q_seg[0, 10:14] = 7  # no key carries segment 7
  kv_seg = np.zeros((1, 40), np.int32)
  out, lse, (dq, dk, dv, _) = run_kernels(
      q, k, v, q_seg, kv_seg, None, do, **_kernel_kwargs(0.25))
  out, lse, dq = np.asarray(out), np.asarray(lse), np.asarray(dq)
  assert np.isfinite(out).all() and np.isfinite(dq).all()
  assert np.isfinite(np.asarray(dk)).all() and np.isfinite(np.asarray(dv)).all()
  np.testing.assert_array_equal(out[:, :, 10:14], 0.0)
  np.testing.assert_array_equal(dq[:, :, 10:14], 0.0)
  assert np.isneginf(lse[:, :, 10:14]).all()
  assert np.isfinite(lse[:, :, :10]).all() and np.isfinite(lse[:, :, 14:]).all()
  ref = reference(q, k, v, q_seg, kv_seg, None, do, sm_scale=0.25)
  np.testing.assert_allclose(out, ref[0], atol=2e-5)
  np.testing.assert_allclose(np.asarray(dk), ref[2][1], atol=1e-4)


def test_window_masks_every_key_of_some_rows(rng):
  # right=-30: the first rows see no key at all (lse -inf, out 0).
  _, lse, _ = check_case(rng, 1, 1, 1, 40, 40, 16, left=50, right=-30)
  assert np.isneginf(np.asarray(lse)[0, 0, :30]).all()


def test_large_negative_bias_rows_stay_exact(rng):
  # Rows whose logits are all around -300 must not underflow to "empty".
  q, k, v, do, _, _, _ = _inputs(rng, 1, 1, 1, 20, 40, 16)
  bias = np.full((1, 1, 20, 40), -300.0, np.float32)
  bias[0, 0, :, :5] += rng.standard_normal((20, 5)).astype(np.float32)
  out, lse, _ = run_kernels(q, k, v, None, None, bias, None,
                            **_kernel_kwargs(0.25))
  ref_out, ref_lse = reference(q, k, v, bias=bias, sm_scale=0.25)
  np.testing.assert_allclose(np.asarray(out), ref_out, atol=2e-5)
  np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=1e-6)


def test_bfloat16(rng):
  q, k, v, do, _, _, _ = _inputs(rng, 1, 4, 2, 65, 65, 32)
  cast = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
  qb, kb, vb, dob = map(cast, (q, k, v, do))
  out, lse, (dq, dk, dv, _) = run_kernels(
      qb, kb, vb, None, None, None, dob, **_kernel_kwargs(0.2, causal=True))
  assert out.dtype == dq.dtype == dk.dtype == dv.dtype == jnp.bfloat16
  up = lambda x: np.asarray(jnp.asarray(x, jnp.float32))  # noqa: E731
  ref = reference(up(qb), up(kb), up(vb), None, None, None, up(dob),
                  sm_scale=0.2, causal=True)
  for got, expected in zip((out, dq, dk, dv), (ref[0],) + ref[2][:3]):
    err = np.linalg.norm(up(got) - expected) / np.linalg.norm(expected)
    assert err < 2e-2


@pytest.mark.parametrize("causal", [False, True])
def test_bfloat16_head_dim_256_default_tiles(rng, causal):
  # The 512-byte-row defaults (forward 128x64, dk/dv 64x64), shrunk to 128.
  q, k, v, do, _, _, _ = _inputs(rng, 1, 2, 1, 100, 130, 256)
  cast = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
  qb, kb, vb, dob = map(cast, (q, k, v, do))
  out, _, grads = run_kernels(
      qb, kb, vb, None, None, None, dob,
      **_kernel_kwargs(1 / 16, causal=causal, sizes=None))
  up = lambda x: np.asarray(jnp.asarray(x, jnp.float32))  # noqa: E731
  ref = reference(up(qb), up(kb), up(vb), None, None, None, up(dob),
                  sm_scale=1 / 16, causal=causal)
  for got, expected in zip((out,) + tuple(grads[:3]), (ref[0],) + ref[2][:3]):
    err = np.linalg.norm(up(got) - expected) / np.linalg.norm(expected)
    assert err < 2e-2


def test_empty_sequence():
  q = jnp.zeros((1, 2, 0, 16), jnp.float32)
  k = jnp.ones((1, 2, 5, 16), jnp.float32)
  out, lse = gpu.forward(q, k, k, None, None, None, **_kernel_kwargs(0.25))
  assert out.shape == (1, 2, 0, 16) and lse.shape == (1, 2, 0)
  q = jnp.ones((1, 2, 3, 16), jnp.float32)
  k = jnp.zeros((1, 2, 0, 16), jnp.float32)
  out, lse = gpu.forward(q, k, k, None, None, None, **_kernel_kwargs(0.25))
  np.testing.assert_array_equal(out, 0.0)
  assert np.isneginf(np.asarray(lse)).all()


def test_traces_without_interpret_on_cpu():
  # backend=None traces the cuda branch on every host: it must trace here.
  q = jax.ShapeDtypeStruct((2, 4, 100, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 2, 100, 64), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((2, 100), jnp.int32)
  bias = jax.ShapeDtypeStruct((1, 4, 100, 100), jnp.float32)
  kw = _kernel_kwargs(0.125, causal=True, left=30, cap=5.0, sizes=None)
  kw["interpret"] = False
  out, lse = jax.eval_shape(functools.partial(gpu.forward, **kw),
                            q, kv, kv, seg, seg, bias)
  assert out.shape == (2, 4, 100, 64) and out.dtype == jnp.bfloat16
  assert lse.shape == (2, 4, 100) and lse.dtype == jnp.float32
  grads = jax.eval_shape(functools.partial(gpu.backward, **kw),
                         q, kv, kv, seg, seg, bias, out, lse, q, None)
  assert [g.shape for g in grads] == [q.shape, kv.shape, kv.shape, bias.shape]


@pytest.mark.parametrize("bad", [dict(block_q=24), dict(block_k=8),
                                 dict(block_q_dkv=0), dict(num_warps=0)])
def test_invalid_block_sizes(bad):
  with pytest.raises(ValueError, match=next(iter(bad))):
    gpu.GpuBlockSizes(**bad).resolved(128, banded=False)


# ---------------------------------------------------------------------------
# loop bounds: exact against brute force


def _brute_force_blocks(valid, block_rows, block_cols, n_row_blocks):
  """Per row block: (set of col blocks touched, set of col blocks full)."""
  touched, full = [], []
  for i in range(n_row_blocks):
    rows = valid[i * block_rows:(i + 1) * block_rows]
    t, f = set(), set()
    for c in range(-(-valid.shape[1] // block_cols)):
      tile = rows[:, c * block_cols:(c + 1) * block_cols]
      if tile.any():
        t.add(c)
      if tile.shape[1] == block_cols and tile.all():
        f.add(c)
    touched.append(t)
    full.append(f)
  return touched, full


@given(lq=st.integers(1, 70), lk=st.integers(1, 70),
       causal=st.booleans(),
       left=st.one_of(st.none(), st.integers(0, 80)),
       right=st.one_of(st.none(), st.integers(-40, 80)),
       bq=st.sampled_from([16, 32]), bk=st.sampled_from([16, 32]))
def test_loop_bounds_skip_exactly_the_masked_blocks(lq, lk, causal, left,
                                                     right, bq, bk):
  mask = gpu._make_mask(lq, lk, causal, left, right, False)
  valid = _mask(lq, lk, None, None, causal, left, right)[0, 0]
  nq, nk = -(-lq // bq), -(-lk // bk)
  # kv blocks per q block (forward and dq kernels).
  touched, _ = _brute_force_blocks(valid, bq, bk, nq)
  for i in range(nq):
    lo, a, b, hi = (int(x) for x in gpu._kv_blocks(jnp.int32(i * bq), bq, bk,
                                                    mask))
    assert lo <= a <= b <= hi
    visited = set(range(lo, hi))
    assert touched[i] <= visited, (i, lo, hi)
    if touched[i]:
      assert lo == min(touched[i]) and hi == max(touched[i]) + 1
    # Unmasked loop: every real row of the block sees every key.
    rows = valid[i * bq:(i + 1) * bq]
    for c in range(a, b):
      assert rows[:, c * bk:(c + 1) * bk].all() and (c + 1) * bk <= lk
  # q blocks per kv block (dk/dv kernel), transposed view.
  touched_t, _ = _brute_force_blocks(valid.T, bk, bq, nk)
  for j in range(nk):
    lo, a, b, hi = (int(x) for x in gpu._q_blocks(jnp.int32(j * bk), bk, bq,
                                                   mask))
    assert lo <= a <= b <= hi
    assert touched_t[j] <= set(range(lo, hi)), (j, lo, hi)
    if touched_t[j]:
      assert lo == min(touched_t[j]) and hi == max(touched_t[j]) + 1
    cols = valid.T[j * bk:(j + 1) * bk]
    for i in range(a, b):
      assert cols[:, i * bq:(i + 1) * bq].all() and (j + 1) * bk <= lk


# ---------------------------------------------------------------------------
# property test over shapes and masks (forward; generic interpreter)


@given(data=st.data())
def test_forward_property(data):
  rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
  hkv = data.draw(st.sampled_from([1, 2]))
  h = hkv * data.draw(st.sampled_from([1, 2]))
  lq = data.draw(st.integers(1, 40))
  lk = data.draw(st.integers(1, 40))
  d = data.draw(st.sampled_from([4, 16, 20]))
  causal = data.draw(st.booleans())
  left = data.draw(st.one_of(st.none(), st.integers(0, 40)))
  right = data.draw(st.one_of(st.none(), st.integers(-5, 40)))
  segments = data.draw(st.booleans())
  check_case(rng, 1, h, hkv, lq, lk, d, causal=causal, left=left,
             right=right, segments=segments, grads=False)


def test_default_table_and_overrides():
  bf16_128 = gpu.GpuBlockSizes().resolved(256, banded=False)
  assert (bf16_128.block_q, bf16_128.block_k, bf16_128.num_warps) == (256, 64,
                                                                      8)
  banded = gpu.GpuBlockSizes().resolved(256, banded=True)
  assert (banded.block_q, banded.block_k) == (128, 64)
  wide = gpu.GpuBlockSizes(num_stages_dkv=3).resolved(512, banded=False)
  assert (wide.block_q, wide.block_k, wide.num_stages_dkv) == (128, 64, 3)
  assert (wide.block_q_dkv, wide.block_k_dkv, wide.num_warps_dkv) == (64, 64,
                                                                       8)
  assert all(getattr(wide, f.name) is not None
             for f in gpu.dataclasses.fields(wide))
  # float32 rows of 512 bytes (head_dim 128) keep the smaller tiles.
  f32 = gpu.GpuBlockSizes().resolved(512, banded=False, itemsize=4)
  assert (f32.block_q, f32.block_k, f32.block_k_dkv) == (64, 32, 64)
  assert gpu.GpuBlockSizes().resolved(512, False, bias=True).block_q == 64


def test_bias_keeps_forward_tile_within_shared_memory():
  # 256x64 tiles plus float32 bias tiles overflowed the H100's shared memory.
  plain = gpu.GpuBlockSizes().resolved(256, banded=False, bias=False)
  with_bias = gpu.GpuBlockSizes().resolved(256, banded=False, bias=True)
  assert plain.block_q == 256 and with_bias.block_q == 128


def test_lse_cotangent(rng):
  q, k, v, do, q_seg, kv_seg, _ = _inputs(rng, 1, 4, 2, 40, 56, 16,
                                          segments=True)
  d_lse = rng.standard_normal((1, 4, 40)).astype(np.float32)
  kw = _kernel_kwargs(0.25, causal=True)
  out, lse = gpu.forward(q, k, v, q_seg, kv_seg, None, **kw)
  grads = gpu.backward(q, k, v, q_seg, kv_seg, None, out, lse, do, d_lse,
                       **kw)
  ref = reference(q, k, v, q_seg, kv_seg, None, do, sm_scale=0.25,
                  causal=True, d_lse=d_lse)
  for name, got, expected in zip(("dq", "dk", "dv"), grads, ref[2]):
    np.testing.assert_allclose(np.asarray(got), expected, atol=1e-4,
                               err_msg=name)


# ---------------------------------------------------------------------------
# launch order, forward kernel choice, kernels per step


@pytest.mark.parametrize("blocks,heads,batch,chunk,reverse", [
    (6, 3, 2, 2, True), (8, 2, 1, 4, False), (5, 2, 2, 1, True),
    (4, 3, 1, 0, False), (7, 1, 3, 0, True)])
def test_launch_order_visits_every_program_once(blocks, heads, batch, chunk,
                                                reverse):
  order = gpu._LaunchOrder(blocks, heads, reverse=reverse, chunk=chunk)
  g0, g1, g2 = order.grid(batch)
  # Triton's launch order: first grid axis fastest.
  launched = [tuple(int(x) for x in order.ids(a, b, c))
              for c in range(g2) for b in range(g1) for a in range(g0)]
  assert sorted(launched) == sorted(
      (i, b, h) for i in range(blocks) for b in range(batch)
      for h in range(heads))
  if chunk:
    # The first chunk of every head launches before any second chunk.
    first = launched[:chunk * batch * heads]
    heavy = (set(range(blocks - chunk, blocks)) if reverse
             else set(range(chunk)))
    assert {i for i, _, _ in first} == heavy


def test_launch_order_choice():
  sizes = gpu.GpuBlockSizes().resolved(256, banded=True)
  causal = gpu._make_mask(4096, 4096, True, None, None, False)
  window = gpu._make_mask(4096, 4096, True, 100, None, False)
  full = gpu._make_mask(4096, 4096, False, None, None, False)
  assert gpu._launch_order(64, 4, 16, causal, sizes, True) == (
      gpu._LaunchOrder(64, 16, reverse=True, chunk=16))
  assert gpu._launch_order(24, 4, 16, causal, sizes, False).chunk == 8
  # Uniform work per block, or too many (batch, head) pairs for grid axis 1.
  assert gpu._launch_order(64, 4, 16, window, sizes, True).chunk == 0
  assert gpu._launch_order(64, 4, 16, full, sizes, True).chunk == 0
  assert gpu._launch_order(64, 1024, 128, causal, sizes, True).chunk == 0


@pytest.mark.parametrize("chunk", [0, 2])
def test_causal_launch_orders_match_float64(rng, chunk):
  # 96 rows in blocks of 16/32: a chunked grid of several chunks per head.
  sizes = gpu.dataclasses.replace(SMALL, band_chunk=chunk)
  check_case(rng, 2, 4, 2, 96, 96, 16, causal=True, sizes=sizes,
             bias_shape=(2, 4, 96, 96))


def test_invalid_band_chunk():
  with pytest.raises(ValueError, match="band_chunk"):
    gpu.GpuBlockSizes(band_chunk=-1).resolved(256, banded=True)


def test_cuda_gradient_runs_the_forward_once():
  # Lowered for CUDA from this host: forward, dq and dk/dv kernels, one each.
  from pallas_kernels.attention import api
  q = jax.ShapeDtypeStruct((1, 2, 256, 64), jnp.bfloat16)

  def fwd_bwd(q, k, v, do):
    out, vjp = jax.vjp(lambda *a: api.flash_attention(*a, causal=True,
                                                      backend="gpu"), q, k, v)
    return out, vjp(do)

  text = _compat.lower_for_cuda(fwd_bwd, q, q, q, q).as_text()
  for name in ("flash_attention_fwd_gpu", "flash_attention_dq_gpu",
               "flash_attention_dkv_gpu"):
    assert text.count(f'"{name}"') == 1, name
