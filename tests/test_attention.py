"""flash_attention: one suite for every backend (``tests/backends.py``)
against the float64 oracle (``tests/oracles/attention.py``); then the API
(arguments, transforms, sharding, layering) and the Mosaic TPU kernel's own
pieces (block table, block skipping, cost model, races).

Tolerances, max abs error against float64 on N(0, 1) inputs; lse and
gradients are scaled by max(1, max |expected|):
  float32 inputs:          out 2e-5, lse 2e-5, gradients 1e-4.
  bfloat16/float16 inputs: out 2e-2, lse 1e-3, gradients 5e-2 (the kernels
  round probabilities to the input dtype before the P V and dS matmuls, as
  every flash kernel does; the oracle sees the rounded inputs).
A backend that cannot run a case (Mosaic GPU: float32, bias, segment ids)
must refuse it with a ValueError.
"""
from __future__ import annotations

import dataclasses
import functools
import subprocess
import sys

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import backends
import pallas_kernels as pk
from oracles import attention as oracle
from pallas_kernels import _backend, force_interpret
from pallas_kernels.attention import BlockSizes, block_sizes, masks
from pallas_kernels.attention import mosaic_tpu
from pallas_kernels.attention import triton

TOLERANCES = {  # dtype: (out, lse, gradients)
    "float32": (2e-5, 2e-5, 1e-4),
    "bfloat16": (2e-2, 1e-3, 5e-2),
    "float16": (2e-2, 1e-3, 5e-2),
}
# Blocks that give these small shapes several q and kv blocks, so block
# skipping and the masked/unmasked split run; other backends: defaults.
BLOCKS = {
    "interpret": BlockSizes(128, 128),
    "interpret_generic": BlockSizes(128, 128),
    "triton": triton.GpuBlockSizes(block_q=32, block_k=32, block_q_dq=32,
                                   block_k_dq=64, block_q_dkv=64,
                                   block_k_dkv=32),
}
ALL = backends.params()


# ---------------------------------------------------------------- helpers --

def _assert_close(actual, expected, tol, what=""):
  """Equal infinities, then max abs error <= tol."""
  actual = np.asarray(actual).astype(np.float64)
  expected = np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
  inf = np.isinf(expected)
  np.testing.assert_array_equal(actual[inf], expected[inf], err_msg=what)
  assert np.all(np.isfinite(actual[~inf])), f"{what}: non-finite values"
  err = np.max(np.abs(actual[~inf] - expected[~inf]), initial=0)
  assert err <= tol, f"{what}: max abs error {err} > {tol}"


def _scale(x):
  x = np.asarray(x, np.float64)
  return max(1.0, float(np.max(np.abs(x[np.isfinite(x)]), initial=0)))


def _segments(rng, b, lq, lk):
  """Sorted ids (packed sequences) in [0, 3); query rows 5-8 get id 7, which
  no key has, so they attend to nothing."""
  q_seg = np.sort(rng.integers(0, 3, (b, lq)), axis=1)
  q_seg[:, 5:9] = 7
  kv_seg = np.sort(rng.integers(0, 3, (b, lk)), axis=1)
  return jnp.asarray(q_seg, jnp.int32), jnp.asarray(kv_seg, jnp.int32)


