"""Main-job cases for the IoU family (``python -m pallas_kernels``)."""
from __future__ import annotations

import numpy as np

from pallas_kernels._cases import Case, abstract, x64
from . import api

# (batch, boxes per row) for elementwise ops and losses; (N, M) pairwise.
ELEMENTWISE = {"small": (4, 300), "medium": (1024, 256), "large": (4096, 4096)}
PAIRWISE = {"small": (100, 300), "medium": (1000, 1000), "large": (4096, 4096)}
TOLERANCE = 2e-5  # float32; values are O(1)


def _boxes(rng, shape):
  xy = rng.uniform(0.0, 100.0, shape + (2,))
  wh = rng.uniform(0.0, 30.0, shape + (2,))
  return np.concatenate([xy, xy + wh], axis=-1).astype(np.float32)


def main_job_cases(size):
  import jax
  import jax.numpy as jnp
  rng = np.random.default_rng(0)
  b, n = ELEMENTWISE[size]
  pred, target = jnp.asarray(_boxes(rng, (b, n))), jnp.asarray(_boxes(rng, (b, n)))
  pn, pm = PAIRWISE[size]
  set1, set2 = jnp.asarray(_boxes(rng, (pn,))), jnp.asarray(_boxes(rng, (pm,)))

  def giou(x, y, backend=None):
    return api.giou(x, y, backend=backend)

  def giou_loss_grad(x, y, backend=None):
    def loss(x, y):
      return api.giou_loss(x, y, reduction="mean", backend=backend)
    return jax.value_and_grad(loss, argnums=(0, 1))(x, y)

  def ciou_loss(x, y, backend=None):
    return api.ciou_loss(x, y, backend=backend)

  def pairwise_giou(x, y, backend=None):
    return api.pairwise_giou(x, y, backend=backend)

  def bind(op):  # the op with its backend as a keyword
    return lambda x, y, backend=None: getattr(api, op)(x, y, backend=backend)

  shape, pairs = f"{b}x{n}", f"{pn}x{pm}"
  cases = [
      Case("giou", shape, giou, (pred, target), TOLERANCE),
      # Gradients of a mean are O(1/P): compare them at the same scale.
      Case("giou_loss", shape + " mean, fwd+bwd", giou_loss_grad,
           (pred, target), TOLERANCE),
      Case("ciou_loss", shape, ciou_loss, (pred, target), TOLERANCE),
      Case("pairwise_giou", pairs, pairwise_giou, (set1, set2), TOLERANCE),
      Case("box_iou", pairs, bind("box_iou"), (set1, set2), TOLERANCE),
  ]
  for kind in ("iou", "diou", "ciou"):
    cases.append(Case(kind, shape, bind(kind), (pred, target), TOLERANCE))
    cases.append(Case(f"pairwise_{kind}", pairs, bind(f"pairwise_{kind}"),
                      (set1, set2), TOLERANCE))
  for kind in ("iou", "diou"):
    cases.append(Case(f"{kind}_loss", shape, bind(f"{kind}_loss"),
                      (pred, target), TOLERANCE))
  return cases


def support_cases():
  """(label, run(backend)) rows of the docs' backend-support table: each run
  traces one call with ``jax.eval_shape``."""
  import jax
  import jax.numpy as jnp

  def loss(dtype=jnp.float32, reduction="mean"):
    def run(backend):
      with x64(dtype == jnp.float64):
        b = abstract((1000, 4), dtype)
        return jax.eval_shape(
            lambda p, t: api.giou_loss(p, t, reduction=reduction,
                                       backend=backend), b, b)
    return run

  def pairwise(backend):
    return jax.eval_shape(
        lambda a, b: api.pairwise_giou(a, b, backend=backend),
        abstract((300, 4), jnp.float32), abstract((200, 4), jnp.float32))

  return [
      ("IoU-family losses, float32 (iou/giou/diou/ciou)", loss()),
      ("losses, bfloat16", loss(dtype=jnp.bfloat16)),
      ("losses, float64", loss(dtype=jnp.float64)),
      ("pairwise (iou/giou/diou/ciou)", pairwise),
  ]
