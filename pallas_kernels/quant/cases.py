"""Main-job cases for the quantized matmul family (``python -m
pallas_kernels``)."""
from __future__ import annotations

import numpy as np

from pallas_kernels._cases import Case, abstract
from pallas_kernels.quant.int8_cases import _relative_error
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
    from pallas_kernels.quant import layers

    def loss(x_, a, b):
      return jnp.sum(layers.quantized_dense(
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


def support_cases():
  """(label, run(backend)) rows of the docs' backend-support table: each run
  traces one call with ``jax.eval_shape``."""
  import jax
  import jax.numpy as jnp
  def call(w_dtype=jnp.int4, x_dtype=jnp.bfloat16, m=16, k=512, n=384,
           group_size=None, layout="kn", zero=False):
    weight_only = x_dtype in (jnp.bfloat16, jnp.float32)
    w = abstract((k, n) if layout == "kn" else (n, k), w_dtype)
    if group_size:
      table = (k // group_size, n) if layout == "kn" else (n, k // group_size)
    else:
      table = (n,)
    operands = [abstract((m, k), x_dtype), w, abstract(table, jnp.float32)]
    if zero:
      operands.append(abstract(table, w_dtype))

    def run(backend):
      def f(x, w, scale, *zero_):
        return api.quantized_matmul(
            x, w, w_scale=scale, w_zero=zero_[0] if zero_ else None,
            group_size=group_size, weight_only=weight_only,
            weight_layout=layout, backend=backend)
      return jax.eval_shape(f, *operands)
    return run

  return [
      ("int4 weight-only, per channel", call()),
      ("int4 weight-only, group 128 + zero, w [K, N]",
       call(group_size=128, zero=True)),
      ("int4 weight-only, group 128, w [N, K]",
       call(group_size=128, layout="nk")),
      ("int4 weight-only, w [N, K], odd K", call(k=511, layout="nk")),
      ("fp8 e4m3 weight-only, per channel", call(w_dtype=jnp.float8_e4m3fn)),
      ("fp8 e5m2 weight-only, group 64", call(w_dtype=jnp.float8_e5m2,
                                              group_size=64)),
      ("fp8 x fp8 (e4m3)", call(w_dtype=jnp.float8_e4m3fn,
                                x_dtype=jnp.float8_e4m3fn, m=256)),
      ("int8 weight-only, group 128", call(w_dtype=jnp.int8,
                                           group_size=128)),
      ("int8 x int8, group 128 (group products)",
       call(w_dtype=jnp.int8, x_dtype=jnp.int8, group_size=128)),
      ("fp8 x fp8 (e4m3), group 64, w [N, K]",
       call(w_dtype=jnp.float8_e4m3fn, x_dtype=jnp.float8_e4m3fn, m=256,
            group_size=64, layout="nk")),
  ]
