"""int8 matmul benchmark: this package's kernels against their peers.

On a CUDA machine, at LLM shapes (M = 16, 128, 2048 tokens x (K, N) =
(4096, 14336) and (14336, 4096)) and at 8192^3, each shape times the ops
that matter there (INT8_BENCH_ALL=1: every op everywhere):
  ours_raw      int8_matmul(x_i8, w_i8) -> int32 (Pallas, Triton lowering)
  ours_fused    int8_matmul(x_i8, w_i8, x_scale, w_scale, bias) -> bf16
  ours_dynamic  int8_matmul(x_bf16, w_i8, w_scale) ("w8a8 dynamic": row
                quantization + matmul)
  ours_w8a16    int8_matmul(x_bf16, w_i8, w_scale, weight_only=True)
                (M <= 128 only)
  ours_*_nk     the same with the weight stored [N, K]
                (weight_layout="nk", as inference weights are kept on GPUs:
                no per-call transpose of w)
  xla_int8      jax.lax.dot(int8, int8, preferred_element_type=int32)
  xla_bf16      jnp.dot(bf16, bf16) -> bf16
  xla_w8a16     XLA's dequantize-then-dot (the reference backend; M <= 128)
  jax_mixed_mgpu  JAX's own Hopper Pallas int8 x bf16 kernel
                (pallas/ops/gpu/hopper_mixed_type_matmul_mgpu; M <= 128)
  torch_int_mm  torch._int_mm (cuBLASLt int8 -> int32; needs M > 16)
  torch_bf16    torch.mm(bf16, bf16) (cuBLAS)
                (the torch rows cycle through R copies of w, like the JAX
                rows' distinct inputs: no L2 reuse of w between calls)
By default: 8192^3 raw/fused (both layouts) against all four peers; M =
2048 fused (both layouts); M <= 128 weight-only (both layouts) against XLA's
w8a16, XLA bf16 and torch bf16, with the weight bytes per second (``_w_tbs``:
K N / time, the decode shapes' floor). Ratios ``peer / ours`` (> 1 means
ours is faster). Then, while INT8_BENCH_SECONDS lasts, ALT_WEIGHT_ONLY's
other configs (alt_* rows) and the stream probes (stream_probe: the decode
tiles streaming w alone, and with x loaded once; diagnostics, not products).
INT8_CHOOSE_TRANSPOSE=1 first times the ways to transpose w for the K-major
path at 8192^3 (gpu.transpose) and uses the fastest.
Also printed (every run): per TPU generation the tiles the block-size table
picks, their VMEM bytes and the roofline time of int8 vs bf16 (estimates;
no TPU was measured).
Every op is first checked against the reference (int32 exact, float within
tolerance). JAX ops are timed as one jitted program of R independent calls
on distinct copies of the inputs (R = 2..20 by size: no dot merging, no L2
reuse); per call, the slope between 2 and 8 such programs dispatched back
to back, so the dispatch and wait that each sample pays once cancel
(harness.steady_slope, median over 7 alternating pairs). INT8_TIMING=
host_reps: HOST_REPS (3) programs per sample instead, the timing before
stop 13, which counts ~5 us of that per call at the decode shapes. torch
ops: CUDA events, the slope between R and 4 R back-to-back launches.
Decode rows (M <= 128) also record the kernels' device time alone
(profiler traces: ``*_kernel_us``) for ours (w [N, K]), XLA bf16 and
torch bf16, with their ratios. Ops not started within INT8_BENCH_SECONDS
are listed as skipped. A whole run takes ~4-5 minutes on an H100: run
``--shapes 16``, ``128``, ``2048`` and ``square`` in separate calls.

  ours_triton_w8a16_nk / ours_mgpu_w8a16_nk   the weight-only [N, K] call
                with the GPU path's kernel forced (PALLAS_KERNELS_INT8_GPU_
                WEIGHT_ONLY=triton / mosaic): Triton or the Mosaic GPU
                (Hopper) kernel of int8/mosaic_gpu.py.

``--mgpu`` times the Mosaic GPU weight-only kernel at the four decode shapes
against the Triton kernel, torch bf16 and XLA's w8a16 (checked against the
latter), then MGPU_CONFIGS of it, then a profile of its kernels; it first
checks odd shapes against float64 numpy (MGPU_CHECKS). File:
int8_matmul_mgpu-* (INT8_MGPU_NAME; ~3 minutes on an H100).

``--variants NAMES`` (with ``--shapes 16|128|MxKxN``) times MGPU_VARIANTS
of the Mosaic GPU kernel (fused epilogue, x multicast pairs, split partials
summed in a CTA cluster, ...) where VARIANT_SHAPES lists them, beside the
Triton kernel ("triton" in NAMES) and torch bf16, each checked against
XLA's w8a16, after odd-shape float64 checks (VARIANT_CHECKS; those of
INT8_VARIANT_CHECKS only, "none" for none; the cluster sums also run three
times and must repeat bit for bit); ``--profile`` lists variants whose
kernels are then profiled. File: ``--name`` (int8_matmul_mgpu_variants-*).
INT8_REPLICAS sets the calls per timed program (default 20 at the decode
shapes; compile time grows with it: 20 copies of a Mosaic kernel took
~20 s to compile on the H100 VM) and INT8_DECODE_OPS the ops of the decode
rows.

``--sweep`` instead times candidate Triton block configurations (SWEEP)
and the peers at the decode shapes; its file is int8_matmul_decode_sweep-*.
Elsewhere (CPU) ``--quick`` runs one small shape with the kernel in
interpret mode beside the reference: a smoke test only.

  python bench/bench_int8_matmul.py [--quick] [--sweep] [--mgpu]
                                    [--shapes SHAPES]

SHAPES: all (default), square, llm, or a token count M (e.g. 2048: the LLM
shapes of that M); anything but "all" writes int8_matmul_<SHAPES>-*.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import harness, roofline  # noqa: E402
from pallas_kernels import _compat  # noqa: E402
from pallas_kernels._compat import pl  # noqa: E402
from pallas_kernels.int8 import api, block_sizes as bs, gpu  # noqa: E402
from pallas_kernels.int8 import mosaic_gpu  # noqa: E402

LLM_SHAPES = [(16, 4096, 14336), (16, 14336, 4096), (128, 4096, 14336),
              (128, 14336, 4096), (2048, 14336, 4096), (2048, 4096, 14336)]
SQUARE = (8192, 8192, 8192)

# Sweep rows: (shape, ops, configs); a config is BlockSizes' fields (bm, bk,
# bn, warps, stages, w_kmajor, split_k, int8_via_bf16, group_m, swap_ab,
# stream_w). This session's sweep: weight-only at the decode shapes, w as
# [N, K] ("nk") and [K, N], swap_ab (w as the tensor cores' left operand,
# upcast in registers), split K, evict-first w loads. Earlier sweeps (the
# large and int8 decode tiles) are in int8_matmul_sweep-h100-*.
F, T = False, True
# Sweep 1 (20:37 UTC; int8_matmul_decode_sweep-h100-*, first rows): w [N, K]
# without swap_ab, bk 256, bn 64 led (33.7 / 32.9 us); swap_ab lost 10-60%;
# evict-first w loads gained 15% on a swapped config. Sweep 2: around it.
_W16_N = [  # 16 x 4096 x 14336 (wide N): split 1 already fills the GPU
    (16, 256, 64, 4, 4, F, 1, F, 1, F, F),
    (16, 256, 64, 4, 4, F, 1, F, 1, F, T),
    (16, 256, 32, 4, 4, F, 1, F, 1, F, T),
    (16, 512, 64, 4, 3, F, 1, F, 1, F, T),
    (16, 256, 64, 4, 3, F, 1, F, 1, F, T),
    (16, 256, 64, 4, 5, F, 1, F, 1, F, T),
    (16, 256, 64, 2, 4, F, 1, F, 1, F, T),
    (16, 256, 64, 8, 4, F, 1, F, 1, F, T),
    (16, 128, 64, 4, 6, F, 1, F, 1, F, T),
    (16, 256, 128, 4, 4, F, 1, F, 1, F, T),
    (16, 256, 64, 4, 4, F, 2, F, 1, F, T),
]
_W16_K = [  # 16 x 14336 x 4096 (long K): split K for enough programs
    (16, 256, 64, 4, 4, F, 2, F, 1, F, F),
    (16, 256, 64, 4, 4, F, 2, F, 1, F, T),
    (16, 256, 64, 4, 4, F, 4, F, 1, F, T),
    (16, 512, 64, 4, 3, F, 2, F, 1, F, T),
    (16, 256, 64, 4, 5, F, 2, F, 1, F, T),
    (16, 256, 64, 2, 4, F, 2, F, 1, F, T),
    (16, 256, 32, 4, 4, F, 2, F, 1, F, T),
    (16, 256, 32, 4, 4, F, 1, F, 1, F, T),
    (16, 256, 64, 8, 4, F, 2, F, 1, F, T),
]
SWEEP = [
    ((16, 4096, 14336), ("ours_w8a16_nk",), _W16_N),
    ((16, 14336, 4096), ("ours_w8a16_nk",), _W16_K),
    ((16, 4096, 14336), ("ours_w8a16",), [
        (16, 64, 128, 4, 6, F, 1, F, 1, F, T),
        (16, 64, 128, 4, 6, F, 2, F, 1, F, T),
        (16, 128, 128, 4, 4, F, 1, F, 1, F, T),
        (16, 64, 64, 4, 6, F, 1, F, 1, F, T)]),
    ((16, 14336, 4096), ("ours_w8a16",), [
        (16, 64, 128, 4, 6, F, 4, F, 1, F, T),
        (16, 64, 128, 4, 6, F, 2, F, 1, F, T)]),
    ((128, 4096, 14336), ("ours_w8a16_nk",), [
        (128, 128, 128, 8, 3, F, 1, F, 1, T, T),
        (128, 128, 64, 4, 3, F, 1, F, 1, T, T),
        (128, 128, 64, 4, 4, F, 1, F, 1, F, T),
        (128, 64, 128, 8, 4, F, 1, F, 1, F, T)]),
    ((128, 4096, 14336), ("ours_w8a16",), [
        (128, 64, 128, 8, 4, F, 1, F, 1, F, T)]),
    ((128, 14336, 4096), ("ours_w8a16_nk",), [
        (128, 128, 64, 4, 4, F, 2, F, 1, T, T),
        (128, 128, 64, 4, 4, F, 2, F, 1, F, T)]),
]
# After the main run, while its time lasts: other weight-only configs at
# 16x4096x14336 (rows named alt_w8a16, beside the table's ours_w8a16).
# After the main run, while its time lasts: other weight-only configs (rows
# alt_w8a16 / alt_w8a16_nk) as (shape, op, config): the table's tiles with
# stagger_k, the runner-up tiles of the decode sweep again (its single runs
# varied by up to 10%), wider tiles (half the re-reads of x) and smaller
# ones with a finer split (more programs resident per SM).
ALT_WEIGHT_ONLY = [
    ((16, 4096, 14336), "ours_w8a16_nk", (16, 256, 64, 8, 4, F, 1, F, 1, F, T, T)),
    ((16, 14336, 4096), "ours_w8a16_nk", (16, 256, 32, 4, 4, F, 2, F, 1, F, T, T)),
    ((16, 4096, 14336), "ours_w8a16_nk", (16, 256, 64, 4, 4, F, 1, F, 1, F, F)),
    ((16, 14336, 4096), "ours_w8a16_nk", (16, 256, 64, 4, 4, F, 2, F, 1, F, F)),
    ((16, 4096, 14336), "ours_w8a16_nk", (16, 256, 128, 8, 4, F, 2, F, 1, F, T)),
    ((16, 4096, 14336), "ours_w8a16_nk", (16, 128, 64, 4, 4, F, 2, F, 1, F, T)),
    ((16, 14336, 4096), "ours_w8a16_nk", (16, 128, 32, 4, 4, F, 4, F, 1, F, T)),
    ((16, 4096, 14336), "ours_w8a16_nk", (16, 128, 64, 4, 6, F, 1, F, 1, F, T)),
    ((16, 4096, 14336), "ours_w8a16", (16, 128, 128, 4, 4, F, 1, F, 1, F, T)),
    ((128, 4096, 14336), "ours_w8a16_nk",
     (128, 128, 64, 4, 3, F, 1, F, 1, T, T, T)),
    ((128, 14336, 4096), "ours_w8a16_nk", (128, 128, 64, 4, 3, F, 4, F, 1, T, T)),
]
# The ops timed per shape (INT8_BENCH_ALL=1: every op at every shape).
SQUARE_OPS = ("ours_raw", "ours_fused", "ours_raw_nk", "ours_fused_nk",
              "xla_int8", "xla_bf16", "torch_int_mm", "torch_bf16")
PREFILL_OPS = ("ours_fused", "ours_fused_nk", "xla_int8", "xla_bf16",
               "torch_int_mm", "torch_bf16")
DECODE_OPS = tuple(os.environ.get("INT8_DECODE_OPS", ",".join((
    "ours_w8a16", "ours_w8a16_nk", "ours_mgpu_w8a16_nk", "xla_w8a16",
    "jax_mixed_mgpu", "xla_bf16", "torch_bf16"))).split(","))
BENCH_SECONDS = float(os.environ.get("INT8_BENCH_SECONDS", "170"))
SWEEP_SECONDS = float(os.environ.get("INT8_SWEEP_SECONDS", "250"))


def replicas_for(m, k, n):
  """Independent calls per timed program: enough to hide the host."""
  work = m * k * n
  if os.environ.get("INT8_REPLICAS"):  # fewer: faster compiles (Mosaic)
    return int(os.environ["INT8_REPLICAS"])
  return 2 if work >= 2**36 else 4 if work >= 2**33 else 20


HOST_REPS = int(os.environ.get("INT8_HOST_REPS", "3"))
# INT8_TIMING "steady" (default): per call, the slope between 2 and 8
# programs of R calls (JAX) and between R and 4 R launches (torch) per
# sample (harness.steady_slope). That cancels what each sample pays once:
# for JAX the first program's dispatch and the final wait, ~0.3 ms per
# sample on the H100 VM, which "host_reps" (HOST_REPS programs per sample,
# these results' timing before stop 13) spread as ~5 us over each of 60
# calls of 25 us, but which a model running many ops does not pay per op.
TIMING = os.environ.get("INT8_TIMING", "steady")
STEADY_PROGRAMS = (2, 8)


def timing_text(reps="R"):
  if TIMING == "steady":
    return (f"jax: one program of {reps} independent calls on distinct input "
            f"copies; per call, the slope between {STEADY_PROGRAMS[0]} and "
            f"{STEADY_PROGRAMS[1]} programs dispatched back to back (cancels "
            "the one dispatch and wait of each sample), median over 7 "
            "alternating pairs; torch: CUDA events, the slope between R and "
            "4 R back-to-back launches, median over 15 pairs")
  return (f"jax: one program of {reps} independent calls on distinct input "
          f"copies, {HOST_REPS} programs dispatched back to back per sample "
          "(host sync hidden), median of 5; torch: CUDA events around R "
          "launches")


def time_replicated_jax(op, args, reps, iters=None, warmup=1):
  """(seconds per call of ``op``, first output): harness.time_replicated_jax
  (one jitted program of ``reps`` calls on distinct input copies: no CSE,
  no dot merging, no L2 reuse), timed as TIMING says."""
  steady = TIMING == "steady"
  return harness.time_replicated_jax(
      op, args, reps, iters=iters or (7 if steady else 5), warmup=warmup,
      host_reps=HOST_REPS, steady=STEADY_PROGRAMS if steady else None)


def time_batched_torch(fn, reps=10, iters=15, warmup=2):
  return harness.time_torch_cuda(
      fn, warmup=warmup, iters=iters, reps=reps,
      steady=(reps, 4 * reps) if TIMING == "steady" else None)


def kernel_us(name, fn, argnames, data, reps):
  """Device time per call (us, kernels only, no launch gaps) of a JAX op in
  its replicated program, from a profiler trace; None on failure."""
  try:
    program, flat = harness.replicated_program(
        fn, [data[a] for a in argnames], reps)
    total = harness.device_kernel_times(program, *flat, reps=3)[
        "(device total)"][1]
    if total <= 0:
      raise RuntimeError("the trace holds no GPU kernels")
    return total / reps
  except Exception:  # noqa: BLE001  (a diagnostic: never fails the row)
    traceback.print_exc(limit=1)
    print("kernel time failed:", name, flush=True)
    return None


# Decode rows also record kernel-only device times (profiler traces) of
# these, and the ratios between them: the comparison free of both
# frameworks' launch gaps. The torch traces run after every JAX one
# (finish_torch_kernel_times): once torch's profiler has held CUPTI, JAX's
# profiler fails to start in the same process.
KERNEL_TIMED = ("ours_w8a16_nk", "xla_bf16", "torch_bf16")
TORCH_KERNEL_JOBS = []  # (row, name, fn, reps)


def kernel_ratios(row):
  ours = row.get("ours_w8a16_nk_kernel_us")
  for peer in ("torch_bf16", "xla_bf16"):
    if ours and row.get(f"{peer}_kernel_us"):
      row[f"ours_w8a16_nk_kernel_vs_{peer}_kernel"] = (
          row[f"{peer}_kernel_us"] / ours)


def finish_torch_kernel_times():
  while TORCH_KERNEL_JOBS:
    row, name, fn, reps = TORCH_KERNEL_JOBS.pop(0)
    try:
      row[f"{name}_kernel_us"] = harness.torch_kernel_times(fn, reps=reps)[
          "(device total)"][1]
      kernel_ratios(row)
    except Exception as e:  # noqa: BLE001  (a diagnostic)
      row["errors"][f"{name}_kernel"] = f"{type(e).__name__}: {str(e)[:200]}"


def time_torch_bf16(torch_ops, data, shape, reps, errors):
  """Seconds of torch's bf16 matmul at ``shape`` (M, K, N), or None with the
  failure recorded in ``errors``."""
  try:
    return time_batched_torch(torch_ops["torch_bf16"](data, *shape),
                              reps=reps)
  except Exception as e:  # noqa: BLE001
    errors["torch_bf16"] = f"{type(e).__name__}: {str(e)[:300]}"
    return None


def make_inputs(m, k, n, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), 6)
  x8 = jax.random.randint(keys[0], (m, k), -128, 128, jnp.int32).astype(jnp.int8)
  w8 = jax.random.randint(keys[1], (k, n), -128, 128, jnp.int32).astype(jnp.int8)
  xs = jax.random.uniform(keys[2], (m, 1), jnp.float32, 1e-3, 2e-3)
  ws = jax.random.uniform(keys[3], (n,), jnp.float32, 1e-3, 2e-3)
  bias = jax.random.normal(keys[4], (n,), jnp.float32)
  xb = jax.random.normal(keys[5], (m, k), jnp.bfloat16)
  wb = (w8.astype(jnp.float32) * ws).astype(jnp.bfloat16)
  w8t = jnp.array(w8.T, copy=True)
  return dict(x8=x8, w8=w8, w8t=w8t, xs=xs, ws=ws, bias=bias, xb=xb, wb=wb)


def jax_ops(backend, blocks=None):
  """name -> (fn, argument names); ours at ``backend``."""
  def ours(names, **flags):
    def fn(x, w, *rest):
      return api.int8_matmul(x, w, **dict(zip(names, rest)), backend=backend,
                             block_sizes=blocks, **flags)
    return fn
  return {
      "ours_raw": (ours(()), ("x8", "w8")),
      "ours_fused": (ours(("x_scale", "w_scale", "bias")),
                     ("x8", "w8", "xs", "ws", "bias")),
      "ours_dynamic": (ours(("w_scale",)), ("xb", "w8", "ws")),
      "ours_w8a16": (ours(("w_scale",), weight_only=True), ("xb", "w8", "ws")),
      "ours_raw_nk": (ours((), weight_layout="nk"), ("x8", "w8t")),
      "ours_fused_nk": (ours(("x_scale", "w_scale", "bias"), weight_layout="nk"),
                        ("x8", "w8t", "xs", "ws", "bias")),
      "ours_w8a16_nk": (ours(("w_scale",), weight_only=True, weight_layout="nk"),
                        ("xb", "w8t", "ws")),
      # the same call with the GPU path's weight-only kernel forced: Triton
      # or the Mosaic GPU (Hopper) kernel (gpu.py, mosaic_gpu.py)
      "ours_triton_w8a16_nk": (forced("triton", ours(
          ("w_scale",), weight_only=True, weight_layout="nk")),
                               ("xb", "w8t", "ws")),
      "ours_mgpu_w8a16_nk": (forced("mosaic", ours(
          ("w_scale",), weight_only=True, weight_layout="nk")),
                             ("xb", "w8t", "ws")),
  }


def forced(kernel, fn):
  """fn traced with PALLAS_KERNELS_INT8_GPU_WEIGHT_ONLY=kernel (read at
  trace time by gpu.py)."""
  def traced(*args):
    old = os.environ.get(mosaic_gpu.ENV_WEIGHT_ONLY)
    os.environ[mosaic_gpu.ENV_WEIGHT_ONLY] = kernel
    try:
      return fn(*args)
    finally:
      if old is None:
        del os.environ[mosaic_gpu.ENV_WEIGHT_ONLY]
      else:
        os.environ[mosaic_gpu.ENV_WEIGHT_ONLY] = old
  return traced


def peer_jax_ops():
  ref = jax_ops("reference")
  return {
      "xla_int8": (lambda x, w: jax.lax.dot(
          x, w, preferred_element_type=jnp.int32), ("x8", "w8")),
      "xla_fused": ref["ours_fused"],
      "xla_dynamic": ref["ours_dynamic"],
      "xla_w8a16": ref["ours_w8a16"],
      "xla_bf16": (lambda x, w: jnp.dot(x, w), ("xb", "wb")),
      # the bandwidth yardstick: reads and writes w once (2 K N bytes)
      "xla_copy_w": (lambda w: w ^ jnp.int8(1), ("w8",)),
      **_jax_mixed_peer(),
  }


def _jax_mixed_peer():
  """JAX's own Hopper Pallas kernel for int8 x bf16 products
  (pallas/ops/gpu/hopper_mixed_type_matmul_mgpu) as a weight-only peer:
  (w [N, K] @ x.T).T with XLA's transpose, and no w_scale (a little less
  work than ours). Its config is the best of those probed at each M
  (int8_matmul_jax_peer_probe-h100-*): 64-row w tiles per warpgroup, tile_k
  128, 4 stages, x tiles multicast to CTA pairs below M = 128. Needs M to
  be a multiple of its x tile (16 or 128 here); {} where jax lacks it."""
  try:
    from jax.experimental.pallas.ops.gpu import (
        hopper_mixed_type_matmul_mgpu as mixed)
  except Exception:  # noqa: BLE001  (older jax: no such peer)
    return {}

  def fn(x, w):
    m = x.shape[0]
    config = mixed.TuningConfig(
        tile_m=64, tile_n=min(128, m), tile_k=128, max_concurrent_steps=4,
        epi_tile_n=min(64, m), epi_tile_m=64,
        grid_minor_dim=mixed.MatmulDimension.M, grid_tile_width=8,
        wg_dimension=mixed.MatmulDimension.M,
        cluster_dimension=mixed.MatmulDimension.M if m < 128 else None)
    return mixed.mixed_matmul_kernel(w, x.T, out_dtype=jnp.bfloat16,
                                     config=config).T
  return {"jax_mixed_mgpu": (fn, ("xb", "w8t"))}


def reference_of(name):
  name = name.replace("alt_", "ours_").replace("_nk", "")
  name = name.replace("ours_mgpu_", "ours_").replace("ours_triton_", "ours_")
  return "xla_int8" if name == "ours_raw" else name.replace("ours", "xla")


TRANSPOSES = [("xla", 0, 0, 0), ("packed", 128, 128, 4),
              ("packed", 128, 128, 8), ("packed", 256, 64, 4)]


def choose_transpose(data, reps):
  """Times each way of the w_kmajor path's per-call transpose of w (checked
  exact), sets block_sizes.GPU_TRANSPOSE to the fastest, returns the times."""
  want = np.asarray(data["w8"]).T
  times = {}
  for cfg in TRANSPOSES:
    bs.GPU_TRANSPOSE = cfg
    try:
      seconds, out = time_replicated_jax(lambda w: gpu.transpose(w),
                                         [data["w8"]], reps)
      if not np.array_equal(np.asarray(out), want):
        raise AssertionError("transpose differs from w.T")
      times[str(cfg)] = seconds * 1e6
    except Exception as e:  # noqa: BLE001
      times[str(cfg)] = f"{type(e).__name__}: {str(e)[:200]}"
  timed = [(t, c) for c, t in times.items() if isinstance(t, float)]
  best = min(timed)[1] if timed else str(TRANSPOSES[0])
  bs.GPU_TRANSPOSE = next(c for c in TRANSPOSES if str(c) == best)
  print("transposes (us):", times, "chosen:", best, flush=True)
  return dict(transpose_us=times, transpose_chosen=best)


def check(name, out, expected):
  """Max relative error vs the reference, raising if beyond tolerance."""
  out, expected = np.asarray(out), np.asarray(expected)
  if out.dtype == np.int32:
    bad = int(np.sum(out != expected))
    if bad:
      raise AssertionError(f"{name}: {bad} int32 elements differ")
    return 0.0
  out = out.astype(np.float64)
  expected = expected.astype(np.float64)
  rel = float(np.abs(out - expected).max() / (np.abs(expected).max() + 1e-30))
  if not np.isfinite(out).all() or rel > 2e-2:
    raise AssertionError(f"{name}: relative error {rel:.3g}")
  return rel


def run_op(name, fn, argnames, data, reps, peers, errors, check_it=True,
           outputs=None):
  """Seconds per call of ``fn`` (None on failure, recorded in ``errors``);
  ours are checked against the reference output (taken from ``outputs``
  where a timed peer already produced it)."""
  args = [data[a] for a in argnames]
  try:
    seconds, out = time_replicated_jax(fn, args, reps)
    if outputs is not None:
      outputs[name] = out
    if check_it and name.startswith(("ours", "alt")):
      ref = reference_of(name)
      expected = (outputs or {}).get(ref)
      if expected is None:
        ref_fn, ref_args = peers[ref]
        expected = jax.jit(ref_fn)(*[data[a] for a in ref_args])
      errors[name] = check(name, out, expected)
    return seconds
  except Exception as e:  # record and go on: one failure hides nothing else
    errors[name] = f"{type(e).__name__}: {str(e)[:300]}"
    traceback.print_exc(limit=1)
    return None


TIMED_PEERS = ("xla_int8", "xla_bf16", "xla_w8a16", "jax_mixed_mgpu")
WEIGHT_ONLY_MAX_M = 128  # w8a16 rows at decode shapes only (to fit the run)


def ops_for(m, k, n):
  """The op names timed at this shape (None: all)."""
  if os.environ.get("INT8_BENCH_ALL") == "1":
    return None
  if (m, k, n) == SQUARE:
    return SQUARE_OPS
  return DECODE_OPS if m <= WEIGHT_ONLY_MAX_M else PREFILL_OPS


def bench_shape(m, k, n, ops, peers, torch_ops, rows, chip, extra_row=None,
                deadline=None):
  """One row: every wanted op at this shape; ops not started by
  ``deadline`` (perf_counter seconds) are listed as skipped."""
  data = make_inputs(m, k, n)
  reps = replicas_for(m, k, n)
  times, errors, outputs = {}, {}, {}
  row = dict(shape=f"{m}x{k}x{n}", m=m, k=k, n=n, replicas=reps)
  if extra_row:
    row.update(extra_row(data, reps))
  wanted = ops_for(m, k, n)
  timed = {name: peers[name] for name in TIMED_PEERS if name in peers}
  timed.update(ops)
  torch_ops = {name: make for name, make in torch_ops.items()
               if wanted is None or name in wanted}
  for name, (fn, argnames) in timed.items():
    if "w8a16" in name and m > WEIGHT_ONLY_MAX_M:
      continue
    if wanted is not None and name not in wanted:
      continue
    if deadline is not None and time.perf_counter() > deadline:
      errors[name] = "skipped: out of INT8_BENCH_SECONDS"
      continue
    times[name] = run_op(name, fn, argnames, data, reps, peers, errors,
                         outputs=outputs)
  del outputs
  kernels = {}
  decode = m <= WEIGHT_ONLY_MAX_M
  if decode:
    for name in KERNEL_TIMED:
      if times.get(name) is not None and name in timed:
        kernels[name] = kernel_us(name, *timed[name], data, reps)
  for name, make in torch_ops.items():
    if deadline is not None and time.perf_counter() > deadline:
      errors[name] = "skipped: out of INT8_BENCH_SECONDS"
      continue
    try:
      fn = make(data, m, k, n)
      times[name] = None if fn is None else time_batched_torch(fn, reps=reps)
      if fn is not None and decode and name in KERNEL_TIMED:
        TORCH_KERNEL_JOBS.append((row, name, fn, reps))
    except Exception as e:
      times[name] = None
      errors[name] = f"{type(e).__name__}: {str(e)[:300]}"
  for name, us in kernels.items():
    row[f"{name}_kernel_us"] = us
  kernel_ratios(row)
  flops = 2.0 * m * n * k
  for name, t in times.items():
    row[f"{name}_us"] = None if t is None else t * 1e6
  for ours in ("ours_raw", "ours_fused", "ours_dynamic", "ours_w8a16",
               "ours_raw_nk", "ours_fused_nk", "ours_w8a16_nk",
               "ours_triton_w8a16_nk", "ours_mgpu_w8a16_nk"):
    t = times.get(ours)
    if t:
      row[f"{ours}_tops"] = flops / t / 1e12
      if "w8a16" in ours:  # streaming w is the floor at decode shapes
        row[f"{ours}_w_tbs"] = k * n / t / 1e12
      for peer in ("torch_int_mm", "xla_int8", "torch_bf16", "xla_bf16") + (
          ("xla_w8a16", "jax_mixed_mgpu") if "w8a16" in ours else ()):
        row[f"{ours}_vs_{peer}"] = harness.ratio(times.get(peer), t)
  if chip in roofline.SPECS:
    row["roofline_int8_us"] = roofline.roofline(
        chip, flops, m * k + k * n + m * n * 2, "int8")["time_s"] * 1e6
    row["roofline_bf16_us"] = roofline.roofline(
        chip, flops, 2 * (m * k + k * n + m * n))["time_s"] * 1e6
  row["errors"] = errors
  rows.append(row)
  print({k: (round(v, 2) if isinstance(v, float) else v)
         for k, v in row.items() if k != "errors"}, flush=True)
  print("  errors:", errors, flush=True)


def _rotating(op, a, b):
  """A call of op(a, w) that takes the next of replicas_for(...) copies of
  b each time, as the JAX rows use distinct input copies: no call finds the
  previous call's weights in L2 (as in a model, whose layers each have
  their own)."""
  m, k = a.shape
  copies = [b] + [b.clone() for _ in range(replicas_for(m, k, b.shape[1]) - 1)]
  turn = itertools.cycle(copies)
  return lambda: op(a, next(turn))


def torch_peer_ops():
  import torch

  def int_mm(data, m, k, n):
    if m <= 16:
      return None  # torch._int_mm requires M > 16
    a = torch.from_numpy(np.array(data["x8"])).cuda()
    b = torch.from_numpy(np.array(data["w8"])).cuda()
    got = torch._int_mm(a, b)[:64].cpu().numpy()
    want = np.asarray(data["x8"], np.int64)[:64] @ np.asarray(data["w8"], np.int64)
    if not np.array_equal(got, want):
      raise AssertionError("torch._int_mm disagrees with numpy")
    return _rotating(torch._int_mm, a, b)

  def bf16(data, m, k, n):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    return _rotating(torch.mm, a, b)

  return {"torch_int_mm": int_mm, "torch_bf16": bf16}


def sweep(rows, torch_ops, out_name="int8_matmul_sweep"):
  """Times candidate Triton configs (and the peers) at representative shapes,
  stopping at SWEEP_SECONDS; also the per-call transpose of w at 8192^2."""
  start = time.perf_counter()
  peers = peer_jax_ops()
  done_peers, outputs_of = set(), {}
  for (m, k, n), names, configs in SWEEP:
    if time.perf_counter() - start > SWEEP_SECONDS:
      break
    data = make_inputs(m, k, n)
    reps = int(os.environ.get("INT8_SWEEP_REPLICAS", replicas_for(m, k, n)))
    outputs = outputs_of.setdefault((m, k, n), {})
    if (m, k, n) not in done_peers:
      done_peers.add((m, k, n))
      errors = {}
      base = dict(sweep=True, shape=f"{m}x{k}x{n}")
      for peer in ("xla_bf16", "xla_copy_w") + (("xla_w8a16",)
                                                 if m <= 128 else ()):
        fn, argnames = peers[peer]
        base[f"{peer}_us"] = _us(run_op(peer, fn, argnames, data, reps, peers,
                                        errors, outputs=outputs))
      if base.get("xla_copy_w_us"):  # bytes read + written
        base["copy_tbs"] = 2 * k * n / base["xla_copy_w_us"] / 1e6
      if m > 128:
        base.update(choose_transpose(data, reps))
      for name, make in torch_ops.items():
        try:
          fn = make(data, m, k, n)
          base[f"{name}_us"] = None if fn is None else _us(
              time_batched_torch(fn, reps=reps))
        except Exception as e:
          errors[name] = str(e)[:200]
      rows.append(dict(base, errors=errors))
      print(rows[-1], flush=True)
    for cfg in configs:
      if time.perf_counter() - start > SWEEP_SECONDS:
        break
      ops = jax_ops("gpu", bs.BlockSizes(*cfg))
      row = dict(sweep=True, shape=f"{m}x{k}x{n}", config=str(cfg))
      errs = {}
      for name in names:
        fn, argnames = ops[name]
        row[f"{name}_us"] = t = _us(run_op(name, fn, argnames, data, reps,
                                           peers, errs, outputs=outputs))
        if t:  # the weight's bytes per second, the decode shapes' floor
          row[f"{name}_w_tbs"] = k * n / t / 1e6
      row["errors"] = errs
      rows.append(row)
      print(row, flush=True)
    harness.write_results(out_name, rows)


MGPU_SHAPES = [(16, 4096, 14336), (16, 14336, 4096), (128, 4096, 14336),
               (128, 14336, 4096)]
# Mosaic GPU weight-only configs per padded M (MgpuBlockSizes fields; {}
# is the table's): ring depth, tile_k, one or two compute warpgroups per
# CTA, B from an XLA-made x^T, the split-K target.
MGPU_CONFIGS = {
    16: [dict(tile_k=512, stages=2), dict(compute_wgs=1)],
    128: [dict(wg_rows=128, tile_k=64, stages=4),
          dict(compute_wgs=1, stages=4), dict(max_split=2)],
}
# Sweep 1 (int8_matmul_mgpu_sweep-h100-*, M = 16, 36-41 us for every
# config): x^T from XLA +10%, more split (two waves) +6-10%; hence the split
# rule of one wave.
# Odd shapes checked on the GPU against float64 numpy: (M, K, N, config).
MGPU_CHECKS = [(5, 300, 130, {}), (77, 1000, 300, dict(wg_rows=128,
                                                       tile_k=64))]
MGPU_SECONDS = float(os.environ.get("INT8_MGPU_SECONDS", "190"))


def mgpu_checks():
  """Max relative error of the Mosaic GPU kernel at odd shapes (float64
  numpy reference, w_scale and bias applied, float32 out)."""
  rng = np.random.default_rng(0)
  results = {}
  for m, k, n, cfg in MGPU_CHECKS:
    key = f"{m}x{k}x{n}{cfg or ''}"
    try:
      x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
      w = jnp.asarray(rng.integers(-128, 128, (n, k)), jnp.int8)
      ws = jnp.asarray(rng.uniform(0.5, 1.5, (1, n)), jnp.float32)
      b = jnp.asarray(rng.standard_normal((1, n)), jnp.float32)
      out = jax.jit(functools.partial(
          mosaic_gpu.matmul, mode="weight_only", out_dtype=jnp.float32,
          w_layout="nk", block_sizes=mosaic_gpu.MgpuBlockSizes(**cfg)))(
              x, w, None, ws, b)
      want = (np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
              * np.asarray(ws, np.float64) + np.asarray(b, np.float64))
      got = np.asarray(out, np.float64)
      results[key] = float(np.abs(got - want).max() / np.abs(want).max())
    except Exception as e:  # noqa: BLE001
      results[key] = f"{type(e).__name__}: {str(e)[:400]}"
      traceback.print_exc(limit=2)
  print("mgpu checks (max rel error):", results, flush=True)
  return results


def mgpu_sweep(rows, torch_ops, out_name, extra, configs=None):
  """At the four decode shapes: torch bf16, the Triton weight-only kernel,
  the public call with the Mosaic GPU kernel forced (each checked against
  XLA's w8a16); then, while MGPU_SECONDS last, MGPU_CONFIGS of the Mosaic
  GPU kernel called directly (checked likewise)."""
  start = time.perf_counter()
  configs = MGPU_CONFIGS if configs is None else configs
  peers = peer_jax_ops()
  ops = jax_ops("gpu")
  state = {}
  for m, k, n in MGPU_SHAPES:
    if time.perf_counter() - start > MGPU_SECONDS:
      extra.setdefault("not_run", []).append(f"{m}x{k}x{n}")
      continue
    data = make_inputs(m, k, n)
    reps = replicas_for(m, k, n)
    errors, outputs = {}, {}
    row = dict(shape=f"{m}x{k}x{n}", m=m, k=k, n=n, replicas=reps)
    times = {}
    for name in ("xla_w8a16", "ours_triton_w8a16_nk", "ours_mgpu_w8a16_nk"):
      fn, argnames = peers[name] if name in peers else ops[name]
      times[name] = run_op(name, fn, argnames, data, reps, peers, errors,
                           outputs=outputs)
    times["torch_bf16"] = time_torch_bf16(torch_ops, data, (m, k, n), reps,
                                          errors)
    for name, t in times.items():
      row[f"{name}_us"] = _us(t)
    for ours in ("ours_triton_w8a16_nk", "ours_mgpu_w8a16_nk"):
      t = times.get(ours)
      if t:
        row[f"{ours}_w_tbs"] = k * n / t / 1e12
        row[f"{ours}_vs_torch_bf16"] = harness.ratio(times.get("torch_bf16"), t)
    if times.get("ours_mgpu_w8a16_nk"):
      row["ours_mgpu_vs_triton"] = harness.ratio(
          times.get("ours_triton_w8a16_nk"), times["ours_mgpu_w8a16_nk"])
    row["mgpu_plan"] = str(mosaic_gpu.plan(m, k, n))
    row["errors"] = errors
    rows.append(row)
    print(row, flush=True)
    harness.write_results(out_name, rows, extra=extra)
    state[(m, k, n)] = (times, outputs.get("xla_w8a16"))
  for (m, k, n), (times, expected) in state.items():
    data = make_inputs(m, k, n)
    reps = replicas_for(m, k, n)
    data = dict(xb=data["xb"], w8t=data["w8t"], ws=data["ws"].reshape(1, n))
    for cfg in configs.get(mosaic_gpu.padded_m(m), []):
      if time.perf_counter() - start > MGPU_SECONDS:
        extra.setdefault("configs_not_run", []).append(f"{m}x{k}x{n} {cfg}")
        continue
      errs, got = {}, {}
      sizes = mosaic_gpu.MgpuBlockSizes(**cfg)
      fn = functools.partial(mosaic_gpu.matmul, mode="weight_only",
                             out_dtype=jnp.bfloat16, w_layout="nk",
                             block_sizes=sizes)
      name = "alt_mgpu_w8a16_nk"
      t = run_op(name, lambda x, w, s_: fn(x, w, None, s_, None),
                 ("xb", "w8t", "ws"), data, reps, peers, errs,
                 check_it=False, outputs=got)
      if t is not None and expected is not None:
        try:
          errs[name] = check(name, got[name], expected)
        except Exception as e:  # noqa: BLE001
          errs[name] = f"{type(e).__name__}: {str(e)[:300]}"
          t = None
      sub = dict(shape=f"{m}x{k}x{n}", mgpu_config=str(cfg),
                 mgpu_plan=str(mosaic_gpu.plan(m, k, n, sizes)),
                 alt_mgpu_us=_us(t), alt_mgpu_w_tbs=t and k * n / t / 1e12,
                 alt_mgpu_vs_torch_bf16=harness.ratio(times.get("torch_bf16"),
                                                      t),
                 alt_mgpu_vs_triton=harness.ratio(
                     times.get("ours_triton_w8a16_nk"), t),
                 errors=errs)
      rows.append(sub)
      print(sub, flush=True)
      harness.write_results(out_name, rows, extra=extra)
  # Diagnostics while time is left: device time per kernel of one public
  # call (the Mosaic kernel and XLA's epilogue fusion apart).
  kernels = extra.setdefault("mgpu_kernel_us", {})
  for m, k, n in state:
    if time.perf_counter() - start > MGPU_SECONDS + 22:
      break
    try:
      data = make_inputs(m, k, n)
      fn, argnames = ops["ours_mgpu_w8a16_nk"]
      kernels[f"{m}x{k}x{n}"] = harness.device_kernel_times(
          jax.jit(fn), *[data[a] for a in argnames])
    except Exception as e:  # noqa: BLE001
      kernels[f"{m}x{k}x{n}"] = f"{type(e).__name__}: {str(e)[:200]}"
    print(f"kernels {m}x{k}x{n}:", kernels[f"{m}x{k}x{n}"], flush=True)
    harness.write_results(out_name, rows, extra=extra)


# --variants: Mosaic GPU kernel variants at the decode shapes, each checked
# against XLA's w8a16 and timed beside torch bf16 and the Triton kernel.
# name -> MgpuBlockSizes fields ({}: the table); VARIANT_OVERRIDES adjusts
# them per padded M (shared memory).
MGPU_VARIANTS = {
    "old": dict(fused=False),            # partials + one XLA epilogue pass
    "fused": {},                         # epilogue in the kernel (split 1)
    "mc2": dict(cluster=2),              # x tiles multicast to 2 CTAs
    "tk512": dict(tile_k=512, stages=2),
    "s5": dict(stages=5),
    "cred": dict(split_reduce="cluster"),  # split K summed in a cluster
    "cred2": dict(split_reduce="cluster", compute_wgs=1, max_split=2),
    "mc4": dict(cluster=4),
    "nosplit1": dict(fused=True, compute_wgs=1),  # 64-row CTAs, no split
    "rows256": dict(wg_rows=128, tile_k=64, stages=4, fused=True),
    "mc2rows256": dict(cluster=2, wg_rows=128, tile_k=64, stages=4,
                       fused=True),
}
VARIANT_OVERRIDES = {("cred", 128): dict(stages=2)}
VARIANT_SHAPES = {
    (16, 4096, 14336): ("old", "fused", "mc2", "tk512", "s5"),
    (16, 14336, 4096): ("old", "cred", "cred2", "nosplit1", "mc2"),
    (128, 4096, 14336): ("old", "fused", "mc2", "mc4", "rows256"),
    (128, 14336, 4096): ("old", "cred", "cred2", "mc2"),
}
# Odd shapes checked against float64 numpy per variant: (M, K, N).
VARIANT_CHECKS = {"fused": [(5, 200, 130)],
                  "mc2": [(77, 128, 500), (16, 256, 1000)],
                  "cred": [(9, 2048, 200), (100, 4096, 256)],
                  "cred2": [(9, 2048, 200), (100, 4096, 256)],
                  "nosplit1": [(16, 640, 64)]}


def _shape_wanted(only, m, k, n):
  """only: None (all), a token count "16" or a shape "16x14336x4096"."""
  return only in (None, "all") or only in (str(m), f"{m}x{k}x{n}")


def variant_sizes(name, m):
  cfg = dict(MGPU_VARIANTS[name])
  cfg.update(VARIANT_OVERRIDES.get((name, mosaic_gpu.padded_m(m)), {}))
  return mosaic_gpu.MgpuBlockSizes(**cfg)


def _mgpu_fn(sizes, out_dtype=jnp.bfloat16):
  return functools.partial(mosaic_gpu.matmul, mode="weight_only",
                           out_dtype=out_dtype, w_layout="nk",
                           block_sizes=sizes)


def variant_checks(names):
  """{check: max relative error vs float64 numpy, or the error}; a
  variant whose partial sums meet across CTAs is also run three times on
  the same inputs and must give identical bits (a race shows otherwise)."""
  rng = np.random.default_rng(1)
  results = {}
  for name in names:
    for m, k, n in VARIANT_CHECKS.get(name, []):
      key = f"{name} {m}x{k}x{n}"
      try:
        sizes = variant_sizes(name, m)
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        w = jnp.asarray(rng.integers(-128, 128, (n, k)), jnp.int8)
        ws = jnp.asarray(rng.uniform(0.5, 1.5, (1, n)), jnp.float32)
        b = jnp.asarray(rng.standard_normal((1, n)), jnp.float32)
        fn = jax.jit(_mgpu_fn(sizes, jnp.float32))
        outs = [np.asarray(fn(x, w, None, ws, b)) for _ in range(3)]
        want = (np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
                * np.asarray(ws, np.float64) + np.asarray(b, np.float64))
        got = outs[0].astype(np.float64)
        rel = float(np.abs(got - want).max() / np.abs(want).max())
        same = all(np.array_equal(outs[0], o) for o in outs[1:])
        results[key] = dict(rel=rel, repeatable=same,
                            plan=str(mosaic_gpu.plan(m, k, n, sizes)))
        if not np.isfinite(got).all() or rel > 1e-4 or not same:
          results[key]["FAILED"] = True
      except Exception as e:  # noqa: BLE001
        results[key] = f"{type(e).__name__}: {str(e)[:400]}"
        traceback.print_exc(limit=2)
      print("check", key, results[key], flush=True)
  return results


def mgpu_variants(names, out_name, torch_ops, profile=(), only=None):
  """Rows per decode shape: the named variants (VARIANT_SHAPES decides
  where each runs), the Triton kernel and torch bf16, each checked against
  XLA's w8a16; then device kernel times of the ``profile`` variants."""
  checked = os.environ.get("INT8_VARIANT_CHECKS")  # default: all named
  extra = dict(variant_checks=variant_checks(
                   names if checked is None else checked.split(",")),
               variants={v: MGPU_VARIANTS.get(v) for v in names},
               timing=timing_text(20))
  rows, peers, ops = [], peer_jax_ops(), jax_ops("gpu")
  for (m, k, n), wanted in VARIANT_SHAPES.items():
    run = [v for v in wanted if v in names]
    if not run or not _shape_wanted(only, m, k, n):
      continue
    data = make_inputs(m, k, n)
    reps = replicas_for(m, k, n)
    args = dict(xb=data["xb"], w8t=data["w8t"], ws=data["ws"].reshape(1, n))
    errors, outputs, times = {}, {}, {}
    expected = jax.jit(peers["xla_w8a16"][0])(data["xb"], data["w8"],
                                              data["ws"])
    row = dict(shape=f"{m}x{k}x{n}", replicas=reps)
    if "triton" in names:
      fn, argnames = ops["ours_triton_w8a16_nk"]
      times["triton"] = run_op("ours_triton_w8a16_nk", fn, argnames, data,
                               reps, peers, errors, outputs=outputs)
    for v in run:
      sizes = variant_sizes(v, m)
      fn = _mgpu_fn(sizes)
      row[f"{v}_plan"] = str(mosaic_gpu.plan(m, k, n, sizes))
      t = run_op(v, lambda x, w, s_, fn=fn: fn(x, w, None, s_, None),
                 ("xb", "w8t", "ws"), args, reps, peers, errors,
                 check_it=False, outputs=outputs)
      if t is not None:
        try:
          errors[v] = check(v, outputs[v], expected)
        except Exception as e:  # noqa: BLE001
          errors[v] = f"{type(e).__name__}: {str(e)[:300]}"
          t = None
      times[v] = t
    times["torch_bf16"] = time_torch_bf16(torch_ops, data, (m, k, n), reps,
                                          errors)
    for v, t in times.items():
      row[f"{v}_us"] = _us(t)
      if t and v != "torch_bf16":
        row[f"{v}_vs_torch_bf16"] = harness.ratio(times.get("torch_bf16"), t)
        row[f"{v}_w_tbs"] = k * n / t / 1e12
    row["errors"] = errors
    rows.append(row)
    print({a: (round(b, 3) if isinstance(b, float) else b)
           for a, b in row.items() if not a.endswith("_plan")}, flush=True)
    harness.write_results(out_name, rows, extra=extra)
  kernels = extra.setdefault("kernel_us", {})
  for (m, k, n), wanted in VARIANT_SHAPES.items():
    if not _shape_wanted(only, m, k, n):
      continue
    for v in [v for v in wanted if v in profile and v in names]:
      try:
        data = make_inputs(m, k, n)
        fn = _mgpu_fn(variant_sizes(v, m))
        kernels[f"{v} {m}x{k}x{n}"] = harness.device_kernel_times(
            jax.jit(lambda x, w, s_, fn=fn: fn(x, w, None, s_, None)),
            data["xb"], data["w8t"], data["ws"].reshape(1, n))
      except Exception as e:  # noqa: BLE001
        kernels[f"{v} {m}x{k}x{n}"] = f"{type(e).__name__}: {str(e)[:200]}"
      print("kernels", v, m, k, n, kernels[f"{v} {m}x{k}x{n}"], flush=True)
  harness.write_results(out_name, rows, extra=extra)
  return rows


def tpu_estimates():
  """Per TPU generation: the chosen tiles, their VMEM use and the roofline
  time of the fused int8 matmul against a bf16 matmul (no TPU measured)."""
  rows = []
  for chip in ("v5e", "v6e", "v5p", "v4"):
    for m, k, n in [SQUARE] + LLM_SHAPES:
      plan = bs.plan_tpu(m, k, n, x_bytes=1, out_bytes=2, mode="dequant",
                         generation=chip)
      flops = 2.0 * m * k * n
      int8 = roofline.roofline(chip, flops, m * k + k * n + 2 * m * n, "int8")
      bf16 = roofline.roofline(chip, flops, 2 * (m * k + k * n + m * n))
      rows.append(dict(chip=chip, shape=f"{m}x{k}x{n}",
                       tiles=f"{plan.bm}x{plan.bk}x{plan.bn}",
                       vmem_mib=plan.vmem_bytes / 2**20,
                       vmem_limit_mib=plan.vmem_limit_bytes / 2**20,
                       int8_us=int8["time_s"] * 1e6, bound=int8["bound"],
                       bf16_us=bf16["time_s"] * 1e6,
                       int8_speedup=bf16["time_s"] / int8["time_s"]))
  return rows


def _us(seconds):
  return None if seconds is None else seconds * 1e6


def _stream_probe_kernel(x_ref, w_ref, o_ref, *, nk, bk, probe):
  """Diagnostic twins of the weight-only decode kernel (w [N, K], same
  tiles and program count; results are not the product): "read" only
  streams w (sums it), "x_once" does the full upcast-and-dot but loads its
  x tile once instead of every step (no re-reads of x)."""
  bm, bn = o_ref.shape[-2:]
  first = pl.program_id(1) * nk
  x_first = x_ref[:, pl.ds(pl.multiple_of(first * bk, bk), bk)]

  def step(kk, acc):
    start = pl.multiple_of((first + kk) * bk, bk)
    w = w_ref[:, pl.ds(start, bk)]
    if probe == "read":
      return acc + jnp.sum(w.astype(jnp.int32), axis=1)[None, :].astype(
          jnp.float32)
    return acc + jax.lax.dot_general(
        x_first, w.astype(x_first.dtype), (((1,), (1,)), ((), ())),
        preferred_element_type=jnp.float32)

  acc = jax.lax.fori_loop(0, nk, step, jnp.zeros((bm, bn), jnp.float32))
  o_ref[...] = acc.astype(o_ref.dtype)


def stream_probe(x, w_nk, *, probe, plan):
  """[split, M, N] float32 from _stream_probe_kernel with ``plan``'s tiles."""
  m, k = x.shape
  n = w_nk.shape[0]
  bm, bk, bn, split = plan.bm, plan.bk, plan.bn, plan.split_k
  nk = k // bk // split
  kernel = functools.partial(_stream_probe_kernel, nk=nk, bk=bk, probe=probe)
  return pl.pallas_call(
      kernel, grid=(n // bn, split),
      in_specs=[pl.BlockSpec((bm, k), lambda j, s: (0, 0)),
                pl.BlockSpec((bn, k), lambda j, s: (j, 0))],
      out_specs=pl.BlockSpec((None, bm, bn), lambda j, s: (s, 0, j)),
      out_shape=jax.ShapeDtypeStruct((split, m, n), jnp.float32),
      compiler_params=_compat.gpu_compiler_params(
          num_warps=plan.num_warps, num_stages=plan.num_stages),
  )(x, w_nk)


PROBE_SHAPES = [(16, 4096, 14336), (16, 14336, 4096)]


def run_probes(rows, start):
  """Times the stream probes at the table's w [N, K] decode tiles."""
  for m, k, n in PROBE_SHAPES:
    data = make_inputs(m, k, n)
    plan = bs.plan_gpu(m, k, n, mode="weight_only", w_layout="nk")
    row = dict(shape=f"{m}x{k}x{n}", probe_plan=str(tuple(plan)))
    for probe in ("read", "x_once"):
      if time.perf_counter() - start > BENCH_SECONDS:
        return
      try:
        t, _ = time_replicated_jax(
            functools.partial(stream_probe, probe=probe, plan=plan),
            [data["xb"], data["w8t"]], replicas_for(m, k, n))
        row[f"probe_{probe}_us"] = t * 1e6
        row[f"probe_{probe}_w_tbs"] = k * n / t / 1e12
      except Exception as e:  # noqa: BLE001
        row[f"probe_{probe}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    rows.append(row)
    print(row, flush=True)


def quick():
  """CPU smoke test: small shape, kernel in interpret mode vs reference."""
  m, k, n = 40, 300, 200
  data = make_inputs(m, k, n)
  ops = jax_ops("interpret", bs.BlockSizes(32, 128, 128))
  peers = peer_jax_ops()
  rows = []
  for name, (fn, argnames) in ops.items():
    errors = {}
    t = run_op(name, fn, argnames, data, 1, peers, errors)
    ref_fn, ref_args = peers[reference_of(name)]
    t_ref = run_op(reference_of(name), ref_fn, ref_args, data, 1, peers, {})
    rows.append(dict(op=name, shape=f"{m}x{k}x{n}", interpret_ms=t * 1e3,
                     reference_ms=t_ref * 1e3, max_rel_error=errors[name]))
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--sweep", action="store_true",
                      help="time candidate GPU block configs instead")
  parser.add_argument("--mgpu", action="store_true",
                      help="the Mosaic GPU weight-only kernel at the decode "
                           "shapes (INT8_MGPU_SWEEP=0: no config sweep)")
  parser.add_argument("--variants", default=None,
                      help="comma-separated MGPU_VARIANTS (and 'triton') to "
                           "time at the decode shapes")
  parser.add_argument("--profile", default="",
                      help="with --variants: variants to profile per kernel")
  parser.add_argument("--name", default="int8_matmul_mgpu_variants",
                      help="with --variants: results file name")
  parser.add_argument("--shapes", default="all",
                      help="all | square | llm | a token count M")
  args = parser.parse_args(argv)
  on_gpu = jax.default_backend() == "gpu"
  estimates = tpu_estimates()
  harness.print_table(estimates)
  if args.quick or not on_gpu:
    rows = quick()
    harness.print_table(rows)
    if on_gpu or os.environ.get("BENCH_RESULTS_DIR"):
      print("wrote", harness.write_results("int8_matmul", rows,
                                           extra=dict(quick=True)))
    return 0
  chip = harness.device_slug(harness.device_info())
  torch_ops = torch_peer_ops()
  if args.variants:
    names = args.variants.split(",")
    rows = mgpu_variants(names, args.name, torch_ops,
                         profile=args.profile.split(","),
                         only=args.shapes)
    cols = ["shape"] + [f"{v}_us" for v in names + ["torch_bf16"]] + [
        f"{v}_vs_torch_bf16" for v in names]
    harness.print_table(rows, [c for c in cols if any(c in r for r in rows)])
    return 0
  if args.mgpu:
    rows = []
    name = os.environ.get("INT8_MGPU_NAME", "int8_matmul_mgpu")
    extra = dict(mgpu_checks=mgpu_checks(),
                 mgpu_default_tiles=str(mosaic_gpu.DEFAULT_TILES),
                 timing=timing_text())
    mgpu_sweep(rows, torch_ops, name, extra,
               configs=None if os.environ.get("INT8_MGPU_SWEEP", "1") == "1"
               else {})
    print("wrote", harness.write_results(name, rows, extra=extra))
    harness.print_table([r for r in rows if "replicas" in r], [
        "shape", "ours_mgpu_w8a16_nk_us", "ours_triton_w8a16_nk_us",
        "torch_bf16_us", "xla_w8a16_us", "ours_mgpu_w8a16_nk_w_tbs",
        "ours_mgpu_w8a16_nk_vs_torch_bf16", "ours_mgpu_vs_triton",
        "ours_triton_w8a16_nk_vs_torch_bf16"])
    harness.print_table([r for r in rows if "mgpu_config" in r], [
        "shape", "mgpu_config", "alt_mgpu_us", "alt_mgpu_w_tbs",
        "alt_mgpu_vs_torch_bf16", "alt_mgpu_vs_triton"])
    return 0
  if args.sweep:
    rows = []
    sweep(rows, torch_ops, "int8_matmul_decode_sweep")
    print("wrote", harness.write_results("int8_matmul_decode_sweep", rows))
    harness.print_table(rows, ["shape", "config", "ours_w8a16_nk_us",
                               "ours_w8a16_us", "ours_w8a16_nk_w_tbs",
                               "ours_w8a16_w_tbs", "torch_bf16_us",
                               "xla_bf16_us", "xla_w8a16_us", "copy_tbs"])
    return 0
  rows = []
  extra = dict(tpu_estimates=estimates,
               gpu_table={c: list(dataclasses.astuple(b))
                          for c, b in bs.GPU_TABLE.items()},
               gpu_table_weight_only={
                   c: list(dataclasses.astuple(b))
                   for c, b in bs.GPU_TABLE_WEIGHT_ONLY.items()},
               gpu_table_weight_only_nk={
                   c: list(dataclasses.astuple(b))
                   for c, b in bs.GPU_TABLE_WEIGHT_ONLY_NK.items()},
               gpu_weight_only_target_programs=(
                   bs.GPU_WEIGHT_ONLY_TARGET_PROGRAMS),
               mgpu_auto_m=bs.GPU_WEIGHT_ONLY_MOSAIC_AUTO_M,
               mgpu_plans={f"{m}x{k}x{n}": str(mosaic_gpu.plan(m, k, n))
                           for m, k, n in MGPU_SHAPES},
               replicas_env=os.environ.get("INT8_REPLICAS"),
               timing=timing_text())
  if args.shapes.isdigit():
    shapes = [s_ for s_ in LLM_SHAPES if s_[0] == int(args.shapes)]
  else:
    shapes = (LLM_SHAPES if args.shapes in ("all", "llm") else []) + (
        [SQUARE] if args.shapes in ("all", "square") else [])
  if not shapes:
    parser.error(f"--shapes {args.shapes}: no such shapes")
  name = "int8_matmul" if args.shapes == "all" else f"int8_matmul_{args.shapes}"
  ops, peers = jax_ops("gpu"), peer_jax_ops()
  start = time.perf_counter()
  for m, k, n in shapes:
    if time.perf_counter() - start > BENCH_SECONDS:
      extra.setdefault("not_run", []).append(f"{m}x{k}x{n}")
      continue
    pick = None
    if (m, k, n) == SQUARE and os.environ.get("INT8_CHOOSE_TRANSPOSE") == "1":
      # first: the transpose the w_kmajor path uses
      def pick(data, reps):
        chosen = choose_transpose(data, reps)
        extra.update(chosen)
        return chosen
    bench_shape(m, k, n, ops, peers, torch_ops, rows, chip, extra_row=pick,
                deadline=start + BENCH_SECONDS)
    extra["gpu_transpose"] = list(bs.GPU_TRANSPOSE)
    harness.write_results(name, rows, extra=extra)  # partial results
  for (m, k, n), op, cfg in ALT_WEIGHT_ONLY:
    if (m, k, n) not in shapes or time.perf_counter() - start > BENCH_SECONDS:
      continue
    data, errors = make_inputs(m, k, n), {}
    alt = op.replace("ours_", "alt_")
    fn, argnames = jax_ops("gpu", bs.BlockSizes(*cfg))[op]
    t = run_op(alt, fn, argnames, data, replicas_for(m, k, n), peers, errors)
    rows.append({"shape": f"{m}x{k}x{n}", f"{alt}_config": str(cfg),
                 f"{alt}_us": _us(t),
                 f"{alt}_w_tbs": t and k * n / t / 1e12,
                 "errors": dict(errors)})
    print(rows[-1], flush=True)
    harness.write_results(name, rows, extra=extra)
  if args.shapes in ("all", "llm"):
    run_probes(rows, start)
  finish_torch_kernel_times()
  harness.write_results(name, rows, extra=extra)
  harness.print_table([r for r in rows if "replicas" in r], [
      "shape", "ours_raw_us", "ours_fused_us", "ours_fused_nk_us",
      "torch_int_mm_us", "xla_int8_us", "torch_bf16_us", "xla_bf16_us",
      "ours_fused_vs_torch_int_mm", "ours_fused_vs_torch_bf16",
      "ours_fused_nk_vs_torch_bf16", "ours_raw_vs_xla_int8", "ours_fused_tops"])
  harness.print_table([r for r in rows if r.get("ours_w8a16_us")], [
      "shape", "ours_w8a16_us", "ours_w8a16_nk_us", "xla_w8a16_us",
      "torch_bf16_us", "xla_bf16_us", "ours_w8a16_vs_torch_bf16",
      "ours_w8a16_nk_vs_torch_bf16", "ours_w8a16_vs_xla_bf16",
      "ours_w8a16_nk_vs_xla_bf16", "ours_w8a16_nk_vs_xla_w8a16",
      "ours_w8a16_w_tbs", "ours_w8a16_nk_w_tbs"])
  harness.print_table([r for r in rows if r.get("ours_w8a16_nk_kernel_us")], [
      "shape", "ours_w8a16_nk_kernel_us", "torch_bf16_kernel_us",
      "xla_bf16_kernel_us", "ours_w8a16_nk_kernel_vs_torch_bf16_kernel",
      "ours_w8a16_nk_kernel_vs_xla_bf16_kernel"])
  harness.print_table([r for r in rows if "probe_plan" in r], [
      "shape", "probe_plan", "probe_read_us", "probe_read_w_tbs",
      "probe_x_once_us", "probe_x_once_w_tbs"])
  harness.print_table([r for r in rows if "replicas" not in r
                       and "probe_plan" not in r], [
      "shape", "alt_w8a16_nk_config", "alt_w8a16_nk_us", "alt_w8a16_nk_w_tbs",
      "alt_w8a16_config", "alt_w8a16_us"])
  harness.print_table([r for r in rows if r.get("ours_dynamic_us")], [
      "shape", "ours_dynamic_us", "ours_dynamic_vs_torch_int_mm",
      "ours_dynamic_vs_xla_int8", "ours_dynamic_vs_torch_bf16",
      "ours_dynamic_vs_xla_bf16"])
  print("wrote", harness.write_results(name, rows, extra=extra))
  return 0


if __name__ == "__main__":
  sys.exit(main())
