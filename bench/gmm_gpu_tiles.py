"""Tile search for the Triton grouped matmul (gmm forward, tgmm) on a GPU.

    python -m bench.gmm_gpu_tiles [--out DIR]

Times ``gmm.triton.gmm`` / ``tgmm`` at each (bm, bk, bn, warps, stages) on
the MoE shapes of ``bench.grouped_matmul`` (balanced routing, 4096 tokens),
in-program (``harness.Timer.jax``), and checks each config's result against
the first config's. Writes ``gmm-gpu-tiles-<device>-<date>.json``; the
chosen rows become ``gmm.triton``'s defaults.
"""
from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from bench import harness
from bench.tpu import MOE, moe_group_sizes
from pallas_kernels.gmm import triton

GMM_CONFIGS = [(128, 64, 128, 4, 3), (128, 64, 256, 8, 3),
               (128, 64, 128, 8, 4), (128, 128, 128, 8, 3),
               (64, 64, 256, 4, 4), (128, 32, 256, 8, 5),
               (256, 64, 128, 8, 3), (64, 128, 128, 4, 3)]
TGMM_CONFIGS = [(64, 128, 128, 4, 3), (64, 128, 256, 8, 3),
                (128, 128, 128, 8, 3), (32, 128, 128, 4, 4),
                (64, 256, 128, 8, 3), (128, 64, 128, 4, 3)]


def _check(kind, operands, out):
  a, b, sizes = (np.asarray(t.astype(jnp.float32), np.float64)
                 for t in operands)
  starts = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
  errors = []
  for g in (0, 1):
    rows = slice(starts[g], starts[g + 1])
    want = a[rows] @ b[g] if kind == "gmm" else a[rows].T @ b[rows]
    got = out[rows] if kind == "gmm" else out[g]
    errors.append(harness.rel_error(got, want))
  return max(errors)


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default=harness.RESULTS_DIR)
  args = parser.parse_args(argv)
  timer = harness.Timer()
  rows = []
  for model, (tokens, d, f, e, top_k) in MOE.items():
    m = 4096 * top_k
    sizes = jnp.asarray(moe_group_sizes(m, e, "balanced"))
    x = jax.random.normal(jax.random.key(0), (m, d), jnp.bfloat16)
    w = (jax.random.normal(jax.random.key(1), (e, d, f), jnp.float32)
         / np.sqrt(d)).astype(jnp.bfloat16)
    dy = jax.random.normal(jax.random.key(2), (m, f), jnp.bfloat16)
    for kind, configs, flops in (("gmm", GMM_CONFIGS, 2.0 * m * d * f),
                                 ("tgmm", TGMM_CONFIGS, 2.0 * m * d * f)):
      first = None
      for bm, bk, bn, warps, stages in configs:
        if kind == "gmm":
          op = lambda a, b, s, t=(bm, bk, bn), nw=warps, ns=stages: (
              triton.gmm(a, b, s, tiles=t, num_warps=nw, num_stages=ns))
          operands = (x, w, sizes)
        else:
          op = lambda a, b, s, t=(bm, bk, bn), nw=warps, ns=stages: (
              triton.tgmm(a, b, s, e, tiles=t, num_warps=nw, num_stages=ns))
          operands = (x, dy, sizes)
        row = dict(model=model, kernel=kind, bm=bm, bk=bk, bn=bn,
                   warps=warps, stages=stages)
        try:
          seconds, out = timer.jax(op, *operands, copies=2)
          out = np.asarray(out.astype(jnp.float32))
          if first is None:
            first = out
            if model == "qwen3-30b-a3b":  # float64 check of two groups
              row["err"] = _check(kind, operands, out)
          row.update(ms=seconds * 1e3, tflops=flops / seconds / 1e12,
                     diff=float(np.abs(out - first).max()))
        except Exception as err:  # noqa: BLE001  (a config may not fit)
          row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
        print(row, flush=True)
        rows.append(row)
  info = harness.device_info()
  path = os.path.join(args.out, f"gmm-gpu-tiles-{harness.device_slug(info['device'])}"
                      f"-{info['date'][:10]}.json")
  with open(path, "w") as fh:
    json.dump(dict(info, rows=rows, command="python -m bench.gmm_gpu_tiles"),
              fh, indent=1)
  print("wrote", path)


if __name__ == "__main__":
  main()