@dataclasses.dataclass(frozen=True)
class Case:
  """One call of the suite; ``bias`` is its (batch, heads) broadcast shape,
  "extreme" for a bias whose row 3 is -inf and rows 4-6 near -300."""
  b: int
  h: int
  hk: int
  lq: int
  lk: int
  d: int
  dtype: str = "float32"
  causal: bool = False
  window: object = None
  cap: float | None = None
  sm_scale: float | None = None
  segments: bool = False
  bias: object = None
  lse: bool = True      # return_lse, with an lse cotangent
  dv: int | None = None  # v's head dim (MLA), None: d

  @property
  def v_dim(self):
    return self.d if self.dv is None else self.dv

  def inputs(self, rng):
    """(q, k, v, bias, d_out, d_lse, flash_attention kwargs)."""
    dtype = jnp.dtype(self.dtype)
    make = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)  # noqa: E731
    q, k, v = (make(self.b, self.h, self.lq, self.d),
               make(self.b, self.hk, self.lk, self.d),
               make(self.b, self.hk, self.lk, self.v_dim))
    d_out = make(self.b, self.h, self.lq, self.v_dim)
    d_lse = (jnp.asarray(rng.standard_normal((self.b, self.h, self.lq)),
                         jnp.float32) if self.lse else None)
    bias = None
    if self.bias == "extreme":
      bias = 0.1 * rng.standard_normal((1, 1, self.lq, self.lk))
      bias[..., 3, :] = -np.inf
      bias[..., 4:7, :] -= 300.0
    elif self.bias is not None:
      bias = rng.standard_normal(tuple(self.bias) + (self.lq, self.lk))
    if bias is not None:
      bias = jnp.asarray(bias, jnp.float32)
    kw = dict(causal=self.causal, sliding_window=self.window,
              logit_soft_cap=self.cap, sm_scale=self.sm_scale)
    if self.segments:
      kw["segment_ids"] = _segments(rng, self.b, self.lq, self.lk)
    return q, k, v, bias, d_out, d_lse, kw


CASES = {
    "gqa_full": Case(1, 4, 2, 70, 90, 24, lse=False),
    "causal_long_query": Case(2, 2, 1, 200, 150, 16, causal=True),
    "window_pair": Case(1, 2, 2, 150, 270, 32, window=(70, 5)),
    "window_left_only": Case(1, 2, 1, 140, 140, 8, window=(30, None),
                             lse=False),
    "causal_window_cap": Case(1, 4, 1, 130, 260, 40, causal=True, window=50,
                              cap=2.5, sm_scale=0.3),
    "segments": Case(2, 2, 1, 150, 200, 16, segments=True),
    # v wider than q and k (MLA's Dv > D)
    "bias_per_batch_head": Case(2, 2, 2, 100, 140, 16, bias=(2, 2), dv=40),
    "bias_broadcast": Case(1, 4, 2, 100, 140, 16, bias=(1, 1), lse=False),
    "bias_extreme": Case(1, 2, 1, 20, 150, 16, bias="extreme"),
    "everything": Case(1, 4, 2, 150, 200, 24, causal=True, window=(90, 0),
                       cap=3.0, sm_scale=0.2, segments=True, bias=(1, 4)),
    "bf16_causal_gqa": Case(1, 4, 2, 150, 200, 64, "bfloat16", causal=True),
    "bf16_window_cap": Case(1, 2, 1, 130, 260, 64, "bfloat16",
                            window=(150, 40), cap=4.0, lse=False),
    "f16_full": Case(1, 1, 1, 140, 256, 128, "float16"),
    # head dims between the 128-byte swizzle widths (Mosaic GPU: 32- and
    # 64-byte swizzled tiles)
    "bf16_d80_causal_gqa": Case(1, 2, 1, 140, 200, 80, "bfloat16",
                                causal=True),
    "f16_d96_full": Case(1, 1, 1, 130, 260, 96, "float16", lse=False),
    # above 128: the Mosaic GPU backward splits head_dim over warpgroups
    "bf16_d160_causal_gqa": Case(1, 2, 1, 140, 200, 160, "bfloat16",
                                 causal=True),
    # MLA: v's head dim differs from q's and k's, smaller and larger
    "mla_causal_segments_gqa": Case(1, 2, 1, 150, 200, 24, dv=40, causal=True,
                                    segments=True),
    "mla_wide_v_window_cap_bias": Case(1, 2, 1, 130, 170, 16, dv=72,
                                       window=(50, 10), cap=2.0, bias=(1, 2),
                                       lse=False),
    "bf16_mla_d192_dv128_causal": Case(1, 2, 1, 140, 200, 192, "bfloat16",
                                       dv=128, causal=True),
}


def _refusal(backend, case) -> bool:
  """Whether ``backend`` must refuse ``case`` (what the kernel lacks)."""
  if backend.name != "mosaic_gpu":
    return False
  return (case.dtype == "float32" or case.bias is not None or case.segments
          or not 64 <= case.d <= 256 or case.v_dim != case.d)


