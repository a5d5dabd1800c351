"""Main job: run every kernel on this machine, check it, time it.

    python -m pallas_kernels [--size small|medium|large] [--ops NAME ...]
                             [--backend BACKEND] [--json FILE]
"""
from __future__ import annotations

import functools
import json
import sys

from pallas_kernels import _quiet

_quiet.select_cpu_when_no_accelerator()

import jax  # noqa: E402

from pallas_kernels import _backend, _cases, _cli, _timing  # noqa: E402


def _row(case, backend, iters):
  kernel = jax.jit(functools.partial(case.fn, backend=backend))
  reference = jax.jit(functools.partial(case.fn, backend="reference"))
  try:
    out = jax.block_until_ready(kernel(*case.args))
    ref = jax.block_until_ready(reference(*case.args))
    error = case.error(out, ref)
    t_kernel = _timing.time_call(lambda: kernel(*case.args), warmup=0,
                                 iters=iters)["median_s"]
    t_ref = _timing.time_call(lambda: reference(*case.args), warmup=0,
                              iters=iters)["median_s"]
    status = "ok" if error <= case.tolerance else "MISMATCH"
  except Exception as e:  # a failing case must not hide the others
    return dict(op=case.op, shape=case.shape, status="ERROR",
                error_message=f"{type(e).__name__}: {str(e)[:300]}")
  return dict(op=case.op, shape=case.shape, status=status, max_error=error,
              tolerance=case.tolerance, kernel_ms=t_kernel * 1e3,
              reference_ms=t_ref * 1e3, speedup=t_ref / t_kernel)


def main(argv=None) -> int:
  args = _cli.parse(argv)
  platform = jax.default_backend()
  shown_backend = args.backend or _backend.resolve_for_platform(platform)
  print(f"jax {jax.__version__} on {platform} ({jax.devices()[0].device_kind}); "
        f"kernels run as: {shown_backend}")
  cases = _cases.load_cases(args.size, args.families)
  if args.ops:
    cases = [c for c in cases if c.op in args.ops]
  header = (f"{'op':<22} {'shape':<48} {'backend':<11} {'max error':>10} "
            f"{'tol':>8} {'kernel ms':>10} {'ref ms':>9} {'speed-up':>8}  status")
  print(header)
  print("-" * len(header))
  rows = []
  for case in cases:
    row = _row(case, args.backend, args.iters)
    row["backend"] = shown_backend
    rows.append(row)
    if row["status"] == "ERROR":
      print(f"{case.op:<22} {case.shape:<48} {shown_backend:<11} "
            f"ERROR {row['error_message']}")
    else:
      print(f"{case.op:<22} {case.shape:<48} {shown_backend:<11} "
            f"{row['max_error']:>10.2e} {row['tolerance']:>8.1e} "
            f"{row['kernel_ms']:>10.2f} {row['reference_ms']:>9.2f} "
            f"{row['speedup']:>7.2f}x  {row['status']}", flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(jax_version=jax.__version__, platform=platform,
                     rows=rows), f, indent=2)
  bad = [r for r in rows if r["status"] != "ok"]
  print(f"\n{len(rows) - len(bad)} of {len(rows)} cases match their reference.")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
