"""Wall-clock timing of the main job's kernel-vs-reference table."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import jax


def time_call(fn: Callable[[], Any], *, warmup: int = 2, iters: int = 10,
              min_seconds: float = 0.0) -> dict:
  """Median/min seconds of ``fn()`` after ``warmup`` calls. ``fn`` must return
  JAX arrays: each call is waited for with ``jax.block_until_ready`` so
  asynchronous dispatch is not mistaken for speed."""
  for _ in range(warmup):
    jax.block_until_ready(fn())
  samples = []
  start_all = time.perf_counter()
  while len(samples) < iters or (time.perf_counter() - start_all) < min_seconds:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    samples.append(time.perf_counter() - start)
    if len(samples) >= 10_000:
      break
  return {"median_s": statistics.median(samples), "min_s": min(samples),
          "runs": len(samples)}
