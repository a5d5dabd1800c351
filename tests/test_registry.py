"""The op registry is the one list of ops: everything that lists ops reads
it, and every cross-cutting test covers each registered kernel op (or says
why not)."""
from __future__ import annotations

import importlib
import inspect
import pathlib
import re

import pytest

import pallas_kernels as pk
from pallas_kernels import _registry, reference

TESTS = pathlib.Path(__file__).parent

# Cross-cutting test module -> registered kernel ops (or whole families) it
# leaves out, and why. Families whose ops share one kernel may be covered by
# one op each: ``FAMILY_WIDE`` lists them.
FAMILY_WIDE = {"iou", "nms"}
NOT_COVERED = {
    "test_vmap": {
        "write_kv_pages": "a cache update: no mapped serving step writes "
                          "into one shared pool",
    },
    "test_empty_inputs": {
        "quantize": "quantize_int8 runs its kernel",
    },
    "test_kernel_costs_aot": None,  # the module's COVERED_ELSEWHERE
    "sharding_cases": {
        "quantize": "symmetric int8 runs quantize_int8's kernel (its case)",
        "ragged_paged_attention": "tests/test_ragged_paged_attention.py "
                                  "shards it over heads and sequences",
        "mla_ragged_paged_attention": "tests/test_mla_ragged_paged_attention"
                                      ".py shards it over heads and "
                                      "sequences",
        "write_kv_pages": "a cache update aliased in place: sharded with "
                          "the attention step that follows it",
    },
    "test_backends_agree": {
        "iou": "test_iou_family draws every kind and form by name",
        "grouped_matmul": "tests/test_grouped_matmul.py's shared suite runs "
                          "every backend against one float64 oracle",
        "ragged_paged_attention": "tests/test_ragged_paged_attention.py's "
                                  "shared suite, likewise",
        "mla_ragged_paged_attention": "tests/test_mla_ragged_paged_attention"
                                      ".py's shared suite, likewise",
        "write_kv_pages": "tests/test_write_kv_pages.py, likewise",
        "quantize_int8": "int8_matmul's dynamic mode runs its kernel",
    },
}


def _called_ops(module_name: str) -> set[str]:
  """Registered ops the module calls (``pk.<op>``), or names as a case
  (a key of its ``OPS``, or a ``Case("<op>...")``)."""
  source = (TESTS / f"{module_name}.py").read_text()
  names = set(re.findall(r"\b(?:pk|nn|reference)\.(\w+)", source))
  cases = re.findall(r"^    \"(\w+)\": \(|Case\(\"(\w+)\"", source, re.M)
  registered = {op.name for op in _registry.OPS}
  for key in (a or b for a, b in cases):  # int8_matmul_raw: int8_matmul
    prefixes = [op for op in registered if key == op
                or key.startswith(op + "_")]
    names |= {max(prefixes, key=len)} if prefixes else set()
  return names & registered


@pytest.mark.parametrize("module_name", sorted(NOT_COVERED))
def test_cross_cutting_tests_cover_every_kernel_op(module_name):
  exempt = NOT_COVERED[module_name]
  if exempt is None:
    exempt = importlib.import_module(module_name).COVERED_ELSEWHERE
  called = _called_ops(module_name)
  missing = []
  for family in _registry.FAMILIES:
    ops = [op.name for op in family.ops if op.kind == "kernel"]
    if family.name in exempt or (family.name in FAMILY_WIDE
                                 and called & set(ops)):
      continue
    missing += [op for op in ops if op not in called and op not in exempt]
  assert not missing, (
      f"tests/{module_name}.py has no case for {missing}: add one, or say "
      "why not in tests/test_registry.py")
  stale = sorted(name for name in exempt if name in called)
  assert not stale, f"{module_name} covers {stale}: drop the exemption"


def test_exports_are_the_registry():
  kernels = {op.name for op in _registry.OPS if op.kind == "kernel"}
  assert set(dir(reference)) == kernels
  exported = {n for n in dir(pk) if inspect.isfunction(getattr(pk, n))}
  assert exported == {op.name for op in _registry.OPS
                      if op.kind != "layer"} | {"force_interpret"}
  from pallas_kernels import nn
  for op in _registry.OPS:
    module = nn if op.kind == "layer" else pk
    assert "backend" in inspect.signature(getattr(module, op.name)).parameters \
        or op.kind == "helper", op.name


def test_every_family_has_cases_and_support_rows():
  for family in _registry.FAMILIES:
    cases = importlib.import_module(family.module("cases"))
    assert cases.support_cases(), family.name
    main_job = {c.op for c in cases.main_job_cases("small")}
    assert main_job == {op.name for op in family.ops if op.main_job}, (
        family.name)


def test_benches_exist():
  for bench in _registry.benches():
    assert (TESTS.parent / "bench" / f"{bench}.py").is_file(), bench
