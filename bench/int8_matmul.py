"""int8 matmul against cuBLAS bf16 (jnp.dot, torch.mm) and torch._int_mm.

    python -m bench.int8_matmul [--quick] [--cases 16x] [--tag T] [--out DIR]

Cases (M x K x N):
  fused        x int8 [M, K], w int8, x_scale [M, 1], w_scale [N], bias [N]
               -> bf16 (``pk.int8_matmul``), w as [K, N] (ours_fused) and
               [N, K] (ours_fused_nk, ``weight_layout="nk"``)
  weight_only  x bf16, w int8 [N, K], w_scale -> bf16 (ours_w8a16_nk,
               ``weight_only=True, weight_layout="nk"``): decode shapes,
               bound by streaming w (``w_tbs``: w's bytes per second)
Peers in the same run: xla_bf16 (``jnp.dot`` of bf16 x and w: cuBLAS),
torch_bf16 (``torch.mm``), torch_int_mm (``torch._int_mm``, int8 -> int32;
fused cases, M > 16). Each torch call takes the next of ``copies`` copies of
w, as the JAX rows' distinct inputs do: no call finds w in L2. ``err``: ours
against float64 numpy on the first 16 rows. TPU rows: the roofline of each
case's minimum HBM traffic (int8 rate for fused, bf16 for weight-only).
"""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from bench import harness, roofline

LLM = [(4096, 14336), (14336, 4096)]  # (K, N) of a Llama-3-8B MLP
CASES = ([dict(m=8192, k=8192, n=8192, mode="fused", copies=2)]
         + [dict(m=2048, k=k, n=n, mode="fused", copies=2) for k, n in LLM]
         + [dict(m=m, k=k, n=n, mode="weight_only", copies=10)
            for m in (16, 128) for k, n in LLM])
QUICK = [dict(m=40, k=300, n=200, mode="fused", copies=1),
         dict(m=16, k=256, n=128, mode="weight_only", copies=1)]
CHECK_ROWS = 16


def label(case):
  return f"{case['m']}x{case['k']}x{case['n']} {case['mode']}"


def inputs(m, k, n):
  keys = jax.random.split(jax.random.key(0), 6)
  w8 = jax.random.randint(keys[1], (k, n), -128, 128, jnp.int32).astype(
      jnp.int8)
  ws = jax.random.uniform(keys[3], (n,), jnp.float32, 1e-3, 2e-3)
  return dict(
      x8=jax.random.randint(keys[0], (m, k), -128, 128, jnp.int32).astype(
          jnp.int8),
      w8=w8, w8t=jnp.array(w8.T, copy=True), ws=ws,
      xs=jax.random.uniform(keys[2], (m, 1), jnp.float32, 1e-3, 2e-3),
      bias=jax.random.normal(keys[4], (n,), jnp.float32),
      xb=jax.random.normal(keys[5], (m, k), jnp.bfloat16),
      wb=(w8.astype(jnp.float32) * ws).astype(jnp.bfloat16))


def ours(mode):
  """name -> (op, argument names) of our calls in this mode."""
  def fused(x, w, xs, ws, bias, layout):
    return pk.int8_matmul(x, w, x_scale=xs, w_scale=ws, bias=bias,
                          weight_layout=layout)
  if mode == "fused":
    return {"ours_fused": (lambda *a: fused(*a, "kn"),
                           ("x8", "w8", "xs", "ws", "bias")),
            "ours_fused_nk": (lambda *a: fused(*a, "nk"),
                              ("x8", "w8t", "xs", "ws", "bias"))}
  return {"ours_w8a16_nk": (lambda x, w, ws: pk.int8_matmul(
      x, w, w_scale=ws, weight_only=True, weight_layout="nk"),
                            ("xb", "w8t", "ws"))}


