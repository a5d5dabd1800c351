"""Writes the guide's backend-support tables from the kernels' own rules.

    python docs/support_table.py          # rewrite docs/backends.md's tables
    python docs/support_table.py --check  # exit 1 if the page is stale

The rows are each registered family's ``cases.support_cases()``. Each cell
asks the op itself: the call is traced (``jax.eval_shape``, no compilation)
with ``backend=`` naming one kernel, for a Hopper GPU target and the default
TPU generation, so the answer is the kernel row's ``supports`` and
``hardware`` rules. A refusal shows the kernel's reason.
"""
from __future__ import annotations

import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import importlib  # noqa: E402

from pallas_kernels import _backend, _registry  # noqa: E402

PAGE = pathlib.Path(__file__).with_name("backends.md")
BEGIN, END = "<!-- support-table:begin -->", "<!-- support-table:end -->"
COLUMNS = ("mosaic_tpu", "triton", "mosaic_gpu", "reference")


def _cell(run, backend):
  try:
    run(backend)
  except ValueError as error:
    message = " ".join(str(error).split())
    if "kernel exists for this op" in message:
      return "–"
    if "cannot run this call: " in message:
      message = message.split("cannot run this call: ", 1)[1]
    elif "has no GPU kernel for this call (" in message:
      message = message.split("for this call (", 1)[1][:-1]
    return "no: " + message.replace("|", "/")
  return "yes"


def tables() -> str:
  out = []
  with _backend.target_override(gpu_capability="9.0"):
    for family in _registry.FAMILIES:
      cases = importlib.import_module(family.module("cases")).support_cases
      out.append(f"### {family.title}\n")
      out.append("| call | " + " | ".join(f"`{c}`" for c in COLUMNS) + " |")
      out.append("| --- |" + " --- |" * len(COLUMNS))
      for name, run in cases():
        cells = [_cell(run, c) for c in COLUMNS]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
      out.append("")
  return "\n".join(out).rstrip() + "\n"


def render(page: str) -> str:
  start, end = page.index(BEGIN) + len(BEGIN), page.index(END)
  return page[:start] + "\n" + tables() + page[end:]


def main(argv) -> int:
  page = PAGE.read_text()
  new = render(page)
  if "--check" in argv:
    if new != page:
      print(f"{PAGE} is stale: run python docs/support_table.py")
      return 1
    return 0
  PAGE.write_text(new)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
