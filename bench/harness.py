"""Shared benchmark utilities: timing, device facts, results files, tables.

Timing rules: warm-up calls first (compilation, autotuning), then the median
of many runs. JAX calls are waited for with ``block_until_ready``; torch CUDA
calls are timed with CUDA events on the stream, so host overhead between
launches is not counted twice.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Iterable, Sequence

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def time_jax(fn: Callable, *args, warmup: int = 3, iters: int = 20,
             min_seconds: float = 0.0, reps: int = 1) -> float:
  """Median seconds of ``fn(*args)`` (JAX), after ``warmup`` calls.

  With ``reps`` > 1, that many calls are dispatched back to back and only
  the last is waited for (the time is divided by ``reps``): this hides the
  per-call host synchronisation, as ``time_torch_cuda``'s ``reps`` does, and
  measures what a model that never syncs on the result sees.
  """
  import jax
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  samples = []
  start_all = time.perf_counter()
  while len(samples) < iters or time.perf_counter() - start_all < min_seconds:
    start = time.perf_counter()
    for _ in range(reps - 1):
      fn(*args)
    jax.block_until_ready(fn(*args))
    samples.append((time.perf_counter() - start) / reps)
  return statistics.median(samples)


def steady_slope(run: Callable[[int], float], counts: tuple[int, int],
                 iters: int = 5) -> float:
  """Seconds per unit of work in steady state.

  ``run(c)`` returns the time of ``c`` units dispatched back to back with one
  wait at the end. Every sample also pays once for the first dispatch and
  the final wait (~0.3 ms for a JAX program of 20 calls on the H100 VM);
  the slope between the two counts cancels that, leaving what each further
  unit adds, as in a model that runs many such ops. The counts alternate
  and the result is the median of the ``iters`` pairs' slopes, so a slow
  spell of the host spoils one pair, not a whole count's median.
  """
  low, high = counts
  if not 0 < low < high:
    raise ValueError(f"counts={counts}: need 0 < low < high")
  slopes = []
  for _ in range(iters):
    low_time = run(low)
    slopes.append((run(high) - low_time) / (high - low))
  return statistics.median(slopes)


def replicated_program(op: Callable, args: Sequence, copies: int):
  """(program, its inputs): one jitted program of ``copies`` calls of
  ``op``, each on its own copy of ``args``; it returns their outputs."""
  import jax
  import jax.numpy as jnp
  count = len(args)
  flat = [jnp.array(a, copy=True) for _ in range(copies) for a in args]
  program = jax.jit(lambda *f: [op(*f[i * count:(i + 1) * count])
                                for i in range(copies)])
  return program, flat


def time_replicated_jax(op: Callable, args: Sequence, copies: int,
                        iters: int = 5, warmup: int = 1,
                        host_reps: int = 3,
                        steady: tuple[int, int] | None = None
                        ) -> tuple[float, Any]:
  """(seconds per call of ``op``, first output), timed inside one program.

  One jitted program runs ``copies`` calls of ``op``, each on its own copy
  of ``args`` (no CSE, no merged dots, no L2 reuse between calls), and
  ``host_reps`` such programs are dispatched back to back per sample. This
  is how an op runs inside a jitted model: the per-call host dispatch (~50
  us on the H100 VM) is paid once per program, not per op. Every JAX
  implementation of a case is timed this way, so the ratios compare the
  device work plus XLA's launch gaps.

  ``steady=(low, high)``: instead of ``host_reps``, the slope between
  ``low`` and ``high`` programs per sample (``steady_slope``), which also
  removes the one dispatch and one wait each sample pays.
  """
  import jax
  program, flat = replicated_program(op, args, copies)
  first = jax.block_until_ready(program(*flat))[0]
  if steady is None:
    seconds = time_jax(program, *flat, warmup=warmup, iters=iters,
                       reps=host_reps)
    return seconds / copies, first
  for _ in range(warmup):
    jax.block_until_ready(program(*flat))

  def run(count):
    start = time.perf_counter()
    for _ in range(count - 1):
      program(*flat)
    jax.block_until_ready(program(*flat))
    return time.perf_counter() - start
  return steady_slope(run, steady, iters=iters) / copies, first


def device_kernel_times(fn, *args, reps=5):
  """{kernel name: [launches, us]} per call of ``fn`` on the GPU streams.

  From a JAX profiler trace of ``reps`` calls; "(device total)" sums them.
  """
  import glob
  import tempfile
  import jax
  from jax.profiler import ProfileData
  jax.block_until_ready(fn(*args))
  folder = tempfile.mkdtemp()
  with jax.profiler.trace(folder):
    for _ in range(reps):
      jax.block_until_ready(fn(*args))
  [path] = glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)
  per_kernel = {}
  for plane in ProfileData.from_file(path).planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    for line in plane.lines:
      if line.name.startswith("Stream"):
        for event in line.events:
          entry = per_kernel.setdefault(event.name[:60], [0.0, 0.0])
          entry[0] += 1 / reps
          entry[1] += event.duration_ns / 1e3 / reps
  return _with_device_total(per_kernel)


def _with_device_total(per_kernel):
  per_kernel["(device total)"] = [sum(v[0] for v in per_kernel.values()),
                                  sum(v[1] for v in per_kernel.values())]
  return per_kernel


def torch_kernel_times(fn: Callable[[], Any], reps: int = 20):
  """{kernel name: [launches, us]} per call of ``fn``: the CUDA kernels of
  ``reps`` calls in a torch profiler trace; "(device total)" sums them."""
  import torch
  from torch.profiler import ProfilerActivity, profile
  fn()
  torch.cuda.synchronize()
  with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(reps):
      fn()
    torch.cuda.synchronize()
  per_kernel = {}
  for event in prof.events():
    if event.device_type == torch.autograd.DeviceType.CUDA:
      entry = per_kernel.setdefault(event.name[:60], [0.0, 0.0])
      entry[0] += 1 / reps
      entry[1] += (event.time_range.end - event.time_range.start) / reps
  return _with_device_total(per_kernel)


def time_torch_cuda(fn: Callable[[], Any], warmup: int = 3,
                    iters: int = 20, reps: int = 1,
                    steady: tuple[int, int] | None = None) -> float:
  """Median seconds of ``fn()`` on the current CUDA stream (CUDA events).

  ``reps`` calls run between each pair of events (the time is divided by
  it), which hides launch gaps of very short kernels. ``steady=(low,
  high)``: the slope between ``low`` and ``high`` calls per pair of events
  (``steady_slope``; cancels the first launch's latency) instead.
  """
  import torch
  for _ in range(warmup):
    fn()
  torch.cuda.synchronize()

  def run(count):
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(count):
      fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3

  if steady is not None:
    return steady_slope(run, steady, iters=iters)
  return statistics.median(run(reps) / reps for _ in range(iters))


def time_host(fn: Callable[[], Any], warmup: int = 3, iters: int = 20) -> float:
  """Median wall seconds of a call that synchronises itself (e.g. .cpu())."""
  for _ in range(warmup):
    fn()
  samples = []
  for _ in range(iters):
    start = time.perf_counter()
    fn()
    samples.append(time.perf_counter() - start)
  return statistics.median(samples)


def _version(module: str) -> str | None:
  try:
    mod = __import__(module)
  except Exception:
    return None
  return getattr(mod, "__version__", "unknown")


def device_info() -> dict:
  """What ran the benchmark: device kind, host, library versions."""
  info: dict[str, Any] = {
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"),
      "host": platform.node(),
      "python": sys.version.split()[0],
  }
  for name in ("jax", "jaxlib", "torch", "triton", "torchvision", "numpy"):
    version = _version(name)
    if version:
      info[name] = version
  try:
    import jax
    dev = jax.devices()[0]
    info["jax_platform"] = dev.platform
    info["device"] = dev.device_kind
  except Exception as e:
    info["device"] = f"unknown ({e})"
  try:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
         "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
    if out.returncode == 0:
      info["nvidia_smi"] = out.stdout.strip()
  except (OSError, subprocess.SubprocessError):
    pass
  return info


def device_slug(info: dict | None = None) -> str:
  info = info or device_info()
  name = str(info.get("device", "unknown")).lower()
  for key in ("h200", "h100", "a100", "v5e", "v5 lite", "v6e", "v6 lite",
              "v5p", "v4", "cpu"):
    if key in name:
      return key.replace(" ", "")
  return "".join(c if c.isalnum() else "_" for c in name)[:24] or "unknown"


def write_results(name: str, rows: Sequence[dict], extra: dict | None = None,
                  directory: str | None = None) -> str:
  """Writes ``<name>-<device>-<date>.json`` with device facts and the rows."""
  info = device_info()
  directory = directory or os.environ.get("BENCH_RESULTS_DIR") or RESULTS_DIR
  os.makedirs(directory, exist_ok=True)
  date = info["date"][:10]
  path = os.path.join(directory, f"{name}-{device_slug(info)}-{date}.json")
  with open(path, "w") as f:
    json.dump({"benchmark": name, **info, **(extra or {}), "rows": list(rows)},
              f, indent=2, default=str)
  return path


def _fmt(value) -> str:
  if isinstance(value, float):
    if value != value:
      return "nan"
    if abs(value) >= 1000 or (value != 0 and abs(value) < 0.01):
      return f"{value:.3g}"
    return f"{value:.3f}"
  return str(value)


def print_table(rows: Iterable[dict], columns: Sequence[str] | None = None,
                file=None) -> None:
  rows = list(rows)
  if not rows:
    print("(no rows)", file=file)
    return
  columns = list(columns or rows[0].keys())
  cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
  widths = [max(len(c), *(len(row[i]) for row in cells))
            for i, c in enumerate(columns)]
  print("  ".join(c.ljust(w) for c, w in zip(columns, widths)), file=file)
  print("  ".join("-" * w for w in widths), file=file)
  for row in cells:
    print("  ".join(v.ljust(w) for v, w in zip(row, widths)), file=file)
  sys.stdout.flush()


def module_settings(module, names: Iterable[str]) -> dict:
  """{name: module.name} for the named settings, for a results file."""
  return {name: getattr(module, name) for name in names}


def ratio(baseline_s: float | None, ours_s: float | None) -> float | None:
  """How many times faster ours is than baseline (>1 means faster)."""
  if not baseline_s or not ours_s:
    return None
  return baseline_s / ours_s
