"""decode_attention: one suite for every backend (``tests/backends.py``)
against the float64 oracle (``tests/oracles/decode.py``); the kernels' own
split-KV paths (several blocks, several splits); agreement with
flash_attention on the prefix; the API (errors, empty inputs, gradients).

Tolerances, max abs error against float64 on N(0, 1) inputs, scaled by
max(1, max |expected|): float32 2e-5; bfloat16/float16 2e-2 (the kernels
round probabilities to the cache dtype before the P V matmul; the oracle
sees the rounded inputs). Cache rows past each length hold NaN (int8
caches: -128), which must not reach the output. 8-bit caches: the same
tolerances by q's dtype (the oracle dequantizes the stored 8-bit values in
float64, so quantization error is not measured).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import backends
import pallas_kernels as pk
from oracles import decode as oracle
from pallas_kernels import _backend, _compat
from pallas_kernels.decode import mosaic_tpu, triton

TOLERANCES = {"float32": 2e-5, "bfloat16": 2e-2, "float16": 2e-2}
# The paged TPU kernel runs by default in the generic interpreter.
ALL = backends.params(every_flavour=True)


def _assert_close(actual, expected, tol, what=""):
  actual = np.asarray(actual).astype(np.float64)
  expected = np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
  assert np.all(np.isfinite(actual)), f"{what}: non-finite values"
  scale = max(1.0, float(np.max(np.abs(expected), initial=0)))
  err = float(np.max(np.abs(actual - expected), initial=0))
  assert err <= tol * scale, f"{what}: max abs error {err} > {tol * scale}"


@dataclasses.dataclass(frozen=True)
class Case:
  """One call. ``page_size`` set: a paged cache of ``pages`` pages per
  sequence, shuffled over a pool with spare (NaN) pages; ``lengths``: the
  kv lengths, None for random ones with 0 and the capacity among them."""
  b: int
  h: int
  hk: int
  t: int
  s: int               # contiguous capacity, or pages per sequence
  d: int
  dtype: str = "float32"
  window: int | None = None
  cap: float | None = None
  sm_scale: float | None = None
  sinks: bool = False
  page_size: int | None = None
  lengths: tuple | None = None
  quant: str | None = None   # an 8-bit cache dtype (scales per kv head)
  dv: int | None = None      # v's head_dim (MLA), None: d

  @property
  def capacity(self):
    return self.s * (self.page_size or 1)

  @property
  def out_shape(self):
    return (self.b, self.h, self.t, self.dv or self.d)

  def inputs(self, rng):
    """(q, k_cache, v_cache, kv_lengths, kwargs)."""
    dtype = jnp.dtype(self.dtype)
    normal = lambda *shape: rng.standard_normal(shape)  # noqa: E731
    if self.lengths is not None:
      lengths = np.array(self.lengths)
    else:
      lengths = rng.integers(0, self.capacity + 1, self.b)
      lengths[0] = self.capacity
      if self.b > 1:
        lengths[1] = 0
    kw = dict(sliding_window=self.window, logit_soft_cap=self.cap,
              sm_scale=self.sm_scale)
    if self.sinks:
      kw["sinks"] = jnp.asarray(2 * normal(self.h), jnp.float32)
    dims = self.d, self.dv or self.d
    if self.page_size is None:
      k, v = (normal(self.b, self.hk, self.s, d) for d in dims)
      past = np.arange(self.s)[None, :] >= lengths[:, None]
      for x in (k, v):
        x[np.broadcast_to(past[:, None, :, None], x.shape)] = np.nan
    else:
      pool = self.b * self.s + 3
      k, v = (np.full((pool, self.hk, self.page_size, d), np.nan)
              for d in dims)
      table = rng.permutation(pool)[:self.b * self.s].reshape(self.b, self.s)
      for b in range(self.b):
        for p in range(self.s):
          rows = np.clip(lengths[b] - p * self.page_size, 0, self.page_size)
          for x in (k, v):
            x[table[b, p], :, :rows] = normal(self.hk, rows, x.shape[3])
      kw["page_table"] = jnp.asarray(table, jnp.int32)
    q = jnp.asarray(normal(self.b, self.h, self.t, self.d), dtype)
    lengths = jnp.asarray(lengths, jnp.int32)
    if self.quant is None:
      return q, jnp.asarray(k, dtype), jnp.asarray(v, dtype), lengths, kw
    k, kw["k_scale"] = self._quantize(k, rng)
    v, kw["v_scale"] = self._quantize(v, rng)
    return q, k, v, lengths, kw

  def _quantize(self, x, rng):
    """(8-bit cache, float32 scales [Hkv]) holding about x (N(0, 1)): the
    scales spread over 2x per head; NaN stays NaN (int8: -128)."""
    int8 = self.quant == "int8"
    scale = rng.uniform(0.7, 1.4, self.hk) * (4 / 127 if int8 else 1 / 16)
    stored = x / scale[:, None, None]
    if int8:
      stored = np.where(np.isnan(stored), -128,
                        np.clip(np.round(stored), -127, 127))
    return (jnp.asarray(stored, jnp.dtype(self.quant)),
            jnp.asarray(scale, jnp.float32))


CASES = {
    "mha_one_token": Case(3, 2, 2, 1, 77, 32),
    "gqa_window_short_sequences": Case(2, 8, 2, 4, 300, 64, window=37,
                                       lengths=(300, 3)),
    "cap_sinks_scale": Case(3, 4, 1, 3, 200, 64, cap=2.5, sm_scale=0.3,
                            sinks=True),
    "bf16_head_dim_96": Case(2, 4, 2, 2, 129, 96, "bfloat16", window=64),
    "head_dim_80_paged_sinks": Case(3, 4, 2, 2, 6, 80, sinks=True,
                                    page_size=16, lengths=(96, 0, 41)),
    "head_dim_112_int8_many_splits": Case(2, 8, 2, 1, 700, 112,
                                          quant="int8"),
    "bf16_sixteen_tokens": Case(2, 4, 2, 16, 150, 64, "bfloat16",
                                sinks=True),
    "f16": Case(2, 2, 1, 2, 100, 64, "float16"),
    "paged_shuffled": Case(3, 4, 2, 2, 9, 64, window=70, sinks=True,
                           page_size=16),
    "paged_odd_page_size": Case(2, 2, 1, 3, 5, 32, cap=3.0, page_size=24),
    "int8_gqa_window": Case(3, 8, 2, 3, 150, 64, window=60, quant="int8"),
    "int8_bf16_paged_sinks": Case(3, 4, 2, 2, 5, 32, "bfloat16", sinks=True,
                                  page_size=16, quant="int8"),
    "e4m3_bf16_cap": Case(2, 4, 1, 4, 90, 64, "bfloat16", cap=4.0,
                          quant="float8_e4m3fn"),
    "e5m2": Case(2, 2, 1, 1, 40, 32, quant="float8_e5m2"),
    # MLA: v's head_dim differs from q's and k's (DeepSeek-V3's 192 / 128),
    # narrower and wider, contiguous and paged, float and int8 caches.
    "mla_192_128_bf16_gqa_window_sinks": Case(2, 8, 2, 2, 70, 192,
                                              "bfloat16", window=50,
                                              sinks=True, dv=128),
    "mla_v_wider_paged_int8_cap": Case(3, 4, 2, 3, 5, 32, cap=3.0,
                                       sm_scale=0.2, page_size=16, dv=80,
                                       lengths=(80, 0, 37), quant="int8"),
    "mla_int8_paged_window": Case(2, 4, 1, 1, 7, 48, window=50,
                                  page_size=16, quant="int8", dv=32),
}
# By default: test_e5m2_reference_with_scalar_scales; the MLA int8 paged
# window: the MLA cases above and KERNEL_CASES.
SLOW_CASES = {"e5m2", "mla_int8_paged_window"}
# The oldest-jax tier runs these on every backend.
COMPAT_CASES = {"mla_v_wider_paged_int8_cap"}


def _refusal(backend, case) -> bool:
  """Whether ``backend`` must refuse ``case``: Mosaic TPU takes no float16
  (named; ``backend=None`` then runs the reference); Triton needs
  head_dim on the 16 grid and a power-of-two page size."""
  if backend.name == "interpret":
    return case.dtype == "float16"
  if backend.name == "triton":
    return ((case.d % 16 or (case.dv or case.d) % 16) != 0
            or (case.page_size or 16) & ((case.page_size or 16) - 1) != 0)
  return False


def _unless_runslow(request, why):
  if not request.config.getoption("--runslow"):
    pytest.skip(f"{why} (--runslow runs it)")


def _names(cases, slow, compat=()):
  return [pytest.param(n, marks=([pytest.mark.slow] if n in slow else [])
                       + ([pytest.mark.compat] if n in compat else []))
          for n in sorted(cases)]


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("name", _names(CASES, SLOW_CASES, COMPAT_CASES))
def test_matches_oracle(backend, name, rng):
  case = CASES[name]
  q, k, v, lengths, kw = case.inputs(rng)
  if _refusal(backend, case):
    with pytest.raises(ValueError, match="cannot run this call"):
      backend.run(pk.decode_attention, q, k, v, lengths, **kw)
    return
  out = backend.run(jax.jit(pk.decode_attention,
                            static_argnames=("sm_scale", "logit_soft_cap",
                                             "sliding_window", "backend")),
                    q, k, v, lengths, **kw)
  assert out.shape == case.out_shape and out.dtype == q.dtype
  want = oracle.decode_attention(q, k, v, lengths, **kw)
  _assert_close(out, want, TOLERANCES[case.dtype], name)
  # Queries before the first cached token (position < 0) see nothing.
  early = np.arange(case.t)[None, :] < case.t - np.asarray(lengths)[:, None]
  assert np.all(np.asarray(out, np.float64)[early.nonzero()[0], :,
                                            early.nonzero()[1]] == 0)


@pytest.mark.parametrize("backend", backends.params(["interpret_generic",
                                                     "triton"]))
def test_paged_equals_contiguous(backend, rng):
  case = CASES["paged_shuffled"]
  q, k, v, lengths, kw = case.inputs(rng)
  table = kw.pop("page_table")
  paged = backend.run(pk.decode_attention, q, k, v, lengths,
                      page_table=table, **kw)
  contiguous = jnp.asarray(oracle.gather_pages(k, table)), jnp.asarray(
      oracle.gather_pages(v, table))
  flat = backend.run(pk.decode_attention, q, *contiguous, lengths, **kw)
  np.testing.assert_allclose(np.asarray(paged), np.asarray(flat), atol=2e-6)


# Ragged lengths: the capacity, 0, fewer than T (the first queries see
# nothing) and others; windows, sinks, GQA, contiguous and paged caches.
PREFIX_CASES = {
    "contiguous_window_sinks_gqa": Case(4, 8, 2, 4, 200, 32, window=70,
                                        sinks=True, lengths=(200, 0, 3, 131)),
    "paged_bf16_window_cap_sinks": Case(3, 4, 1, 3, 6, 32, "bfloat16",
                                        window=40, cap=4.0, sinks=True,
                                        page_size=16, lengths=(96, 2, 61)),
}


@functools.cache
def _prefix_inputs_and_flash(name):
  """A case's inputs (fixed seed, so that every decode backend shares the
  flash_attention calls) and, per sequence, flash_attention on (q, k[:L],
  v[:L], causal=True) with the same window, cap and sinks (paged caches
  gathered first), None where L = 0: the TPU kernel in Pallas' generic
  interpreter (what ``backend=None`` runs on a CPU)."""
  inputs = PREFIX_CASES[name].inputs(
      np.random.default_rng(sorted(PREFIX_CASES).index(name)))
  q, k, v, lengths, kw = inputs
  flash, = (b for b in backends.ALL if b.name == "interpret_generic")
  kw = dict(kw)
  table = kw.pop("page_table", None)
  if table is not None:
    k, v = (jnp.asarray(oracle.gather_pages(x, table)) for x in (k, v))
  want = [None if n == 0 else flash.run(
      pk.flash_attention, q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n],
      causal=True, **kw) for b, n in enumerate(np.asarray(lengths))]
  return inputs, want


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("name", sorted(PREFIX_CASES))
def test_equals_flash_attention_on_the_prefix(backend, name, request):
  """T queries at the end of a prefix of length L equal flash_attention's
  kernel on the prefix, one sequence at a time. Both are within the
  dtype's tolerance of float64 (checked elsewhere) and run in float32 on
  the same rounded inputs, so that tolerance holds between them."""
  case = PREFIX_CASES[name]
  # The TPU kernel's paged path runs by default in the generic interpreter.
  if (backend.name == "interpret" and case.page_size is not None
      and not request.config.getoption("--runslow")):
    pytest.skip("slow in the interpret interpreter (--runslow runs it)")
  if _refusal(backend, case):
    pytest.skip("test_matches_oracle checks this backend's refusal")
  (q, k, v, lengths, kw), want = _prefix_inputs_and_flash(name)
  out = np.asarray(backend.run(pk.decode_attention, q, k, v, lengths, **kw),
                   np.float64)
  for b, expected in enumerate(want):
    if expected is None:   # no cached key (flash_attention takes none)
      assert not np.any(out[b]), f"{name}: sequence {b} sees no key"
    else:
      _assert_close(out[b:b + 1], expected, TOLERANCES[case.dtype],
                    f"{name}, sequence {b} (length {lengths[b]})")


# ------------------------------------------ the kernels' split-KV paths --

KERNEL_CASES = {
    "contiguous": Case(3, 4, 2, 3, 700, 64, window=300, sinks=True),
    # The first query (position length - 3) and the window start at, one
    # before and one past a 128-key block boundary (384), where the
    # unmasked fast path begins.
    "causal_boundaries": Case(4, 2, 1, 3, 520, 32,
                              lengths=(384, 385, 386, 2)),
    "window_boundaries": Case(3, 2, 1, 3, 520, 32, window=128,
                              lengths=(385, 386, 387)),
    "contiguous_all_visible": Case(2, 2, 1, 2, 517, 32, cap=4.0),
    "paged": Case(3, 4, 1, 2, 11, 32, window=90, page_size=16),
    "int8_paged": Case(2, 4, 2, 2, 7, 32, sinks=True, page_size=16,
                       quant="int8"),
    "e4m3_contiguous": Case(2, 4, 2, 1, 517, 32, window=300,
                            quant="float8_e4m3fn"),
    "mla_contiguous": Case(3, 4, 2, 3, 300, 48, window=200, sinks=True,
                           dv=32),
    "mla_paged": Case(2, 4, 1, 2, 11, 32, window=90, sinks=True,
                      page_size=16, dv=48),
}
# 8-bit caches by default: test_matches_oracle (the default plans split too).
SLOW_KERNEL_CASES = {"int8_paged", "e4m3_contiguous"}
# MLA by default: (case, kernel, block) of several blocks and splits.
MLA_KERNEL_DEFAULTS = {("mla_contiguous", mosaic_tpu, 128),
                       ("mla_paged", mosaic_tpu, 128),
                       ("mla_paged", triton, 16)}


@pytest.mark.parametrize("name", _names(KERNEL_CASES, SLOW_KERNEL_CASES))
@pytest.mark.parametrize("kernel,block,num_splits", [
    (mosaic_tpu, 128, 3), (mosaic_tpu, 256, 1), (triton, 16, 2),
    (triton, 32, 4), (triton, 64, 1)])
def test_kernel_blocks_and_splits(kernel, block, num_splits, name, rng,
                                  request):
  """Many blocks per split, several splits, ragged lengths: each kernel in
  Pallas' generic interpreter. A paged block holds several pages (Triton:
  1, 2 or 4 of 16 rows, the table's last entries past its width)."""
  if name.startswith("mla") and (name, kernel, block) not in (
      MLA_KERNEL_DEFAULTS):
    _unless_runslow(request, "MLA: a few plans by default")
  case = KERNEL_CASES[name]
  q, k, v, lengths, kw = case.inputs(rng)
  page_table = kw.pop("page_table", None)
  sinks = kw.pop("sinks", None)
  scales = kw.pop("k_scale", None), kw.pop("v_scale", None)
  out = kernel.decode(
      q, k, v, lengths, sinks, page_table, *scales,
      sm_scale=kw["sm_scale"] or 1 / np.sqrt(case.d),
      logit_soft_cap=kw["logit_soft_cap"],
      sliding_window=kw["sliding_window"], interpret=True, block_kv=block,
      num_splits=num_splits)
  want = oracle.decode_attention(q, k, v, lengths, sinks=sinks,
                                 page_table=page_table, k_scale=scales[0],
                                 v_scale=scales[1], **kw)
  _assert_close(out, want, TOLERANCES[case.dtype], name)


