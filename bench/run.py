"""Runs the benches, each in its own process (its own GPU memory).

    python -m bench.run [OP ...] [-- ARGS]

OP: attention, attention_masks, decode_attention, ragged_paged_attention,
int8_matmul, quantized_matmul, giou, nms, torch_bridge (default: all). ARGS go to every
bench, e.g. ``-- --quick`` or ``-- --tag before``. The exit status is 1 if
any bench failed to finish.
"""
from __future__ import annotations

import subprocess
import sys

OPS = ("attention", "attention_masks", "decode_attention",
       "ragged_paged_attention", "int8_matmul",
       "quantized_matmul", "grouped_matmul", "giou", "nms", "torch_bridge")


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  ops, args = argv, []
  if "--" in argv:
    ops, args = argv[:argv.index("--")], argv[argv.index("--") + 1:]
  if ops in (["-h"], ["--help"]):
    print(__doc__)
    return 0
  unknown = sorted(set(ops) - set(OPS))
  if unknown:
    print(f"unknown bench(es) {unknown}; known: {', '.join(OPS)}")
    return 2
  failed = [op for op in ops or OPS
            if subprocess.call([sys.executable, "-m", f"bench.{op}", *args])]
  if failed:
    print("failed:", " ".join(failed))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
