"""Shape cliffs of the TPU box kernels, read from real TPU compiles (no TPU).

    python -m bench.boxes_cliffs [--generations v5e,v4]
        [--cases giou,pairwise,nms,sorts,mosaic_sort] [--label after] [--json FILE]
    python -m bench.boxes_cliffs --table before.json after.json --md OUT.md

Each case is AOT-compiled with libtpu's compile-only topology of the
generation (``tpu_aot.compile_for_tpu``, a fresh jit each time) and reports
XLA's memory analysis (argument / output / temp bytes), the HLO ops around
the Mosaic custom calls that move data (copy, transpose, pad, slice,
concatenate, sort, broadcast, gather, scatter, also as fusions named after
them: ``data_movement``), the scoped VMEM
of the kernels and the wall seconds of lowering + compiling. Run it once per
tree (``PYTHONPATH=<tree>``) with ``--label`` and ``--json``, then
``--table`` merges the files into one markdown table.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import functools
import json
import platform
import re
import time

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from pallas_kernels.boxes.nms import mosaic_tpu as nms_mosaic_tpu

GENERATIONS = ("v5e",)
ELEMENTWISE = (1000, 4096, 100_003, 1_000_003)
PAIRWISE = ((1000, 1001), (4096, 4095))
NMS = (5_000, 20_000, 100_000, 300_000)
NMS_MAX_OUTPUT = 1000
# XLA's TPU sort alone (what NMS's compile time is made of): (key, index)
# pairs of 131072 boxes sorted in rows of this many, lexicographically.
SORT_ROWS = (1024, 4096, 131072)
# Ops that only move or reorder data (fusions are named by XLA after them).
# Async copy-start/-done pairs are XLA prefetching an operand into VMEM
# (same layout), not counted.
MOVES = ("copy", "transpose", "pad", "slice", "concatenate", "sort",
         "broadcast", "gather", "scatter")


def _spec(*shape, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype)


def cases(kinds):
  out = []
  if "giou" in kinds:
    for n in ELEMENTWISE:
      out.append((f"giou {n}", pk.giou, (_spec(n, 4), _spec(n, 4))))
      out.append((f"giou_loss mean fwd+bwd {n}", jax.value_and_grad(
          lambda p, t: pk.giou_loss(p, t, reduction="mean"), argnums=(0, 1)),
          (_spec(n, 4), _spec(n, 4))))
  if "pairwise" in kinds:
    for n, m in PAIRWISE:
      out.append((f"pairwise_giou {n}x{m}", pk.pairwise_giou,
                  (_spec(n, 4), _spec(m, 4))))
  if "nms" in kinds:
    for n in NMS:
      out.append((f"nms {n} (max_output {NMS_MAX_OUTPUT})",
                  functools.partial(pk.nms, iou_threshold=0.5,
                                    max_output_size=NMS_MAX_OUTPUT),
                  (_spec(n, 4), _spec(n))))
  if "sorts" in kinds:
    for row in SORT_ROWS:
      out.append((f"XLA sort of (key, index), rows of {row}", functools.partial(
          _sorted_rows, row=row), (_spec(SORT_ROWS[-1]),)))
  if "mosaic_sort" in kinds:
    out.append((f"Mosaic sort of (key, index), {SORT_ROWS[-1]}",
                nms_mosaic_tpu.sort_keys,
                (_spec(1, SORT_ROWS[-1], dtype=jnp.int32),)))
  return out


def _sorted_rows(keys, row):
  keys = keys.reshape(-1, row)
  index = jax.lax.broadcasted_iota(jnp.int32, keys.shape, 1)
  return jax.lax.sort((keys, index), dimension=1, num_keys=2)[1]


def data_movement(hlo_text):
  """Counts of data-moving ops (by name) in the entry computation."""
  entry = hlo_text[hlo_text.find("\nENTRY"):]
  counts = collections.Counter()
  for line in entry.splitlines():
    match = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\S+\s+([\w\-]+)\(",
                     line)
    if not match or "tpu_custom_call" in line:
      continue
    name, op = match.groups()
    if op in ("copy-start", "copy-done"):
      continue
    for move in MOVES:
      if op.startswith(move) or (op == "fusion" and move in name):
        counts[move] += 1
        break
  return dict(sorted(counts.items()))


def measure(generations, kinds):
  tpu_aot = pk.tpu_aot
  rows = []
  for generation in generations:
    topology = tpu_aot.GENERATION_TOPOLOGY[generation]
    tpu_aot.topology_devices(topology)  # libtpu start-up, not timed
    for name, fn, specs in cases(kinds):
      start = time.perf_counter()
      result = tpu_aot.compile_for_tpu(fn, *specs, topology=topology)
      seconds = time.perf_counter() - start
      memory = result.memory
      rows.append(dict(
          generation=generation, case=name,
          argument_bytes=int(memory.argument_size_in_bytes),
          output_bytes=int(memory.output_size_in_bytes),
          temp_bytes=int(memory.temp_size_in_bytes),
          kernel_vmem_bytes=sum(result.kernel_vmem_bytes.values()),
          data_movement=data_movement(result.hlo_text),
          compile_s=round(seconds, 2)))
      print(json.dumps(rows[-1]), flush=True)
  return rows


def _moves(row):
  return ", ".join(f"{k} {v}" for k, v in row["data_movement"].items()) or "-"


def table(files):
  runs = [json.load(open(f)) for f in files]
  lines = []
  for run in runs:
    lines.append(f"* {run['label']}: jax {run['jax']}, libtpu compile-only "
                 f"topologies, host {run['host']}, {run['date']}")
  columns = ("argument / output / temp bytes", "kernel VMEM", "data movement",
             "compile s")
  lines += ["", "| generation | case | " + " | ".join(
      f"{run['label']}: {col}" for run in runs for col in columns) + " |",
            "| --- | --- |" + " --- |" * (4 * len(runs))]
  keyed = [{(r["generation"], r["case"]): r for r in run["rows"]}
           for run in runs]
  for key in dict.fromkeys(k for rows in keyed for k in rows):
    cells = []
    for rows in keyed:
      row = rows.get(key)
      if row is None:
        cells += ["-"] * 4
        continue
      cells += [f"{row['argument_bytes']:,} / {row['output_bytes']:,} / "
                f"{row['temp_bytes']:,}", f"{row['kernel_vmem_bytes']:,}",
                _moves(row), f"{row['compile_s']:.1f}"]
    lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--generations", default=",".join(GENERATIONS))
  parser.add_argument("--cases", default="giou,pairwise,nms")
  parser.add_argument("--label", default="run")
  parser.add_argument("--json")
  parser.add_argument("--table", nargs="+")
  parser.add_argument("--md")
  args = parser.parse_args(argv)
  if args.table:
    text = table(args.table)
    if args.md:
      with open(args.md, "a") as f:
        f.write(text)
    print(text)
    return
  rows = measure(args.generations.split(","), args.cases.split(","))
  run = dict(label=args.label, jax=jax.__version__, host=platform.node(),
             date=datetime.date.today().isoformat(), rows=rows)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(run, f, indent=1)


if __name__ == "__main__":
  main()
