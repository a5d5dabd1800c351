"""pallas_kernels.nn.quantized_dense: frozen quantized weights with a LoRA
adapter, differentiable in x, bias and the adapter (float64 numpy checks)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracles import quant as oracle

import pallas_kernels as pk
from pallas_kernels import nn


def _layer(rng, fmt=jnp.int4, k=64, n=48, r=4, group_size=32):
  w = rng.standard_normal((k, n)).astype(np.float32)
  q, s, z = pk.quantize(jnp.asarray(w), fmt, axis=0, group_size=group_size,
                        symmetric=False)
  a = jnp.asarray(rng.standard_normal((k, r)) * 0.1, jnp.float32)
  b = jnp.asarray(rng.standard_normal((r, n)) * 0.1, jnp.float32)
  bias = jnp.asarray(rng.standard_normal(n), jnp.float32)
  return q, s, z, a, b, bias


@pytest.mark.parametrize("backend", ["interpret", "reference"])
def test_forward_and_gradients_match_float64(backend, rng):
  q, s, z, a, b, bias = _layer(rng)
  x = jnp.asarray(rng.standard_normal((2, 5, 64)), jnp.float32)
  dy = rng.standard_normal((2, 5, 48))
  lora_scale = 0.5

  def loss(x_, bias_, a_, b_):
    y = nn.quantized_dense(x_, q, s, bias_, w_zero=z, group_size=32,
                           lora=(a_, b_), lora_scale=lora_scale,
                           backend=backend)
    return jnp.sum(y * jnp.asarray(dy, jnp.float32)), y

  (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3),
                                     has_aux=True)(x, bias, a, b)
  w_deq = oracle.dequantized_weight(q, s, z, 32, "float32")
  x64 = np.asarray(x, np.float64).reshape(-1, 64)
  a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
  weight = w_deq + lora_scale * a64 @ b64
  want = x64 @ weight + np.asarray(bias, np.float64)
  tol = 1e-5 * (np.abs(x64) @ np.abs(weight)).max()
  np.testing.assert_allclose(np.asarray(y).reshape(-1, 48), want, atol=tol)
  dy2 = dy.reshape(-1, 48)
  dx, dbias, da, db = (np.asarray(g, np.float64) for g in grads)
  np.testing.assert_allclose(dx.reshape(-1, 64), dy2 @ weight.T, atol=tol)
  np.testing.assert_allclose(dbias, dy2.sum(0), atol=1e-4)
  np.testing.assert_allclose(da, lora_scale * x64.T @ dy2 @ b64.T,
                             atol=1e-4 * np.abs(x64.T @ dy2).max())
  np.testing.assert_allclose(db, lora_scale * (x64 @ a64).T @ dy2,
                             atol=1e-4 * np.abs(x64.T @ dy2).max())


def test_gradient_of_the_frozen_weight_is_a_clear_error(rng):
  x = jnp.ones((3, 64), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((64, 8)), jnp.float32)
  q8, s8 = pk.quantize(w, jnp.float8_e4m3fn, axis=0)
  with pytest.raises(TypeError, match="with respect to w: w is a quantized "
                     "weight .*not differentiable"):
    jax.grad(lambda q: nn.quantized_dense(x, q, s8.reshape(-1)).astype(
        jnp.float32).sum())(q8)
  with pytest.raises(TypeError, match="with respect to w_scale"):
    jax.grad(lambda s: nn.quantized_dense(x, q8, s.reshape(-1)).astype(
        jnp.float32).sum())(s8)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(lora=jnp.ones((64, 2))), TypeError, "lora must be a pair"),
    (dict(lora=(jnp.ones((64, 2)), jnp.ones((3, 8)))), ValueError,
     "lora must be"),
    (dict(lora=(jnp.ones((64, 2), jnp.int8), jnp.ones((2, 8)))), TypeError,
     r"lora\[0\] must be"),
    (dict(lora=(jnp.ones((64, 2)), jnp.ones((2, 8))), lora_scale="x"),
     TypeError, "lora_scale must be a scalar"),
    (dict(backend="cuda"), ValueError, "backend='cuda'"),
])
def test_bad_inputs(kwargs, error, match):
  x = jnp.ones((3, 64), jnp.float32)
  q = jnp.ones((64, 8), jnp.int8)
  with pytest.raises(error, match=match):
    nn.quantized_dense(x, q, jnp.ones((8,)), **kwargs)
  with pytest.raises(TypeError, match="x must be"):
    nn.quantized_dense(jnp.ones((3, 64), jnp.int8), q, jnp.ones((8,)))