def test_tpu_paged_page_dmas_are_race_free(rng):
  """The paged path issues its own page DMAs (two slots, the next block's
  in flight while this one computes): 3-page blocks over 11 pages with a
  window, ragged lengths and 3 splits, in the race-detecting TPU
  interpreter."""
  case = KERNEL_CASES["paged"]
  q, k, v, lengths, kw = case.inputs(rng)
  table = kw.pop("page_table")
  sm_scale = 1 / np.sqrt(case.d)
  out, log = _backend.find_races(lambda: mosaic_tpu.decode(
      q, k, v, lengths, None, table, sm_scale=sm_scale, logit_soft_cap=None,
      sliding_window=kw["sliding_window"],
      interpret=_backend.interpret_value("races"), block_kv=48,
      num_splits=3))
  assert log.launches == 1 and not log.found, log
  want = oracle.decode_attention(q, k, v, lengths, page_table=table,
                                 **dict(kw, sm_scale=sm_scale))
  _assert_close(out, want, TOLERANCES[case.dtype])


def test_triton_merges_many_splits_in_steps(rng):
  """16 splits of 16 rows at head_dim 64: the last program of each kv head
  merges them in two steps of 8 (``MERGE_ELEMENTS``), with the sinks."""
  case = Case(2, 8, 2, 4, 700, 64, sinks=True, lengths=(700, 517))
  q, k, v, lengths, kw = case.inputs(rng)
  rows = case.t * case.h // case.hk
  assert triton.MERGE_ELEMENTS // (rows * case.d) == 8
  out = triton.decode(q, k, v, lengths, kw["sinks"], None, sm_scale=0.125,
                      logit_soft_cap=None, sliding_window=None,
                      interpret=True, block_kv=32, num_splits=16)
  want = oracle.decode_attention(q, k, v, lengths, sinks=kw["sinks"],
                                 sm_scale=0.125)
  _assert_close(out, want, TOLERANCES["float32"])


