"""Main-job cases for the quantized matmul family (``python -m
pallas_kernels``)."""
from __future__ import annotations

import numpy as np

from pallas_kernels._cases import Case
from pallas_kernels.int8.cases import _relative_error
from pallas_kernels.quant import api

SHAPES = {  # (M, K, N), K a multiple of the group size
    "small": (16, 256, 384),
    "medium": (128, 2048, 1024),
    "large": (1024, 4096, 4096),
}
GROUP = 128


def main_job_cases(size):
  import jax
  import jax.numpy as jnp
  m, k, n = SHAPES[size]
  rng = np.random.default_rng(0)
  wf = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.float32)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  w4, s4, z4 = api.quantize(wf, jnp.int4, axis=0, group_size=GROUP,
                            symmetric=False, backend="reference")
  w8, s8 = api.quantize(wf, jnp.float8_e4m3fn, axis=0, backend="reference")
  xq, xs = api.quantize(x.astype(jnp.float32), jnp.float8_e4m3fn,
                        backend="reference")
  xg, xgs = api.quantize(x.astype(jnp.float32), jnp.int8, group_size=GROUP,
                         backend="reference")
  wg, wgs = api.quantize(wf, jnp.int8, axis=0, group_size=GROUP,
                         backend="reference")
  bias = jnp.asarray(rng.standard_normal(n), jnp.float32)
  shape = f"{m}x{k}x{n}"

  def int4_grouped(x_, w, s, z, backend=None):
    return api.quantized_matmul(x_, w, w_scale=s, w_zero=z, group_size=GROUP,
                                weight_only=True, backend=backend)

  def fp8_weight_only(x_, w, s, backend=None):
    return api.quantized_matmul(x_, w, w_scale=s.reshape(-1),
                                weight_only=True, backend=backend)

  def fp8_x_fp8(x_, xs_, w, s, b, backend=None):
    return api.quantized_matmul(x_, w, x_scale=xs_, w_scale=s.reshape(-1),
                                bias=b, backend=backend)

  def int8_group_products(x_, xs_, w, s, backend=None):
    return api.quantized_matmul(x_, w, x_scale=xs_, w_scale=s,
                                group_size=GROUP, backend=backend)

  def quantize(x_, backend=None):  # the TPU kernel's case: int8 per row
    return api.quantize(x_, jnp.int8, axis=-1, backend=backend)

  def dense_grad(x_, w, s, z, a, b, backend=None):
    from pallas_kernels import nn

    def loss(x_, a, b):
      return jnp.sum(nn.quantized_dense(
          x_, w, s, w_zero=z, group_size=GROUP, lora=(a, b),
          backend=backend).astype(jnp.float32) ** 2)
    return jax.value_and_grad(loss, argnums=(0, 1, 2))(x_, a, b)

  lora_a = jnp.asarray(rng.standard_normal((k, 8)) * 0.01, jnp.float32)
  lora_b = jnp.asarray(rng.standard_normal((8, n)) * 0.01, jnp.float32)
  return [
      Case("quantized_matmul", f"{shape} int4 g{GROUP} w4a16", int4_grouped,
           (x, w4, s4, z4), 2**-7, _relative_error),
      Case("quantized_matmul", f"{shape} fp8 w8a16", fp8_weight_only,
           (x, w8, s8), 2**-7, _relative_error),
      Case("quantized_matmul", f"{shape} fp8 x fp8", fp8_x_fp8,
           (xq, xs, w8, s8, bias), 2**-7, _relative_error),
      Case("quantized_matmul", f"{shape} int8 x int8 g{GROUP}",
           int8_group_products, (xg, xgs, wg, wgs), 2**-7, _relative_error),
      Case("quantize", f"{m}x{k} int8 rows", quantize,
           (x.astype(jnp.float32),), 0.0),
      Case("quantized_dense", f"{shape} int4 + LoRA fwd+bwd", dense_grad,
           (x.astype(jnp.float32), w4, s4, z4, lora_a, lora_b), 2**-7,
           _relative_error),
  ]
