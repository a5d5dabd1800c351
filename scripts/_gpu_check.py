"""The loop of the compiled-GPU check scripts: run each named check, print
its status and time, return the exit status."""
from __future__ import annotations

import sys
import time


def run(checks) -> int:
  """``checks``: (name, callable raising on a mismatch) pairs; the command
  line's arguments select names by substring (default: all); ``--list``
  prints the selected names without running them."""
  only = [a for a in sys.argv[1:] if a != "--list"]
  checks = [c for c in checks if not only or any(o in c[0] for o in only)]
  if "--list" in sys.argv[1:]:
    print("\n".join(name for name, _ in checks))
    return 0
  failed = 0
  for name, check in checks:
    start = time.perf_counter()
    try:
      check()
      status = "ok"
    except Exception as e:  # noqa: BLE001
      failed += 1
      status = f"FAIL {type(e).__name__}: {str(e)[:400]}"
    print(f"{name}: {status} ({time.perf_counter() - start:.1f} s)",
          flush=True)
  print(f"{len(checks) - failed}/{len(checks)} passed")
  return 1 if failed else 0