def _run(q, k, v, bias, d_out, d_lse, *, backend, blocks, **kw):
  """(out, lse or None, (dq, dk, dv, dbias or None)) of one forward and one
  backward, jitted."""
  return_lse = d_lse is not None

  def loss(q, k, v, bias):
    result = pk.flash_attention(q, k, v, bias=bias, return_lse=return_lse,
                                block_sizes=blocks, backend=backend, **kw)
    out, lse = result if return_lse else (result, None)
    total = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))
    if return_lse:
      total += jnp.sum(jnp.where(jnp.isinf(lse), 0.0, lse) * d_lse)
    return total, (out, lse)

  argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
  grad = jax.jit(jax.grad(loss, argnums, has_aux=True))
  grads, (out, lse) = grad(q, k, v, bias)
  return out, lse, tuple(grads) + (None,) * (4 - len(grads))


def check(backend, case, rng):
  """Runs ``case`` on ``backend`` and compares with the oracle."""
  q, k, v, bias, d_out, d_lse, kw = case.inputs(rng)
  if _refusal(backend, case):
    with pytest.raises(ValueError, match="cannot run this call"):
      backend.run(pk.flash_attention, q, k, v, bias=bias, **kw)
    return
  out, lse, grads = backend.run(_run, q, k, v, bias, d_out, d_lse,
                                blocks=BLOCKS.get(backend.name), **kw)
  ref_out, ref_lse, ref_grads = oracle.attention(
      q, k, v, bias=bias, d_out=d_out, d_lse=d_lse, **kw)
  out_tol, lse_tol, grad_tol = TOLERANCES[case.dtype]
  assert out.shape == q.shape[:3] + v.shape[3:] and out.dtype == q.dtype
  _assert_close(out, ref_out, out_tol * _scale(ref_out), "out")
  empty = np.isneginf(ref_lse)
  np.testing.assert_array_equal(np.asarray(out)[empty], 0.0)
  if lse is not None:
    assert lse.shape == q.shape[:3] and lse.dtype == jnp.float32
    _assert_close(lse, ref_lse, lse_tol * _scale(ref_lse), "lse")
  for name, got, want, arg in zip(("dq", "dk", "dv", "dbias"), grads,
                                  ref_grads, (q, k, v, bias)):
    if want is None:
      assert got is None, name
      continue
    assert got.shape == arg.shape and got.dtype == arg.dtype, name
    _assert_close(got, want, grad_tol * _scale(want), name)
  return empty


# ------------------------------------------------------------ the suite --

SLOW_CASES = {"mla_wide_v_window_cap_bias"}


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("name", [
    pytest.param(n, marks=[pytest.mark.slow] if n in SLOW_CASES else [])
    for n in sorted(CASES)])
def test_forward_and_gradients_match_float64(backend, name, rng):
  empty = check(backend, CASES[name], rng)
  if name in ("causal_long_query", "segments", "bias_extreme",
              "everything") and empty is not None:
    assert empty.any(), "the case must contain rows without keys"


@pytest.mark.parametrize("backend", ALL)
def test_nan_in_one_query_row_stays_in_that_row(backend, rng):
  q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
             for s in ((1, 2, 130, 64), (1, 1, 150, 64), (1, 1, 150, 64)))
  q = q.at[0, 0, 4, 0].set(jnp.nan)
  out = np.asarray(backend.run(pk.flash_attention, q, k, v),
                   np.float64)
  assert np.all(np.isnan(out[0, 0, 4]))
  keep = np.ones(130, bool)
  keep[4] = False
  ref, _ = oracle.attention(np.asarray(q)[:, :, keep], k, v)
  _assert_close(out[:, :, keep], ref, 2e-2 * _scale(ref))


@st.composite
def _problems(draw):
  dtype, d = draw(st.sampled_from([("float32", 1), ("float32", 33),
                                   ("bfloat16", 64), ("float16", 64)]))
  hk = draw(st.sampled_from([1, 2]))
  window = draw(st.one_of(
      st.none(), st.integers(0, 200),
      st.tuples(st.one_of(st.none(), st.integers(0, 200)),
                st.one_of(st.none(), st.integers(0, 200)))))
  return Case(b=draw(st.integers(1, 2)), hk=hk,
              h=hk * draw(st.sampled_from([1, 2, 4])),
              lq=draw(st.integers(1, 260)), lk=draw(st.integers(1, 260)),
              d=d, dtype=dtype, causal=draw(st.booleans()), window=window,
              cap=draw(st.sampled_from([None, 1.5])),
              segments=draw(st.booleans()), lse=draw(st.booleans()),
              dv=draw(st.sampled_from([None, None, 20, 72])))


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("examples", [
    3, pytest.param(25, marks=pytest.mark.slow)])