@pytest.mark.parametrize("page_size,programs,want", [
    (16, 8, 128), (64, 8, 256), (256, 8, 256), (16, 512, 16), (64, 512, 64)])
def test_triton_paged_steps(page_size, programs, want):
  # An H100 probe (bench/results/decode_attention-paged-steps-*): split-KV
  # programs read 8 pages of 16 or 4 of 64 per step; a batch that fills
  # the GPU without splits, one page.
  assert triton.block_rows(1 << 17, 128, 2, page_size, programs) == want


@given(head_dim=st.integers(1, 32).map(lambda n: 16 * n),
       itemsize=st.sampled_from([1, 2, 4]),
       page_size=st.integers(4, 9).map(lambda n: 1 << n),
       pages=st.integers(1, 300), programs=st.integers(1, 1024))
def test_triton_block_is_whole_pages_of_a_power_of_two(
    head_dim, itemsize, page_size, pages, programs):
  block = triton.block_rows(page_size * pages, head_dim, itemsize, page_size,
                            programs)
  assert block % page_size == 0 and block & (block - 1) == 0
  assert block <= max(page_size, page_size * pages)
  contiguous = triton.block_rows(page_size * pages, head_dim, itemsize, None)
  assert contiguous & (contiguous - 1) == 0 and contiguous >= triton.MIN_TILE


