"""Main-job cases for NMS: indices must equal the reference's exactly."""
from __future__ import annotations

import functools

import numpy as np

from pallas_kernels._cases import Case, abstract
from .api import batched_nms, nms, soft_nms

SIZES = {"small": 300, "medium": 2000, "large": 20000}


def writeup_boxes(rng, n, image=1024):
  """The write-up's generator: integer boxes in an image x image picture,
  uniform scores."""
  sizes = rng.integers(1, image, (n, 2))
  top_left = rng.integers(0, image - 1, (n, 2))
  bottom_right = np.clip(top_left + sizes, 0, image - 1)
  boxes = np.concatenate([top_left, bottom_right], 1).astype(np.float32)
  return boxes, rng.random(n).astype(np.float32)


def main_job_cases(size: str) -> list[Case]:
  n = SIZES[size]
  rng = np.random.default_rng(6)
  boxes, scores = writeup_boxes(rng, n)
  batch = 2 if size == "small" else 4
  many = [writeup_boxes(rng, n // batch) for _ in range(batch)]
  bboxes = np.stack([b for b, _ in many])
  bscores = np.stack([s for _, s in many])
  classes = rng.integers(0, 5, bscores.shape).astype(np.int32)
  return [
      Case("nms", f"N={n} iou>0.5 M=128",
           functools.partial(nms, iou_threshold=0.5, max_output_size=128),
           (boxes, scores), tolerance=0.0),
      Case("nms", f"N={n} iou>0.1 M=N",
           functools.partial(nms, iou_threshold=0.1, max_output_size=n),
           (boxes, scores), tolerance=0.0),
      Case("batched_nms", f"B={batch} N={n // batch} classes iou>0.5",
           lambda b, s, c, backend=None: batched_nms(
               b, s, iou_threshold=0.5, max_output_size=64, class_ids=c,
               backend=backend),
           (bboxes, bscores, classes), tolerance=0.0),
      # No kernel exists (each step rescores every box): the reference runs.
      Case("soft_nms", f"N={min(n, 2000)} gaussian M=64",
           functools.partial(soft_nms, max_output_size=64),
           (boxes[:2000], scores[:2000]), tolerance=0.0),
  ]


def support_cases():
  """(label, run(backend)) rows of the docs' backend-support table: each run
  traces one call with ``jax.eval_shape``."""
  import jax
  import jax.numpy as jnp

  def greedy(n, batched=False):
    def run(backend):
      shape = (3, n) if batched else (n,)
      op = batched_nms if batched else nms
      return jax.eval_shape(
          lambda b, s: op(b, s, iou_threshold=0.5, max_output_size=100,
                          backend=backend),
          abstract(shape + (4,), jnp.float32), abstract(shape, jnp.float32))
    return run

  def soft(backend):
    return jax.eval_shape(
        lambda b, s: soft_nms(b, s, max_output_size=50, backend=backend),
        abstract((500, 4), jnp.float32), abstract((500,), jnp.float32))

  return [
      ("nms, N = 5000", greedy(5000)),
      ("batched_nms, 3 x 5000", greedy(5000, batched=True)),
      ("soft_nms", soft),
  ]