def test_random_shapes_and_masks(backend, examples):
  """Default block sizes at random odd shapes."""
  @settings(max_examples=examples)
  @given(case=_problems(), seed=st.integers(0, 2**31 - 1))
  def run(case, seed):
    check(backend, case, np.random.default_rng(seed))
  run()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ALL)
def test_long_odd_length_everything(backend, rng):
  check(backend, Case(1, 4, 2, 1000, 1100, 40, causal=True, window=(300, 0),
                      cap=3.0, segments=True, bias=(1, 4)), rng)


# -------------------------------------------------------------------- API --

def test_empty_sequences():
  q = jnp.ones((1, 2, 0, 8))
  k = v = jnp.ones((1, 1, 5, 8))
  out, lse = pk.flash_attention(q, k, v, return_lse=True)
  assert out.shape == (1, 2, 0, 8) and lse.shape == (1, 2, 0)
  q = jnp.ones((1, 2, 3, 8))
  k = v = jnp.ones((1, 1, 0, 8))
  out, lse = pk.flash_attention(q, k, v, return_lse=True)
  np.testing.assert_array_equal(out, 0)
  assert np.all(np.isneginf(lse))
  grads = jax.grad(lambda q: pk.flash_attention(q, k, v).sum())(q)
  np.testing.assert_array_equal(grads, 0)
  # MLA: v's head dim
  out = pk.flash_attention(q, k, jnp.ones((1, 1, 0, 5)))
  assert out.shape == (1, 2, 3, 5)


def _qkv(shape_q=(1, 2, 100, 16), shape_kv=(1, 1, 100, 16), rng=None,
         dtype=jnp.float32):
  rng = rng or np.random.default_rng(0)
  return tuple(jnp.asarray(rng.standard_normal(s), dtype)
               for s in (shape_q, shape_kv, shape_kv))


def test_jit_and_default_backend_on_cpu(rng):
  # backend=None lowers for the CPU here: the TPU kernel in the interpreter.
  q, k, v = _qkv(rng=rng)
  fn = jax.jit(functools.partial(pk.flash_attention, causal=True))
  ref, _ = oracle.attention(q, k, v, causal=True)
  _assert_close(fn(q, k, v), ref, 2e-5)
  _assert_close(pk.reference.flash_attention(q, k, v, causal=True), ref, 2e-5)


@pytest.mark.parametrize("causal,lk", [(True, 300), (False, 300),
                                       (False, 100)])
def test_forward_without_lse_writes_the_same_out(causal, lk, rng):
  # Without return_lse (not differentiated) the TPU forward writes no lse;
  # lk 100 at kv blocks of 128: rows of one block (softmax on values).
  q, k, v = _qkv((1, 2, 200, 16), (1, 1, lk, 16), rng)
  fn = functools.partial(pk.flash_attention, causal=causal,
                         block_sizes=(128, 128))
  with force_interpret("generic"):
    out = jax.jit(fn)(q, k, v)
    with_lse, _ = jax.jit(functools.partial(fn, return_lse=True))(q, k, v)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(with_lse))
  ref, _ = oracle.attention(q, k, v, causal=causal)
  _assert_close(out, ref, 2e-5)


def test_vmap_over_an_extra_axis(rng):
  q, k, v = _qkv((3, 2, 50, 8), (3, 1, 60, 8), rng)
  fn = jax.vmap(lambda q, k, v: pk.flash_attention(q, k, v, causal=True))
  with force_interpret("generic"):
    out = jax.jit(fn)(q[:, None], k[:, None], v[:, None])[:, 0]
    dq = jax.jit(jax.grad(lambda q: fn(q, k[:, None], v[:, None]).sum()))(
        q[:, None])[:, 0]
  ref, _, (ref_dq, *_) = oracle.attention(q, k, v, causal=True,
                                          d_out=np.ones(q.shape))
  _assert_close(out, ref, 2e-5)
  _assert_close(dq, ref_dq, 1e-4 * _scale(ref_dq))