def test_triton_refuses_a_block_of_part_pages(rng):
  q, k, v, lengths, kw = Case(1, 2, 1, 1, 4, 32, page_size=32).inputs(rng)
  with pytest.raises(ValueError, match="block_kv=48 must be a power-of-two "
                     "multiple of the page size 32"):
    triton.decode(q, k, v, lengths, None, kw["page_table"], sm_scale=0.1,
                  logit_soft_cap=None, sliding_window=None, interpret=True,
                  block_kv=48)


@pytest.mark.parametrize("batch,kv_heads,want", [
    (1, 8, 16), (2, 8, 8), (4, 8, 4), (8, 8, 2), (16, 8, 2), (64, 8, 1),
    (1, 1, 128), (3, 5, 8)])
def test_gpu_splits_are_powers_of_two_near_one_program_per_sm(
    batch, kv_heads, want):
  # An H100 sweep (bench/results/decode_attention-splits-h100-*) found one
  # program per SM and splits that divide the blocks evenly fastest.
  splits = triton.default_splits(batch, kv_heads)
  assert splits == want and splits & (splits - 1) == 0


def test_tpu_plan_fits_and_splits():
  plan = mosaic_tpu.make_plan(1, 8, 4, 131072, 128, 2)
  assert plan.block % 128 == 0 and plan.num_splits == 1
  assert plan.num_blocks * plan.block >= 131072
  assert plan.steps * plan.num_splits >= plan.num_blocks
  one_head = mosaic_tpu.make_plan(1, 1, 4, 131072, 128, 2)
  assert one_head.num_splits == mosaic_tpu.PARALLEL_ITEMS
  # A paged step reads its block's pages of every kv head: 2 MiB of K on
  # v5e is 64 pages of 16 rows for 8 heads, and the page cap for one.
  paged = mosaic_tpu.make_plan(2, 8, 8, 4096, 128, 2, page_size=16,
                               pages_per_seq=256, generation="v5e")
  assert paged.heads == 8 and paged.chunks == 64
  assert paged.block == 16 * paged.chunks and paged.num_splits == 1
  one_head = mosaic_tpu.make_plan(2, 1, 8, 4096, 128, 2, page_size=16,
                                  pages_per_seq=256, generation="v5e")
  assert one_head.chunks == mosaic_tpu.MAX_PAGES_PER_BLOCK


