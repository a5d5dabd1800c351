"""Main-job cases for the int8 matmul family (``python -m pallas_kernels``)."""
from __future__ import annotations

import numpy as np

from pallas_kernels._cases import Case, abstract, max_abs_error
from pallas_kernels.quant import int8_api as api

SHAPES = {  # (M, K, N)
    "small": (40, 300, 200),
    "medium": (256, 1024, 512),
    "large": (2048, 4096, 4096),
}


def _int8(rng, shape):
  return rng.integers(-128, 128, shape).astype(np.int8)


def _relative_error(out, ref):
  """Largest |out - ref| relative to ref's largest entry, per array."""
  import jax
  errors = [0.0]
  for o, r in zip(jax.tree_util.tree_leaves(out),
                  jax.tree_util.tree_leaves(ref)):
    scale = float(np.max(np.abs(np.asarray(r, np.float64)), initial=0.0))
    errors.append(max_abs_error(o, r) / (scale or 1.0))
  return max(errors)


def main_job_cases(size):
  import jax.numpy as jnp
  m, k, n = SHAPES[size]
  rng = np.random.default_rng(0)
  x8, w8 = jnp.asarray(_int8(rng, (m, k))), jnp.asarray(_int8(rng, (k, n)))
  xs = jnp.asarray(rng.uniform(1e-3, 2e-3, (m, 1)), jnp.float32)
  ws = jnp.asarray(rng.uniform(1e-3, 2e-3, (n,)), jnp.float32)
  bias = jnp.asarray(rng.standard_normal(n), jnp.float32)
  xb = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  shape = f"{m}x{k}x{n}"

  def raw(x, w, backend=None):
    return api.int8_matmul(x, w, backend=backend)

  def fused(x, w, xs_, ws_, b, backend=None):
    return api.int8_matmul(x, w, x_scale=xs_, w_scale=ws_, bias=b,
                           backend=backend)

  def dynamic(x, w, ws_, backend=None):
    return api.int8_matmul(x, w, w_scale=ws_, backend=backend)

  def weight_only(x, w, ws_, backend=None):
    return api.int8_matmul(x, w, w_scale=ws_, weight_only=True,
                           backend=backend)

  def quantize(x, backend=None):
    return api.quantize_int8(x, axis=-1, backend=backend)

  def dense_grad(x, w, b, backend=None):
    import jax
    from pallas_kernels.quant import int8_layers as layers

    def loss(x, w, b):
      return jnp.sum(layers.int8_dense(x, w, b, backend=backend)
                     .astype(jnp.float32) ** 2)
    return jax.value_and_grad(loss, argnums=(0, 1, 2))(x, w, b)

  wf = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.float32)

  return [
      Case("int8_matmul", f"{shape} raw int32", raw, (x8, w8), 0.0),
      Case("int8_matmul", f"{shape} fused bf16", fused, (x8, w8, xs, ws, bias),
           2**-7, _relative_error),
      Case("int8_matmul", f"{shape} w8a8 dynamic", dynamic, (xb, w8, ws),
           2**-7, _relative_error),
      Case("int8_matmul", f"{shape} w8a16", weight_only, (xb, w8, ws),
           2**-7, _relative_error),
      Case("quantize_int8", f"{m}x{k} rows", quantize, (xb,), 0.0),
      Case("int8_dense", f"{shape} fwd+bwd", dense_grad,
           (xb.astype(jnp.float32), wf, bias), 2**-7, _relative_error),
  ]


def support_cases():
  """(label, run(backend)) rows of the docs' backend-support table: each run
  traces one call with ``jax.eval_shape``."""
  import jax
  import jax.numpy as jnp
  def call(m=256, k=512, n=384, weight_only=False, layout="kn",
           scales=True):
    x = abstract((m, k), jnp.bfloat16 if weight_only else jnp.int8)
    w = abstract((k, n) if layout == "kn" else (n, k), jnp.int8)
    operands = [x, w]
    if scales:
      operands.append(abstract((n,), jnp.float32))
      if not weight_only:
        operands.append(abstract((m, 1), jnp.float32))

    def run(backend):
      def f(x, w, *scale):
        return api.int8_matmul(x, w, w_scale=scale[0] if scale else None,
                              x_scale=scale[1] if len(scale) > 1 else None,
                              weight_only=weight_only, weight_layout=layout,
                              backend=backend)
      return jax.eval_shape(f, *operands)
    return run

  return [
      ("int8 x int8, fused dequant", call()),
      ("int8 x int8, int32 out (no scales)", call(scales=False)),
      ("weight-only, M = 16, w [N, K]", call(m=16, weight_only=True,
                                             layout="nk")),
      ("weight-only, M = 128, w [N, K]", call(m=128, weight_only=True,
                                              layout="nk")),
      ("weight-only, M = 128, w [K, N]", call(m=128, weight_only=True)),
      ("weight-only, M = 512", call(m=512, weight_only=True, layout="nk")),
  ]