def test_shard_helper_on_cpu_mesh(rng):
  from jax.sharding import Mesh
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
  q, k, v = _qkv((2, 4, 40, 16), (2, 2, 60, 16), rng)
  segs = _segments(rng, 2, 40, 60)
  bias = jnp.asarray(rng.standard_normal((1, 4, 40, 60)), jnp.float32)

  def loss(q):
    out, lse = pk.shard_flash_attention(mesh, q, k, v, causal=True,
                                        segment_ids=segs, bias=bias,
                                        return_lse=True)
    return jnp.sum(out), (out, lse)
  with force_interpret("generic"):
    dq, (out, lse) = jax.jit(jax.grad(loss, has_aux=True))(q)
  ref, ref_lse, (ref_dq, *_) = oracle.attention(
      q, k, v, causal=True, segment_ids=segs, bias=bias,
      d_out=np.ones(q.shape))
  _assert_close(out, ref, 2e-5)
  _assert_close(lse, ref_lse, 2e-5 * _scale(ref_lse))
  _assert_close(dq, ref_dq, 1e-4 * _scale(ref_dq))


def test_shard_helper_rejects_indivisible_heads():
  from jax.sharding import Mesh
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
  q = jnp.ones((1, 2, 8, 8))
  with pytest.raises(ValueError, match="no axis 'heads'"):
    pk.shard_flash_attention(mesh, q, q, q, head_axis="heads")


def test_named_kernels_check_the_chip():
  q, k, v = _qkv((1, 2, 128, 64), (1, 1, 128, 64), dtype=jnp.bfloat16)
  # Compiled (not interpreted) Mosaic GPU kernels need a Hopper.
  with pytest.raises(ValueError, match="Hopper|jax >= 0.10"):
    pk.flash_attention(q, k, v, backend="mosaic_gpu")
  # Interpreted, the chip is not asked, but what the kernel takes is.
  with force_interpret("generic"):
    with pytest.raises(ValueError,
                       match="cannot run this call: .*(bias|jax >= 0.10)"):
      pk.flash_attention(q, k, v, backend="mosaic_gpu",
                         bias=jnp.zeros((1, 1, 128, 128)))


def test_mosaic_gpu_refuses_a_different_v_head_dim_naming_v():
  q, k, _ = _qkv((1, 2, 128, 64), (1, 1, 128, 64), dtype=jnp.bfloat16)
  v = jnp.ones((1, 1, 128, 128), jnp.bfloat16)
  with force_interpret("generic"):
    with pytest.raises(ValueError, match="cannot run this call: .*(v's "
                       "head_dim equal to q's, got 128 and 64|jax >= 0.10)"):
      pk.flash_attention(q, k, v, backend="mosaic_gpu")
    # The default GPU choice passes it to the Triton kernel.
    assert pk.flash_attention(q, k, v, backend="gpu").shape == (1, 2, 128, 128)


def test_reference_and_kernels_import_neither_api_nor_bench():
  code = ("import sys; import pallas_kernels.attention.reference; "
          "assert 'pallas_kernels.attention.api' not in sys.modules; "
          "import pallas_kernels.attention.mosaic_tpu, "
          "pallas_kernels.attention.triton; "
          "assert not any(m == 'bench' or m.startswith('bench.') "
          "for m in sys.modules)")
  subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


def _ones(lq=8, lk=8, h=2, hk=1, d=8, dtype=jnp.float32):
  return (jnp.ones((1, h, lq, d), dtype), jnp.ones((1, hk, lk, d), dtype),
          jnp.ones((1, hk, lk, d), dtype))


