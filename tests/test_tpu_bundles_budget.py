"""Bundle budgets of TPU kernels, from the compiler's final bundle listings.

The parser test reads a committed listing (tests/data/tpu_bundles_tiny_v5e.txt:
a (8, 128) f32 ``x + 1`` kernel on a grid of 4 whose step 0 also runs a
``pl.when`` body with one ``exp``; libtpu 0.0.50.1, v5e). The budget test
compiles the ``bench.tpu.BUDGET_CASES`` (one subprocess each: libtpu reads
its dump flags once per process) and fails when a kernel's bundles per
steady grid step exceed ``tests/tpu_bundles_budget.json`` by more than its
slack. After an intended change: ``python -m bench.tpu --write-budget``.
"""
from __future__ import annotations

import importlib.metadata
import json
import pathlib

import pytest

from bench import tpu, tpu_bundles

HERE = pathlib.Path(__file__).resolve().parent


def test_walk_of_a_committed_listing():
  path = tpu_bundles.bundle_path(
      (HERE / "data" / "tpu_bundles_tiny_v5e.txt").read_text())
  assert path.grid == (4,)
  assert path.static == 80
  assert path.unresolved_branches == 0
  # 4 grid steps + 2 pipeline ramp trips; the pl.when body runs in the
  # trip of step 0 only (8 bundles more than the steady trips).
  assert path.iterations == [44, 71, 63, 63, 63, 44]
  assert (path.prologue, path.epilogue) == (5, 4)
  assert path.total == 5 + sum(path.iterations) + 4 == 357
  assert path.steady == 63
  assert path.mix["eup"] == 1                  # the exp, once
  assert path.mix["dma"] == 8                  # 4 blocks in, 4 out
  assert path.mix["dma_bytes"] == 8 * 8 * 128 * 4


def test_smem_words_pack_narrow_types_and_follow_tiling():
  assert tpu_bundles._words([1, 2, 3, 4, 5], 8) == [0x04030201, 5]
  assert tpu_bundles._words([-1], 16) == [0xFFFF]
  tiled = tpu_bundles._tiled(list(range(6)), "s32[2,3]{1,0:T(8,128)}")
  assert len(tiled) == 8 * 128
  assert tiled[:3] == [0, 1, 2] and tiled[128:131] == [3, 4, 5]


def test_hlo_operand_values_follow_unfused_clips_of_parameters():
  # ragged_paged_attention's jnp.clip of [1] lengths stays unfused:
  # minimum(constant, maximum(constant, parameter)).
  hlo = """
ENTRY %main (p: s32[1]) -> f32[8] {
  %lens = s32[1]{0} parameter(2)
  %lo = s32[1]{0} constant({0})
  %hi = s32[1]{0} constant({8192})
  %max.1 = s32[1]{0} maximum(%lo, %lens)
  %min.1 = s32[1]{0} minimum(%hi, %max.1)
  ROOT %k = f32[8]{0} custom-call(%min.1, %lens), custom_call_target="tpu_custom_call"
}
"""
  assert tpu_bundles.hlo_operand_values(hlo, {2: [4097]}) == {
      "k": {0: [4097], 1: [4097]}}


def test_ragged_cases_give_the_walk_every_token_once():
  # The walk follows ours' work items from these entry parameters (5
  # arrays per launch): together they must cover each batch's tokens
  # exactly (quick: the mixed batch; its default runs two launches).
  pytest.importorskip(
      "jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel")
  table = tpu.cases(("ragged",), quick=True)
  ours = [k for k in table
          if k.startswith("ragged_paged_attention ") and k.endswith("|ours")]
  assert ours and any("|jax ragged_paged_attention" in k for k in table)
  for name in ours:
    batch = name.split("|")[0][len("ragged_paged_attention "):]
    q_lens, kv_lens = tpu.RAGGED_BATCHES[batch]
    params = table[name][2]
    items = [params[k] for k in sorted(params) if k >= 6]
    assert len(items) == 10   # decodes and the prefill: two launches
    covered = 0
    for at in range(0, len(items), 5):
      seq, pos0, nq = items[at:at + 3]
      covered += sum(nq)
      for s, p, n in zip(seq, pos0, nq):
        if n:   # a live item lies inside its sequence's new tokens
          assert kv_lens[s] - q_lens[s] <= p and p + n <= kv_lens[s]
    assert covered == sum(q_lens)



def test_write_kv_pages_cases_donate_the_cache():
  # Without donation both programs copy the whole pool first, and that copy
  # would be most of what the rows compare.
  pytest.importorskip(
      "jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel")
  table = tpu.cases(("ragged",), quick=True)
  writes = {k: v for k, v in table.items() if k.startswith("write_kv_pages")}
  assert {k.split("|")[1] for k in writes} == {"ours", "xla reference"}
  for fn, specs, params, donated in writes.values():
    assert donated == (0,) and specs[0].ndim == 4 and sorted(params) == [
        2, 3, 4, 5]

def _budget():
  return json.loads((HERE / "tpu_bundles_budget.json").read_text())


def test_budget_covers_the_budget_cases():
  assert set(_budget()["cases"]) == set(tpu.BUDGET_CASES)


@pytest.mark.tpu_aot
@pytest.mark.parametrize("case", tpu.BUDGET_CASES)
def test_steady_bundles_within_budget(case):
  budget = _budget()
  try:
    version = importlib.metadata.version("libtpu")
  except importlib.metadata.PackageNotFoundError:
    pytest.skip("libtpu is not installed: no TPU compiler to list bundles")
  if version != budget["libtpu"]:
    pytest.skip(f"budgets were measured with libtpu {budget['libtpu']}; "
                f"this is {version} (bundle counts differ between versions)")
  got = tpu.run_one_subprocess(case, budget["generation"], quick=False)
  assert "error" not in got, got.get("error")
  want = budget["cases"][case]
  assert tuple(got["grid"]) == tuple(want["grid"])
  limit = want["steady"] * budget["slack"]
  assert got["steady"] <= limit, (
      f"{case}: {got['steady']} bundles per steady step on "
      f"{budget['generation']}, budget {want['steady']} (+{budget['slack']-1:.0%}); "
      "if intended: python -m bench.tpu --write-budget")
