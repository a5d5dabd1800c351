"""Check and time the Mosaic GPU (Hopper) flash-attention forward.

  python bench/bench_attention_mgpu.py            # on an H100: checks + timings
  python bench/bench_attention_mgpu.py --quick    # CPU smoke test (interpreter)
  python bench/bench_attention_mgpu.py --sweep    # also block_k/stages variants
  python bench/bench_attention_mgpu.py --variants [--only a,b] [--causal 1]
      # the schedule variants (_variant_table) at D128 (and --other-dims at
      # D64), each checked against the first one's output, timed in rounds
      # beside cuDNN, attention_mgpu and tokamax (needs .whl carried)

Checks compare ``attention.mosaic_gpu.forward`` with the float32 reference
(relative error ||out - ref|| / ||ref||, and lse where finite; -inf rows must
match) on fresh random inputs: causal and not, GQA, ragged lengths, Lq != Lk,
windows, soft cap, head_dim 64/128/256. Peers timed in the same run (forward
only, B=4, H=16, L=4096, bf16 unless noted): cuDNN through
``jax.nn.dot_product_attention``, jax's ``attention_mgpu`` (float16: it takes
no bf16), and our Triton forward (``attention.gpu.forward``). Writes
``bench/results/attention_mgpu-<device>-<date>.json``.
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench import harness  # noqa: E402
from pallas_kernels.attention import gpu as triton_attention  # noqa: E402
from pallas_kernels.attention import mosaic_gpu  # noqa: E402
from pallas_kernels.attention import reference  # noqa: E402

REPS = 5  # calls per timing sample: hides JAX's per-call host overhead


def _inputs(key, b, h, hk, lq, lk, d, dtype):
  kq, kk, kv = jax.random.split(key, 3)
  q = jax.random.normal(kq, (b, h, lq, d), jnp.float32).astype(dtype)
  k = jax.random.normal(kk, (b, hk, lk, d), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (b, hk, lk, d), jnp.float32).astype(dtype)
  return q, k, v


def _kwargs(d, causal=False, left=None, right=None, cap=None, sizes=None):
  return dict(sm_scale=1 / math.sqrt(d), causal=causal, window_left=left,
              window_right=right, logit_soft_cap=cap, block_sizes=sizes)


def ours_fn(interpret=False, **kw):
  return jax.jit(lambda q, k, v: mosaic_gpu.forward(
      q, k, v, None, None, None, interpret=interpret, **kw))


def triton_fn(**kw):
  # gpu.forward may itself pick the Mosaic GPU kernel on a Hopper: force Triton.
  fields = getattr(triton_attention.GpuBlockSizes, "__dataclass_fields__", {})
  kw["block_sizes"] = (triton_attention.GpuBlockSizes(forward_kernel="triton")
                       if "forward_kernel" in fields else None)
  return jax.jit(lambda q, k, v: triton_attention.forward(
      q, k, v, None, None, None, interpret=False, **kw))


CHECKS = [  # (b, h, hk, lq, lk, d, dtype, causal, left, right, cap)
    (2, 4, 4, 1024, 1024, 128, "bfloat16", False, None, None, None),
    (2, 4, 4, 1024, 1024, 128, "bfloat16", True, None, None, None),
    (1, 8, 2, 1000, 1500, 128, "bfloat16", True, None, None, None),
    (1, 4, 1, 1500, 700, 128, "float16", True, None, None, None),
    (1, 4, 2, 777, 1333, 64, "bfloat16", False, 200, 50, None),
    (2, 4, 4, 1024, 1024, 64, "bfloat16", True, None, None, None),
    (1, 4, 4, 640, 900, 256, "bfloat16", True, None, None, 30.0),
    (1, 4, 4, 512, 512, 256, "bfloat16", False, None, None, None),
]
QUICK_CHECKS = [
    (1, 2, 1, 100, 300, 64, "bfloat16", True, None, None, None),
]


def check_one(case, key, interpret=False, sizes=None):
  b, h, hk, lq, lk, d, dtype, causal, left, right, cap = case
  q, k, v = _inputs(key, b, h, hk, lq, lk, d, jnp.dtype(dtype))
  kw = _kwargs(d, causal, left, right, cap, sizes)
  label = (f"B{b} H{h}/{hk} L{lq}x{lk} D{d} {dtype} causal={causal} "
           f"window={left},{right} cap={cap}"
           + (f" sizes={sizes}" if sizes else ""))
  ok = mosaic_gpu.supports(q, k, v, **kw)
  if ok is not True:
    return {"case": label, "ok": False, "error": f"unsupported: {ok}"}
  try:
    out, lse = ours_fn(interpret, **kw)(q, k, v)
    out = np.asarray(out.astype(jnp.float32))
    lse = np.asarray(lse)
  except Exception as e:  # report and go on: one call must cover many cases
    return {"case": label, "ok": False,
            "error": f"{type(e).__name__}: {str(e)[:1500]}"}
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  kw.pop("block_sizes")
  ref_out, ref_lse = jax.jit(functools.partial(reference.attention, **kw))(
      f32(q), f32(k), f32(v))
  ref_out, ref_lse = np.asarray(ref_out), np.asarray(ref_lse)
  err = float(np.linalg.norm(out - ref_out) / max(np.linalg.norm(ref_out),
                                                  1e-30))
  finite = np.isfinite(ref_lse)
  lse_err = float(np.max(np.abs(lse[finite] - ref_lse[finite]),
                         initial=0.0))
  inf_match = bool(np.array_equal(np.isneginf(lse), np.isneginf(ref_lse)))
  nan = bool(np.isnan(out).any() or np.isnan(lse).any())
  tol = 1e-2
  ok = err < tol and lse_err < 1e-2 and inf_match and not nan
  return {"case": label, "err_out": err, "err_lse": lse_err,
          "inf_rows_match": inf_match, "nan": nan, "ok": ok}


def time_fn(fn, *args, iters=20):
  def batch():
    for _ in range(REPS - 1):
      fn(*args)
    return fn(*args)
  return harness.time_jax(batch, warmup=1, iters=iters) / REPS


def attention_flops(b, h, lq, lk, d, causal):
  flops = 4 * b * h * lq * lk * d
  return flops // 2 if causal else flops


def peers(q, k, v, causal):
  """name -> (jitted fn, args) for the peers at these inputs."""
  d = q.shape[-1]
  t = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731  [B, L, H, D]
  result = {}
  result["cudnn"] = (jax.jit(functools.partial(
      jax.nn.dot_product_attention, is_causal=causal,
      implementation="cudnn")), (t(q), t(k), t(v)))
  try:
    from jax.experimental.pallas.ops.gpu import attention_mgpu
    config = attention_mgpu.TuningConfig(
        block_q=64, block_kv=128 if d <= 128 else 64, max_concurrent_steps=2,
        causal=causal)
    # float16 only; it applies no softmax scale, so q is pre-scaled.
    h16 = lambda x: t(x).astype(jnp.float16)  # noqa: E731
    result["jax_mgpu_fp16"] = (
        jax.jit(functools.partial(attention_mgpu.attention, config=config)),
        (h16(q * (1 / math.sqrt(d))), h16(k), h16(v)))
  except Exception as e:  # pragma: no cover
    print("attention_mgpu unavailable:", e)
  result["triton_ours"] = (triton_fn(**_kwargs(d, causal)), (q, k, v))
  return result


SWEEP = {  # head_dim -> (block_k, stages, compute registers)
    64: ((128, 2, 232), (128, 4, 232), (256, 2, 232), (64, 4, 232)),
    128: ((64, 2, 232),),
}


def bench_shape(key, d, causal, iters, sweep, b=4, h=16, seq=4096):
  q, k, v = _inputs(key, b, h, h, seq, seq, d, jnp.bfloat16)
  flops = attention_flops(b, h, seq, seq, d, causal)
  rows = []

  def record(impl, fn, args, note=""):
    row = {"impl": impl, "head_dim": d, "causal": causal, "ms": None,
           "tflops": None, "note": note}
    try:
      seconds = time_fn(fn, *args, iters=iters)
      row["ms"] = seconds * 1e3
      row["tflops"] = flops / seconds / 1e12
    except Exception as e:
      row["note"] = (note + " " + f"{type(e).__name__}: {str(e)[:300]}").strip()
    rows.append(row)
    print(f"  {impl:28s} D{d} causal={causal}: "
          f"{row['ms'] if row['ms'] is None else round(row['ms'], 4)} ms "
          f"{row['note'][:200]}", flush=True)

  variants = [("mosaic_gpu", None)]
  if sweep:
    for block_k, stages, regs in SWEEP.get(d, ()):
      variants.append((f"mosaic_gpu bk{block_k} s{stages} r{regs}",
                       mosaic_gpu.MosaicGpuBlockSizes(
                           block_k=block_k, stages=stages,
                           compute_registers=regs,
                           memory_registers=min(40, 65536 // 128 - 2 * regs))))
  for name, sizes in variants:
    kw = _kwargs(d, causal, sizes=sizes)
    ok = mosaic_gpu.supports(q, k, v, **kw)
    if ok is not True:
      rows.append({"impl": name, "head_dim": d, "causal": causal, "ms": None,
                   "tflops": None, "note": f"unsupported: {ok}"})
      continue
    record(name, ours_fn(**kw), (q, k, v))
  for name, (fn, args) in peers(q, k, v, causal).items():
    record(name, fn, args)
  ours = next((r for r in rows if r["impl"] == "mosaic_gpu"), None)
  cudnn = next((r for r in rows if r["impl"] == "cudnn"), None)
  for row in rows:
    if row["ms"] and cudnn and cudnn["ms"]:
      row["vs_cudnn"] = cudnn["ms"] / row["ms"]
    if row["ms"] and ours and ours["ms"]:
      row["mosaic_gpu_speedup_vs_this"] = row["ms"] / ours["ms"]
  return rows


# --variants: schedule variants of the kernel at B4 H16 L4096 D128, each
# checked against the default kernel's output on the same inputs and timed
# in rounds interleaved with the peers (cuDNN, jax attention_mgpu, tokamax).
def _variant_table():
  S = mosaic_gpu.MosaicGpuBlockSizes
  return {  # the hardware-barrier ones last: a hang there keeps the rest
      "rendezvous": S(overlap=False, named_barriers=False, lean=False),
      "lean": S(overlap=False, named_barriers=False, lean=True),
      "lean s3": S(overlap=False, named_barriers=False, lean=True, stages=3),
      "overlap": S(overlap=True, named_barriers=False, lean=False),
      "overlap lean": S(overlap=True, named_barriers=False, lean=True),
      "named": S(overlap=False, named_barriers=True, lean=False),
      "overlap named lean": S(overlap=True, named_barriers=True, lean=True),
      "overlap named lean s3": S(overlap=True, named_barriers=True,
                                 lean=True, stages=3),
      "overlap named lean r240": S(overlap=True, named_barriers=True,
                                   lean=True, compute_registers=240,
                                   memory_registers=24),
      # head_dim 64: S of 256 keys would not fit beside P V in registers.
      "overlap lean bk128 s3": S(overlap=True, named_barriers=False,
                                 lean=True, block_k=128, stages=3),
      "overlap named lean bk128 s3": S(overlap=True, named_barriers=True,
                                       lean=True, block_k=128, stages=3),
  }


VARIANT_CHECKS = [CHECKS[i] for i in (2, 3, 4, 6)]


def _tokamax_forward(q, k, v, causal):
  from bench import bench_attention
  fwd, _ = bench_attention.build_tokamax(causal, q, k, v, q)
  return fwd


def variants(args, key):
  """Checks and times ``_variant_table()``; rows go to the results file."""
  table = _variant_table()
  rows, checks = [], []
  extra = {"checks": checks, "variants": {n: str(s) for n, s in
                                          table.items()}}

  def save():
    harness.write_results(args.name, rows, extra=extra, directory=args.out)

  def timed(row, fn, fargs):
    try:
      row["ms"].append(time_fn(fn, *fargs, iters=args.iters) * 1e3)
    except Exception as e:
      row["note"] = f"{type(e).__name__}: {str(e)[:300]}"

  for d in args.variant_head_dims:
    names = [n for n in table if (not args.only or n in args.only)
             and "bk128" not in n] if d == 128 else args.other_dims
    for causal in args.causal:
      key, sub = jax.random.split(key)
      q, k, v = _inputs(sub, 4, 16, 16, 4096, 4096, d, jnp.bfloat16)
      flops = attention_flops(4, 16, 4096, 4096, d, causal)
      impls, shape_rows = {}, []

      def new_row(name):
        row = {"impl": name, "head_dim": d, "causal": causal, "ms": []}
        rows.append(row)
        shape_rows.append(row)
        return row

      if d == 128:  # peers first: they cannot hang
        for name, (fn, fargs) in peers(q, k, v, causal).items():
          if name != "triton_ours":
            impls[name] = (fn, fargs, new_row(name))
        try:
          impls["tokamax"] = (_tokamax_forward(q, k, v, causal), (),
                              new_row("tokamax"))
        except Exception as e:
          print("tokamax unavailable:", type(e).__name__, str(e)[:300])
        for fn, fargs, row in impls.values():
          timed(row, fn, fargs)
      base_out = None
      for name in names:
        kw = _kwargs(d, causal, sizes=table[name])
        fn = ours_fn(**kw)
        row = new_row(name)
        try:
          out, _ = jax.block_until_ready(fn(q, k, v))
          out = np.asarray(out.astype(jnp.float32))
          if base_out is None:
            base_out = out
            ref = reference.attention(
                *(x[:1, :2].astype(jnp.float32) for x in (q, k, v)),
                **{k_: v_ for k_, v_ in kw.items() if k_ != "block_sizes"})
            ref = np.asarray(ref[0])
            row["err_vs_f32_ref_2heads"] = float(
                np.linalg.norm(out[:1, :2] - ref) / np.linalg.norm(ref))
          row["max_diff_vs_first"] = float(np.max(np.abs(out - base_out)))
          row["ok"] = bool(np.isfinite(out).all()
                           and row["max_diff_vs_first"] < 0.05)
          impls[name] = (fn, (q, k, v), row)
          timed(row, fn, (q, k, v))
        except Exception as e:
          row["note"] = f"{type(e).__name__}: {str(e)[:600]}"
          row["ok"] = False
        print("variant", row, flush=True)
        save()
      for _ in range(args.rounds - 1):
        for fn, fargs, row in impls.values():
          timed(row, fn, fargs)
      best = {}
      for row in shape_rows:
        if row["ms"]:
          row["ms_best"] = min(row["ms"])
          row["tflops"] = flops / row["ms_best"] / 1e9
          best[row["impl"]] = row["ms_best"]
      for row in shape_rows:
        for peer in ("cudnn", "jax_mgpu_fp16", "tokamax", "rendezvous"):
          if best.get(peer) and row.get("ms_best"):
            row[f"vs_{peer}"] = best[peer] / row["ms_best"]
        print("timed", {k_: (round(v_, 4) if isinstance(v_, float) else v_)
                        for k_, v_ in row.items()}, flush=True)
      save()
  for name in args.check_variants:
    for case in VARIANT_CHECKS:
      key, sub = jax.random.split(key)
      result = check_one(case, sub, sizes=table[name])
      result["variant"] = name
      checks.append(result)
      print("check", "ok  " if result["ok"] else "FAIL", result, flush=True)
    save()
  columns = ["impl", "head_dim", "causal", "ms_best", "tflops", "vs_cudnn",
             "vs_jax_mgpu_fp16", "vs_tokamax", "vs_rendezvous",
             "max_diff_vs_first", "ok"]
  harness.print_table(rows, columns)
  failed = [c["case"] for c in checks if not c["ok"]]
  failed += [r["impl"] for r in rows if r.get("ok") is False]
  print("failed:", failed)
  return 1 if failed else 0


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="small shapes (CPU smoke test via the interpreter)")
  parser.add_argument("--sweep", action="store_true",
                      help="time block_k/stages variants too")
  parser.add_argument("--head-dims", default="128,64,256")
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--no-checks", action="store_true")
  parser.add_argument("--name", default="attention_mgpu")
  parser.add_argument("--variants", action="store_true",
                      help="check and time the schedule variants (GPU)")
  split = lambda x: [v for v in x.split(",") if v]  # noqa: E731
  parser.add_argument("--only", type=split, default=None,
                      help="--variants: these variant names only")
  parser.add_argument("--other-dims", type=split,
                      default=["rendezvous", "overlap lean bk128 s3",
                               "overlap named lean bk128 s3"],
                      help="--variants: the variants timed at other dims")
  parser.add_argument("--variant-head-dims",
                      type=lambda x: [int(v) for v in split(x)],
                      default=[128, 64])
  parser.add_argument("--check-variants", type=split,
                      default=["overlap lean", "overlap named lean"])
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--causal", type=lambda x: [v == "1" for v in
                                                  split(x)],
                      default=[False, True],
                      help="--variants: e.g. 1 for causal only")
  parser.add_argument("--out", default=None, help="results directory")
  args = parser.parse_args(argv)
  if args.variants:
    return variants(args, jax.random.key(int(time.time())))
  on_gpu = jax.default_backend() == "gpu"
  key = jax.random.key(int(time.time()))
  checks = []
  if not args.no_checks:
    cases = CHECKS if on_gpu and not args.quick else QUICK_CHECKS
    interpret = False if on_gpu else mosaic_gpu.interpret_params()
    if not on_gpu and interpret is None:
      print("no GPU and no Mosaic GPU interpreter in this jax: checks skipped")
      cases = []
    for case in cases:
      key, sub = jax.random.split(key)
      result = check_one(case, sub, interpret=interpret)
      checks.append(result)
      print("check", "ok  " if result["ok"] else "FAIL", result, flush=True)
  rows = []
  if on_gpu:
    for d in (int(x) for x in args.head_dims.split(",") if x):
      for causal in (False, True):
        key, sub = jax.random.split(key)
        seq = 1024 if args.quick else 4096
        rows += bench_shape(sub, d, causal, args.iters,
                            args.sweep, seq=seq)
    harness.print_table(rows, ["impl", "head_dim", "causal", "ms", "tflops",
                               "vs_cudnn", "mosaic_gpu_speedup_vs_this",
                               "note"])
  else:
    print("no GPU: timings skipped"
          + (" (checks ran in the Mosaic GPU interpreter)" if checks else ""))
  failed = [c["case"] for c in checks if not c["ok"]]
  extra = {"shape": {"batch": 4, "heads": 16, "seq": 1024 if args.quick
                     else 4096, "dtype": "bf16"},
           "checks": checks, "checks_failed": failed,
           "peers": "cudnn = jax.nn.dot_product_attention(implementation="
                    "'cudnn'); jax_mgpu_fp16 = jax attention_mgpu on float16 "
                    "copies; triton_ours = pallas_kernels.attention.gpu."
                    "forward forced to its Triton kernel"}
  path = harness.write_results(args.name, rows, extra=extra,
                               directory=args.out)
  print("wrote", path)
  return 1 if failed else rows


if __name__ == "__main__":
  main()