@pytest.mark.parametrize("make,kwargs,error,match", [
    (lambda: (jnp.ones((2, 8, 8)),) + _ones()[1:], {}, ValueError,
     "q must have 4 dimensions"),
    (lambda: _ones(h=3, hk=2), {}, ValueError, "multiple of kv_heads"),
    (lambda: _ones()[:2] + (jnp.ones((1, 1, 9, 8)),), {}, ValueError,
     r"k and v must have the same \[batch, kv_heads, kv_len\]"),
    (lambda: _ones()[:2] + (jnp.ones((1, 1, 8, 0)),), {}, ValueError,
     "v's head_dim must be >= 1"),
    (lambda: (_ones()[0], jnp.ones((1, 1, 8, 6)), _ones()[2]), {}, ValueError,
     r"head_dim of k \(6\) != head_dim of q \(8\)"),
    (lambda: (jnp.ones((1, 2, 8, 4)),) + _ones()[1:], {}, ValueError,
     "head_dim"),
    (lambda: (jnp.ones((2, 2, 8, 8)),) + _ones()[1:], {}, ValueError, "batch"),
    (lambda: _ones(dtype=jnp.int32), {}, TypeError, "bfloat16, float16"),
    (lambda: (_ones()[0].astype(jnp.bfloat16),) + _ones()[1:], {}, TypeError,
     "share a dtype"),
    (_ones, dict(sliding_window=-1), ValueError, "sliding_window size"),
    (_ones, dict(sliding_window=(1, 2, 3)), ValueError, "pair"),
    (_ones, dict(sliding_window=(4, -2)), ValueError, "right must be >= 0"),
    (_ones, dict(sliding_window=2.5), TypeError, "sliding_window size"),
    (_ones, dict(logit_soft_cap=0.0), ValueError, "logit_soft_cap"),
    (_ones, dict(logit_soft_cap=jnp.float32(1.0)), TypeError,
     "logit_soft_cap"),
    (_ones, dict(sm_scale=jnp.float32(1.0)), TypeError, "sm_scale"),
    (_ones, dict(causal="yes"), TypeError, "causal"),
    (_ones, dict(segment_ids=jnp.zeros((1, 8), jnp.int32)), TypeError,
     "segment_ids"),
    (_ones, dict(segment_ids=(jnp.zeros((1, 7), jnp.int32),
                              jnp.zeros((1, 8), jnp.int32))), ValueError,
     r"q_segment_ids must have shape \(1, 8\)"),
    (_ones, dict(segment_ids=(jnp.zeros((1, 8)), jnp.zeros((1, 8)))),
     TypeError, "must be integers"),
    (_ones, dict(bias=jnp.zeros((1, 3, 8, 8))), ValueError, "bias must have"),
    (_ones, dict(bias=jnp.zeros((1, 1, 8, 8), jnp.int32)), TypeError, "bias"),
    (_ones, dict(block_sizes=(100, 128)), ValueError, "multiple of 128"),
    (_ones, dict(block_sizes={"block_x": 128}), ValueError, "unknown keys"),
    (_ones, dict(block_sizes="big"), TypeError, "block_sizes"),
    (_ones, dict(backend="cuda"), ValueError, "backend"),
])
def test_bad_arguments_raise(make, kwargs, error, match):
  with pytest.raises(error, match=match):
    pk.flash_attention(*make(), **kwargs)


# ------------------------------------------------ the Mosaic TPU kernel --

@pytest.mark.parametrize("flavour", ["generic", "tpu"])
def test_blocks_with_disjoint_segments_are_skipped(flavour, rng):
  """A kv block whose ids never meet the query block's is not computed: its
  NaN values would otherwise reach the output through 0 * NaN."""
  q, k, v = _qkv((1, 1, 100, 16), (1, 1, 256, 16), rng)
  k = k.at[:, :, 128:].set(jnp.nan)
  v = v.at[:, :, 128:].set(jnp.nan)
  q_seg = jnp.zeros((1, 100), jnp.int32)
  kv_seg = jnp.asarray(np.repeat([[0, 1]], 128, axis=1), jnp.int32)
  with force_interpret(flavour):
    out, lse = pk.flash_attention(q, k, v, segment_ids=(q_seg, kv_seg),
                                  block_sizes=(128, 128), return_lse=True)
  ref_out, ref_lse = oracle.attention(q, k[:, :, :128], v[:, :, :128])
  _assert_close(out, ref_out, 2e-5)
  _assert_close(lse, ref_lse, 2e-5 * _scale(ref_lse))