@pytest.mark.parametrize("generation", _backend.TPU_GENERATIONS)
def test_tpu_plan_fits_each_generations_vmem(generation):
  """Every generation's blocks use at most 3/4 of its VMEM per core
  (double-buffered K/V included), and the scoped limit a launch asks for
  covers that and stays inside the VMEM."""
  vmem = _backend.TPU_VMEM_BYTES[generation]
  blocks = set()
  for d in (64, 128, 256):
    for rows in (1, 64, 256):
      # (cache, q) itemsizes: float caches, and 8-bit ones converted in VMEM.
      for itemsize, compute in ((2, 2), (4, 4), (1, 2), (1, 4)):
        plan = mosaic_tpu.make_plan(1, 1, rows, 131072, d, itemsize,
                                    generation=generation,
                                    compute_itemsize=compute)
        limit = mosaic_tpu.vmem_limit_bytes(plan, d, itemsize, compute)
        used = mosaic_tpu.vmem_bytes(plan, d, itemsize, compute)
        assert used <= vmem * 3 // 4 and used < limit <= vmem, (
            generation, d, rows, itemsize, compute, used, limit)
        if itemsize == compute:
          blocks.add(plan.block)
  assert max(blocks) * 128 * 2 == mosaic_tpu.BLOCK_BYTES[generation]


def test_tpu_page_table_beyond_smem_runs_as_several_launches(rng):
  case = Case(3, 2, 1, 1, 4, 32, page_size=16)
  q, k, v, lengths, kw = case.inputs(rng)
  budget = mosaic_tpu.PAGE_TABLE_BYTES
  try:
    mosaic_tpu.PAGE_TABLE_BYTES = 4 * case.s  # one sequence per launch
    out = mosaic_tpu.decode(q, k, v, lengths, None, kw["page_table"],
                            sm_scale=0.2, logit_soft_cap=None,
                            sliding_window=None, interpret=True)
    jaxpr = jax.make_jaxpr(lambda *a: mosaic_tpu.decode(
        *a, None, kw["page_table"], sm_scale=0.2, logit_soft_cap=None,
        sliding_window=None, interpret=True))(q, k, v, lengths)
  finally:
    mosaic_tpu.PAGE_TABLE_BYTES = budget
  launches = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
  assert len(launches) == 3
  want = oracle.decode_attention(q, k, v, lengths, sm_scale=0.2,
                                 page_table=kw["page_table"])
  _assert_close(out, want, 2e-5)


# ---------------------------------------------------------------- the API --

def _args(b=2, h=4, hk=2, t=2, s=32, d=16, dtype=jnp.float32):
  q = jnp.zeros((b, h, t, d), dtype)
  kv = jnp.zeros((b, hk, s, d), dtype)
  return q, kv, kv, jnp.full((b,), s, jnp.int32)


