"""Every public op on every zero-sized dimension it has, on every CPU
backend: forward results and gradients have the documented shapes and
values (nothing to compute: zeros, padding, -inf log-sum-exp, bias only).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import backends
import pallas_kernels as pk
from pallas_kernels import nn

ALL = backends.params(every_flavour=True)
PAIRWISE = [pk.pairwise_iou, pk.pairwise_giou, pk.pairwise_diou,
            pk.pairwise_ciou, pk.box_iou]
METRICS = [pk.iou, pk.giou, pk.diou, pk.ciou]
LOSSES = [pk.iou_loss, pk.giou_loss, pk.diou_loss, pk.ciou_loss]


def grads_of(fn, *arrays):
  """Gradients of sum(fn(*arrays)) (float results only) w.r.t. arrays."""
  def total(*a):
    out = fn(*a)
    outs = out if isinstance(out, tuple) else (out,)
    return sum(jnp.sum(jnp.where(jnp.isfinite(o), o, 0)) for o in outs)
  return jax.grad(total, argnums=tuple(range(len(arrays))))(*arrays)


def assert_zero_grads(grads, arrays):
  for g, a in zip(grads, arrays):
    assert g.shape == a.shape and g.dtype == a.dtype
    np.testing.assert_array_equal(np.asarray(g), 0)


@pytest.mark.parametrize("shapes", [((5, 4), (0, 4)), ((0, 4), (3, 4)),
                                    ((0, 5, 4), (0, 3, 4)),
                                    ((2, 0, 4), (1, 3, 4))], ids=str)
@pytest.mark.parametrize("backend", ALL)
def test_pairwise(backend, shapes):
  a, b = jnp.ones(shapes[0]), jnp.zeros(shapes[1])
  batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
  for op in PAIRWISE:
    run = lambda x, y: backend.run(op, x, y)
    out = run(a, b)
    assert out.shape == batch + (a.shape[-2], b.shape[-2])
    assert out.dtype == jnp.float32
    assert_zero_grads(grads_of(run, a, b), (a, b))


@pytest.mark.parametrize("shape", [(0, 4), (3, 0, 4)], ids=str)
@pytest.mark.parametrize("backend", ALL)
def test_metrics_and_losses(backend, shape):
  a = jnp.ones(shape)
  b = a + 1
  for op in METRICS:
    run = lambda x, y: backend.run(op, x, y)
    assert run(a, b).shape == shape[:-1]
    assert_zero_grads(grads_of(run, a, b), (a, b))
  for op in LOSSES:
    for reduction in ("none", "mean", "sum"):
      run = lambda x, y: backend.run(op, x, y, reduction=reduction)
      out = run(a, b)
      if reduction == "none":
        assert out.shape == shape[:-1]
      else:  # a mean over no boxes is 0, as torchvision's
        assert out.shape == () and float(out) == 0.0
      assert_zero_grads(grads_of(run, a, b), (a, b))


@pytest.mark.parametrize("q_shape,kv_shape", [
    ((0, 2, 3, 8), (0, 1, 5, 8)),     # batch 0
    ((1, 0, 3, 8), (1, 0, 5, 8)),     # heads 0 (and kv heads 0)
    ((1, 0, 3, 8), (1, 1, 5, 8)),     # heads 0
    ((1, 2, 0, 8), (1, 2, 5, 8)),     # q_len 0
    ((1, 2, 3, 8), (1, 1, 0, 8)),     # kv_len 0: no keys
], ids=str)
@pytest.mark.parametrize("backend", ALL)
def test_attention(backend, q_shape, kv_shape):
  q, k, v = jnp.ones(q_shape), jnp.ones(kv_shape), jnp.ones(kv_shape)
  bias = jnp.ones(q_shape[:3] + kv_shape[2:3])

  def run(q, k, v, bias):
    return backend.run(pk.flash_attention, q, k, v, bias=bias, causal=True,
                       return_lse=True)

  out, lse = run(q, k, v, bias)
  assert out.shape == q_shape and lse.shape == q_shape[:3]
  np.testing.assert_array_equal(np.asarray(out), 0)
  assert np.all(np.isneginf(np.asarray(lse)))
  assert_zero_grads(grads_of(run, q, k, v, bias), (q, k, v, bias))


INT8_SHAPES = [((0, 5), 3), ((2, 0), 3), ((2, 5), 0), ((0, 2, 5), 3)]


@pytest.mark.parametrize("x_shape,n", INT8_SHAPES, ids=str)
@pytest.mark.parametrize("backend", ALL)
def test_int8(backend, x_shape, n):
  k = x_shape[-1]
  out_shape = x_shape[:-1] + (n,)
  x8 = jnp.ones(x_shape, jnp.int8)
  w8 = jnp.ones((k, n), jnp.int8)
  bias = jnp.arange(n, dtype=jnp.float32)
  raw = backend.run(pk.int8_matmul, x8, w8)
  assert raw.shape == out_shape and raw.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(raw), 0)
  # K == 0: the sum is empty, the bias remains
  out = backend.run(pk.int8_matmul, x8, w8, x_scale=jnp.float32(2),
                    w_scale=jnp.ones(n), bias=bias, out_dtype=jnp.float32)
  np.testing.assert_array_equal(np.asarray(out),
                                np.broadcast_to(np.asarray(bias), out_shape))
  xf = jnp.ones(x_shape)
  for weight_only in (False, True):
    out = backend.run(pk.int8_matmul, xf, w8, weight_only=weight_only)
    assert out.shape == out_shape and out.dtype == jnp.float32
  w = jnp.ones((k, n))
  for int8_input_grad in (False, True):
    dense = lambda x, w, b: backend.run(nn.int8_dense, x, w, b,
                                        int8_input_grad=int8_input_grad)
    np.testing.assert_array_equal(
        np.asarray(dense(xf, w, bias)),
        np.broadcast_to(np.asarray(bias), out_shape))
    dx, dw, db = grads_of(dense, xf, w, bias)
    assert dx.shape == x_shape and dw.shape == (k, n) and db.shape == (n,)
    np.testing.assert_array_equal(np.asarray(dx), 0)  # dy @ w.T, K or N 0
    np.testing.assert_array_equal(np.asarray(dw),
                                  np.full((k, n), np.prod(x_shape[:-1])))
  q, scale = backend.run(pk.quantize_int8, xf)  # last: no GPU kernel exists
  assert q.shape == x_shape and scale.shape == x_shape[:-1] + (1,)


@pytest.mark.parametrize("images,boxes,keep", [(0, 5, 3), (2, 0, 3),
                                               (2, 5, 0)], ids=str)
@pytest.mark.parametrize("backend", ALL)
def test_nms(backend, images, boxes, keep):
  b = jnp.tile(jnp.array([0.0, 0.0, 1.0, 1.0]), (images, boxes, 1))
  s = jnp.ones((images, boxes))
  classes = jnp.zeros((images, boxes), jnp.int32)
  indices, count = backend.run(pk.batched_nms, b, s, iou_threshold=0.5,
                               max_output_size=keep, class_ids=classes)
  assert indices.shape == (images, keep) and count.shape == (images,)
  np.testing.assert_array_equal(np.asarray(indices), -1)
  np.testing.assert_array_equal(np.asarray(count), 0)
  if images:
    indices, count = backend.run(pk.nms, b[0], s[0], iou_threshold=0.5,
                                 max_output_size=keep)
    assert indices.shape == (keep,) and int(count) == 0
    indices, scores, count = backend.run(pk.soft_nms, b[0], s[0],
                                         max_output_size=keep)
    assert indices.shape == scores.shape == (keep,) and int(count) == 0


@pytest.mark.parametrize("q_shape,cache_shape", [
    ((0, 4, 1, 16), (0, 2, 8, 16)),    # no sequences
    ((2, 4, 0, 16), (2, 2, 8, 16)),    # no new tokens
    ((2, 4, 1, 16), (2, 2, 0, 16)),    # an empty cache: no key to see
], ids=str)
@pytest.mark.parametrize("backend", ALL)
def test_decode(backend, q_shape, cache_shape):
  cache = jnp.ones(cache_shape)
  lengths = jnp.zeros((q_shape[0],), jnp.int32)
  out = backend.run(pk.decode_attention, jnp.ones(q_shape), cache, cache,
                    lengths)
  assert out.shape == q_shape and out.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(out), 0)


@pytest.mark.parametrize("x_shape", [(0, 256), (3, 0)], ids=str)
@pytest.mark.parametrize("backend", ALL)
def test_quantized_matmul(backend, x_shape):
  k = x_shape[1]
  w = jnp.ones((k, 128), jnp.int8)
  bias = jnp.arange(128, dtype=jnp.float32)
  out = backend.run(pk.quantized_matmul, jnp.ones(x_shape, jnp.bfloat16), w,
                    w_scale=jnp.ones((128,)), bias=bias, weight_only=True)
  assert out.shape == (x_shape[0], 128)
  np.testing.assert_array_equal(  # K == 0: the bias remains
      np.asarray(out, np.float32),
      np.broadcast_to(np.asarray(bias), out.shape))


@pytest.mark.parametrize("m", [0, 5])
@pytest.mark.parametrize("backend", ALL)
def test_grouped_matmul(backend, m):
  """No rows at all, and groups of no rows: zeros, and zero gradients for
  the experts that saw no token."""
  sizes = jnp.asarray([0, m, 0], jnp.int32)
  lhs, rhs = jnp.ones((m, 32)), jnp.ones((3, 32, 16))
  out = backend.run(pk.grouped_matmul, lhs, rhs, sizes)
  assert out.shape == (m, 16)
  d_lhs, d_rhs = grads_of(
      lambda a, b: backend.run(pk.grouped_matmul, a, b, sizes), lhs, rhs)
  assert d_lhs.shape == lhs.shape and d_rhs.shape == rhs.shape
  np.testing.assert_array_equal(np.asarray(d_rhs[0::2]), 0)
  np.testing.assert_array_equal(np.asarray(d_rhs[1]), m)


@pytest.mark.parametrize("backend", ALL)
def test_ragged_paged_attention(backend):
  """A step with no new token and no live sequence: an empty output, and a
  cache write that leaves the pages as they were."""
  pages = jnp.ones((8, 4, 4, 16))
  metadata = (jnp.zeros((2,), jnp.int32), jnp.zeros((2, 2), jnp.int32),
              jnp.zeros((3,), jnp.int32), jnp.zeros((1,), jnp.int32))
  out = backend.run(pk.ragged_paged_attention, jnp.ones((0, 4, 16)), pages,
                    *metadata)
  assert out.shape == (0, 4, 16)
  written = backend.run(pk.write_kv_pages, pages, jnp.ones((0, 4, 16)),
                        *metadata)
  np.testing.assert_array_equal(np.asarray(written), np.asarray(pages))
  out = backend.run(pk.mla_ragged_paged_attention, jnp.ones((0, 4, 24)),
                    jnp.ones((8, 4, 24)), *metadata, latent_dim=16)
  assert out.shape == (0, 4, 16)