def test_no_data_races_in_tpu_interpreter(rng):
  """Every launch of the forward and of the gradient (forward, dq, dk/dv)."""
  from pallas_kernels import _backend
  q, k, v = _qkv((1, 2, 130, 16), (1, 1, 130, 16), rng)

  def run(q, k, v):
    out = pk.flash_attention(q, k, v, causal=True, block_sizes=(128, 128))
    grads = jax.grad(lambda q, k, v: pk.flash_attention(
        q, k, v, causal=True, block_sizes=(128, 128)).sum(),
                     argnums=(0, 1, 2))(q, k, v)
    return out, grads

  (out, _), log = _backend.find_races(run, q, k, v)
  assert log.launches >= 4, log   # forward; forward, dq, dk/dv in the grad
  assert not log.found, log
  ref, _ = oracle.attention(q, k, v, causal=True)
  _assert_close(out, ref, 2e-5)


@pytest.mark.parametrize("blocks,lq", [
    # Separate backward blocks; the default table blocks at a length they
    # must shrink for (1100 -> 128).
    (BlockSizes(block_q=256, block_kv=128, block_q_bwd=128,
                block_kv_bwd=256), 300),
    (None, 1100)])
def test_tpu_block_sizes(blocks, lq, rng):
  q, k, v = _qkv((1, 2, lq, 16), (1, 2, lq, 16), rng)
  d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  def forward_and_backward(q, k, v):
    out, vjp = jax.vjp(functools.partial(
        pk.flash_attention, causal=True, sliding_window=(600, 0),
        block_sizes=blocks), q, k, v)
    return out, vjp(d_out)
  with force_interpret("generic"):
    out, (dq, dk, dv) = jax.jit(forward_and_backward)(q, k, v)
  ref_out, _, ref = oracle.attention(q, k, v, causal=True,
                                     sliding_window=(600, 0), d_out=d_out)
  _assert_close(out, ref_out, 2e-5)
  for got, want in zip((dq, dk, dv), ref):
    _assert_close(got, want, 1e-4 * _scale(want))


@given(lq=st.integers(1, 2000), lk=st.integers(1, 2000),
       bq=st.sampled_from([128, 256, 512]), bk=st.sampled_from([128, 256, 512]),
       causal=st.booleans(),
       left=st.one_of(st.none(), st.integers(0, 2500)),
       right=st.one_of(st.none(), st.integers(0, 2500)))
