"""pallas_kernels.nn.int8_dense: int8 forward, straight-through gradients."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import force_interpret, nn
from pallas_kernels.quant import int8_api as api


def _float_dense(x, w, b):
  out = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32),
                precision=jax.lax.Precision.HIGHEST)
  return out if b is None else out + b


def _inputs(rng, batch=(2, 5), k=96, n=40, dtype=jnp.float32):
  x = jnp.asarray(rng.standard_normal(batch + (k,)), dtype)
  w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype)
  b = jnp.asarray(rng.standard_normal(n), dtype)
  return x, w, b


def _forward_bound(x, w):
  """|int8 - float| bound: per-row and per-column rounding of half a step."""
  x = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
  w = np.asarray(w, np.float64)
  sx = np.abs(x).max(1, keepdims=True) / 127
  sw = np.abs(w).max(0, keepdims=True) / 127
  return ((sx / 2) * np.abs(w).sum(0)
          + np.abs(x).sum(1, keepdims=True) * (sw / 2)
          + x.shape[1] * (sx / 2) * (sw / 2))


def test_forward_matches_float_within_quantization_error(rng):
  x, w, b = _inputs(rng)
  out = nn.int8_dense(x, w, b, backend="interpret")
  assert out.shape == (2, 5, 40) and out.dtype == jnp.float32
  want = np.asarray(_float_dense(x, w, b), np.float64).reshape(-1, 40)
  got = np.asarray(out, np.float64).reshape(-1, 40)
  bound = _forward_bound(x, w) * 1.01 + 1e-5 * (np.abs(want) + 1)
  assert np.all(np.abs(got - want) <= bound)
  # ... and is exactly the int8 pipeline the docstring describes.
  wq, ws = api.quantize_int8(w, axis=0, backend="reference")
  ref = api.int8_matmul(x, wq, w_scale=ws, bias=b, out_dtype=x.dtype,
                        backend="reference")
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-6,
                             atol=1e-6)


@pytest.mark.parametrize("with_bias", [True, False])
def test_gradients_are_straight_through(rng, with_bias):
  x, w, b = _inputs(rng)
  b = b if with_bias else None
  g = jnp.asarray(rng.standard_normal((2, 5, 40)), jnp.float32)

  def loss(fn):
    return lambda x_, w_, b_: jnp.sum(fn(x_, w_, b_) * g)

  with force_interpret("generic"):
    grads = jax.grad(loss(nn.int8_dense), argnums=(0, 1, 2) if with_bias
                     else (0, 1))(x, w, b)
  want = jax.grad(loss(_float_dense), argnums=(0, 1, 2) if with_bias
                  else (0, 1))(x, w, b)
  for got, exp in zip(grads, want):
    assert got.dtype == exp.dtype and got.shape == exp.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(exp), rtol=1e-4,
                               atol=1e-4)


def test_int8_input_gradient_is_close(rng):
  x, w, b = _inputs(rng, batch=(7,), k=64, n=48)
  g = jnp.asarray(rng.standard_normal((7, 48)), jnp.float32)
  with force_interpret("generic"):
    dx8, dw8 = jax.grad(lambda x_, w_: jnp.sum(
        nn.int8_dense(x_, w_, b, int8_input_grad=True) * g), (0, 1))(x, w)
    dx, dw = jax.grad(lambda x_, w_: jnp.sum(
        nn.int8_dense(x_, w_, b) * g), (0, 1))(x, w)
  np.testing.assert_array_equal(np.asarray(dw8), np.asarray(dw))
  exact = np.asarray(g, np.float64) @ np.asarray(w, np.float64).T
  # dy quantized per row, w per input channel: half a step of each.
  sg = np.abs(np.asarray(g, np.float64)).max(1, keepdims=True) / 127
  sw = np.abs(np.asarray(w, np.float64)).max(1) / 127
  abs_w = np.abs(np.asarray(w, np.float64))
  abs_g = np.abs(np.asarray(g, np.float64))
  bound = ((sg / 2) * abs_w.sum(1) + abs_g.sum(1, keepdims=True) * (sw / 2)
           + 48 * (sg / 2) * (sw / 2)) * 1.05 + 1e-5
  assert np.all(np.abs(np.asarray(dx8, np.float64) - exact) <= bound)
  assert not np.array_equal(np.asarray(dx8), np.asarray(dx))


def test_bf16_training_step_runs_under_jit(rng):
  x, w, b = _inputs(rng, batch=(4,), k=64, n=32, dtype=jnp.bfloat16)

  @jax.jit
  def step(w_, b_):
    loss = lambda w2, b2: jnp.mean(nn.int8_dense(x, w2, b2).astype(jnp.float32) ** 2)
    gw, gb = jax.grad(loss, (0, 1))(w_, b_)
    return w_ - 0.1 * gw, b_ - 0.1 * gb

  with force_interpret("generic"):
    w2, b2 = step(w, b)
  assert w2.dtype == jnp.bfloat16 and b2.dtype == jnp.bfloat16
  assert np.all(np.isfinite(np.asarray(w2, np.float32)))
  assert not np.array_equal(np.asarray(w2), np.asarray(w))


@pytest.mark.parametrize("args,error,match", [
    ((jnp.zeros((2, 4), jnp.int8), jnp.zeros((4, 3))), TypeError, "x must be"),
    ((jnp.zeros((2, 4)), jnp.zeros((4, 3), jnp.int32)), TypeError, "w must be"),
    ((jnp.zeros((2, 4)), jnp.zeros((4, 3, 1))), ValueError, "w must be 2-D"),
    ((jnp.zeros((2, 5)), jnp.zeros((4, 3))), ValueError, "last dimension"),
    ((jnp.zeros((2, 4)), jnp.zeros((4, 3)), jnp.zeros((4,))), ValueError,
     r"bias must have shape \(3,\)"),
])
def test_bad_inputs(args, error, match):
  with pytest.raises(error, match=match):
    nn.int8_dense(*args)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(int8_input_grad="no"), TypeError, "int8_input_grad must be a bool"),
    (dict(int8_input_grad=None), TypeError, "int8_input_grad must be a bool"),
    (dict(backend="cuda"), ValueError, "int8_dense: backend='cuda' is not one"),
])
def test_bad_options(kwargs, error, match):
  with pytest.raises(error, match=match):
    nn.int8_dense(jnp.zeros((2, 4)), jnp.zeros((4, 3)), **kwargs)


@pytest.mark.parametrize("backend", ["triton", "gpu"])
def test_gpu_backends_match_reference(rng, backend):
  """GPU backends run the int8 matmuls on the GPU kernel and quantize the
  weights with XLA (quantize_int8 has no GPU kernel)."""
  x, w, b = _inputs(rng, batch=(7,), k=64, n=48)

  def run(backend_):
    def loss(x_, w_):
      return jnp.sum(nn.int8_dense(x_, w_, b, int8_input_grad=True,
                                   backend=backend_) ** 2)
    return nn.int8_dense(x, w, b, backend=backend_), jax.grad(loss, (0, 1))(
        x, w)

  with force_interpret("generic"):
    got = run(backend)
  want = run("reference")
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5,
                               atol=1e-5)
