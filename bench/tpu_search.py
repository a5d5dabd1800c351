"""Compile-time block-size search for the Mosaic TPU flash-attention kernels.

    python -m bench.tpu_search [--generations G ...] [--head-dims D ...]
                               [--kernels fwd bwd] [--jobs N] [--resume F]

Each candidate ``(block_q, block_kv)`` is AOT-compiled with the final-bundles
dump for every problem of ``PROBLEMS`` (one subprocess per compile, as
``bench.tpu``) and scored by ``max(bundle path us, DMA bytes / peak HBM
rate)``; a compile that does not fit VMEM drops out. Per generation, head_dim
and mask kind, the winner minimises the geometric mean over the problems of
its score / the best candidate's. ``bwd`` compiles the gradient with the
forward fixed at the table's blocks, so only the backward kernels differ.

Writes ``bench/results/tpu-search-<libtpu>-<date>.json`` and ``.md`` and
prints the rows for ``pallas_kernels.attention.block_sizes.TABLE``. Re-run it
for a new libtpu or generation and update the table from its output.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import math
import os
import sys

from bench import tpu

# Candidates; the search's cost is their count times the problems'.
FWD_CANDIDATES = tuple((q, k) for q in (512, 1024, 2048)
                       for k in (512, 1024, 2048))
BWD_CANDIDATES = tuple((q, k) for q in (512, 1024) for k in (512, 1024))
# (mask kind, sequence length); batch 1, 4 heads: per-block costs and, for
# causal, the share of the diagonal blocks at a short and a long sequence.
PROBLEMS = (("full", 4096), ("causal", 2048), ("causal", 8192))
HEADS = 4
DEFAULT_HEAD_DIMS = (64, 128, 256)


def case_name(kernel, head_dim, mask, length, block_q, block_kv):
  return (f"search {kernel} D={head_dim} {mask} L={length}"
          f"|{block_q}x{block_kv}")


def _parse(case):
  group, blocks = case.split("|")
  _, kernel, d, mask, l = group.split()
  bq, bk = blocks.split("x")
  return kernel, int(d[2:]), mask, int(l[2:]), int(bq), int(bk)


def cases(quick=False, names=None) -> dict:
  """case -> (function, argument specs, walk params) for ``bench.tpu``."""
  del quick
  import jax
  import jax.numpy as jnp
  import pallas_kernels as pk
  from pallas_kernels.attention import block_sizes as bs_lib
  out = {}
  for name in names or ():
    kernel, d, mask, l, bq, bk = _parse(name)
    qkv = [tpu._S((1, HEADS, l, d), jnp.bfloat16)] * 3
    causal = mask == "causal"
    if kernel == "fwd":
      sizes = bs_lib.BlockSizes(block_q=bq, block_kv=bk)

      def fn(q, k, v, sizes=sizes, causal=causal):
        return pk.flash_attention(q, k, v, causal=causal, block_sizes=sizes)
    else:
      table = bs_lib.table_block_sizes(tpu.GENERATION, d)
      sizes = bs_lib.BlockSizes(block_q=table.block_q,
                                block_kv=table.block_kv, block_q_bwd=bq,
                                block_kv_bwd=bk)

      def fn(q, k, v, sizes=sizes, causal=causal):
        return jax.grad(lambda *a: pk.flash_attention(
            *a, causal=causal, block_sizes=sizes).astype(jnp.float32).sum(),
            argnums=(0, 1, 2))(q, k, v)
    out[name] = (fn, qkv, None)
  return out


def score(row) -> float | None:
  """max(bundle path us, HBM us): the time the compile promises at best."""
  from bench import roofline
  if "bundles" not in row:
    return None
  hbm = row["mix"]["dma_bytes"] / roofline.SPECS[row["generation"]]["hbm"]
  return max(row["time_us"], hbm * 1e6)


def choose(rows):
  """{(generation, kernel, head_dim, mask): (winner, {candidate: geomean})}"""
  by_problem = {}
  for r in rows:
    s = score(r)
    if s is None:
      continue
    kernel, d, mask, l, bq, bk = _parse(r["case"])
    by_problem.setdefault((r["generation"], kernel, d, mask, l), {})[
        (bq, bk)] = s
  groups = {}
  for (gen, kernel, d, mask, l), scores in by_problem.items():
    best = min(scores.values())
    g = groups.setdefault((gen, kernel, d, mask), {})
    for cand, s in scores.items():
      g.setdefault(cand, []).append(s / best)
  out = {}
  for key, per_cand in groups.items():
    n = max(len(v) for v in per_cand.values())
    means = {c: math.exp(sum(map(math.log, v)) / len(v))
             for c, v in per_cand.items() if len(v) == n}   # fits everywhere
    out[key] = (min(means, key=means.get), means)
  return out


def markdown(rows, chosen, meta) -> str:
  lines = [f"# Flash-attention block search ({meta['date']})", "",
           f"jax {meta['jax']}, libtpu {meta['libtpu']}; "
           "`python -m bench.tpu_search`. Score = max(bundle path us, DMA "
           "bytes at peak HBM rate) of one AOT compile (batch 1, "
           f"{HEADS} heads, bf16); geomean = mean over the problems of score "
           "/ the best candidate's (1.00 = best everywhere). bwd rows: the "
           "gradient with the forward at the table's blocks. Bundle paths "
           "leave out DMA waits, MXU result stalls and HBM contention.", "",
           "| gen | kernel | head_dim | mask | chosen | geomean of chosen "
           "| table's | geomean of table's | runner-up |",
           "| --- | --- | ---: | --- | --- | ---: | --- | ---: | --- |"]
  from pallas_kernels.attention import block_sizes as bs_lib
  for (gen, kernel, d, mask), (win, means) in sorted(chosen.items()):
    t = bs_lib.table_block_sizes(gen, d)
    table = (t.block_q, t.block_kv) if kernel == "fwd" else (
        t.block_q_bwd, t.block_kv_bwd)
    ranked = sorted(means, key=means.get)
    runner = ranked[1] if len(ranked) > 1 else None
    fmt = lambda c: f"{c[0]}x{c[1]}" if c else "-"
    tm = f"{means[table]:.2f}" if table in means else "no fit"
    lines.append(f"| {gen} | {kernel} | {d} | {mask} | {fmt(win)} | "
                 f"{means[win]:.2f} | {fmt(table)} | {tm} | {fmt(runner)} "
                 f"{means[runner]:.2f} |" if runner else "|")
  lines += ["", "Per problem (us = score):", "",
            "| gen | case | us | bundles | steps | DMA MB |",
            "| --- | --- | ---: | ---: | ---: | ---: |"]
  for r in sorted(rows, key=lambda r: (r["generation"], r["case"])):
    if "bundles" in r:
      lines.append(f"| {r['generation']} | {r['case']} | {score(r):.1f} | "
                   f"{r['bundles']} | {r.get('steps') or ''} | "
                   f"{r['mix']['dma_bytes'] / 1e6:.2f} |")
    else:
      lines.append(f"| {r['generation']} | {r['case']} | "
                   f"{r['error'][-80:].replace('|', '/')} | | | |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--generations", nargs="+",
                      default=list(tpu.DEFAULT_GENERATIONS))
  parser.add_argument("--head-dims", nargs="+", type=int,
                      default=list(DEFAULT_HEAD_DIMS))
  parser.add_argument("--kernels", nargs="+", choices=("fwd", "bwd"),
                      default=["fwd", "bwd"])
  parser.add_argument("--jobs", type=int, default=2)
  tpu.add_run_arguments(parser)
  args = parser.parse_args(argv)
  if args.one:
    case = args.one[0]
    print(json.dumps(tpu.compile_and_walk(
        *args.one, case_table=lambda: cases(names=[case]))))
    return 0
  meta = dict(tpu.versions(), date=datetime.date.today().isoformat())
  work = []
  for gen in args.generations:
    for kernel in args.kernels:
      cands = FWD_CANDIDATES if kernel == "fwd" else BWD_CANDIDATES
      for d in args.head_dims:
        for mask, l in PROBLEMS:
          work += [(case_name(kernel, d, mask, l, bq, bk), gen)
                   for bq, bk in cands if bq <= l and bk <= l]
  done = {}
  if args.resume and os.path.exists(args.resume):
    with open(args.resume) as f:
      for line in f:
        r = json.loads(line)
        done[(r["case"], r["generation"])] = r
  rows = [done[w] for w in work if w in done]
  left = [] if args.report else [w for w in work if w not in done]
  print(f"{len(work)} compiles ({len(left)} to do), {args.jobs} at a time",
        flush=True)
  with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
    futures = {pool.submit(tpu.run_one_subprocess, c, g, False,
                           module="bench.tpu_search"): (c, g)
               for c, g in left}
    for fut in concurrent.futures.as_completed(futures):
      case, gen = futures[fut]
      r = dict(fut.result(), case=case, generation=gen)
      rows.append(r)
      if args.resume:
        with open(args.resume, "a") as f:
          f.write(json.dumps(r) + "\n")
      s = score(r)
      print(f"  {gen:5s} {case:50s} " + (f"{s:9.1f} us ({r['wall_s']} s)"
            if s is not None else "ERROR " + r["error"][-100:]), flush=True)
  chosen = choose(rows)
  text = markdown(rows, chosen, meta)
  print(text)
  print("TABLE rows (generation, kernel, head_dim, mask) -> blocks:")
  for key, (win, _) in sorted(chosen.items()):
    print(f"  {key}: {win}")
  if not args.no_save:
    stem = f"tpu-search-{meta['libtpu']}-{meta['date']}"
    tpu.RESULTS.mkdir(exist_ok=True)
    with open(tpu.RESULTS / f"{stem}.json", "w") as f:
      json.dump(dict(meta, rows=rows), f, indent=1)
    with open(tpu.RESULTS / f"{stem}.md", "w") as f:
      f.write(text)
    print("wrote", tpu.RESULTS / f"{stem}.md")
  return 0


if __name__ == "__main__":
  sys.exit(main())