def test_block_skipping_is_conservative_and_tight(lq, lk, bq, bk, causal, left,
                                                  right):
  """The band's block tables list exactly the blocks holding an allowed
  entry (both walks), and blocks listed as full are fully allowed."""
  if causal:
    right = 0 if right is None else min(right, 0)
  geom = mosaic_tpu._geometry(lq, lk, bq, bk, False, False, left, right)
  allowed = oracle.mask(lq, lk, sliding_window=(left, right))[0, 0]
  padded = np.zeros((geom.q_pad, geom.kv_pad), bool)
  padded[:lq, :lk] = allowed
  blocks = padded.reshape(geom.num_q, bq, geom.num_kv, bk).transpose(0, 2, 1, 3)
  any_allowed = blocks.any(axis=(2, 3))
  real_rows = (np.arange(geom.q_pad) < lq).reshape(geom.num_q, 1, bq, 1)
  full = (blocks | ~real_rows).all(axis=(2, 3))
  if left is None and right is None:
    assert geom.tables is None          # no band: the plain grid
    return
  t = geom.tables
  listed = np.zeros_like(any_allowed)
  unmasked = np.zeros_like(any_allowed)
  for i in range(geom.num_q):
    listed[i, t.kv_index[0, i, :t.kv_total[0, i]]] = True
    unmasked[i, t.kv_index[0, i, t.kv_partial[0, i]:t.kv_total[0, i]]] = True
  np.testing.assert_array_equal(listed, any_allowed)
  assert not np.any(unmasked & ~full)
  listed_t = np.zeros_like(any_allowed)
  for j in range(geom.num_kv):
    listed_t[t.q_index[0, j, :t.q_total[0, j]], j] = True
  np.testing.assert_array_equal(listed_t, any_allowed)
  # The walks step once per live block (an empty row once), and list each
  # live block exactly once.
  for major, live in (("kv", any_allowed), ("q", any_allowed.T)):
    walk = geom.walks[major]
    runs = (walk.flags[0] & masks.RUNS) != 0
    pairs = sorted(zip(walk.row[0][runs], walk.col[0][runs]))
    assert pairs == sorted(zip(*np.nonzero(live)))
    assert geom.grid(major, 1, 1)[-1] == np.maximum(live.sum(axis=1), 1).sum()


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
  # The walk: a 1024 window at L = 131072 steps through its 765 live
  # blocks, not 256 x 256.
  geom = mosaic_tpu._geometry(131072, 131072, 512, 512, False, True, 1024,
                              None)
  assert geom.grid("kv", 1, 1) == (1, 1, 765)
  backward = mosaic_tpu.cost(4, 16, 4096, 4096, 128, 2, backward=True)
  assert backward["flops"] == 3.5 * full["flops"]
  # MLA (D 192 padded to 256, Dv 128): the QK^T matmuls at D, P V at Dv.
  mla = mosaic_tpu.cost(4, 16, 4096, 4096, 192, 2, block_q=256,
                        block_kv=256, value_dim=128)
  assert mla["flops"] == 2 * 4 * 16 * 4096 * 4096 * (256 + 128)
  mla_bwd = mosaic_tpu.cost(4, 16, 4096, 4096, 192, 2, backward=True,
                            value_dim=128)
  assert mla_bwd["flops"] == 2 * 4 * 16 * 4096 * 4096 * (4 * 256 + 3 * 128)
  assert mla_bwd["vmem_bytes"] < mosaic_tpu.cost(
      4, 16, 4096, 4096, 256, 2, backward=True)["vmem_bytes"]
  # The table's VMEM per generation: tests/test_tile_tables.py.


def test_block_size_table_follows_the_target_and_fits_lengths():
  def forward_blocks(generation=None, length=4096, masked=False):
    chosen = block_sizes.choose(length, length, 128, generation=generation,
                                masked=masked)
    return chosen.fwd_q, chosen.fwd_kv
  assert forward_blocks() == (1024, 2048)      # no TPU attached: v5e
  for generation, want in (("v6e", (2048, 1024)), ("v5p", (512, 2048)),
                           ("tpu7x", (1024, 512)), ("v4", (512, 512))):
    with _backend.target_override(tpu_generation=generation):
      assert forward_blocks() == want, generation
  # Masked calls (causal, window, mask) have their own rows, by length.
  for generation, length, want in (("v5e", 2048, (512, 512)),
                                   ("v5e", 8192, (1024, 1024)),
                                   ("v5p", 8192, (1024, 1024)),
                                   ("v6e", 2048, (1024, 1024))):
    assert forward_blocks(generation, length, True) == want, (generation,
                                                              length)
  assert forward_blocks("v5e", 256, False) == (256, 256)   # shrunk to fit
  chosen = block_sizes.choose(4096, 4096, 128, generation="tpu7x")
  assert (chosen.bwd_q, chosen.bwd_kv) == (512, 1024)
  # Short or awkward lengths shrink the block instead of padding a lot.
  assert block_sizes.fit_block(512, 1) == 128
  assert block_sizes.fit_block(512, 600) == 128
  assert block_sizes.fit_block(512, 1000) == 512
  chosen = block_sizes.choose(4096, 4096, 128, BlockSizes(block_kv=256),
                              generation="v5e")
  assert (chosen.fwd_kv, chosen.bwd_kv) == (256, 256)
  # The Triton kernels' block sizes leave the table in charge.
  gpu_blocks = block_sizes.as_block_sizes(triton.GpuBlockSizes(block_q=64))
  assert isinstance(gpu_blocks, triton.GpuBlockSizes)
  assert block_sizes.choose(4096, 4096, 128, gpu_blocks, generation="v5e") == (
      block_sizes.choose(4096, 4096, 128, generation="v5e"))
  assert block_sizes.padded_head_dim(64) == 64
  assert block_sizes.padded_head_dim(65) == 128
