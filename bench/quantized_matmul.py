"""Quantized matmul (int8, fp8, int4 group 128) against bf16 and torch.

    python -m bench.quantized_matmul [--quick] [--cases TEXT] [--tag T] [--out DIR]

Cases (M x K x N):
  weight_only  x bf16 [M, K], w [K, N] as int8 / float8_e4m3fn (per-channel
               w_scale [N]) and int4 (groups of 128 along K, w_scale and
               w_zero [K/128, N]) -> bf16 (``pk.quantized_matmul(...,
               weight_only=True)``), M = 1..256 over the (K, N) of Llama-3
               8B and 70B layers, and prefill M = 1024 and 4096 (compute-
               bound); ``ours_<fmt>_nk``: w stored [N, K]
               (``weight_layout="nk"``, torch's layout; int4 tables [N,
               K/128]). Memory-bound rows report ``hbm_tbs``: the
               HBM bytes the call must move (w, its scales, x, out) per
               second.
  w8a8         8-bit x times 8-bit w -> bf16 with x_scale [M] and w_scale
               [N] (dequant mode), over the Llama (K, N) shapes and M = 16..
               2048, and 8192^3: ``ours_fp8_nk`` (float8_e4m3fn, w [N, K]),
               ``ours_fp8`` (w [K, N], 8192^3 only), ``ours_int8_nk``
               (``pk.int8_matmul``, int8, w [N, K]), and the same calls
               with backend="triton" (``*_triton``); peers torch_scaled_mm
               (fp8, one scalar scale each; ``_fast_accum``: with
               use_fast_accum=True, the tensor cores' own fp8 sums as ours;
               ``_rowwise``: x_scale [M, 1], w_scale [1, N]) and
               torch_int_mm (int8 -> int32, no scales).
Peers in the same run: xla_bf16 (``jnp.dot`` of bf16 x and w in the same
program), torch_bf16 (``torch.matmul``). Each call takes the next of
``copies`` copies of its inputs, so no call finds w in L2. ``err``: ours
against float64 numpy of the dequantized weight, first 16 rows. TPU rows:
the roofline of each case's minimum HBM traffic, per weight format
(weight-only: bf16 MXU; w8a8: the fp8 MXU of tpu7x, the int8 MXU of the
generations that have one, and bf16); ``python -m bench.roofline`` adds the
kernels' dequantization (VPU) and grid-step terms.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from bench import harness, int8_matmul, roofline

SHAPES = [(4096, 14336), (14336, 4096), (8192, 8192), (8192, 28672)]
MS = (1, 8, 16, 32, 64, 128, 256)
PREFILL_MS = (1024, 4096)
FORMATS = ("int8", "float8_e4m3fn", "int4")
GROUP = 128
W8A8_MS = (256, 2048)
CASES = ([dict(m=m, k=k, n=n, mode="weight_only", copies=8)
          for k, n in SHAPES for m in MS]
         + [dict(m=m, k=k, n=n, mode="weight_only", copies=2)
            for k, n in SHAPES for m in PREFILL_MS]
         + [dict(m=8192, k=8192, n=8192, mode="w8a8", copies=2)]
         + [dict(m=m, k=8192, n=8192, mode="w8a8", copies=4)
            for m in (16, 64, 128, 512, 1024)]
         + [dict(m=m, k=k, n=n, mode="w8a8", copies=4)
            for k, n in SHAPES for m in W8A8_MS])
QUICK = [dict(m=8, k=256, n=128, mode="weight_only", copies=1),
         dict(m=32, k=128, n=64, mode="w8a8", copies=1)]
CHECK_ROWS = 16
DTYPES = {"int8": jnp.int8, "float8_e4m3fn": jnp.float8_e4m3fn,
          "int4": jnp.int4}
W_BITS = {"int8": 8, "float8_e4m3fn": 8, "int4": 4}


def label(case):
  return f"{case['m']}x{case['k']}x{case['n']} {case['mode']}"


def weights(k, n):
  """fmt -> (w_q, w_scale, w_zero | None, dequantized float64 w)."""
  w = jax.random.normal(jax.random.key(1), (k, n), jnp.float32) / np.sqrt(k)
  out = {}
  for fmt in FORMATS:
    if fmt == "int4":
      q, s, z = pk.quantize(w, jnp.int4, axis=0, group_size=GROUP,
                            symmetric=False)
      deq = ((np.asarray(q, np.float64) - np.repeat(np.asarray(
          z, np.float64), GROUP, 0)) * np.repeat(np.asarray(s, np.float64),
                                                 GROUP, 0))
    else:
      q, s = pk.quantize(w, DTYPES[fmt], axis=0)
      s = s.reshape(-1)
      z = None
      deq = np.asarray(q, np.float64) * np.asarray(s, np.float64)
    out[fmt] = (q, s, z, deq)
  return w, out


def weight_only_op(fmt, layout="kn"):
  if fmt == "int4":
    return lambda x, w, s, z: pk.quantized_matmul(
        x, w, w_scale=s, w_zero=z, group_size=GROUP, weight_only=True,
        weight_layout=layout)
  return lambda x, w, s: pk.quantized_matmul(
      x, w, w_scale=s, weight_only=True, weight_layout=layout)


def hbm_bytes(m, k, n, fmt):
  scale_rows = k // GROUP * 2 if fmt == "int4" else 1
  return (k * n * W_BITS[fmt] // 8 + scale_rows * n * 4 + m * k * 2
          + m * n * 2)


def torch_peers(case, copies):
  """name -> thunk; {} without torch."""
  torch = harness.torch_module()
  if torch is None:
    return {}
  device = "cuda" if torch.cuda.is_available() else "cpu"
  m, k, n = case["m"], case["k"], case["n"]
  peers = {"torch_bf16": int8_matmul.torch_bf16_peer(
      torch, torch.matmul, m, k, n, device, copies)}
  if case["mode"] == "w8a8" and device == "cuda":
    a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=device)
    rows_scale = torch.rand((m, 1), device=device) + 0.5
    cols_scale = torch.rand((1, n), device=device) + 0.5
    peers["torch_scaled_mm"] = int8_matmul.rotating(
        lambda a_, b_: torch._scaled_mm(a_, b_, scale_a=one, scale_b=one,
                                        out_dtype=torch.bfloat16), a, b,
        copies)
    peers["torch_scaled_mm_fast_accum"] = int8_matmul.rotating(
        lambda a_, b_: torch._scaled_mm(a_, b_, scale_a=one, scale_b=one,
                                        out_dtype=torch.bfloat16,
                                        use_fast_accum=True), a, b, copies)
    peers["torch_scaled_mm_rowwise"] = int8_matmul.rotating(
        lambda a_, b_: torch._scaled_mm(a_, b_, scale_a=rows_scale,
                                        scale_b=cols_scale,
                                        out_dtype=torch.bfloat16), a, b,
        copies)
    ai = torch.randint(-127, 128, (m, k), device=device, dtype=torch.int8)
    bi = torch.randint(-127, 128, (n, k), device=device,
                       dtype=torch.int8).t()
    peers["torch_int_mm"] = int8_matmul.rotating(torch._int_mm, ai, bi,
                                                 copies)
  return peers


def run(case, timer):
  m, k, n, copies = case["m"], case["k"], case["n"], case["copies"]
  name, rows = label(case), []
  flops = 2.0 * m * k * n
  x = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
  w, quantized = weights(k, n)
  x64 = np.asarray(x, np.float64)[:CHECK_ROWS]
  if case["mode"] == "weight_only":
    variants = [(fmt, layout) for layout in ("kn", "nk") for fmt in FORMATS]
    for fmt, layout in variants:
      q, s, z, deq = quantized[fmt]
      if layout == "nk":  # int4 group tables [N, K/128] too
        q = q.T
        s, z = (s, z) if z is None else (s.T, z.T)
      args = (x, q, s) if z is None else (x, q, s, z)
      out = {}

      def timed(fmt=fmt, layout=layout, args=args, out=out):
        seconds, result = timer.jax(weight_only_op(fmt, layout), *args,
                                    copies=copies)
        out["err"] = harness.rel_error(result[:CHECK_ROWS], x64 @ deq)
        return seconds
      impl = f"ours_{fmt}" + ("_nk" if layout == "nk" else "")
      row = harness.measure(rows, name, impl, timed, flops=flops)
      row["err"] = out.get("err")
      if row["ms"]:
        row["hbm_tbs"] = hbm_bytes(m, k, n, fmt) / row["ms"] / 1e9
  else:
    w8a8_rows(rows, name, case, timer, x, quantized, flops)
  int8_matmul.measure_peers(rows, name, timer, x, w.astype(jnp.bfloat16),
                            lambda: torch_peers(case, copies),
                            copies=copies, flops=flops)
  return rows


def w8a8_ops(m, k, n):
  """impl -> (fmt, layout, op of (x_q, w_q, x_scale, w_scale))."""
  def op(layout, backend=None, int8=False):
    if int8:
      return lambda a, b, c, d: pk.int8_matmul(
          a, b, x_scale=c, w_scale=d, weight_layout=layout, backend=backend)
    return lambda a, b, c, d: pk.quantized_matmul(
        a, b, x_scale=c, w_scale=d, weight_layout=layout, backend=backend)
  ops = {"ours_fp8_nk": ("float8_e4m3fn", "nk", op("nk")),
         "ours_int8_nk": ("int8", "nk", op("nk", int8=True)),
         "ours_fp8_nk_triton": ("float8_e4m3fn", "nk", op("nk", "triton")),
         "ours_int8_nk_triton": ("int8", "nk",
                                 op("nk", "triton", int8=True))}
  if m == k == n == 8192:
    ops["ours_fp8"] = ("float8_e4m3fn", "kn", op("kn"))
  return ops


def w8a8_rows(rows, name, case, timer, x, quantized, flops):
  """Rows of ours (and the Triton kernel) for an 8-bit x 8-bit case."""
  m, k, n, copies = case["m"], case["k"], case["n"], case["copies"]
  for impl, (fmt, layout, op) in w8a8_ops(m, k, n).items():
    xq, xs = pk.quantize(x.astype(jnp.float32), DTYPES[fmt])
    q, s, _, deq = quantized[fmt]
    w_arg = q.T if layout == "nk" else q
    out = {}

    def timed(op=op, xq=xq, xs=xs, w_arg=w_arg, s=s, deq=deq, out=out):
      seconds, result = timer.jax(op, xq, w_arg, xs, s,
                                  copies=copies)
      want = (np.asarray(xq, np.float64)[:CHECK_ROWS]
              * np.asarray(xs, np.float64)[:CHECK_ROWS]) @ deq
      out["err"] = harness.rel_error(result[:CHECK_ROWS], want)
      return seconds
    row = harness.measure(rows, name, impl, timed, flops=flops)
    row["err"] = out.get("err")


def tpu_rows(cases):
  rows = []
  for case in cases:
    m, k, n = case["m"], case["k"], case["n"]
    if case["mode"] == "w8a8":
      rows += roofline.rows(label(case), 2.0 * m * k * n,
                            m * k + k * n + 2 * m * n, "fp8",
                            chips=("tpu7x",))
      rows += roofline.rows(label(case) + " int8", 2.0 * m * k * n,
                            m * k + k * n + 2 * m * n, "int8")
      rows += roofline.rows(label(case) + " (bf16 MXU)", 2.0 * m * k * n,
                            m * k + k * n + 2 * m * n, "bf16")
    else:   # the weights dequantized to bf16 for the MXU
      for fmt in FORMATS:
        rows += roofline.rows(f"{label(case)} {fmt}", 2.0 * m * k * n,
                              hbm_bytes(m, k, n, fmt), "bf16")
  return rows


def main(argv=None):
  return harness.main(
      "quantized_matmul", CASES, QUICK, run, label=label, tpu_rows=tpu_rows,
      argv=argv, doc=__doc__,
      columns=["case", "impl", "ms", "tflops", "hbm_tbs", "err",
               "vs_xla_bf16", "vs_torch_bf16", "vs_torch_scaled_mm",
               "vs_torch_int_mm", "error"])


if __name__ == "__main__":
  main()