@pytest.mark.parametrize("change,error,match", [
    (dict(q=jnp.zeros((2, 4, 16))), ValueError, "q must have 4"),
    (dict(q=jnp.zeros((2, 4, 2, 16), jnp.int32)), TypeError, "q must be"),
    (dict(k_cache=jnp.zeros((2, 2, 32, 16), jnp.bfloat16)), TypeError,
     "share a dtype"),
    # v_cache may differ from k_cache in head_dim only (MLA).
    (dict(v_cache=jnp.zeros((2, 2, 31, 16))), ValueError,
     r"capacity of v_cache \(31\) != capacity of k_cache \(32\).*only in "
     "head_dim"),
    (dict(v_cache=jnp.zeros((3, 2, 32, 8))), ValueError,
     r"batch of v_cache \(3\) != batch of k_cache \(2\)"),
    (dict(v_cache=jnp.zeros((2, 1, 32, 24))), ValueError,
     r"kv_heads of v_cache \(1\) != kv_heads of k_cache \(2\)"),
    (dict(k_cache=jnp.zeros((2, 2, 32, 24))), ValueError,
     r"head_dim of k_cache \(24\) != head_dim of q \(16\)"),
    (dict(q=jnp.zeros((2, 4, 17, 16))), ValueError, "at most 16"),
    (dict(q=jnp.zeros((2, 3, 2, 16))), ValueError, "multiple of"),
    (dict(q=jnp.zeros((2, 4, 2, 8))), ValueError, "head_dim"),
    (dict(q=jnp.zeros((3, 4, 2, 16))), ValueError, "kv_lengths must have"),
    (dict(kv_lengths=jnp.zeros((2,), jnp.float32)), TypeError, "integers"),
    (dict(kv_lengths=jnp.asarray([3, 33])), ValueError,
     r"kv_lengths\[1\] = 33 is outside \[0, 32\]"),
    (dict(kv_lengths=jnp.asarray([-1, 3])), ValueError, "outside"),
    (dict(sm_scale=jnp.float32(1.0)), TypeError, "sm_scale"),
    (dict(sm_scale=float("inf")), ValueError, "sm_scale"),
    (dict(logit_soft_cap=0.0), ValueError, "logit_soft_cap"),
    (dict(sliding_window=-1), ValueError, "sliding_window"),
    (dict(sliding_window=2.5), TypeError, "sliding_window"),
    (dict(sinks=jnp.zeros((3,))), ValueError, "sinks must have shape"),
    (dict(sinks=jnp.zeros((4,), jnp.int32)), TypeError, "sinks"),
    (dict(backend="tpu"), ValueError, "backend"),
    (dict(k_scale=jnp.ones((2,))), ValueError,
     "k_scale is only for 8-bit caches.*pass k_scale=None"),
    (dict(k_cache=jnp.zeros((2, 2, 32, 16), jnp.int8)), TypeError,
     "k_cache and v_cache must share a dtype"),
    (dict(k_cache=jnp.zeros((2, 2, 32, 16), jnp.int8),
          v_cache=jnp.zeros((2, 2, 32, 16), jnp.int8)), ValueError,
     r"int8 caches need k_scale .*shape \(2,\)"),
    (dict(k_cache=jnp.zeros((2, 2, 32, 16), jnp.float8_e4m3fn),
          v_cache=jnp.zeros((2, 2, 32, 16), jnp.float8_e4m3fn),
          k_scale=1.0), ValueError, "float8_e4m3fn caches need v_scale"),
    (dict(k_cache=jnp.zeros((2, 2, 32, 16), jnp.int8),
          v_cache=jnp.zeros((2, 2, 32, 16), jnp.int8),
          k_scale=jnp.ones((4,)), v_scale=1.0), ValueError,
     r"k_scale must have shape \(2,\)"),
    (dict(k_cache=jnp.zeros((2, 2, 32, 16), jnp.int8),
          v_cache=jnp.zeros((2, 2, 32, 16), jnp.int8),
          k_scale=1.0, v_scale=jnp.ones((2,), jnp.int32)), TypeError,
     "v_scale must be floats"),
])
def test_bad_input_raises(change, error, match):
  q, k, v, lengths = _args()
  kw = {"q": q, "k_cache": k, "v_cache": v, "kv_lengths": lengths}
  kw.update(change)
  args = [kw.pop(n) for n in ("q", "k_cache", "v_cache", "kv_lengths")]
  with pytest.raises(error, match=match):
    pk.decode_attention(*args, **kw)


def test_bad_page_table_raises():
  q = jnp.zeros((2, 4, 1, 16))
  cache = jnp.zeros((5, 2, 8, 16))
  lengths = jnp.asarray([9, 0], jnp.int32)
  table = jnp.asarray([[0, 7, 1], [9, 9, 9]], jnp.int32)   # b=1 reads none
  with pytest.raises(ValueError, match=r"page_table\[0, 1\] = 7"):
    pk.decode_attention(q, cache, cache, lengths, page_table=table)
  with pytest.raises(ValueError, match="page_table must have shape"):
    pk.decode_attention(q, cache, cache, lengths, page_table=table[:1])
  for v_cache, dim in ((jnp.zeros((6, 2, 8, 16)), "pages"),
                       (jnp.zeros((5, 2, 4, 32)), "page_size")):
    with pytest.raises(ValueError, match=f"{dim} of v_cache .* != {dim} of "
                       "k_cache"):
      pk.decode_attention(q, cache, v_cache, lengths, page_table=table)
  with pytest.raises(ValueError, match="needs page_table"):
    pk.decode_attention(q, cache, cache, lengths)
  with pytest.raises(ValueError, match="outside"):
    pk.decode_attention(q, cache, cache, jnp.asarray([25, 0]),
                        page_table=table)


def test_triton_refuses_what_it_cannot_tile():
  q, k, v, lengths = _args(d=24)
  with pytest.raises(ValueError, match="multiple of 16"):
    pk.decode_attention(q, k, v, lengths, backend="triton")
  q, k, v, lengths = _args()
  with pytest.raises(ValueError, match="v_cache's head_dim a multiple of 16"):
    pk.decode_attention(q, k, jnp.zeros(v.shape[:3] + (40,)), lengths,
                        backend="triton")


def test_triton_refuses_e4m3_before_ada():
  q, k, v, lengths = _args()
  k = v = k.astype(jnp.float8_e4m3fn)
  with _backend.target_override(gpu_capability="8.0"):
    with pytest.raises(ValueError, match="float8_e4m3fn only on sm_89"):
      pk.decode_attention(q, k, v, lengths, k_scale=1.0, v_scale=1.0,
                          backend="triton")
    jax.eval_shape(functools.partial(pk.decode_attention, backend="triton",
                                     k_scale=1.0, v_scale=1.0),
                   q, k.astype(jnp.float8_e5m2), v.astype(jnp.float8_e5m2),
                   lengths)


@pytest.mark.parametrize("shapes", [
    dict(b=0), dict(h=0, hk=0), dict(t=0), dict(s=0), dict(d=0)])
