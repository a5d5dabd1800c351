"""Grouped matmul (MoE expert projections) against XLA's ragged_dot, a dense
matmul and torch's grouped mm.

    python -m bench.grouped_matmul [--quick] [--cases TEXT] [--tag T] [--out DIR]

Cases: the gated up-projection of one MoE layer, lhs [rows, D] bf16 sorted
by expert times w [E, D, F] bf16, rows = tokens x top_k (``bench.tpu.MOE``:
Mixtral-8x7B, DeepSeek-V3, Qwen3-30B-A3B), routing "balanced" or "skewed"
(Zipf-like, a quarter of the experts empty). Impls, each in the same run:
  ours             ``pk.grouped_matmul`` (the Triton kernel on a GPU)
  ours_int8        the same with int8 experts, per-channel scales
  ours_fwd_bwd     forward plus d lhs and d w (``jax.grad``; d w by XLA)
  xla_ragged_dot   ``jax.lax.ragged_dot`` (and ``_fwd_bwd``)
  xla_dense_bf16   one dense [rows, D] x [D, F] matmul: the rate a grouped
                   matmul of balanced routing should approach
  torch_grouped_mm ``torch._grouped_mm`` (CUTLASS grouped GEMM, sm90)
JAX impls are timed in-program (``harness.Timer.jax``: a jitted program of
``copies`` calls, as a jitted model runs them). ``tflops`` counts the
grouped matmul's useful flops (2 rows D F; x3 with the backward).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from bench import harness
from bench.tpu import MOE, moe_group_sizes

CASES = [dict(model=model, routing=routing, tokens=4096, copies=2)
         for model in MOE for routing in ("balanced", "skewed")]
QUICK = [dict(model="tiny", routing="skewed", tokens=64, copies=1)]
SHAPES = dict(MOE, tiny=(64, 128, 256, 4, 2))
CHECK_ROWS = 64


def label(case):
  return f"{case['model']} {case['routing']} {case['tokens']} tokens"


def _loss(op):
  """value_and_grad: the loss value keeps the forward product alive (a
  plain grad lets XLA drop it, the gradients not needing it)."""
  def fwd_bwd(x, w, sizes):
    return jax.value_and_grad(
        lambda a, b: op(a, b, sizes).astype(jnp.float32).sum(), (0, 1))(x, w)
  return fwd_bwd


def torch_peer(x, w, sizes):
  """A thunk of ``torch._grouped_mm`` on copies of the inputs, or None."""
  torch = harness.torch_module()
  if torch is None or not torch.cuda.is_available() or not hasattr(
      torch, "_grouped_mm"):
    return None
  a = torch.from_numpy(np.asarray(x.astype(jnp.float32))).cuda().bfloat16()
  b = torch.from_numpy(np.asarray(w.astype(jnp.float32))).cuda().bfloat16()
  offs = torch.from_numpy(np.cumsum(np.asarray(sizes)).astype(np.int32)).cuda()
  return lambda: torch._grouped_mm(a, b, offs=offs)


def run(case, timer):
  _, d, f, e, top_k = SHAPES[case["model"]]
  rows_n = case["tokens"] * top_k
  copies = case["copies"]
  name, rows = label(case), []
  flops = 2.0 * rows_n * d * f
  sizes = jnp.asarray(moe_group_sizes(rows_n, e, case["routing"]))
  x = jax.random.normal(jax.random.key(0), (rows_n, d), jnp.bfloat16)
  w = (jax.random.normal(jax.random.key(1), (e, d, f), jnp.float32)
       / np.sqrt(d)).astype(jnp.bfloat16)
  wq, ws = pk.quantize(w, jnp.int8, axis=1, backend="reference")
  starts = np.concatenate([[0], np.cumsum(np.asarray(sizes))])
  x64 = np.asarray(x, np.float64)
  check = [g for g in range(e) if starts[g + 1] > starts[g]][:2]

  def want(weights):  # the first rows of two non-empty groups, float64
    return {g: x64[starts[g]:min(starts[g] + CHECK_ROWS, starts[g + 1])]
            @ weights[g] for g in check}

  def error(out, wanted):
    out = np.asarray(out.astype(jnp.float32), np.float64)
    return max(harness.rel_error(out[starts[g]:starts[g] + CHECK_ROWS][
        :len(wanted[g])], wanted[g]) for g in wanted)

  w64 = np.asarray(w, np.float64)
  wq64 = np.asarray(wq, np.float64) * np.asarray(ws, np.float64)
  ours = lambda a, b, s: pk.grouped_matmul(a, b, s)
  ragged = lambda a, b, s: jax.lax.ragged_dot(a, b, s)
  impls = {
      "ours": (ours, (x, w, sizes), want(w64), 1),
      "ours_int8": (lambda a, b, c, s: pk.grouped_matmul(a, b, s,
                                                         rhs_scale=c),
                    (x, wq, ws, sizes), want(wq64), 1),
      "xla_ragged_dot": (ragged, (x, w, sizes), want(w64), 1),
      "ours_fwd_bwd": (_loss(ours), (x, w, sizes), None, 3),
      "xla_ragged_dot_fwd_bwd": (_loss(ragged), (x, w, sizes), None, 3),
      "xla_dense_bf16": (lambda a, b: jnp.dot(a, b[0]), (x, w), None, 1),
  }
  for impl, (op, args, wanted, factor) in impls.items():
    errors = {}

    def timed(op=op, args=args, wanted=wanted, errors=errors):
      seconds, out = timer.jax(op, *args, copies=copies)
      if wanted is not None:
        errors["err"] = error(out, wanted)
      return seconds
    row = harness.measure(rows, name, impl, timed, flops=flops * factor)
    if errors:
      row["err"] = errors["err"]
  thunk = torch_peer(x, w, sizes)
  if thunk is not None:
    harness.measure(rows, name, "torch_grouped_mm",
                    lambda: timer.torch(thunk, reps=copies), flops=flops)
  return rows


def main(argv=None):
  return harness.main("grouped_matmul", CASES, QUICK, run, label=label,
                      argv=argv, doc=__doc__)


if __name__ == "__main__":
  main()
