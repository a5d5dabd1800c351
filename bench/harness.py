"""The benches' one harness: timing, results files, tables, plots.

``python -m bench.<op> [--quick] [--cases REGEX] [--tag TAG] [--out DIR]
[--roofline]`` times each case of the op's list (``--cases``: those whose
label matches REGEX, e.g. ``"^(1|8)x.*weight_only"``; ``--roofline``:
none, only the TPU estimates) and writes ``<op>[-TAG]-<device>-<date>.json`` (date, device,
versions, rows, TPU roofline estimates) after every case, so a run cut
short keeps what it timed, and a PNG beside it when matplotlib imports.

Rows are ``dict(case=..., impl=..., ms=...)`` plus fields. Each impl whose
name starts with "ours" gets ``vs_<peer> = peer ms / its ms`` for every
other impl of its case (above 1: ours is faster).

Timing: ``Timer`` (its docstring is copied into every results file).
``--quick`` runs the tiny cases on the CPU, kernels in the Pallas
interpreter, one sample each: a smoke test, not a speed figure.
JAX takes most GPU memory at start; torch peers get the rest unless
``XLA_PYTHON_CLIENT_PREALLOCATE=false`` is set.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Sequence

from bench import roofline

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def steady_slope(run: Callable[[int], float], counts: tuple[int, int],
                 iters: int) -> float:
  """Median over ``iters`` alternating pairs of (run(high) - run(low)) /
  (high - low): seconds per unit once what each sample pays once cancels."""
  low, high = counts
  if not 0 < low < high:
    raise ValueError(f"counts={counts}: need 0 < low < high")
  slopes = []
  for _ in range(iters):
    low_time = run(low)
    slopes.append((run(high) - low_time) / (high - low))
  return statistics.median(slopes)


@functools.lru_cache(maxsize=None)
def _program(op: Callable, count: int, copies: int):
  import jax
  return jax.jit(lambda *f: [op(*f[i * count:(i + 1) * count])
                             for i in range(copies)])


def replicated_program(op: Callable, args: Sequence, copies: int):
  """(program, inputs): one jitted program of ``copies`` calls of ``op``,
  each on its own device copy of ``args``; it returns their outputs as a
  list. The same op and counts give the same program (compiled once)."""
  import jax.numpy as jnp
  flat = [jnp.array(a, copy=True) for _ in range(copies) for a in args]
  return _program(op, len(args), copies), flat


def torch_module():
  """torch, or None where it is not installed (a bare "torch" namespace
  package, such as the tests' torch folder seen from the root, is not
  torch)."""
  try:
    import torch
  except ImportError:
    return None
  return torch if hasattr(torch, "cuda") else None


def wait(out: Any) -> Any:
  """Blocks until ``out`` (JAX arrays, torch tensors) is computed."""
  import jax
  jax.block_until_ready(out)
  torch = sys.modules.get("torch")  # loaded by whoever made torch tensors
  if any(type(leaf).__module__.startswith("torch")
         for leaf in jax.tree.leaves(out)) and torch.cuda.is_available():
    torch.cuda.synchronize()
  return out


@dataclasses.dataclass(frozen=True)
class Timer:
  """Seconds per call of an op.

  jax     JAX ops, ours and JAX peers alike, as in a jitted model: one
          jitted program of ``copies`` calls, each on its own copy of the
          inputs (no CSE, no merged ops, no L2 reuse between calls). Per
          call: the slope between 2 and 8 such programs dispatched back to
          back, which cancels the one dispatch and final wait that every
          sample pays; the median over alternating pairs, so a slow spell
          of the host spoils one pair, not the result. Pairs: ``iters``,
          or more (up to ``max_iters``) while they fit in ``budget_s``,
          since host noise weighs most on the shortest ops.
  torch   CUDA events around ``reps`` and ``4 reps`` back-to-back launches,
          the same slope; tensors on the CPU: host wall time.
  synced  host wall time of one call waited for (torchvision's NMS, which
          syncs itself; the torch bridge); ``jax_synced`` for a JAX op.
  back_to_back  host wall time per call of calls launched back to back
          and waited for once (eager host overhead; the torch bridge).
  ``quick``: one sample of one call each.
  """
  quick: bool = False
  iters: int = 7
  max_iters: int = 31
  budget_s: float = 0.3
  programs: tuple[int, int] = (2, 8)

  def _pairs(self, iters: int | None, pair_seconds: float) -> int:
    if iters:
      return iters
    return max(self.iters, min(self.max_iters,
                               int(self.budget_s / max(pair_seconds, 1e-9))))

  def jax(self, op: Callable, *args, copies: int = 1,
          iters: int | None = None) -> tuple[float, Any]:
    """(seconds per call of ``op(*args)``, the first copy's output)."""
    copies = 1 if self.quick else copies
    program, flat = replicated_program(op, args, copies)
    first = wait(program(*flat))[0]

    def run(count):
      start = time.perf_counter()
      for _ in range(count - 1):
        program(*flat)
      wait(program(*flat))
      return time.perf_counter() - start

    if self.quick:
      return run(1) / copies, first
    pairs = self._pairs(iters, sum(self.programs) * run(1))
    return steady_slope(run, self.programs, pairs) / copies, first

  def jax_synced(self, op: Callable, *args, iters: int | None = None):
    """Host seconds of one call of ``op(*args)`` dispatched and waited for
    (``jax``'s program with one copy: no second compile)."""
    program, flat = replicated_program(op, args, 1)
    return self.synced(lambda: program(*flat), iters)

  def torch(self, fn: Callable[[], Any], reps: int = 1,
            iters: int | None = None) -> float:
    """Seconds per call of ``fn()`` launching torch work."""
    import torch
    if not torch.cuda.is_available():
      return self.synced(fn, iters)
    for _ in range(1 if self.quick else 3):
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

    if self.quick:
      return run(reps) / reps
    pairs = self._pairs(iters, 5 * run(reps))
    return steady_slope(run, (reps, 4 * reps), pairs)

  def back_to_back(self, fn: Callable[[], Any], reps: int = 25,
                   iters: int | None = None) -> float:
    """Host seconds per call of ``fn()`` called back to back and waited for
    once: the per-call cost a loop of eager calls pays where the host's
    work exceeds the device's (slope between ``reps`` and ``4 reps``)."""
    for _ in range(1 if self.quick else 2):
      wait(fn())

    def run(count):
      start = time.perf_counter()
      for _ in range(count - 1):
        fn()
      wait(fn())
      return time.perf_counter() - start

    if self.quick:
      return run(reps) / reps
    pairs = self._pairs(iters, 5 * run(reps))
    return steady_slope(run, (reps, 4 * reps), pairs)

  def synced(self, fn: Callable[[], Any], iters: int | None = None) -> float:
    """Median host seconds of ``fn()`` with its result waited for."""
    for _ in range(1 if self.quick else 2):
      wait(fn())
    samples = []
    for _ in range(1 if self.quick else iters or 3 * self.iters):
      start = time.perf_counter()
      wait(fn())
      samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure(rows: list, case: str, impl: str, timed: Callable[[], float],
            flops: float | None = None, **fields) -> dict:
  """Appends the row of one implementation of ``case``.

  ``timed()`` returns seconds per call; an exception becomes the row's
  ``error`` (one failing peer hides nothing else). With ``flops``, the row
  also gets TFLOP/s.
  """
  row = dict(case=case, impl=impl, ms=None, **fields)
  try:
    seconds = timed()
    row["ms"] = seconds * 1e3
    if flops:
      row["tflops"] = flops / seconds / 1e12
  except Exception as e:  # noqa: BLE001  (recorded in the results file)
    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    traceback.print_exc(limit=2)
  rows.append(row)
  print({k: (round(v, 4) if isinstance(v, float) else v)
         for k, v in row.items()}, flush=True)
  return row


def rel_error(got, want) -> float:
  """max |got - want| / max |want|, in float64 (inf if got is not finite)."""
  import numpy as np
  got = np.asarray(got, np.float64)
  want = np.asarray(want, np.float64)
  if not np.isfinite(got).all():
    return float("inf")
  return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def add_ratios(rows: list) -> None:
  """``vs_<peer>`` on every "ours" row: peer ms / ours ms in its case."""
  for row in rows:
    if not row["impl"].startswith("ours") or not row.get("ms"):
      continue
    for peer in rows:
      if (peer["case"] == row["case"] and peer.get("ms")
          and not peer["impl"].startswith("ours")):
        row[f"vs_{peer['impl']}"] = peer["ms"] / row["ms"]


def device_info() -> dict:
  """Date, host, device and library versions of this run."""
  info: dict[str, Any] = dict(
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"),
      host=platform.node(), python=sys.version.split()[0])
  for name in ("jax", "jaxlib", "torch", "torchvision", "triton", "numpy"):
    try:
      info[name] = __import__(name).__version__
    except Exception:  # noqa: BLE001  (not installed: not recorded)
      pass
  import jax
  device = jax.devices()[0]
  info.update(platform=device.platform, device=device.device_kind)
  try:
    import pallas_kernels
    info["pallas_kernels"] = os.path.dirname(pallas_kernels.__file__)
  except ImportError:
    pass
  return info


def device_slug(device: str) -> str:
  name = device.lower()
  for key in ("h200", "h100", "a100", "v5 lite", "v5e", "v5p", "v6 lite",
              "v6e", "7x", "v4", "cpu"):
    if key in name:
      return {"v5 lite": "v5e", "v6 lite": "v6e", "7x": "tpu7x"}.get(key, key)
  return "".join(c if c.isalnum() else "_" for c in name)[:24] or "unknown"


def write_results(path: str, rows: list, extra: dict) -> str:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    json.dump({**extra, "rows": rows}, f, indent=1, default=str)
  return path


def _fmt(value) -> str:
  if isinstance(value, float):
    if value != value:
      return "nan"
    if abs(value) >= 1000 or (value != 0 and abs(value) < 0.01):
      return f"{value:.3g}"
    return f"{value:.3f}"
  return "" if value is None else str(value)


def print_table(rows: Sequence[dict], columns: Sequence[str] | None = None):
  rows = list(rows)
  if not rows:
    print("(no rows)")
    return
  columns = list(columns or dict.fromkeys(k for r in rows for k in r))
  cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
  widths = [max(len(c), *(len(row[i]) for row in cells))
            for i, c in enumerate(columns)]
  print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
  print("  ".join("-" * w for w in widths))
  for row in cells:
    print("  ".join(v.ljust(w) for v, w in zip(row, widths)))
  sys.stdout.flush()


def plot(png: str, rows: Sequence[dict], tpu: Sequence[dict]) -> str | None:
  """Bars of ours vs each peer per case (log scale) and the TPU rows'
  positions on their chips' rooflines; None without matplotlib."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except Exception:  # noqa: BLE001
    return None
  bars = [(f"{r['case']} [{r['impl']}]",
           {k[3:]: v for k, v in r.items() if k.startswith("vs_")})
          for r in rows if r["impl"].startswith("ours")]
  bars = [b for b in bars if b[1]]
  points = [r for r in tpu if r.get("flops")]
  panels = [p for p in (bars, points) if p]
  if not panels:
    return None
  fig, axes = plt.subplots(len(panels), 1, squeeze=False,
                           figsize=(max(8, 0.7 * len(bars)), 5 * len(panels)))
  axes = list(axes[:, 0])
  if bars:
    ax = axes.pop(0)
    peers = sorted({p for _, vs in bars for p in vs})
    width = 0.8 / len(peers)
    for j, peer in enumerate(peers):
      at = [(i, vs[peer]) for i, (_, vs) in enumerate(bars) if peer in vs]
      ax.bar([i + j * width for i, _ in at], [v for _, v in at], width,
             label=peer)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_ylabel("peer time / our time (> 1: ours faster)")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(bars))])
    ax.set_xticklabels([label for label, _ in bars], rotation=60, ha="right",
                       fontsize=7)
    ax.legend(fontsize=7)
  if points:
    ax = axes.pop(0)
    grid = [2.0 ** e for e in range(-2, 15)]
    colors = {}
    for chip, dtype in sorted({(p["chip"], p["dtype"]) for p in points}):
      spec = roofline.SPECS[chip]
      [line] = ax.plot(grid, [min(spec[dtype], x * spec["hbm"]) / 1e12
                              for x in grid], linewidth=0.8,
                       label=f"{chip} {dtype}")
      colors[chip, dtype] = line.get_color()
    for p in points:  # where each case sits; the JSON names them
      ax.scatter(p["intensity"], p["flops"] / p["time_ms"] / 1e9, s=10,
                 color=colors[p["chip"], p["dtype"]])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("FLOP per HBM byte")
    ax.set_ylabel("TFLOP/s at the roofline (estimate)")
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(png, dpi=110)
  plt.close(fig)
  return png


def main(op: str, cases: Sequence, quick_cases: Sequence,
         run_case: Callable[[Any, Timer], list], *, label: Callable = str,
         tpu_rows: Callable[[Sequence], list] | None = None,
         columns: Sequence[str] | None = None, argv=None, doc: str = "") -> str:
  """Runs ``run_case(case, timer) -> rows`` over the cases; returns the
  results file's path (the command line is the module docstring's)."""
  parser = argparse.ArgumentParser(
      description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true",
                      help="tiny cases on the CPU, interpreted kernels")
  parser.add_argument("--cases", default="",
                      help="only cases whose label matches this regular "
                           "expression (plain text: contains it)")
  parser.add_argument("--tag", default="", help="added to the file name")
  parser.add_argument("--out", default=None, help="results directory")
  parser.add_argument("--roofline", action="store_true",
                      help="only the cases' TPU roofline estimates, no timing")
  args = parser.parse_args(argv)
  if args.roofline:
    args.tag = args.tag or "roofline"
  import jax
  if args.quick and jax.config.jax_platforms != "cpu":
    jax.config.update("jax_platforms", "cpu")
  import pallas_kernels as pk

  chosen = [c for c in (quick_cases if args.quick else cases)
            if re.search(args.cases, label(c))]
  info = device_info()
  name = "-".join(p for p in (op, args.tag, device_slug(info["device"]),
                              info["date"][:10]) if p)
  out = args.out or (os.path.join(tempfile.gettempdir(), "bench")
                     if args.quick else RESULTS_DIR)
  path = os.path.join(out, name + ".json")
  extra = dict(benchmark=op, **info, quick=args.quick,
               command=" ".join(sys.argv),
               timing=Timer.__doc__)
  try:
    extra["tpu_roofline"] = tpu_rows(chosen) if tpu_rows else []
  except Exception as e:  # noqa: BLE001  (estimates only: the timing goes on)
    extra["tpu_roofline"] = []
    extra["tpu_roofline_error"] = f"{type(e).__name__}: {str(e)[:300]}"
  if extra["tpu_roofline"]:
    print("TPU roofline estimates (no TPU measured):")
    print_table(extra["tpu_roofline"])
  rows: list[dict] = []
  interpret = pk.force_interpret("generic") if args.quick else (
      contextlib.nullcontext())
  with interpret:
    for case in [] if args.roofline else chosen:
      start = time.perf_counter()
      try:
        rows += run_case(case, Timer(quick=args.quick))
      except Exception as e:  # noqa: BLE001  (the other cases still run)
        traceback.print_exc()
        rows.append(dict(case=label(case), impl="ours", ms=None,
                         error=f"{type(e).__name__}: {str(e)[:300]}"))
      add_ratios(rows)
      write_results(path, rows, extra)
      print(f"{label(case)}: {time.perf_counter() - start:.1f} s", flush=True)
  print_table(rows, columns)
  print("wrote", write_results(path, rows, extra))
  png = plot(path[:-len(".json")] + ".png", rows, extra["tpu_roofline"])
  if png:
    print("wrote", png)
  return path
