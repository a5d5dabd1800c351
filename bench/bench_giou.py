"""Benchmark: IoU-family kernels vs jitted JAX and torchvision.

    python bench/bench_giou.py [--quick]

Cases (full run): GIoU loss forward (reduction="none") and forward+backward
(reduction="mean", gradients for both box sets) at B=1024 x N=256 and at 16M
box pairs; the pairwise GIoU matrix at 4096 x 4096. Peers measured in the
same run: the jitted JAX reference (``backend="reference"``), torchvision's
``generalized_box_iou_loss`` / ``generalized_box_iou`` eager and under
``torch.compile``. Bandwidth is the minimum HBM traffic of the op (inputs
read once, outputs written once) divided by time, compared to a measured
device-to-device copy (JAX ``x + 1`` over 1 GiB: read + write). Before
timing, every GPU kernel is checked against the reference on random and
degenerate boxes. TPU numbers are roofline estimates (memory-bound).
``--quick`` runs small shapes (a CPU smoke test: kernels run interpreted).
On a GPU the 1024x256 cases also get their device time from a profiler
trace ("device_time_1024x256"): at that size a call's wall time is mostly
dispatch (a trivial jitted call takes ~65 us on the H100 host), so the wall
ratio compares launch counts and noise while the device ratio compares the
kernels. ``--explain`` repeats, for aligned and ragged sizes, the direct
``elementwise_vjp`` calls and the public-API vjp that once disagreed (see
``pallas_kernels.boxes.iou.gpu``: unmasked stores past a ragged end).
On a GPU, ``--diagnose`` first checks each GPU kernel alone at a block-aligned
and a ragged size for each kernel variant (``gpu.COLUMN_ACCESS``,
``gpu.RAGGED``) and benchmarks the first that passes; ``--sweep`` times a
few block sizes. Results: ``bench/results/giou-h100-*.json``.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pallas_kernels import _quiet  # noqa: E402

_quiet.select_cpu_when_no_accelerator()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from bench import harness, roofline  # noqa: E402

F32 = 4


def _boxes(rng, shape):
  xy = rng.uniform(0.0, 100.0, shape + (2,))
  wh = rng.uniform(1.0, 30.0, shape + (2,))
  return np.concatenate([xy, xy + wh], axis=-1).astype(np.float32)


def _torch():
  try:
    import torch
    import torchvision.ops as tvops
  except Exception:  # noqa: BLE001
    return None, None
  if not torch.cuda.is_available():
    return None, None
  return torch, tvops


def _kernel_backend():
  return "gpu" if jax.devices()[0].platform == "gpu" else None


# ------------------------------------------------------------ diagnosis
def diagnose_gpu_kernels():
  """Each GPU kernel alone vs the reference, for both column-access modes."""
  from pallas_kernels.boxes.iou import gpu, reference
  rng = np.random.default_rng(1)
  rows = []
  variants = (("select", "mask"), ("strided", "mask"), ("select", "pad"))
  for access, ragged in variants:
    mode = f"{access}/{ragged}"
    gpu.COLUMN_ACCESS, gpu.RAGGED = access, ragged
    for count in (2048, 3000):
      a = jnp.asarray(_boxes(rng, (count,)))
      b = jnp.asarray(_boxes(rng, (count,)))
      g = jnp.asarray(rng.normal(size=count), jnp.float32)
      common = dict(kind="giou", formula="loss", eps=1e-7, box_format="xyxy")

      def ref_score(x, y):
        return reference.elementwise_score("giou", "loss", 1e-7, "xyxy", x, y)

      want = ref_score(a, b)
      want_d = jax.vjp(ref_score, a, b)[1](g)
      want_s = jax.vjp(ref_score, a, b)[1](jnp.full((count,), 0.5))
      want_p = reference.pairwise_score("giou", 0.0, "xyxy", a[:100], b)

      def rel(x, y):
        return float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + 1e-30))

      try:
        got = jax.jit(lambda x, y: gpu.elementwise(x, y, **common))(a, b)
        total = jax.jit(lambda x, y: gpu.elementwise(
            x, y, reduce=True, **common))(a, b)
        d = jax.jit(lambda x, y, c: gpu.elementwise_vjp(x, y, c, **common))(
            a, b, g)
        ds = jax.jit(lambda x, y: gpu.elementwise_vjp(
            x, y, jnp.full((1,), 0.5), shared_cotangent=True, **common))(a, b)
        pw = jax.jit(lambda x, y: gpu.pairwise(
            x[None], y[None], kind="giou", eps=0.0,
            out_dtype=jnp.float32)[0])(a[:100], b)
        rows.append(dict(mode=mode, count=count, fwd=rel(got, want),
                         fwd_sum=rel(total, jnp.sum(want)),
                         bwd_d1=rel(d[0], want_d[0]), bwd_d2=rel(d[1], want_d[1]),
                         bwd_shared=rel(ds[0], want_s[0]),
                         pairwise=rel(pw, want_p)))
      except Exception as e:  # noqa: BLE001
        rows.append(dict(mode=mode, count=count, error=str(e)[:300]))
  harness.print_table(rows)
  good = [v for v in variants
          if all("error" not in r and max(x for k, x in r.items()
                                          if k not in ("mode", "count")) < 1e-4
                 for r in rows if r["mode"] == "/".join(v))]
  gpu.COLUMN_ACCESS, gpu.RAGGED = good[0] if good else variants[0]
  print("GPU kernel variant used below:", gpu.COLUMN_ACCESS, gpu.RAGGED)
  return rows


def explain_vjp_mismatch():
  """Direct elementwise_vjp calls at aligned/ragged sizes, located errors.

  Variants separate the kernel from the calling convention: jitted with the
  cotangent as a parameter, jitted with it computed inside, eager, and the
  public giou_loss vjp with the same cotangent.
  """
  from pallas_kernels.boxes.iou import gpu, reference
  rng = np.random.default_rng(1)
  common = dict(kind="giou", formula="loss", eps=1e-7, box_format="xyxy")
  rows = []

  def ref_score(x, y):
    return reference.elementwise_score("giou", "loss", 1e-7, "xyxy", x, y)

  for count in (2048, 3000, 3072, 5000):
    a = jnp.asarray(_boxes(rng, (count,)))
    b = jnp.asarray(_boxes(rng, (count,)))
    g = jnp.asarray(rng.normal(size=count), jnp.float32)
    want = jax.vjp(ref_score, a, b)[1](g)
    variants = {
        "jit(param g)": lambda: jax.jit(lambda x, y, c: gpu.elementwise_vjp(
            x, y, c, **common))(a, b, g),
        "jit(g * 1 inside)": lambda: jax.jit(lambda x, y, c: gpu.elementwise_vjp(
            x, y, c * 1.0, **common))(a, b, g),
        "eager": lambda: gpu.elementwise_vjp(a, b, g, **common),
        "public giou_loss vjp": lambda: tuple(-d for d in jax.vjp(
            lambda x, y: pk.giou_loss(x, y, backend="gpu"), a, b)[1](g)),
    }
    for name, call in variants.items():
      try:
        got = call()
        err = np.abs(np.asarray(got[0]) - np.asarray(want[0]))
        bad = np.argwhere(err > 1e-4 * (np.abs(np.asarray(want[0])).max()))
        rows.append(dict(count=count, variant=name,
                         max_err=float(err.max()), bad=int(len(bad)),
                         first_bad_rows=sorted({int(r) for r in bad[:, 0]})[:8],
                         bad_row_range=[int(bad[:, 0].min()), int(bad[:, 0].max())]
                         if len(bad) else None))
      except Exception as e:  # noqa: BLE001
        rows.append(dict(count=count, variant=name, error=repr(e)[:300]))
      print(rows[-1], flush=True)
  return rows


def profile_cases():
  """Device kernels per call of the 1024x256 cases (jax profiler)."""
  from bench import bench_nms
  rng = np.random.default_rng(3)
  p = jnp.asarray(_boxes(rng, (1024, 256)))
  t = jnp.asarray(_boxes(rng, (1024, 256)))
  rows = []
  floor = jax.jit(lambda x: x + 1)
  rows.append(dict(case="jit floor", wall_ms=1e3 * harness.time_jax(
      floor, p, iters=50)))
  for impl, be in (("pallas", "gpu"), ("jax_reference", "reference")):
    for case, fn in (("fwd", _jax_loss_fwd(be)),
                     ("fwd+bwd", _jax_loss_fwd_bwd(be))):
      kernels = bench_nms.device_kernel_times(fn, p, t)
      rows.append(dict(case=f"{case} 1024x256", impl=impl,
                       wall_ms=1e3 * harness.time_jax(fn, p, t, iters=50),
                       kernels={k: [round(v[0], 1), round(v[1], 1)]
                                for k, v in kernels.items()}))
      print(rows[-1], flush=True)
  return rows


def device_times_small():
  """Device time (profiler) of the 1024x256 cases, Pallas vs jitted JAX.

  At this size a call's wall time is mostly host dispatch (see "jit floor"),
  so the wall-time ratio mainly compares launch counts and dispatch noise;
  the device time is what the kernels themselves cost.
  """
  from bench import bench_nms
  rng = np.random.default_rng(4)
  p = jnp.asarray(_boxes(rng, (1024, 256)))
  t = jnp.asarray(_boxes(rng, (1024, 256)))
  out = {"jit_floor_wall_us": 1e6 * harness.time_jax(
      jax.jit(lambda x: x + 1), p, iters=50)}
  for case, make in (("fwd", _jax_loss_fwd), ("fwd+bwd", _jax_loss_fwd_bwd)):
    for impl, be in (("pallas", "gpu"), ("jax_reference", "reference")):
      kernels = bench_nms.device_kernel_times(make(be), p, t, reps=20)
      out[f"{case} {impl}"] = dict(
          device_us=kernels["(device total)"][1],
          launches=kernels["(device total)"][0],
          kernels={k: round(v[1], 2) for k, v in kernels.items()})
    out[f"{case} x_vs_jax_reference_device"] = (
        out[f"{case} jax_reference"]["device_us"]
        / out[f"{case} pallas"]["device_us"])
  print(out, flush=True)
  return out


def sweep_gpu_blocks(iters):
  """Times the GPU kernels at a few block sizes (16M pairs, 4096^2)."""
  from pallas_kernels.boxes.iou import gpu
  rng = np.random.default_rng(2)
  p = jnp.asarray(_boxes(rng, (1 << 24,)))
  t = jnp.asarray(_boxes(rng, (1 << 24,)))
  common = dict(kind="giou", formula="loss", eps=1e-7, box_format="xyxy")
  rows = []
  saved = gpu.NUM_WARPS
  for warps in (4, 8):
    gpu.NUM_WARPS = warps
    for block in (512, 1024, 2048):
      fwd = jax.jit(lambda x, y, block=block: gpu.elementwise(
          x, y, as_loss=True, block=block, **common))
      bwd = jax.jit(lambda x, y, block=block: gpu.elementwise_vjp(
          x, y, jnp.ones((1,)), shared_cotangent=True, block=block, **common))
      rows.append(dict(kernel="elementwise", warps=warps, block=str(block),
                       ms=harness.time_jax(fwd, p, t, iters=iters) * 1e3))
      rows.append(dict(kernel="elementwise_vjp", warps=warps, block=str(block),
                       ms=harness.time_jax(bwd, p, t, iters=iters) * 1e3))
    a = p[:4096]
    b = t[:4096]
    for tile in ((32, 128), (64, 128), (64, 256), (128, 128), (16, 512)):
      pw = jax.jit(lambda x, y, tile=tile: gpu.pairwise(
          x[None], y[None], kind="giou", eps=0.0, out_dtype=jnp.float32,
          tile=tile))
      rows.append(dict(kernel="pairwise", warps=warps, block=str(tile),
                       ms=harness.time_jax(pw, a, b, iters=iters) * 1e3))
  gpu.NUM_WARPS = saved
  harness.print_table(rows)
  return rows


# ------------------------------------------------------------ correctness
def check_kernels(backend):
  """Max |kernel - reference| for every op, on random + degenerate boxes."""
  rng = np.random.default_rng(0)
  a = _boxes(rng, (3, 1000))
  b = _boxes(rng, (3, 1000))
  degenerate = np.array([[0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 4, 0],
                         [3, 3, 1, 1], [0, 0, 2, 2]], np.float32)
  a[0, :5], b[0, :5] = degenerate, degenerate[::-1]
  rows = []
  for name in ("iou", "giou", "diou", "ciou"):
    metric = getattr(pk, name)
    loss = getattr(pk, name + "_loss")
    pairwise = getattr(pk, "pairwise_" + name)

    def all_outputs(x, y, be, metric=metric, loss=loss, pairwise=pairwise):
      grads = jax.grad(lambda p, t: loss(p, t, reduction="mean", backend=be),
                       argnums=(0, 1))(x, y)
      grads_none = jax.grad(lambda p, t: jnp.sum(loss(p, t, backend=be) ** 2),
                            argnums=(0, 1))(x, y)
      return (metric(x, y, backend=be), loss(x, y, backend=be),
              pairwise(x[0], y[1], backend=be)) + grads + grads_none

    got = jax.jit(all_outputs, static_argnums=2)(a, b, backend)
    want = jax.jit(all_outputs, static_argnums=2)(a, b, "reference")
    finite = all(bool(jnp.all(jnp.isfinite(g))) for g in got)
    errors = [float(jnp.max(jnp.abs(g - w)) / (jnp.max(jnp.abs(w)) + 1e-30))
              for g, w in zip(got, want)]
    rows.append(dict(op=name, max_rel_err=max(errors), all_finite=finite))
  return rows


# ------------------------------------------------------------------ cases
def _jax_loss_fwd(backend):
  return jax.jit(lambda p, t: pk.giou_loss(p, t, backend=backend))


def _jax_loss_fwd_bwd(backend):
  return jax.jit(jax.value_and_grad(
      lambda p, t: pk.giou_loss(p, t, reduction="mean", backend=backend),
      argnums=(0, 1)))


def _jax_pairwise(backend):
  return jax.jit(lambda a, b: pk.pairwise_giou(a, b, backend=backend))


def _copy_bandwidth(quick):
  n = (1 << 20) if quick else (1 << 28)  # 4 MiB / 1 GiB of float32
  x = jnp.ones((n,), jnp.float32)
  fn = jax.jit(lambda v: v + 1.0)
  seconds = harness.time_jax(fn, x, warmup=3, iters=10 if quick else 30)
  return 2 * n * F32 / seconds


def _torch_copy_bandwidth(torch):
  n = 1 << 28
  src = torch.ones(n, device="cuda")
  dst = torch.empty_like(src)
  seconds = harness.time_torch_cuda(lambda: dst.copy_(src), iters=30)
  del src, dst
  return 2 * n * F32 / seconds


def run_cases(quick, iters):
  backend = _kernel_backend()
  torch, tvops = _torch()
  rng = np.random.default_rng(0)
  elementwise_shapes = ([(4, 300)] if quick
                        else [(1024, 256), (16 * 1024 * 1024,)])
  pair_shape = (256, 512) if quick else (4096, 4096)
  rows = []

  def record(case, impl, seconds, bytes_moved, pairs):
    rows.append(dict(case=case, impl=impl, ms=seconds * 1e3,
                     gbps=bytes_moved / seconds / 1e9,
                     gpairs_per_s=pairs / seconds / 1e9))

  for shape in elementwise_shapes:
    pairs = int(np.prod(shape))
    p_np, t_np = _boxes(rng, shape), _boxes(rng, shape)
    p, t = jnp.asarray(p_np), jnp.asarray(t_np)
    label = "x".join(map(str, shape))
    fwd_bytes = pairs * (2 * 4 * F32 + F32)        # two boxes in, loss out
    fb_bytes = pairs * (2 * 4 * F32) * 3           # fwd read; bwd read + write
    for impl, be in (("pallas", backend), ("jax_reference", "reference")):
      seconds = harness.time_jax(_jax_loss_fwd(be), p, t, iters=iters)
      record(f"giou_loss fwd {label}", impl, seconds, fwd_bytes, pairs)
      seconds = harness.time_jax(_jax_loss_fwd_bwd(be), p, t, iters=iters)
      record(f"giou_loss fwd+bwd {label}", impl, seconds, fb_bytes, pairs)
    if torch is not None:
      tp = torch.from_numpy(p_np.reshape(-1, 4)).cuda().requires_grad_(True)
      tt = torch.from_numpy(t_np.reshape(-1, 4)).cuda().requires_grad_(True)
      eager = tvops.generalized_box_iou_loss
      compiled = torch.compile(tvops.generalized_box_iou_loss)
      for impl, fn in (("torchvision_eager", eager),
                       ("torchvision_compiled", compiled)):
        def fwd(fn=fn):
          with torch.no_grad():
            return fn(tp, tt)

        def fwd_bwd(fn=fn):
          loss = fn(tp, tt, reduction="mean")
          return torch.autograd.grad(loss, (tp, tt))

        record(f"giou_loss fwd {label}", impl,
               harness.time_torch_cuda(fwd, iters=iters), fwd_bytes, pairs)
        record(f"giou_loss fwd+bwd {label}", impl,
               harness.time_torch_cuda(fwd_bwd, iters=iters), fb_bytes, pairs)
      del tp, tt

  n, m = pair_shape
  a_np, b_np = _boxes(rng, (n,)), _boxes(rng, (m,))
  a, b = jnp.asarray(a_np), jnp.asarray(b_np)
  pair_bytes = n * m * F32 + (n + m) * 4 * F32
  label = f"pairwise_giou {n}x{m}"
  for impl, be in (("pallas", backend), ("jax_reference", "reference")):
    record(label, impl, harness.time_jax(_jax_pairwise(be), a, b, iters=iters),
           pair_bytes, n * m)
  if torch is not None:
    ta, tb = torch.from_numpy(a_np).cuda(), torch.from_numpy(b_np).cuda()
    compiled = torch.compile(tvops.generalized_box_iou)
    for impl, fn in (("torchvision_eager", tvops.generalized_box_iou),
                     ("torchvision_compiled", compiled)):
      record(label, impl, harness.time_torch_cuda(lambda fn=fn: fn(ta, tb),
                                                  iters=iters), pair_bytes, n * m)
  return rows, torch


def _add_ratios(rows, copy_bw):
  by_case = {}
  for row in rows:
    by_case.setdefault(row["case"], {})[row["impl"]] = row["ms"]
  for row in rows:
    row["pct_copy_bw"] = 100.0 * row["gbps"] * 1e9 / copy_bw
    if row["impl"] != "pallas":
      continue
    for peer, ms in by_case[row["case"]].items():
      if peer != "pallas":
        row[f"x_vs_{peer}"] = harness.ratio(ms, row["ms"])


def _tpu_estimates(rows):
  out = []
  for row in rows:
    if row["impl"] != "pallas":
      continue
    bytes_moved = row["gbps"] * 1e9 * row["ms"] / 1e3
    for chip in ("v5e", "v6e"):
      est = roofline.roofline(chip, 0.0, bytes_moved)
      out.append(dict(case=row["case"], chip=chip,
                      roofline_ms=est["time_s"] * 1e3, bound=est["bound"]))
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="small shapes (CPU smoke test)")
  parser.add_argument("--iters", type=int, default=None)
  parser.add_argument("--no-write", action="store_true",
                      help="print only, write no results file")
  parser.add_argument("--diagnose", action="store_true",
                      help="GPU: check each kernel alone (picks a variant that "
                           "passes)")
  parser.add_argument("--explain", action="store_true",
                      help="GPU: locate the direct elementwise_vjp mismatch")
  parser.add_argument("--profile", action="store_true",
                      help="GPU: device kernels per call at 1024x256")
  parser.add_argument("--only-diagnostics", action="store_true")
  parser.add_argument("--sweep", action="store_true",
                      help="GPU: time a few block sizes")
  args = parser.parse_args(argv)
  iters = args.iters or (3 if args.quick else 30)
  info = harness.device_info()
  print(f"device: {info.get('device')}  jax {info.get('jax')}  "
        f"torch {info.get('torch')}  torchvision {info.get('torchvision')}")

  backend = _kernel_backend()
  extra = {}
  if args.diagnose and backend == "gpu":
    extra["diagnosis"] = diagnose_gpu_kernels()
    from pallas_kernels.boxes.iou import gpu
    extra["gpu_variant"] = [gpu.COLUMN_ACCESS, gpu.RAGGED]
  if args.explain and backend == "gpu":
    extra["explain_vjp"] = explain_vjp_mismatch()
  if args.profile and backend == "gpu":
    extra["profile"] = profile_cases()
  if args.only_diagnostics:
    print("wrote", harness.write_results("giou-diagnostics", [], extra))
    return []
  if args.sweep and backend == "gpu":
    extra["block_sweep"] = sweep_gpu_blocks(iters)
  checks = check_kernels(backend)
  harness.print_table(checks, ["op", "max_rel_err", "all_finite"])

  copy_bw = _copy_bandwidth(args.quick)
  rows, torch = run_cases(args.quick, iters)
  extra.update(copy_bandwidth_gbps_jax=copy_bw / 1e9, checks=checks)
  if torch is not None:
    extra["copy_bandwidth_gbps_torch"] = _torch_copy_bandwidth(torch) / 1e9
  print(f"measured copy bandwidth: {copy_bw / 1e9:.1f} GB/s (JAX x+1)"
        + (f", {extra['copy_bandwidth_gbps_torch']:.1f} GB/s (torch copy_)"
           if "copy_bandwidth_gbps_torch" in extra else ""))
  _add_ratios(rows, copy_bw)
  if backend == "gpu" and not args.quick:
    extra["device_time_1024x256"] = device_times_small()
  columns = ["case", "impl", "ms", "gbps", "pct_copy_bw", "gpairs_per_s"]
  columns += sorted({k for r in rows for k in r if k.startswith("x_vs_")})
  harness.print_table(rows, columns)
  estimates = _tpu_estimates(rows)
  extra["tpu_roofline"] = estimates
  print("TPU roofline estimates (memory-bound, minimum traffic):")
  harness.print_table(estimates, ["case", "chip", "roofline_ms", "bound"])
  if not args.no_write:
    name = "giou-quick" if args.quick else "giou"
    print("wrote", harness.write_results(name, rows, extra))
  return rows


if __name__ == "__main__":
  main()
