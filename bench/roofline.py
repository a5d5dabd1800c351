"""Roofline of the TPU kernels per generation, and peak rates per chip.

    python -m bench.roofline [--generation G ...] [--json PATH]

prints, per op and TPU generation, the kernel's MXU, VPU, EUP (exp, tanh)
and HBM times at peak rate, the fixed cost of its grid steps, and which of
them bounds it. A launch takes ``max(mxu, vpu, eup, hbm) + steps`` (units
overlap within a step; the per-step cost does not); a call sums its launches.

TPU rates are per JAX device (``_backend.TPU_SPECS``: a v4/v5p megacore chip,
one tpu7x TensorCore); ``_backend.TPU_SPEC_SOURCES`` cites each peak and
names what is assumed (clocks of v6e/tpu7x, VPU slots, EUP rate, the
~0.35 us per grid step). The work counts follow each kernel:

- MXU flops with contracted and output-column dims padded to the MXU width
  (128; 256 on v6e and tpu7x), rows to 8 sublanes.
- VPU: f32 elementwise operations per score/output element, counted from
  the kernels' bodies (constants below); EUP: transcendentals.
- HBM: what the BlockSpecs stream (re-reads included), outputs once.
- Grid steps: visited blocks (a compressed grid walks only those).

GPU peaks (``roofline``/``rows``, used by the GPU benches' TPU columns and
plots): H100 SXM 989 TFLOP/s bf16, 1979 TOP/s int8, 3.35 TB/s (NVIDIA H100
datasheet); H200 SXM the same compute at 4.8 TB/s (H200 datasheet).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from pallas_kernels import _backend

MiB = 2**20

SPECS = {
    g: dict(bf16=s.bf16, hbm=s.hbm, vmem=s.vmem, vpu=s.vpu, eup=s.eup,
            clock_hz=s.clock_hz,
            **({"int8": s.int8} if s.int8 else {}),
            **({"fp8": s.fp8} if s.fp8 else {}))
    for g, s in _backend.TPU_SPECS.items()}
SPECS.update({
    "h100": dict(bf16=989e12, int8=1979e12, hbm=3.35e12),
    "h200": dict(bf16=989e12, int8=1979e12, hbm=4.8e12),
})
TPUS = _backend.TPU_GENERATIONS

# f32 VPU operations per score element (the kernels' bodies):
# forward: scale, running max, subtract, row sum, bf16 cast, rescale;
# dq / dk-dv: scale, subtract lse, dp - di, times p, two bf16 casts, sums.
ATTENTION_VPU = {"fwd": 6, "dq": 8, "dkv": 8}
# Decode: scale, mask select, max, subtract, sum, cast per (row, key).
DECODE_VPU = 6
# Weight-only int4: unpack (shift, mask), convert, scale, bf16 cast per w value.
INT4_UNPACK_VPU = 5
# Per-channel 8-bit weights: one conversion to the MXU dtype per w value.
WEIGHT_CONVERT_VPU = 1


def roofline(chip: str, flops: float, bytes_moved: float,
             dtype: str = "bf16") -> dict:
  """max(MXU time, HBM time) on ``chip`` (no vector or per-step terms: for
  a kernel's full picture use ``Work`` and ``terms``). A chip without a
  published ``dtype`` rate raises ValueError."""
  spec = SPECS[chip]
  if flops and dtype not in spec:
    raise ValueError(f"roofline: chip {chip!r} has no published {dtype} rate")
  compute_s = flops / spec[dtype] if flops else 0.0
  memory_s = bytes_moved / spec["hbm"]
  return dict(chip=chip, time_s=max(compute_s, memory_s), compute_s=compute_s,
              memory_s=memory_s,
              bound="compute" if compute_s >= memory_s else "memory",
              intensity=flops / bytes_moved if bytes_moved else float("inf"))


def rows(case: str, flops: float, bytes_moved: float, dtype: str = "bf16",
         chips=TPUS, useful_flops: float | None = None) -> list[dict]:
  """One ``roofline`` estimate per chip that has a ``dtype`` rate, for
  results files; ``useful_flops`` (default ``flops``) gives the TFLOP/s."""
  out = []
  for chip in chips:
    if flops and dtype not in SPECS[chip]:
      continue
    est = roofline(chip, flops, bytes_moved, dtype)
    out.append(dict(case=case, chip=chip, dtype=dtype, flops=flops,
                    bytes=bytes_moved, intensity=est["intensity"],
                    time_ms=est["time_s"] * 1e3, bound=est["bound"],
                    tflops=(useful_flops if useful_flops is not None
                            else flops) / est["time_s"] / 1e12))
  return out


# ------------------------------------------------------------ kernel model
@dataclasses.dataclass(frozen=True)
class Work:
  """One kernel launch: MXU flops (padded) at ``mxu_dtype``'s rate, f32 VPU
  operations, transcendentals, HBM bytes and grid steps."""
  name: str
  mxu_flops: float = 0.0
  mxu_dtype: str = "bf16"
  vpu_ops: float = 0.0
  transcendentals: float = 0.0
  hbm_bytes: float = 0.0
  grid_steps: int = 0


TERMS = ("mxu", "vpu", "eup", "hbm", "steps")


def terms(generation: str, work: Work) -> dict:
  """Seconds of each term of ``work`` on ``generation``, its time
  (``max(mxu, vpu, eup, hbm) + steps``) and the largest term (``bound``)."""
  spec = _backend.TPU_SPECS[generation]
  rate = getattr(spec, work.mxu_dtype)
  if rate is None and work.mxu_flops:
    raise ValueError(f"roofline: {generation} has no published "
                     f"{work.mxu_dtype} rate")
  out = dict(
      mxu=work.mxu_flops / rate if work.mxu_flops else 0.0,
      vpu=work.vpu_ops / spec.vpu,
      eup=work.transcendentals / spec.eup,
      hbm=work.hbm_bytes / spec.hbm,
      steps=work.grid_steps * _backend.TPU_STEP_OVERHEAD_S / spec.cores)
  time_s = max(out[t] for t in TERMS[:4]) + out["steps"]
  bound = max(TERMS, key=out.get)
  return dict(out, time_s=time_s, bound=bound)


def total(generation: str, launches) -> dict:
  """Terms summed over a call's launches (each launch bound on its own)."""
  parts = [terms(generation, w) for w in launches]
  out = {t: sum(p[t] for p in parts) for t in TERMS + ("time_s",)}
  out["bound"] = "+".join(dict.fromkeys(p["bound"] for p in parts))
  return out


def _pad(x: int, m: int) -> int:
  return -(-x // m) * m


def attention(generation, *, batch, heads, length, head_dim, blocks,
              itemsize=2, backward=False, visited=None) -> list[Work]:
  """Forward (or dq + dk/dv) launches of the TPU flash attention at
  ``blocks`` = (block_q, block_kv) for one self-attention shape.
  ``visited``: blocks per head that run (default all)."""
  w = _backend.TPU_SPECS[generation].mxu_width
  bq, bk = blocks
  nq, nk = -(-length // bq), -(-length // bk)
  blocks_run = batch * heads * (nq * nk if visited is None else visited)
  dim = _pad(head_dim, w)
  per_block = bq * _pad(bk, w) * dim          # one matmul pair's MACs / 2
  elems = blocks_run * bq * bk
  io = batch * heads * nq * bq * head_dim * itemsize   # one [L, D] array
  if not backward:
    return [Work("fwd", mxu_flops=blocks_run * 4 * per_block,
                 vpu_ops=elems * ATTENTION_VPU["fwd"], transcendentals=elems,
                 hbm_bytes=blocks_run * 2 * bk * head_dim * itemsize
                 + 2 * io + batch * heads * nq * bq * 4,
                 grid_steps=blocks_run)]
  stats = 8 * batch * heads * nq * bq          # lse and di, float32
  return [
      Work("dq", mxu_flops=blocks_run * 6 * per_block,
           vpu_ops=elems * ATTENTION_VPU["dq"], transcendentals=elems,
           hbm_bytes=blocks_run * 2 * bk * head_dim * itemsize + 3 * io
           + stats, grid_steps=blocks_run),
      Work("dkv", mxu_flops=blocks_run * 8 * per_block,
           vpu_ops=elems * ATTENTION_VPU["dkv"], transcendentals=elems,
           hbm_bytes=blocks_run * (2 * bq * head_dim * itemsize + 8 * bq)
           + 4 * io, grid_steps=blocks_run)]


def decode(generation, *, batch, kv_heads, rows, kv_length, head_dim, block,
           itemsize=2) -> list[Work]:
  """One decode-attention launch: ``rows`` packed query rows per kv head
  against ``kv_length`` cached keys in ``block``-key steps."""
  w = _backend.TPU_SPECS[generation].mxu_width
  steps = batch * kv_heads * -(-kv_length // block)
  elems = steps * rows * block
  return [Work("decode", mxu_flops=steps * 4 * _pad(rows, 8) * block
               * _pad(head_dim, w), vpu_ops=elems * DECODE_VPU,
               transcendentals=elems,
               hbm_bytes=steps * 2 * block * head_dim * itemsize,
               grid_steps=steps)]


def matmul(generation, *, m, k, n, tiles, x_bytes=1, w_bits=8, out_bytes=2,
           mxu_dtype="int8", unpack_ops=0, name="matmul") -> list[Work]:
  """One tiled [m, k] x [k, n] launch at ``tiles`` = (bm, bk, bn): x re-read
  per column tile, w per row tile; ``unpack_ops`` VPU operations per w
  value per step (dequantization); the sum and epilogue per output."""
  w = _backend.TPU_SPECS[generation].mxu_width
  bm, bk, bn = tiles
  gm, gn, gk = -(-m // bm), -(-n // bn), -(-k // bk)
  steps = gm * gn * gk
  return [Work(name, mxu_flops=2 * _pad(m, 8) * _pad(k, w) * _pad(n, w),
               mxu_dtype=mxu_dtype,
               vpu_ops=steps * (bm * bn + unpack_ops * bk * bn) + 3 * m * n,
               hbm_bytes=gn * m * k * x_bytes + gm * k * n * w_bits / 8
               + m * n * out_bytes, grid_steps=steps)]


def elementwise(name, *, items, ops, transcendentals, bytes_per_item,
                steps) -> list[Work]:
  """A VPU-only launch (box formulas): ``ops`` per item."""
  return [Work(name, vpu_ops=items * ops,
               transcendentals=items * transcendentals,
               hbm_bytes=items * bytes_per_item, grid_steps=steps)]


# ------------------------------------------------------------- op table
def op_launches(generation: str) -> dict:
  """op -> launches at this package's tiles for ``generation`` (the shapes of
  ``bench.tpu_tiles``)."""
  from pallas_kernels.attention import block_sizes as attn_bs
  from pallas_kernels.boxes.iou import _math, mosaic_tpu as iou_tpu
  from pallas_kernels.boxes.nms import mosaic_tpu as nms_tpu
  from pallas_kernels.decode import mosaic_tpu as decode_tpu
  from pallas_kernels.quant import int8_block_sizes as int8_bs
  from pallas_kernels.quant import block_sizes as quant_bs

  out = {}
  shape = dict(batch=1, heads=8, length=8192, head_dim=128)
  blocks = attn_bs.table_block_sizes(generation, 128)
  out["flash_attention fwd"] = attention(
      generation, blocks=(blocks.block_q, blocks.block_kv), **shape)
  out["flash_attention bwd"] = attention(
      generation, blocks=(blocks.block_q_bwd, blocks.block_kv_bwd),
      backward=True, **shape)
  plan = decode_tpu.make_plan(8, 8, 4, 32768, 128, 2, generation=generation)
  out["decode_attention"] = decode(
      generation, batch=8, kv_heads=8, rows=plan.rows, kv_length=32768,
      head_dim=128, block=plan.block)
  int8_rate = "int8" if _backend.TPU_SPECS[generation].int8 else "bf16"
  for m in (16, 4096):
    p = int8_bs.plan_tpu(m, 8192, 8192, x_bytes=1, out_bytes=4, mode="raw",
                         generation=generation)
    out[f"int8_matmul M={m}"] = matmul(
        generation, m=m, k=8192, n=8192, tiles=(p.bm, p.bk, p.bn),
        out_bytes=4, mxu_dtype=int8_rate, name="int8_matmul_raw",
        unpack_ops=0 if int8_bs.int8_mxu(generation) else 2)
  out.update(quantized_launches(generation))
  boxes = 1 << 20
  flops, trans = _math.ops_per_box("giou", "loss", 1e-7, "xyxy")
  per_step = iou_tpu.FORWARD_BLOCK_ROWS * iou_tpu.LANES
  out["giou_loss fwd"] = elementwise(
      "giou", items=boxes, ops=flops, transcendentals=trans,
      bytes_per_item=2 * 4 * 4, steps=-(-boxes // per_step))
  n, tile = 4096, nms_tpu.DEFAULT_TILE
  tiles = -(-n // tile)
  pairs = n * n / 2
  out["nms"] = elementwise(
      "nms", items=pairs, ops=nms_tpu.iou_test_flops(), transcendentals=0,
      bytes_per_item=0, steps=tiles)
  return out


def quantized_launches(generation: str) -> dict:
  """``quantized_matmul`` at 8192 x 8192 weights per format and mode, at
  this package's TPU tiles: weight-only (bf16 x) at M = 16 (decode) and
  256, per-channel int8 / fp8 (one conversion per w value) and int4 in
  groups of 128 with zeros; fp8 x fp8 at M = 4096 on the fp8 MXU where the
  generation has one, else both tiles upcast to bf16."""
  from pallas_kernels.quant import int8_block_sizes as int8_bs
  from pallas_kernels.quant import block_sizes as quant_bs
  out = {}
  for fmt, w_bits, unpack in (("int8", 8, WEIGHT_CONVERT_VPU),
                              ("fp8", 8, WEIGHT_CONVERT_VPU),
                              ("int4 g128", 4, INT4_UNPACK_VPU)):
    for m in (16, 256):
      if fmt == "int8":   # per-channel int8 runs the int8 kernel
        p = int8_bs.plan_tpu(m, 8192, 8192, x_bytes=2, out_bytes=2,
                             mode="weight_only", generation=generation)
      else:
        grouped = fmt.startswith("int4")
        p = quant_bs.plan_tpu(m, 8192, 8192, x_bytes=2, w_bits=w_bits,
                              out_bytes=2, compute_bytes=2,
                              generation=generation,
                              group_size=128 if grouped else None,
                              has_zero=grouped)
      out[f"quantized_matmul {fmt} weight-only M={m}"] = matmul(
          generation, m=m, k=8192, n=8192, tiles=(p.bm, p.bk, p.bn),
          x_bytes=2, w_bits=w_bits, mxu_dtype="bf16", unpack_ops=unpack,
          name=f"quantized_matmul_weight_only_{fmt.split()[0]}")
  native = quant_bs.fp8_mxu(generation)
  p = quant_bs.plan_tpu(4096, 8192, 8192, x_bytes=1, w_bits=8, out_bytes=2,
                        compute_bytes=0 if native else 2,
                        generation=generation, x_upcast=not native)
  out["quantized_matmul fp8 x fp8 M=4096"] = matmul(
      generation, m=4096, k=8192, n=8192, tiles=(p.bm, p.bk, p.bn),
      x_bytes=1, w_bits=8, mxu_dtype="fp8" if native else "bf16",
      unpack_ops=0 if native else 2 * WEIGHT_CONVERT_VPU,
      name="quantized_matmul_fp8")
  return out


def table(generations=TPUS) -> list[dict]:
  out = []
  for gen in generations:
    for op, launches in op_launches(gen).items():
      t = total(gen, launches)
      out.append(dict(op=op, generation=gen, grid_steps=sum(
          w.grid_steps for w in launches),
          **{k: (v * 1e6 if k != "bound" else v) for k, v in t.items()}))
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--generation", action="append", choices=TPUS)
  parser.add_argument("--json", help="also write the rows here")
  args = parser.parse_args(argv)
  data = table(tuple(args.generation or TPUS))
  cols = ("op", "generation", "grid_steps") + TERMS + ("time_s", "bound")
  print("times in us; time = max(mxu, vpu, eup, hbm) + steps; bound: the "
        "largest term")
  print(" | ".join(cols))
  for row in data:
    print(" | ".join(f"{row[c]:.1f}" if isinstance(row[c], float)
                     else str(row[c]) for c in cols))
  print("\n" + _backend.TPU_SPEC_SOURCES)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(data, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
