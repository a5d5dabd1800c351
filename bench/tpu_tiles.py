"""Tiles per TPU generation: block sizes, grid steps, compiled VMEM and
compile time of each op's kernels, from ahead-of-time compiles (no TPU).

    python -m bench.tpu_tiles --tag after [--generation G ...] [--op OP ...]
    python -m bench.tpu_tiles --table before after

``--tag`` compiles every op for each generation's topology that the
installed libtpu knows (``tpu_aot.GENERATION_TOPOLOGY``), recording each
``pallas_call`` compiled for the TPU (name, grid, first two block shapes)
and the scoped VMEM the compiler reserved per kernel, and writes
``bench/results/tpu-tiles-<tag>-<date>.json``. Run it from a checkout of
another commit (this file copied there) to get that commit's figures.
``--table`` joins two tags into ``bench/results/tpu-tiles-<date>.md``. Grid
steps are the product of each launch's grid (a compressed grid: its
extents), summed over the op's launches; ``python -m bench.roofline`` gives
the time terms of the same shapes.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import pathlib
import time

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

import pallas_kernels.tpu_aot as tpu_aot

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
S = jax.ShapeDtypeStruct
ATTENTION = (1, 8, 8192, 128)       # batch, heads, length, head_dim


def _ops():
  """op -> (function, argument specs); the shapes of bench.roofline."""
  import pallas_kernels as pk

  def attention_fwd(q, k, v):
    return pk.flash_attention(q, k, v)

  def attention_bwd(q, k, v):
    return jax.grad(lambda *a: pk.flash_attention(*a).astype(
        jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v)

  def decode(q, k, v, lengths):
    return pk.decode_attention(q, k, v, lengths)

  def giou(a, b):
    return pk.giou_loss(a, b, reduction="mean")

  qkv = [S(ATTENTION, jnp.bfloat16)] * 3
  mk = lambda m: [S((m, 8192), jnp.int8), S((8192, 8192), jnp.int8)]
  return {
      "flash_attention fwd": (attention_fwd, qkv),
      "flash_attention fwd+bwd": (attention_bwd, qkv),
      "decode_attention": (decode, [
          S((8, 32, 1, 128), jnp.bfloat16),
          S((8, 8, 32768, 128), jnp.bfloat16),
          S((8, 8, 32768, 128), jnp.bfloat16), S((8,), jnp.int32)]),
      "int8_matmul M=16": (pk.int8_matmul, mk(16)),
      "int8_matmul M=4096": (pk.int8_matmul, mk(4096)),
      "quantized_matmul int4 M=16": (
          lambda x, w, s: pk.quantized_matmul(x, w, w_scale=s,
                                              group_size=128,
                                              weight_only=True),
          [S((16, 8192), jnp.bfloat16), S((8192, 8192), jnp.int4),
           S((64, 8192), jnp.float32)]),
      "giou_loss fwd": (giou, [S((1 << 20, 4), jnp.float32)] * 2),
      "nms": (functools.partial(pk.nms, iou_threshold=0.5,
                                max_output_size=100),
              [S((4096, 4), jnp.float32), S((4096,), jnp.float32)]),
  }


def _recording(calls):
  """Wraps ``pl.pallas_call`` so each traced launch appends its name, grid
  and first block shape to ``calls``."""
  original = pl.pallas_call

  def pallas_call(kernel, *args, **kwargs):
    spec = kwargs.get("grid_spec")
    grid = tuple(spec.grid if spec is not None else kwargs.get("grid", ()))
    specs = (spec.in_specs if spec is not None else kwargs.get("in_specs"))
    blocks = []
    for s in specs or ():
      shape = getattr(s, "block_shape", None)
      if shape is not None:
        blocks.append([d for d in shape if isinstance(d, int)])
    calls.append(dict(name=kwargs.get("name"), grid=list(grid),
                      steps=math.prod(int(g) for g in grid),
                      blocks=blocks[:2]))
    return original(kernel, *args, **kwargs)
  return original, pallas_call


def measure(op, generation) -> dict:
  fn, specs = _ops()[op]
  topology = tpu_aot.GENERATION_TOPOLOGY[generation]
  calls = []
  original, recording = _recording(calls)
  pl.pallas_call = recording
  start = time.perf_counter()
  try:
    result = tpu_aot.compile_for_tpu(fn, *specs, topology=topology)
  except Exception as e:  # a compile failure is a result too
    return dict(op=op, generation=generation, error=str(e)[:500])
  finally:
    pl.pallas_call = original
  seconds = time.perf_counter() - start
  vmem = result.kernel_vmem_bytes
  # Tracing visits every platform's branch: keep the launches compiled here.
  kept = []
  for c in calls:
    if (c["name"] and any(k.startswith(c["name"]) for k in vmem)
        and c not in kept):
      kept.append(c)
  calls = kept
  return dict(op=op, generation=generation, compile_s=round(seconds, 1),
              launches=calls, grid_steps=sum(c["steps"] for c in calls),
              vmem_mib={k: round(v / 2**20, 2) for k, v in vmem.items()},
              max_vmem_mib=round(max(vmem.values(), default=0) / 2**20, 2))


def record(tag, generations, ops) -> pathlib.Path:
  rows = []
  for generation in generations:
    topology = tpu_aot.GENERATION_TOPOLOGY[generation]
    if topology not in tpu_aot.available_topologies((topology,)):
      print(f"skip {generation}: libtpu lacks {topology}")
      continue
    for op in ops:
      row = measure(op, generation)
      print(json.dumps(row)[:300], flush=True)
      rows.append(row)
  date = datetime.date.today().isoformat()
  path = RESULTS / f"tpu-tiles-{tag}-{date}.json"
  path.write_text(json.dumps(dict(
      tag=tag, date=date, jax=jax.__version__, device="CPU host, libtpu "
      "compile-only topologies", rows=rows), indent=1) + "\n")
  return path


def _blocks(row):
  """Distinct block shapes of the launches, compactly."""
  seen = []
  for c in row.get("launches", []):
    shapes = ", ".join("x".join(map(str, b)) for b in c["blocks"])
    text = f"{c['name']} {shapes}"
    if text not in seen:
      seen.append(text)
  return "; ".join(seen)


def table(before_path, after_path) -> str:
  before = {(r["op"], r["generation"]): r
            for r in json.loads(pathlib.Path(before_path).read_text())["rows"]}
  after_data = json.loads(pathlib.Path(after_path).read_text())
  lines = [
      f"# TPU tiles per generation: before / after ({after_data['date']})",
      "",
      "AOT compiles on a CPU host (libtpu compile-only topologies, jax "
      f"{after_data['jax']}); `python -m bench.tpu_tiles`. Blocks: each "
      "launch's first two BlockSpecs (name, shapes without squeezed dims). Grid "
      "steps: summed over the op's launches. VMEM: the largest scoped VMEM "
      "the compiler reserved for one kernel (MiB). Compile: wall seconds of "
      "lower + compile on a shared 2-core host (noisy).",
      "",
      "| op | gen | blocks before | blocks after | grid steps | VMEM MiB "
      "| compile s |",
      "| --- | --- | --- | --- | --- | --- | --- |"]
  for row in after_data["rows"]:
    old = before.get((row["op"], row["generation"]), {})
    def pair(key, r1=old, r2=row):
      a, b = r1.get(key, r1.get("error") and "error"), r2.get(
          key, r2.get("error") and "error")
      return f"{a} → {b}"
    lines.append(
        f"| {row['op']} | {row['generation']} | {_blocks(old)} | "
        f"{_blocks(row)} | {pair('grid_steps')} | {pair('max_vmem_mib')} | "
        f"{pair('compile_s')} |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--tag")
  parser.add_argument("--table", nargs=2, metavar=("BEFORE", "AFTER"),
                      help="two tags (or JSON paths) to join")
  parser.add_argument("--generation", action="append")
  parser.add_argument("--op", action="append")
  args = parser.parse_args(argv)
  if args.table:
    date = datetime.date.today().isoformat()
    paths = [p if p.endswith(".json") else
             RESULTS / f"tpu-tiles-{p}-{date}.json" for p in args.table]
    out = RESULTS / f"tpu-tiles-{date}.md"
    out.write_text(table(*paths))
    print(out.read_text())
    return 0
  gens = args.generation or list(tpu_aot.GENERATION_TOPOLOGY)
  print(record(args.tag or "after", gens, args.op or list(_ops())))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