def test_empty_inputs(shapes):
  q, k, v, lengths = _args(**shapes)
  lengths = jnp.zeros_like(lengths)
  out = pk.decode_attention(q, k, v, lengths, backend="interpret")
  assert out.shape == q.shape and out.dtype == q.dtype
  assert not np.any(np.asarray(out))
  # MLA: the output takes v's head_dim (0 included).
  for dv in (0, 24):
    out = pk.decode_attention(q, k, jnp.zeros(v.shape[:3] + (dv,), v.dtype),
                              lengths, backend="interpret")
    assert out.shape == q.shape[:3] + (dv,) and not np.any(np.asarray(out))


def test_no_visible_key_gives_zero_with_sinks():
  q, k, v, _ = _args()
  k, v = k + 1.0, v + 1.0
  out = pk.decode_attention(q, k, v, jnp.zeros((2,), jnp.int32),
                            sinks=jnp.ones((4,)), backend="interpret")
  assert not np.any(np.asarray(out))


def test_traced_lengths_are_clipped(rng):
  q, k, v, _, _ = Case(2, 2, 1, 1, 40, 16, lengths=(40, 40)).inputs(rng)
  fn = jax.jit(lambda lengths: pk.decode_attention(q, k, v, lengths))
  got = fn(jnp.asarray([99, -5], jnp.int32))
  want = fn(jnp.asarray([40, 0], jnp.int32))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_gradient_matches_flash_attention(rng):
  """grad runs the reference's VJP; on a full cache it is flash attention's
  (an independent implementation)."""
  q, k, v, lengths, _ = Case(1, 4, 2, 3, 40, 16, lengths=(40,)).inputs(rng)

  def loss(op):
    def fn(q, k, v):
      out = op(q, k, v)
      return jnp.sum(jnp.sin(out))
    return jax.grad(fn, argnums=(0, 1, 2))(q, k, v)

  got = loss(lambda q, k, v: pk.decode_attention(
      q, k, v, lengths, logit_soft_cap=3.0))
  want = loss(lambda q, k, v: pk.flash_attention(
      q, k, v, causal=True, logit_soft_cap=3.0, backend="reference"))
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5)


def _garbage_past_lengths(x, rng):
  """x with its NaN entries (the rows past the lengths, spare pages) set to
  NaN, +inf or -inf at random."""
  x = np.asarray(x.astype(jnp.float32))
  junk = rng.choice(np.array([np.nan, np.inf, -np.inf]), x.shape)
  return np.where(np.isnan(x), junk, x)


GARBAGE_CASES = {
    "contiguous": Case(3, 4, 2, 2, 70, 32, window=40, cap=3.0, sinks=True,
                       lengths=(70, 23, 1)),
    "paged": Case(2, 4, 2, 2, 5, 32, window=40, cap=3.0, sinks=True,
                  page_size=16, lengths=(45, 17)),
    # MLA: dv (48) past d (32); dk and dv land in pools of their own width.
    "paged_mla": Case(2, 4, 2, 2, 5, 32, window=40, cap=3.0, sinks=True,
                      page_size=16, lengths=(45, 17), dv=48),
    "contiguous_mla": Case(3, 4, 2, 2, 70, 48, window=40, cap=3.0,
                           sinks=True, lengths=(70, 23, 1), dv=32),
}


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("layout", sorted(GARBAGE_CASES))
def test_nan_and_inf_past_the_lengths_reach_no_value_or_gradient(
    backend, layout, rng, request):
  """Cache rows past kv_lengths may hold anything: NaN, +inf and -inf
  there leave out, dq, dk, dv and dsinks finite and equal to the float64
  oracle's (the unused rows' own gradient is 0)."""
  if layout.endswith("mla") and backend.name != "reference":
    # The gradient is the reference's; test_matches_oracle runs the kernels.
    _unless_runslow(request, "MLA: the reference by default")
  case = GARBAGE_CASES[layout]
  q, k, v, lengths, kw = case.inputs(rng)
  k, v = (jnp.asarray(_garbage_past_lengths(x, rng)) for x in (k, v))
  d_out = jnp.asarray(rng.standard_normal(case.out_shape), jnp.float32)
  sinks = kw.pop("sinks")

  def grads_and_out(q, k, v, sinks, backend):
    def loss(q, k, v, sinks):
      out = pk.decode_attention(q, k, v, lengths, sinks=sinks,
                                backend=backend, **kw)
      return jnp.sum(out * d_out), out
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        q, k, v, sinks)
  grads, out = backend.run(grads_and_out, q, k, v, sinks)
  want_out = oracle.decode_attention(q, k, v, lengths, sinks=sinks, **kw)
  want = oracle.decode_attention_grads(q, k, v, lengths, d_out, sinks=sinks,
                                       **kw)
  _assert_close(out, want_out, 2e-5, "out")
  for name, got, w in zip(("dq", "dk", "dv", "dsinks"), grads, want):
    _assert_close(got, w, 1e-4, name)

def test_e5m2_reference_with_scalar_scales(rng):
  """The e5m2 case on the reference (every backend: --runslow), with the
  scales given as scalars."""
  case = dataclasses.replace(CASES["e5m2"], hk=1)
  q, k, v, lengths, kw = case.inputs(rng)
  kw["k_scale"], kw["v_scale"] = (float(kw["k_scale"][0]),
                                  float(kw["v_scale"][0]))
  out = pk.decode_attention(q, k, v, lengths, backend="reference", **kw)
  _assert_close(out, oracle.decode_attention(q, k, v, lengths, **kw), 2e-5)


