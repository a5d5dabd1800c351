"""The Mosaic GPU (Hopper) flash-attention kernels' own pieces, in jax's
Mosaic GPU interpreter (warpgroups, barriers and TMA copies simulated on the
CPU).

The shared suite (``test_attention.py``) runs these kernels through
``flash_attention``; here: what ``supports`` declines, the CUDA lowering of
every schedule on this host, and interpreter runs of the schedules and ring
paths the suite's shapes do not reach (lagged V refills, ring refills under
a window, warpgroups without keys). The interpreter runs barriers, ring
slots, band arithmetic and masks; the wgmmas run as plain dots (module
docstring), so the wgmma calls themselves are checked on a GPU by the
benchmarks. Against the float64 oracle (``tests/oracles/attention.py``):
outputs and gradients are bf16/fp16-rounded and P is rounded before P V:
relative L2 error 1e-2, max abs 3e-2 on O(1) values; lse is float32: 1e-4.

Skipped where jax has no Mosaic GPU interpreter (jax < 0.10, e.g. 0.7.1);
there only ``supports`` is checked (it must decline).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oracles import attention as oracle
import sweeps
from pallas_kernels import _compat
from pallas_kernels.attention import masks, mosaic_gpu, mosaic_gpu_bwd

INTERPRET = mosaic_gpu.interpret_params()
needs_interpreter = pytest.mark.skipif(
    mosaic_gpu.api_missing() is not None or INTERPRET is None,
    reason="this jax has no Mosaic GPU Pallas interpreter")


def _inputs(rng, b, h, hk, lq, lk, d, dtype):
  make = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
  return make(b, h, lq, d), make(b, hk, lk, d), make(b, hk, lk, d)


def _run(q, k, v, *, causal=False, left=None, right=None, cap=None,
         interpret=None):
  d = q.shape[-1]
  return mosaic_gpu.forward(
      q, k, v, None, None, None, sm_scale=1 / math.sqrt(d), causal=causal,
      window_left=left, window_right=right, logit_soft_cap=cap,
      interpret=INTERPRET if interpret is None else interpret)


def _oracle_mask(causal=False, left=None, right=None, cap=None):
  return dict(causal=causal, sliding_window=(left, right),
              logit_soft_cap=cap)


def _check(rng, b, h, hk, lq, lk, d, dtype=jnp.bfloat16, **mask):
  q, k, v = _inputs(rng, b, h, hk, lq, lk, d, dtype)
  out, lse = _run(q, k, v, **mask)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert lse.shape == q.shape[:3] and lse.dtype == jnp.float32
  ref_out, ref_lse = oracle.attention(q, k, v, **_oracle_mask(**mask))
  out = np.asarray(out.astype(jnp.float32), np.float64)
  lse = np.asarray(lse, np.float64)
  assert not np.isnan(out).any() and not np.isnan(lse).any()
  rel = np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out)
  assert rel < 1e-2, rel
  np.testing.assert_allclose(out, ref_out, atol=3e-2, rtol=0)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
  finite = np.isfinite(ref_lse)
  np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=1e-4, rtol=0)
  return out, lse, ref_lse


# ------------------------------------------------------------- supports --

def _sds(shape, dtype=jnp.bfloat16):
  return jax.ShapeDtypeStruct(shape, dtype)


def _accepted_gqa_call(supports):
  """(q, kv) of a plain GQA call that ``supports`` must accept, after
  checking so; (None, None) where this jax lacks the API (then it must
  decline with a reason)."""
  q, kv = _sds((1, 4, 256, 128)), _sds((1, 2, 256, 128))
  if mosaic_gpu.api_missing() is not None:
    assert isinstance(supports(q, kv, kv), str)
    return None, None
  assert supports(q, kv, kv) is None
  return q, kv


def test_supports_declines_without_the_api_or_with_unsupported_inputs():
  q, kv = _accepted_gqa_call(mosaic_gpu.supports)
  if q is None:
    return
  bias = _sds((1, 4, 256, 256), jnp.float32)
  seg = _sds((1, 256), jnp.int32)
  cases = {
      "bias": (q, kv, kv, None, bias),
      "segment": (q, kv, kv, seg),
      "bf16 or all fp16": (_sds(q.shape, jnp.float32), kv, kv),
      "head_dim": (_sds((1, 4, 256, 48)), _sds((1, 2, 256, 48)),
                   _sds((1, 2, 256, 48))),
      "empty": (_sds((1, 4, 0, 128)), kv, kv),
  }
  for needle, args in cases.items():
    reason = mosaic_gpu.supports(*args)
    assert isinstance(reason, str) and needle in reason, (needle, reason)


def test_forward_rejects_unsupported_calls():
  q = jnp.zeros((1, 1, 128, 48), jnp.bfloat16)
  with pytest.raises(ValueError, match="unsupported"):
    _run(q, q, q, interpret=False)


@pytest.mark.skipif(mosaic_gpu.api_missing() is not None,
                    reason="no Mosaic GPU Pallas API in this jax")
@pytest.mark.parametrize("d,lk,mask", [
    (64, 1500, dict(causal=True, left=100, cap=3.0)),   # rendezvous
    (128, 1536, {}),                                    # overlapped steps
    (128, 1500, dict(causal=True, left=100)),           # hardware ping-pong
    (80, 1536, {}),                     # 32-byte swizzle, overlapped steps
    (96, 1500, dict(causal=True)),      # 64-byte swizzle, ping-pong
    (192, 1500, dict(causal=True)),     # 128-byte swizzle, 64-key blocks
    (256, 1500, dict(causal=True)),     # rendezvous above 128
    (256, 1536, {})])                   # overlapped steps, 64-key blocks
def test_gpu_kernel_lowers_for_cuda_on_a_cpu_host(d, lk, mask):
  # Pallas -> Mosaic GPU lowering of each schedule (wgmma, hardware
  # barriers, accumulator waits); only the PTX compile needs the GPU.
  q, kv = _sds((2, 4, 1000, d)), _sds((2, 2, lk, d))
  fn = lambda q, k, v: _run(q, k, v, interpret=False, **mask)  # noqa: E731
  out, lse = jax.eval_shape(fn, q, kv, kv)
  assert out.shape == q.shape and lse.shape == q.shape[:3]
  assert "mosaic_gpu" in _compat.lower_for_cuda(fn, q, kv, kv).as_text()


# ---------------------------------------------------------- interpreter --

@needs_interpreter
def test_more_queries_than_keys_gives_empty_rows(rng):
  # Causal with Lq > Lk: the first Lq - Lk rows see no key (out 0, lse -inf);
  # a whole warpgroup's rows and the second tile's padding have no band.
  out, lse, _ = _check(rng, 1, 1, 1, 200, 40, 128, causal=True)
  assert np.all(np.isneginf(lse[..., :160]))
  assert np.all(out[..., :160, :] == 0)


@needs_interpreter
def test_window_soft_cap_fp16_ring_refill(rng):
  # Sliding window on both sides with 256-key blocks and 2 slots: the band
  # starts past block 0 (leading blocks skipped), and refills reuse slots.
  _check(rng, 1, 1, 1, 128, 520, 64, dtype=jnp.float16, left=150, right=40,
         cap=4.0)


@needs_interpreter
def test_overlapped_steps_and_lagged_ring(rng):
  # head_dim 128 without a mask runs the overlapped schedule; three 128-key
  # blocks in two slots make the lagged V refills wrap around the ring.
  _check(rng, 1, 2, 1, 200, 384, 128)


@needs_interpreter
def test_overlapped_steps_above_head_dim_128(rng):
  # head_dim 256 without a mask: the overlapped schedule on 64-key blocks
  # (five of them, the ring wrapped twice).
  _check(rng, 1, 2, 1, 130, 320, 256)


def test_default_schedule_by_mask():
  schedule = functools.partial(mosaic_gpu.default_schedule, block_k=128,
                               window_left=None, window_right=None,
                               soft_cap=None)
  assert schedule(128, lk=4096, causal=False) == (True, False)
  assert schedule(128, lk=4096, causal=True) == (False, True)
  assert schedule(128, lk=4000, causal=False) == (False, True)  # ragged
  assert schedule(64, lk=4096, causal=False) == (False, False)
  assert schedule(256, lk=4096, causal=False) == (True, False)
  assert schedule(256, lk=4096, causal=True) == (False, False)
  assert mosaic_gpu.default_schedule(128, 128, 4096, False, 100, None,
                                     None) == (False, True)
  assert mosaic_gpu.default_schedule(128, 128, 4096, False, None, None,
                                     5.0) == (False, True)


@pytest.mark.slow
@needs_interpreter
@pytest.mark.parametrize("d,causal", [(128, False), (256, True)])
def test_square_multi_tile(rng, d, causal):
  _check(rng, 1, 2, 2, 256, 256, d, causal=causal)


@pytest.mark.slow
@needs_interpreter
def test_interpreted_kernel_is_deterministic(rng):
  q, k, v = _inputs(rng, 1, 1, 1, 128, 256, 64, jnp.bfloat16)
  first = _run(q, k, v, causal=True)
  second = _run(q, k, v, causal=True)
  for a, b in zip(first, second):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------ backward --
# attention/mosaic_gpu_bwd.py's dq and dk/dv kernels in the same interpreter,
# given the float64 forward's lse and delta. Tolerances as above: P and dS
# are rounded to the input dtype before their matmuls and the gradients are
# returned in it.


def _check_backward(kernel, rng, b, h, hk, lq, lk, d, dtype=jnp.bfloat16,
                    causal=False, left=None, right=None, cap=None):
  """Runs ``mosaic_gpu_bwd.<kernel>`` ("dkv" or "dq") in the interpreter and
  checks its gradients against the float64 ones; returns them."""
  q, k, v = _inputs(rng, b, h, hk, lq, lk, d, dtype)
  do = jnp.asarray(rng.standard_normal(q.shape), dtype)
  f64 = lambda x: np.asarray(x.astype(jnp.float32), np.float64)  # noqa
  scale = 1 / math.sqrt(d)
  out, lse, (dq, dk, dv, _) = oracle.attention(
      q, k, v, d_out=do, sm_scale=scale,
      **_oracle_mask(causal=causal, left=left, right=right, cap=cap))
  delta = mosaic_gpu_bwd.delta_of(jnp.asarray(out, jnp.float32), do)
  got = getattr(mosaic_gpu_bwd, kernel)(
      q, k, v, do, jnp.asarray(lse, jnp.float32), delta, sm_scale=scale,
      causal=causal, window_left=left, window_right=right,
      logit_soft_cap=cap, interpret=INTERPRET)
  names, refs = (("dk", "dv"), (dk, dv)) if kernel == "dkv" else (("dq",),
                                                                 (dq,))
  got = tuple(got) if kernel == "dkv" else (got,)
  for name, x, ref in zip(names, got, refs):
    assert x.shape == ref.shape and x.dtype == dtype, name
    x = f64(x)
    assert np.isfinite(x).all(), name
    rel = np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30)
    assert rel < 1e-2, (name, rel)
    np.testing.assert_allclose(x, ref, atol=3e-2, rtol=0, err_msg=name)
  return [f64(x) for x in got]


_check_dkv = functools.partial(_check_backward, "dkv")


def _check_dq(*args, **kwargs):
  [dq] = _check_backward("dq", *args, **kwargs)
  return dq


def test_backward_supports_declines_what_it_cannot_run():
  q, kv = _accepted_gqa_call(mosaic_gpu_bwd.supports)
  if q is None:
    return
  seg = _sds((1, 256), jnp.int32)
  bias = _sds((1, 4, 256, 256), jnp.float32)
  d288 = _sds((1, 4, 256, 288))
  cases = {
      "bias": (q, kv, kv, None, bias),
      "segment": (q, kv, kv, seg),
      "bf16 or all fp16": (_sds(q.shape, jnp.float32), kv, kv),
      "head_dim <= 256": (d288, d288, d288),
      "empty": (_sds((1, 4, 0, 128)), kv, kv),
  }
  for needle, args in cases.items():
    reason = mosaic_gpu_bwd.supports(*args)
    assert isinstance(reason, str) and needle in reason, (needle, reason)
  with pytest.raises(ValueError, match="unsupported"):
    mosaic_gpu_bwd.dkv(jnp.zeros((1, 1, 64, 72), jnp.bfloat16),
                       *([jnp.zeros((1, 1, 64, 72), jnp.bfloat16)] * 3),
                       jnp.zeros((1, 1, 64)), jnp.zeros((1, 1, 64)),
                       sm_scale=1.0, causal=False, window_left=None,
                       window_right=None, logit_soft_cap=None)


@pytest.mark.skipif(mosaic_gpu.api_missing() is not None,
                    reason="no Mosaic GPU Pallas API in this jax")
@pytest.mark.parametrize("kernel", ["dq", "dkv"])
@pytest.mark.parametrize("d", [64, 80, 96, 128, 160, 256])
def test_backward_kernels_lower_for_cuda_on_a_cpu_host(kernel, d):
  # The Pallas -> Mosaic GPU lowering (wgmmas, layouts, TMA) runs here; only
  # the final PTX compile needs the GPU.
  q, kv = _sds((2, 4, 1000, d)), _sds((2, 2, 1500, d))
  rows = _sds((2, 4, 1000), jnp.float32)
  fn = lambda *a: getattr(mosaic_gpu_bwd, kernel)(  # noqa: E731
      *a, sm_scale=0.1, causal=True, window_left=100, window_right=None,
      logit_soft_cap=3.0)
  shapes = jax.eval_shape(fn, q, kv, kv, q, rows, rows)
  want = [q.shape] if kernel == "dq" else [kv.shape, kv.shape]
  assert [x.shape for x in jax.tree_util.tree_leaves(shapes)] == want
  text = _compat.lower_for_cuda(fn, q, kv, kv, q, rows, rows).as_text()
  assert "mosaic_gpu" in text


@needs_interpreter
def test_dkv_more_queries_than_keys_and_empty_rows(rng):
  # Causal with Lq > Lk: the first Lq - Lk query rows see no key (lse -inf).
  _check_dkv(rng, 1, 1, 1, 200, 40, 128, causal=True)


@needs_interpreter
def test_dkv_window_soft_cap_fp16_ring_refill(rng):
  # A two-sided window skips leading and trailing q blocks of each
  # warpgroup; the 2 ring slots are refilled; soft cap scales dS by
  # 1 - tanh^2.
  _check_dkv(rng, 1, 1, 1, 400, 260, 64, dtype=jnp.float16, left=150,
             right=40, cap=4.0)


@pytest.mark.slow
@needs_interpreter
def test_dkv_full_mask_multi_head_group(rng):
  _check_dkv(rng, 2, 4, 2, 128, 256, 128)


@needs_interpreter
def test_dq_more_queries_than_keys_gives_zero_rows(rng):
  got = _check_dq(rng, 1, 1, 1, 140, 20, 128, causal=True)
  assert np.all(got[..., :120, :] == 0)


@needs_interpreter
def test_dq_window_soft_cap_fp16_ring_refill(rng):
  _check_dq(rng, 1, 1, 1, 130, 520, 64, dtype=jnp.float16, left=150,
            right=40, cap=4.0)


@pytest.mark.skipif(mosaic_gpu.api_missing() is not None,
                    reason="no Mosaic GPU Pallas API in this jax")
def test_head_dims_off_the_16_grid_run_zero_padded():
  """head_dim 72 runs the 80-wide kernels (forward and backward) on
  zero-padded features: the same function, cropped back."""
  import backends
  import pallas_kernels as pk
  rng = np.random.default_rng(3)
  q, k, v, do = (jnp.asarray(rng.standard_normal((1, 2, 200, 72)),
                             jnp.bfloat16) for _ in range(4))
  backend = backends.Backend("mosaic_gpu", "mosaic_gpu", "generic")

  def vjp(backend):
    out, pull = jax.vjp(lambda q, k, v: pk.flash_attention(
        q, k, v, causal=True, backend=backend), q, k, v)
    return (out,) + pull(do)
  got = backend.run(vjp)
  want = oracle.attention(q, k, v, causal=True, d_out=do)
  for name, g, w in zip(("out", "dq", "dk", "dv"), got,
                        (want[0],) + want[2][:3]):
    assert g.shape == (1, 2, 200, 72), name
    w = np.asarray(w)
    err = np.max(np.abs(np.asarray(g, np.float64) - w))
    assert err <= 5e-2 * max(1.0, np.max(np.abs(w))), (name, err)


def test_head_dims_run_natively_on_the_16_grid():
  # Multiples of 16 from 64 run at their own width; others round up.
  width = mosaic_gpu.kernel_head_dim
  assert [width(d, 256) for d in (64, 72, 80, 96, 100, 112, 192, 256)] == [
      64, 80, 80, 96, 112, 112, 192, 256]
  assert width(48, 256) is None and width(144, 128) is None
  assert width(257, 256) is None
  # The widest swizzle whose span divides a bf16/fp16 row (2-byte elements).
  swizzle = functools.partial(mosaic_gpu.swizzle_bytes, dtype=jnp.bfloat16)
  assert [swizzle(d) for d in (64, 80, 96, 112, 128, 160, 192, 256)] == [
      128, 32, 64, 32, 128, 64, 128, 128]
  with pytest.raises(ValueError, match="swizzle"):
    swizzle(72)
  assert mosaic_gpu.block_k_for(80) == mosaic_gpu.block_k_for(128) == 128
  assert mosaic_gpu.block_k_for(192) == 64


@needs_interpreter
@pytest.mark.parametrize("d", [80, 96])
def test_native_head_dims_overlapped_and_masked(rng, d):
  # Three 128-key blocks without a mask (the overlapped schedule with lagged
  # V refills), then a causal window (the ping-pong with masked steps).
  _check(rng, 1, 2, 1, 130, 384, d)
  _check(rng, 1, 1, 1, 200, 300, d, causal=True, left=90)


@needs_interpreter
@pytest.mark.parametrize("d", [80, 96])
def test_native_head_dims_backward(rng, d):
  _check_dkv(rng, 1, 2, 1, 150, 200, d, causal=True)
  _check_dq(rng, 1, 2, 1, 150, 200, d, causal=True)


@needs_interpreter
def test_split_head_dim_backward(rng):
  # Above head_dim 128 both compute warpgroups share one 64-row block by
  # role: one forms P and hands it over through SMEM, the other forms dS (a
  # GQA group of two; a two-sided window with a soft cap: leading and
  # trailing blocks skipped, masked edges, P handed over times 1 - tanh^2).
  _check_dkv(rng, 1, 2, 1, 150, 200, 256, causal=True)
  _check_dq(rng, 1, 2, 1, 150, 200, 256, causal=True)
  _check_dkv(rng, 1, 1, 1, 140, 260, 192, left=60, right=20, cap=3.0)
  _check_dq(rng, 1, 1, 1, 140, 260, 192, left=60, right=20, cap=3.0)


def test_backward_head_dims_split_above_128():
  width = mosaic_gpu_bwd.kernel_head_dim
  assert [width(d) for d in (64, 72, 128, 136, 144, 160, 176, 256)] == [
      64, 80, 128, 160, 160, 160, 192, 256]
  assert width(48) is None and width(272) is None
  assert [mosaic_gpu_bwd.split_of(d) for d in (128, 160, 256)] == [1, 2, 2]


# ---------------------------------------------------------- static masks --

_LOWERED_MASKS = [
    masks.ChunkedCausal(300) | masks.PrefixLM(100),
    masks.Local(200, 50) & masks.PrefixLM(64),
    masks.Dense(np.tri(1000, 1500, 500, dtype=bool)),
]


@pytest.mark.skipif(mosaic_gpu.api_missing() is not None,
                    reason="no Mosaic GPU Pallas API in this jax")
@pytest.mark.parametrize("d,mask", sweeps.covering_pairs(
    [64, 128, 256], [(m,) for m in _LOWERED_MASKS]),
    ids=lambda v: {64: "64", 128: "128", 256: "256"}.get(v, type(v).__name__))
def test_masked_kernels_lower_for_cuda_on_a_cpu_host(d, mask):
  # Forward, dq and dk/dv with a table walk and an in-kernel formula (or
  # element tiles loaded from global memory).
  q, kv = _sds((1, 4, 1000, d)), _sds((1, 2, 1500, d))
  rows = _sds((1, 4, 1000), jnp.float32)
  kw = dict(sm_scale=0.1, causal=False, window_left=None, window_right=None,
            logit_soft_cap=None, mask=mask)
  fwd = lambda q, k, v: mosaic_gpu.forward(  # noqa: E731
      q, k, v, None, None, None, interpret=False, **kw)
  assert "mosaic_gpu" in _compat.lower_for_cuda(fwd, q, kv, kv).as_text()
  for kernel in ("dq", "dkv"):
    fn = functools.partial(getattr(mosaic_gpu_bwd, kernel), **kw)
    text = _compat.lower_for_cuda(fn, q, kv, kv, q, rows, rows).as_text()
    assert "mosaic_gpu" in text


def test_mask_table_lists_live_blocks_heaviest_tiles_first():
  # PrefixLM(200) at 128-row tiles and 128-key blocks over 512 x 512:
  # tile t sees blocks 0..t (causal) and block 1 (the prefix) as well.
  table, tiles = mosaic_gpu.mask_tables(masks.PrefixLM(200), 512, 512, 128,
                                        128, 512, 512)
  assert tiles is None                                 # a formula mask
  header = mosaic_gpu.TABLE_HEADER
  assert table[:, 0].tolist() == [3, 2, 0, 1]          # longest first
  assert table[:, 2].tolist() == [4, 3, 2, 2]          # listed blocks
  for tile, partial, total, *blocks in table.tolist():
    listed = blocks[:total]
    assert sorted(listed) == list(range(max(tile, 1) + 1))
    # Partial first: past the prefix, the diagonal block; before it, block
    # 1 (cut by the prefix's end at 200) and none of block 0 (all prefix).
    assert (tile if tile >= 2 else 1) in listed[:partial]
    assert 0 in listed[partial:] or tile >= 2
  # Key-major (dk/dv): key tile 1 (keys 128..255) is seen by every q block.
  kv_table, _ = mosaic_gpu.mask_tables(masks.PrefixLM(200), 512, 512, 128,
                                       128, 512, 512, kv_major=True)
  row = kv_table[kv_table[:, 0] == 1][0]
  assert sorted(row[header:header + row[2]].tolist()) == [0, 1, 2, 3]


def test_dense_mask_tiles_are_stored_once():
  # A causal Dense mask over 512 x 512: the four diagonal 128 x 128 tiles
  # are partial and equal, so one element tile serves them all.
  dense = masks.Dense(np.tril(np.ones((512, 512), bool)))
  table, tiles = mosaic_gpu.mask_tables(dense, 512, 512, 128, 128, 512, 512)
  assert tiles.shape == (1, 128, 128)
  np.testing.assert_array_equal(np.asarray(tiles[0], np.float32),
                                np.tril(np.ones((128, 128))))
  width = (table.shape[1] - mosaic_gpu.TABLE_HEADER) // 2
  assert table[:, 1].tolist() == [1, 1, 1, 1]          # one partial each
  assert np.all(table[:, mosaic_gpu.TABLE_HEADER + width] == 0)
  # Key-major tiles are transposed: rows are keys.
  _, kv_tiles = mosaic_gpu.mask_tables(dense, 512, 512, 128, 128, 512, 512,
                                       kv_major=True)
  np.testing.assert_array_equal(np.asarray(kv_tiles[0], np.float32),
                                np.triu(np.ones((128, 128))))


def test_supports_takes_masks_shared_by_every_head():
  q, kv = _accepted_gqa_call(mosaic_gpu.supports)
  if q is None:
    return
  dense = masks.Dense(np.tril(np.ones((256, 256), bool)))
  for supports in (mosaic_gpu.supports, mosaic_gpu_bwd.supports):
    assert supports(q, kv, kv, mask=masks.ChunkedCausal(64)) is None
    assert supports(q, kv, kv, mask=dense & masks.Local(9, 9)) is None
    reason = supports(q, kv, kv, mask=(masks.Causal(),) * 4)
    assert isinstance(reason, str) and "per-head" in reason