def expected(data, mode):
  """float64 numpy result of the first CHECK_ROWS rows."""
  f64 = lambda name: np.asarray(data[name], np.float64)  # noqa: E731
  if mode == "fused":
    x = f64("x8")[:CHECK_ROWS] * f64("xs")[:CHECK_ROWS]
    return x @ f64("w8") * f64("ws") + f64("bias")
  return f64("xb")[:CHECK_ROWS] @ f64("w8") * f64("ws")


def torch_peers(case, data):
  """name -> thunk; {} without torch."""
  torch = harness.torch_module()
  if torch is None:
    return {}
  device = "cuda" if torch.cuda.is_available() else "cpu"
  m, k, n, copies = case["m"], case["k"], case["n"], case["copies"]
  peers = {"torch_bf16": torch_bf16_peer(torch, torch.mm, m, k, n, device,
                                         copies)}
  if case["mode"] == "fused" and m > 16:
    peers["torch_int_mm"] = rotating(
        torch._int_mm, torch.from_numpy(np.array(data["x8"])).to(device),
        torch.from_numpy(np.array(data["w8"])).to(device), copies)
  return peers


def rotating(op, a, b, copies):
  """A thunk of op(a, b) whose calls take the next of ``copies`` copies of
  the torch tensor b in turn, so that no call finds b in L2."""
  turn = itertools.cycle([b] + [b.clone() for _ in range(copies - 1)])
  return lambda: op(a, next(turn))


def torch_bf16_peer(torch, matmul, m, k, n, device, copies):
  """``rotating`` ``matmul`` of random bf16 torch tensors [m, k] and [k, n]."""
  return rotating(
      matmul, torch.randn(m, k, device=device, dtype=torch.bfloat16),
      torch.randn(k, n, device=device, dtype=torch.bfloat16), copies)


def measure_peers(rows, name, timer, x, w, make_torch_peers, *, copies,
                  flops):
  """Appends the peers' rows: xla_bf16 (``jnp.dot`` of bf16 x and w), then
  each torch thunk of ``make_torch_peers()`` (name -> thunk)."""
  harness.measure(rows, name, "xla_bf16", lambda: timer.jax(
      jnp.dot, x, w, copies=copies)[0], flops=flops)
  for impl, thunk in make_torch_peers().items():
    harness.measure(rows, name, impl,
                    lambda t=thunk: timer.torch(t, reps=copies), flops=flops)


def run(case, timer):
  m, k, n, mode, copies = (case[key] for key in ("m", "k", "n", "mode",
                                                  "copies"))
  data, rows, name = inputs(m, k, n), [], label(case)
  flops = 2.0 * m * k * n
  want, errors = expected(data, mode), {}
  for impl, (op, names) in ours(mode).items():
    def timed(op=op, names=names):
      seconds, out = timer.jax(op, *(data[a] for a in names), copies=copies)
      errors[impl] = harness.rel_error(out[:CHECK_ROWS], want)
      return seconds
    row = harness.measure(rows, name, impl, timed, flops=flops)
    row["err"] = errors.get(impl)
    if row["ms"] and mode == "weight_only":
      row["w_tbs"] = k * n / row["ms"] / 1e9
  measure_peers(rows, name, timer, data["xb"], data["wb"],
                lambda: torch_peers(case, data), copies=copies, flops=flops)
  return rows


def tpu_rows(cases):
  rows = []
  for case in cases:
    m, k, n = case["m"], case["k"], case["n"]
    x_bytes = 1 if case["mode"] == "fused" else 2
    rows += roofline.rows(
        label(case), 2.0 * m * k * n, x_bytes * m * k + k * n + 2 * m * n,
        "int8" if case["mode"] == "fused" else "bf16")
  return rows


def main(argv=None):
  return harness.main(
      "int8_matmul", CASES, QUICK, run, label=label, tpu_rows=tpu_rows,
      argv=argv, doc=__doc__,
      columns=["case", "impl", "ms", "tflops", "w_tbs", "err", "vs_xla_bf16",
               "vs_torch_bf16", "vs_torch_int_mm", "error"])


if __name__ == "__main__":
  main()
