"""The Triton flash-attention kernels' own pieces, and the GPU kernel choice.

The shared suite (``test_attention.py``) runs these kernels through
``flash_attention``; here: their loop bounds against brute force, the tile
table, the launch order, windows the public API cannot express (a negative
right reach), the head_dim-256 tiles, and what a CUDA lowering on this CPU
host contains. Kernels run in Pallas' interpreter and are compared with the
float64 oracle (``tests/oracles/attention.py``): float32 out 2e-5, gradients
1e-4; bfloat16 out 2e-2, gradients 5e-2 (max abs error over
max(1, max |expected|)).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import pallas_kernels as pk
from oracles import attention as oracle
from pallas_kernels import _backend, _compat, force_interpret
from pallas_kernels.attention import mosaic_gpu
from pallas_kernels.attention import triton as gpu

SMALL = gpu.GpuBlockSizes(block_q=16, block_k=16, block_q_dq=16,
                          block_k_dq=32, block_q_dkv=32, block_k_dkv=16)


def _assert_close(got, want, tol, what):
  got, want = np.asarray(got).astype(np.float64), np.asarray(want)
  assert got.shape == want.shape, what
  np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), what)
  finite = np.isfinite(want)
  scale = max(1.0, float(np.max(np.abs(want[finite]), initial=0)))
  np.testing.assert_allclose(got[finite], want[finite], rtol=0,
                             atol=tol * scale, err_msg=what)


def check_kernels(rng, b, h, hk, lq, lk, d, *, causal=False, left=None,
                  right=None, bias_shape=None, sizes=SMALL):
  """triton.forward and .backward (interpreted) against the oracle."""
  q, k, v, do = (jnp.asarray(rng.standard_normal(s), jnp.float32)
                 for s in ((b, h, lq, d), (b, hk, lk, d), (b, hk, lk, d),
                           (b, h, lq, d)))
  bias = (None if bias_shape is None else
          jnp.asarray(rng.standard_normal(bias_shape), jnp.float32))
  kw = dict(sm_scale=0.3, causal=causal, window_left=left,
            window_right=right, logit_soft_cap=None, block_sizes=sizes,
            interpret=True)

  @jax.jit
  def run(q, k, v, bias, do):
    out, lse = gpu.forward(q, k, v, None, None, bias, **kw)
    return out, lse, gpu.backward(q, k, v, None, None, bias, out, lse, do,
                                  None, **kw)
  out, lse, grads = run(q, k, v, bias, do)
  want_out, want_lse, want_grads = oracle.attention(
      q, k, v, causal=causal, sm_scale=0.3, sliding_window=(left, right),
      bias=bias, d_out=do)
  _assert_close(out, want_out, 2e-5, "out")
  _assert_close(lse, want_lse, 2e-5, "lse")
  for name, got, want in zip(("dq", "dk", "dv", "dbias"), grads, want_grads):
    if want is None:
      assert got is None
    else:
      _assert_close(got, want, 1e-4, name)
  return lse


# ----------------------------------------------------------- the kernels --

@pytest.mark.parametrize("left,right", [(50, -30), (20, -4)])
def test_window_right_of_the_diagonal_leaves_rows_without_keys(rng, left,
                                                               right):
  # right < 0: the first -right rows see no key (lse -inf, out 0).
  lse = check_kernels(rng, 1, 2, 1, 40, 40, 16, left=left, right=right)
  assert np.isneginf(np.asarray(lse)[:, :, :-right]).all()


@pytest.mark.parametrize("chunk", [0, 2])
def test_causal_launch_orders_match_float64(rng, chunk):
  # 96 rows in blocks of 16/32: a chunked grid of several chunks per head.
  check_kernels(rng, 2, 4, 2, 96, 96, 16, causal=True,
                bias_shape=(2, 4, 96, 96),
                sizes=gpu.dataclasses.replace(SMALL, band_chunk=chunk))


@pytest.mark.parametrize("causal", [False, True])
def test_bfloat16_head_dim_256_default_tiles(rng, causal):
  # The 512-byte-row defaults (forward 128x64, dk/dv 64x64), fitted to 128.
  q, k, v, do = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
                 for s in ((1, 2, 100, 256), (1, 1, 130, 256),
                           (1, 1, 130, 256), (1, 2, 100, 256)))
  fn = functools.partial(pk.flash_attention, causal=causal, backend="triton")
  with force_interpret("generic"):
    out, vjp = jax.vjp(fn, q, k, v)
    grads = vjp(do)
  want_out, _, want_grads = oracle.attention(q, k, v, causal=causal,
                                             d_out=do)
  _assert_close(out, want_out, 2e-2, "out")
  for name, got, want in zip(("dq", "dk", "dv"), grads, want_grads):
    _assert_close(got, want, 5e-2, name)


def test_other_block_size_types_are_ignored(rng):
  # The TPU kernels' block sizes reach this kernel too: defaults apply.
  q = jnp.asarray(rng.standard_normal((1, 1, 20, 16)), jnp.float32)
  with force_interpret("generic"):
    out = pk.flash_attention(q, q, q, block_sizes=(128, 128),
                             backend="triton")
  _assert_close(out, oracle.attention(q, q, q)[0], 2e-5, "out")


def test_traces_without_interpret_on_cpu():
  # backend=None traces the cuda branch on every host: it must trace here.
  q = jax.ShapeDtypeStruct((2, 4, 100, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 2, 100, 64), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((2, 100), jnp.int32)
  bias = jax.ShapeDtypeStruct((1, 4, 100, 100), jnp.float32)
  kw = dict(sm_scale=0.125, causal=True, window_left=30, window_right=None,
            logit_soft_cap=5.0, block_sizes=None, interpret=False)
  out, lse = jax.eval_shape(functools.partial(gpu.forward, **kw),
                            q, kv, kv, seg, seg, bias)
  assert out.shape == (2, 4, 100, 64) and out.dtype == jnp.bfloat16
  assert lse.shape == (2, 4, 100) and lse.dtype == jnp.float32
  grads = jax.eval_shape(functools.partial(gpu.backward, **kw),
                         q, kv, kv, seg, seg, bias, out, lse, q, None)
  assert [g.shape for g in grads] == [q.shape, kv.shape, kv.shape, bias.shape]


# ----------------------------------------------------------- loop bounds --

def _touched_blocks(valid, block_rows, block_cols):
  """Per row block, the set of column blocks holding an allowed entry."""
  n_rows = -(-valid.shape[0] // block_rows)
  n_cols = -(-valid.shape[1] // block_cols)
  return [{c for c in range(n_cols)
           if valid[i * block_rows:(i + 1) * block_rows,
                    c * block_cols:(c + 1) * block_cols].any()}
          for i in range(n_rows)]


@given(lq=st.integers(1, 70), lk=st.integers(1, 70),
       causal=st.booleans(),
       left=st.one_of(st.none(), st.integers(0, 80)),
       right=st.one_of(st.none(), st.integers(-40, 80)),
       bq=st.sampled_from([16, 32]), bk=st.sampled_from([16, 32]))
def test_loop_bounds_skip_exactly_the_masked_blocks(lq, lk, causal, left,
                                                     right, bq, bk):
  """[lo, hi) spans exactly the blocks with an allowed entry (where there is
  one); [a, b) holds only blocks allowed throughout."""
  mask = gpu._make_mask(lq, lk, causal, left, right, False)
  valid = oracle.mask(lq, lk, causal=causal, sliding_window=(left, right))
  valid = valid[0, 0]
  # (view, row block, column block, kernel bounds, axis of the keys): the
  # forward/dq kernels walk kv blocks per q block, dk/dv the reverse.
  for view, rows, cols, bounds, key_axis in (
      (valid, bq, bk, gpu._kv_blocks, 1), (valid.T, bk, bq, gpu._q_blocks, 0)):
    for i, touched in enumerate(_touched_blocks(view, rows, cols)):
      lo, a, b, hi = (int(x) for x in bounds(jnp.int32(i * rows), rows, cols,
                                             mask))
      assert lo <= a <= b <= hi
      if touched:
        assert (lo, hi) == (min(touched), max(touched) + 1), (i, lo, hi)
      for c in range(a, b):
        # Unmasked blocks: no padded key, every real query sees every key.
        tile = view[i * rows:(i + 1) * rows, c * cols:(c + 1) * cols]
        assert tile.shape[key_axis] == (rows, cols)[key_axis], (i, c)
        assert tile.all(), (i, c)


# ------------------------------------------------ tiles and launch order --

@pytest.mark.parametrize("bad", [dict(block_q=24), dict(block_k=8),
                                 dict(block_q_dkv=0), dict(num_warps=0),
                                 dict(band_chunk=-1)])
def test_invalid_block_sizes(bad):
  with pytest.raises(ValueError, match=next(iter(bad))):
    gpu.GpuBlockSizes(**bad).resolved(128, banded=True)


def test_default_table_and_overrides():
  bf16_128 = gpu.GpuBlockSizes().resolved(256, banded=False)
  assert (bf16_128.block_q, bf16_128.block_k, bf16_128.num_warps) == (256, 64,
                                                                      8)
  banded = gpu.GpuBlockSizes().resolved(256, banded=True)
  assert (banded.block_q, banded.block_k) == (128, 64)
  # A bias's float32 tiles must fit beside the forward's (shared memory).
  assert gpu.GpuBlockSizes().resolved(256, False, bias=True).block_q == 128
  assert gpu.GpuBlockSizes().resolved(512, False, bias=True).block_q == 64
  wide = gpu.GpuBlockSizes(num_stages_dkv=3).resolved(512, banded=False)
  assert (wide.block_q, wide.block_k, wide.num_stages_dkv) == (128, 64, 3)
  assert (wide.block_q_dkv, wide.block_k_dkv, wide.num_warps_dkv) == (64, 64,
                                                                       8)
  assert all(getattr(wide, f.name) is not None
             for f in gpu.dataclasses.fields(wide))
  # float32 rows of 512 bytes (head_dim 128) keep the smaller tiles.
  f32 = gpu.GpuBlockSizes().resolved(512, banded=False, itemsize=4)
  assert (f32.block_q, f32.block_k, f32.block_k_dkv) == (64, 32, 64)


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


# ------------------------------------------- lowering for CUDA from here --

_TRITON = ("flash_attention_fwd_gpu", "flash_attention_dq_gpu",
           "flash_attention_dkv_gpu")


def _lowered_kernels(d, dtype, capability, bias=False, backend=None):
  """(Triton kernel names, Mosaic GPU calls) in the CUDA lowering of a
  forward and backward, with the target's compute capability set."""
  q = jax.ShapeDtypeStruct((1, 2, 256, d), dtype)
  b = jax.ShapeDtypeStruct((1, 1, 256, 256), jnp.float32) if bias else None

  def fwd_bwd(q, k, v, do, b):
    out, vjp = jax.vjp(lambda *a: pk.flash_attention(
        *a, bias=b, causal=True, backend=backend), q, k, v)
    return out, vjp(do)
  with _backend.target_override(gpu_capability=capability):
    text = _compat.lower_for_cuda(fwd_bwd, q, q, q, q, b).as_text()
  triton_kernels = [name for name in _TRITON
                    if text.count(f'"{name}"') == 1]
  return triton_kernels, text.count("mosaic_gpu")


def test_cuda_gradient_runs_each_triton_kernel_once():
  assert _lowered_kernels(64, jnp.bfloat16, "8.0", backend="gpu") == (
      list(_TRITON), 0)


@pytest.mark.skipif(mosaic_gpu.api_missing() is not None,
                    reason="no Mosaic GPU Pallas API in this jax")
@pytest.mark.parametrize("d,dtype,bias,triton_kernels", [
    (128, jnp.bfloat16, False, []),            # Mosaic GPU both ways
    (256, jnp.bfloat16, False, []),            # split head_dim backward
    (80, jnp.bfloat16, False, []),             # 32-byte swizzled tiles
    (64, jnp.float32, False, list(_TRITON)),   # float32: Triton
    (64, jnp.bfloat16, True, list(_TRITON)),   # bias: Triton
])
def test_hopper_runs_mosaic_gpu_where_it_applies(d, dtype, bias,
                                                 triton_kernels):
  found, mosaic_calls = _lowered_kernels(d, dtype, "9.0", bias=bias)
  assert found == triton_kernels
  assert (mosaic_calls > 0) == (len(triton_kernels) < 3)