def test_8bit_gradient_in_q_and_sinks(rng):
  """8-bit caches: the gradient in q and sinks equals the float path's on
  the dequantized caches; one in a cache or a scale is a clear error."""
  # Rows past the lengths hold NaN (as an fp8 cache's unused bytes may).
  q, k, v, lengths, kw = Case(2, 4, 2, 2, 40, 16, sinks=True, lengths=(40, 9),
                              quant="float8_e4m3fn").inputs(rng)
  scales = dict(k_scale=kw["k_scale"], v_scale=kw["v_scale"])
  real = [x.astype(jnp.float32) * s[:, None, None]
          for x, s in ((k, kw["k_scale"]), (v, kw["v_scale"]))]

  def loss(q, sinks, k=k, v=v, scales=scales):  # the kernel is not the point
    return jnp.sum(jnp.sin(pk.decode_attention(q, k, v, lengths, sinks=sinks,
                                               backend="reference", **scales)))
  got = jax.grad(loss, argnums=(0, 1))(q, kw["sinks"])
  want = jax.grad(lambda q, s: loss(q, s, *real, scales={}),
                  argnums=(0, 1))(q, kw["sinks"])
  out64 = oracle.decode_attention(q, k, v, lengths, **kw)
  dq64, _, _, dsinks64 = oracle.decode_attention_grads(
      q, k, v, lengths, np.cos(out64), **kw)
  for g, w, w64 in zip(got, want, (dq64, dsinks64)):
    _assert_close(g, w, 2e-5)
    _assert_close(g, w64, 1e-4)
  with pytest.raises(TypeError, match="cannot differentiate with respect to "
                     "k_cache: an 8-bit KV cache"):
    jax.grad(lambda k: loss(q, kw["sinks"], k=k))(k)
  with pytest.raises(TypeError, match="with respect to v_scale"):
    jax.grad(lambda s: loss(q, kw["sinks"], scales=dict(
        k_scale=kw["k_scale"], v_scale=s)))(kw["v_scale"])


@pytest.mark.parametrize("kernel", [mosaic_tpu, triton])
@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
def test_kernels_read_the_8bit_cache(kernel, dtype, rng):
  """The kernel's launch takes the caches in 8 bits (no dequantized copy)."""
  q, k, v, lengths, kw = Case(2, 4, 2, 1, 64, 32, "bfloat16",
                              quant=dtype).inputs(rng)
  jaxpr = jax.make_jaxpr(lambda *a: kernel.decode(
      *a, None, None, kw["k_scale"], kw["v_scale"], sm_scale=0.2,
      logit_soft_cap=None, sliding_window=None, interpret=True))(
          q, k, v, lengths)
  launch, = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
  dtypes = [x.aval.dtype for x in launch.invars]
  assert dtypes.count(jnp.dtype(dtype)) == 2, dtypes


def test_vmap_over_a_leading_axis(rng):
  q, k, v, lengths, _ = Case(2, 2, 1, 1, 40, 16).inputs(rng)
  stack = lambda x: jnp.stack([x, x[::-1]])  # noqa: E731
  got = jax.vmap(lambda q, k, v, n: pk.decode_attention(q, k, v, n))(
      stack(q), stack(k), stack(v), stack(lengths))
  for i in range(2):
    want = oracle.decode_attention(stack(q)[i], stack(k)[i], stack(v)[i],
                                   stack(lengths)[i])
    _assert_close(got[i], want, 2e-5)


@pytest.mark.parametrize("paged,cache_dtype,head_dim,dv", [
    (False, jnp.bfloat16, 128, 128), (True, jnp.bfloat16, 128, 128),
    (False, jnp.int8, 128, 128), (True, jnp.float8_e4m3fn, 128, 128),
    (False, jnp.bfloat16, 80, 80), (True, jnp.int8, 112, 112),
    (True, jnp.bfloat16, 192, 128)])
def test_cuda_lowering_runs_the_triton_kernel(paged, cache_dtype, head_dim,
                                              dv):
  """backend=None lowered for CUDA on this host: the Triton kernel (not the
  reference), with an odd batch and page-table width; 8-bit caches too,
  head_dims off the powers of two (read in pieces: 80 = 64 + 16), and
  MLA's (q/k 192, v 128)."""
  spec = jax.ShapeDtypeStruct
  q = spec((3, 32, 1, head_dim), jnp.bfloat16)
  lengths = spec((3,), jnp.int32)
  scales = {}
  if cache_dtype != jnp.bfloat16:
    scales = dict(k_scale=jnp.full((8,), 0.1), v_scale=0.2)
  if paged:
    k, v = (spec((70, 8, 64, d), cache_dtype) for d in (head_dim, dv))
    args = (q, k, v, lengths, spec((3, 21), jnp.int32))
    fn = lambda q, k, v, n, t: pk.decode_attention(  # noqa: E731
        q, k, v, n, page_table=t, sliding_window=100, **scales)
  else:
    k, v = (spec((3, 8, 1000, d), cache_dtype) for d in (head_dim, dv))
    args = (q, k, v, lengths)
    fn = lambda q, k, v, n: pk.decode_attention(  # noqa: E731
        q, k, v, n, logit_soft_cap=30.0, **scales)
  assert jax.eval_shape(fn, *args).shape == (3, 32, 1, dv)
  text = _compat.lower_for_cuda(fn, *args).as_text()
  assert text.count('"decode_attention_gpu"') == 1
  # One launch: the splits are merged inside it, not by XLA reductions.
  assert "stablehlo.reduce" not in text
