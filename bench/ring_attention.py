"""Ring attention (context parallelism) on several GPUs of one host.

    python -m bench.ring_attention [--quick] [--cases N4] [--tag T] [--out DIR]

ours_ring: ``pk.shard_flash_attention(mesh, ..., sequence_axis="seq")`` on
q/k/v split along their length over the first N devices (N = 2, 4, 8 up to
the device count; contiguous layout, so causal cases include the moves to
zig-zag order and back). Peers in the same run: ``head_parallel``, the
same op split over heads instead (``head_axis="seq"``: no communication, the
ceiling for N devices), and ``one_device``, ``pk.flash_attention`` on the
whole problem on device 0 (timed once per case, listed under every N).
``speedup`` = one_device ms / ours ms; ``efficiency`` = speedup / N. ``err``
is ours against one_device (output, or dq), relative to its largest
magnitude. Cases: B1 H16 D128 bf16, L 32k and 128k, causal or not, fwd and
fwd+bwd (the VJP for q, k, v). Timing: ``Timer.jax``, one call per program
(three pairs at 128k); every device's work is waited for. ``--quick``: CPU
with 4 host devices, kernels interpreted.
"""
from __future__ import annotations

import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import pallas_kernels as pk
from bench import harness

CASES = [dict(batch=1, heads=16, seq=s, head_dim=128, causal=c,
              dtype="bfloat16") for s in (32768, 131072) for c in (True, False)]
QUICK = [dict(batch=1, heads=4, seq=128, head_dim=64, causal=True,
              dtype="float32")]
MODES = ("fwd", "fwd+bwd")
LONG = 65536   # from this length on, three timing pairs


def label(case):
  return (f"B{case['batch']} H{case['heads']} L{case['seq']} "
          f"D{case['head_dim']}" + (" causal" if case["causal"] else ""))


def device_counts():
  """2, 4, 8, ... up to the number of devices (empty on one device)."""
  counts, n = [], 2
  while n <= jax.device_count():
    counts.append(n)
    n *= 2
  return counts


def _with_vjp(fn, mode):
  if mode == "fwd":
    return fn
  return lambda q, k, v, do: jax.vjp(fn, q, k, v)[1](do)


def _sharded(arrays, mesh, spec):
  return [jax.device_put(x, NamedSharding(mesh, spec)) for x in arrays]


def run(case, timer):
  if case["seq"] >= LONG:
    timer = dataclasses.replace(timer, iters=3, max_iters=3)
  shape = (case["batch"], case["heads"], case["seq"], case["head_dim"])
  keys = jax.random.split(jax.random.key(0), 4)
  arrays = [jax.random.normal(key, shape, case["dtype"]) for key in keys]
  causal = case["causal"]
  rows = []
  for mode in MODES:
    args = arrays[:3 if mode == "fwd" else 4]
    single = jax.device_put(args, jax.devices()[0])
    reference = {}

    def one_device():
      seconds, out = timer.jax(_with_vjp(
          functools.partial(pk.flash_attention, causal=causal), mode), *single)
      reference["out"] = out if mode == "fwd" else out[0]
      return seconds
    single_rows: list = []
    harness.measure(single_rows, "", "one_device", one_device)
    for n in device_counts():
      name = f"{label(case)} {mode} N{n}"
      mesh = jax.make_mesh((n,), ("seq",), devices=jax.devices()[:n])
      ring = functools.partial(pk.shard_flash_attention, mesh,
                               batch_axis=None, head_axis=None,
                               sequence_axis="seq", causal=causal)
      heads = functools.partial(pk.shard_flash_attention, mesh,
                                batch_axis=None, head_axis="seq",
                                causal=causal)
      outs = {}

      def timed(fn, spec, impl):
        seconds, out = timer.jax(_with_vjp(fn, mode),
                                 *_sharded(args, mesh, spec))
        outs[impl] = out if mode == "fwd" else out[0]
        return seconds
      ours = harness.measure(
          rows, name, "ours_ring",
          lambda: timed(ring, P(None, None, "seq", None), "ours"), devices=n)
      harness.measure(rows, name, "head_parallel",
                      lambda: timed(heads, P(None, "seq", None, None), "heads"),
                      devices=n)
      rows.append(dict(single_rows[0], case=name, devices=1))
      if ours.get("ms") and single_rows[0].get("ms"):
        ours["speedup"] = single_rows[0]["ms"] / ours["ms"]
        ours["efficiency"] = ours["speedup"] / n
      if "out" in reference and "ours" in outs:
        ours["err"] = harness.rel_error(outs["ours"], reference["out"])
  return rows


def main(argv=None):
  if "--quick" in (sys.argv if argv is None else argv):
    try:   # four host devices, if the CPU backend is not up yet
      jax.config.update("jax_num_cpu_devices", 4)
    except RuntimeError:
      pass
  return harness.main("ring_attention", CASES, QUICK, run, label=label,
                      argv=argv, doc=__doc__,
                      columns=["case", "impl", "devices", "ms", "speedup",
                               "efficiency", "err", "vs_head_parallel",
                               "vs_one_device", "error"])


if __name__ == "__main__":
  main()
