"""The main job's command line, checked with the standard library alone
(``scripts/main.sh`` runs it before any environment exists):
``python3 pallas_kernels/_cli.py --check [ARGS ...]`` exits 0, or 2 and why.
"""
from __future__ import annotations

import argparse
import sys

if __package__:
  from pallas_kernels import _registry
else:  # run as a script (scripts/main.sh), before any environment exists
  import _registry

FAMILIES = _registry.FAMILY_NAMES
SIZES = ("small", "medium", "large")
BACKENDS = ("mosaic_tpu", "triton", "mosaic_gpu", "gpu", "interpret")
# Every op the main job has cases for (tests/test_main_job.py keeps this
# equal to the families' cases).
OPS = _registry.main_job_ops()


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="bash scripts/main.sh",
      description=(
          "Runs every kernel on this machine's default JAX backend (a CPU "
          "runs the TPU kernels in Pallas interpret mode), checks each against "
          "its pure-JAX reference and times both. Prints one row per case: "
          "op, shape, backend, max error vs reference, tolerance, times and "
          "speed-up over the reference. The first run installs its Python "
          "environment under .venvs/ (about 1.4 GB, a few minutes)."))
  p.add_argument("--size", choices=SIZES, default="small",
                 help="problem sizes to run (default: small, fits a laptop "
                      "in interpret mode)")
  p.add_argument("--ops", nargs="*", default=None, metavar="OP",
                 help="only these ops, of: " + ", ".join(OPS))
  p.add_argument("--families", nargs="*", default=list(FAMILIES),
                 choices=list(FAMILIES), help="kernel families to run")
  p.add_argument("--backend", default=None, choices=list(BACKENDS),
                 help="force a backend instead of the platform's default")
  p.add_argument("--iters", type=int, default=5,
                 help="timed runs per case (median reported)")
  p.add_argument("--json", default=None,
                 help="also write the rows to this JSON file")
  return p


def parse(argv=None) -> argparse.Namespace:
  """The parsed arguments; exits with status 2 and the reason when bad."""
  p = parser()
  args = p.parse_args(argv)
  unknown = sorted(set(args.ops or ()) - set(OPS))
  if unknown:
    p.error(f"--ops: unknown op(s) {', '.join(unknown)}; the ops are: "
            + ", ".join(OPS))
  return args


if __name__ == "__main__":
  argv = sys.argv[1:]
  if argv[:1] == ["--check"]:
    argv = argv[1:]
  parse(argv)
