"""Runs one or all benchmarks: ``python bench/run.py [NAME ...] [-- ARGS]``.

NAME is a bench script's suffix (``attention`` runs ``bench_attention.py``);
arguments after ``--`` go to every script (e.g. ``-- --quick``).
"""
from __future__ import annotations

import glob
import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def available() -> list[str]:
  return sorted(os.path.basename(p)[len("bench_"):-3]
                for p in glob.glob(os.path.join(HERE, "bench_*.py")))


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  passthrough = []
  if "--" in argv:
    i = argv.index("--")
    argv, passthrough = argv[:i], argv[i + 1:]
  if argv in (["-h"], ["--help"]):
    print(__doc__)
    print("available:", " ".join(available()))
    return 0
  names = argv or available()
  unknown = set(names) - set(available())
  if unknown:
    print(f"unknown benchmark(s) {sorted(unknown)}; available: {available()}")
    return 2
  sys.path.insert(0, os.path.dirname(HERE))
  failed = []
  for name in names:
    print(f"=== bench_{name} ===", flush=True)
    spec = importlib.util.spec_from_file_location(
        f"bench_{name}", os.path.join(HERE, f"bench_{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
      result = module.main(passthrough)
      # main() returns an exit code, or its rows (success).
      code = result if isinstance(result, int) else 0
    except Exception as e:  # keep going: one broken bench hides no others
      print(f"bench_{name} failed: {type(e).__name__}: {e}")
      code = 1
    if code:
      failed.append(name)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
