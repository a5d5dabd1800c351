"""Sweep of the Mosaic GPU 8-bit weight-only kernel's plan knobs on a GPU.

    python scripts/mgpu_8bit_sweep.py OUT.json [--budget-s S] [--only TEXT]
        [--defaults-only] [--round2] [--check]

For each (K, N) of bench.quantized_matmul's weight-only shapes, M in 64,
128, 256, int8 and float8_e4m3fn w in both layouts: the kernel with the
default plan, then variants (``MgpuBlockSizes`` tile_k/stages, the K split
through max_split/target_ctas, x multicast pairs on/off through
``PAIR_MIN_MP``; ``pairs_ctas`` decides the rest), each against torch bf16
(``torch.matmul``) in the same process; ``--round2``: the second round's
variants (``ROUND2``), each after the default of its case. ``err``:
relative error of the first 16 rows against a float32 HIGHEST-precision
dot of the dequantized w. ``--check``: instead, the default plans against
float64 numpy at odd and bench shapes (OUT: those errors). Rows are
written after every config; the sweep stops starting configs after
``--budget-s`` seconds. Calls the kernel module directly (block sizes are
not public for this kernel).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench import harness, int8_matmul
from pallas_kernels.quant import int8_mosaic_gpu as mg

SHAPES = [(4096, 14336), (14336, 4096), (8192, 8192), (8192, 28672)]
MS = (64, 128, 256)
FORMATS = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
COPIES = 4
CHECK_ROWS = 16
# (layout, padded M) -> (tile_k, stages) alternatives to the table row
TILE_VARIANTS = {
    ("kn", 64): [(128, 5), (192, 3), (256, 2)],
    ("kn", 128): [(64, 6), (192, 2), (64, 7)],
    ("kn", 256): [(128, 2)],
    ("nk", 64): [(128, 4), (128, 5), (192, 3)],
    ("nk", 128): [(64, 8), (192, 2), (128, 3)],
    ("nk", 256): [(128, 2)],
}


def weights(key, k, n):
  w = jax.random.normal(key, (k, n), jnp.float32)
  out = {}
  for fmt, dtype in FORMATS.items():
    if fmt == "int8":
      scale = jnp.max(jnp.abs(w), axis=0, keepdims=True) / 127.0
      q = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)
    else:
      scale = jnp.max(jnp.abs(w), axis=0, keepdims=True) / 448.0
      q = (w / scale).astype(dtype)
    out[fmt] = (q, scale.astype(jnp.float32))
  return out


def call(x, w, s, layout, sizes):
  return mg.matmul(x, w, None, s, None, mode="weight_only",
                   out_dtype=jnp.bfloat16, w_layout=layout,
                   block_sizes=sizes)


OFF = 1 << 20  # PAIR_MIN_MP that pairs no CTAs
# Round 2: (layout, padded M) -> (name, (tile_k, stages) | None, pairs from
# padded M, None: the module's PAIR_MIN_MP)
ROUND2 = {
    ("nk", 64): [("tk256x2", (256, 2), None), ("pairs", None, 64),
                 ("tk128x3", (128, 3), None)],
    ("kn", 64): [("pairs", None, 64), ("tk128x5_pairs", (128, 5), 64)],
    ("nk", 128): [("no_pairs", None, OFF)],
    ("kn", 128): [("no_pairs", None, OFF)],
    ("nk", 256): [("no_pairs", None, OFF)],
    ("kn", 256): [("no_pairs", None, OFF)],
}


def configs_round2(m, k, n, layout):
  default = mg.plan(m, k, n, None, layout)
  out = [("default", None, mg.PAIR_MIN_MP)]
  for name, tiles, pair in ROUND2[layout, default.mp]:
    sizes = None if tiles is None else mg.MgpuBlockSizes(*tiles)
    out.append((name, sizes, mg.PAIR_MIN_MP if pair is None else pair))
  return out


def configs(m, k, n, layout):
  """(name, MgpuBlockSizes | None, PAIR_MIN_MP) to try, default first."""
  default = mg.plan(m, k, n, None, layout)
  out = [("default", None, mg.PAIR_MIN_MP)]
  for tk, st in TILE_VARIANTS[layout, default.mp]:
    out.append((f"tk{tk}x{st}", mg.MgpuBlockSizes(tile_k=tk, stages=st),
                mg.PAIR_MIN_MP))
  if default.split > 1:
    out.append((f"split{default.split // 2}",
                mg.MgpuBlockSizes(max_split=default.split // 2),
                mg.PAIR_MIN_MP))
  out.append((f"split{default.split * 2}",
              mg.MgpuBlockSizes(target_ctas=4 * 132,
                                max_split=default.split * 2),
              mg.PAIR_MIN_MP))
  if default.cluster > 1:
    out.append(("no_pairs", None, 1 << 20))
  elif default.mp >= 64:
    out.append(("pairs", None, default.mp))
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("out")
  ap.add_argument("--budget-s", type=float, default=400)
  ap.add_argument("--only", default="")
  ap.add_argument("--defaults-only", action="store_true")
  ap.add_argument("--check", action="store_true")
  ap.add_argument("--round2", action="store_true")
  args = ap.parse_args()
  if args.check:
    return check(args.out)
  start = time.time()
  timer = harness.Timer()
  torch = harness.torch_module()
  rows = []
  info = harness.device_info()

  def save():
    with open(args.out, "w") as f:
      json.dump({"device": info, "jax": jax.__version__, "rows": rows}, f,
                indent=1)

  default_pair = mg.PAIR_MIN_MP
  data, torch_us = {}, {}
  for k, n in SHAPES:  # peers first
    for m in MS:
      case = f"{m}x{k}x{n}"
      if args.only and args.only not in case:
        continue
      peer = int8_matmul.torch_bf16_peer(torch, torch.matmul, m, k, n,
                                         "cuda", COPIES)
      torch_us[case] = timer.torch(peer, reps=COPIES) * 1e6
      rows.append(dict(case=case, impl="torch_bf16", us=torch_us[case]))
      print(f"{case} torch_bf16 {torch_us[case]:.1f}", flush=True)

  def inputs(m, k, n, fmt):
    if (k, n) not in data:
      data.clear()
      data[k, n] = weights(jax.random.key(1), k, n)
    q, s = data[k, n][fmt]
    x = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
    want = jnp.dot(x[:CHECK_ROWS].astype(jnp.float32),
                   q.astype(jnp.float32) * s,
                   precision=jax.lax.Precision.HIGHEST)
    return x, q, s, want

  # pass 0: every default; pass 1: int8 variants; pass 2: fp8 variants
  # (--round2: passes 1 and 2 each with the defaults)
  for stage in ((1, 2) if args.round2 else (0, 1, 2)):
    if stage and args.defaults_only:
      break
    fmts = list(FORMATS) if stage == 0 else [list(FORMATS)[stage - 1]]
    for k, n in SHAPES:
      for m in MS:
        case = f"{m}x{k}x{n}"
        if case not in torch_us:
          continue
        for fmt in fmts:
          x, q, s, want = inputs(m, k, n, fmt)
          for layout in ("kn", "nk"):
            w = q if layout == "kn" else q.T
            cfgs = (configs_round2 if args.round2 else configs)(m, k, n,
                                                                layout)
            if not args.round2:
              cfgs = cfgs[:1] if stage == 0 else cfgs[1:]
            for name, sizes, pair in cfgs:
              if time.time() - start > args.budget_s:
                save()
                print("budget spent", flush=True)
                return
              rows.append(one(case, m, k, n, fmt, layout, name, sizes, pair,
                              x, w, s, want, torch_us[case], timer,
                              default_pair))
              print(" ".join(f"{key}={v:.3g}" if isinstance(v, float)
                             else f"{key}={v}" for key, v in rows[-1].items()),
                    flush=True)
            save()
  save()


def one(case, m, k, n, fmt, layout, name, sizes, pair, x, w, s, want,
        torch_us, timer, default_pair):
  mg.PAIR_MIN_MP = pair
  try:
    p = mg.plan(m, k, n, sizes, layout)
    row = dict(case=case, impl=f"{fmt}_{layout}", variant=name,
               tile_k=p.sizes.tile_k, stages=p.sizes.stages,
               split=p.split, cluster=p.cluster)
    op = lambda a, b, c: call(a, b, c, layout, sizes)  # noqa: E731
    sec, out = timer.jax(op, x, w, s, copies=COPIES)
    row["us"] = sec * 1e6
    row["vs_torch_bf16"] = torch_us / row["us"]
    row["err"] = float(jnp.linalg.norm(
        out[:CHECK_ROWS].astype(jnp.float32) - want) / jnp.linalg.norm(want))
  except Exception as e:  # a config that fails is a data point
    row = dict(case=case, impl=f"{fmt}_{layout}", variant=name,
               error=f"{type(e).__name__}: {str(e)[:300]}")
  finally:
    mg.PAIR_MIN_MP = default_pair
  return row

CHECK_SHAPES = [(77, 1000, 300), (200, 2112, 1000), (256, 8192, 2048),
                (130, 4096, 14336), (256, 8192, 8192), (64, 8192, 28672),
                (256, 8192, 28672), (100, 14336, 4096)]


def check(path):
  """The default plan against float64 numpy at odd and bench shapes, all
  rows, with w_scale and bias; relative Frobenius error per call."""
  rng = np.random.default_rng(0)
  rows = []
  for m, k, n in CHECK_SHAPES:
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal((1, n)), jnp.float32)
    for fmt, dtype in FORMATS.items():
      if fmt == "int8":
        q = jnp.asarray(rng.integers(-127, 128, (k, n)), jnp.int8)
      else:
        q = jnp.asarray(rng.standard_normal((k, n)) * 64, dtype)
      s = jnp.asarray(rng.uniform(0.5, 2.0, (1, n)) / np.sqrt(k), jnp.float32)
      want = (np.asarray(x, np.float64) @ (np.asarray(q.astype(jnp.float32),
                                                      np.float64)
                                           * np.asarray(s, np.float64))
              + np.asarray(bias, np.float64))
      for layout in ("kn", "nk"):
        w = q if layout == "kn" else q.T
        p = mg.plan(m, k, n, None, layout)
        got = mg.matmul(x, w, None, s, bias, mode="weight_only",
                        out_dtype=jnp.bfloat16, w_layout=layout)
        got = np.asarray(got.astype(jnp.float32), np.float64)
        err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        row = dict(case=f"{m}x{k}x{n}", impl=f"{fmt}_{layout}",
                   tile_k=p.sizes.tile_k, stages=p.sizes.stages,
                   split=p.split, cluster=p.cluster, err=err,
                   finite=bool(np.isfinite(got).all()),
                   ok=bool(np.isfinite(got).all() and err < 1e-2))
        rows.append(row)
        print(row, flush=True)
  with open(path, "w") as f:
    json.dump({"jax": jax.__version__, "rows": rows}, f, indent=1)
  bad = [r for r in rows if not r["ok"]]
  print(f"check: {len(rows) - len(bad)}/{len(rows)} within 1e-2", flush=True)
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
