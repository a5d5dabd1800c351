"""Every generation's tile tables fit its VMEM (computed footprints, no
compile): the attention, int8 and quantized matmul rows, double buffers
included, within 3/4 of the VMEM per core, and the scoped limit each launch
asks for within the VMEM. The AOT tests (test_generations_aot.py) check the
compiler's own figures."""
from __future__ import annotations

import pytest

from pallas_kernels import _backend
from pallas_kernels.attention import block_sizes as attn_bs
from pallas_kernels.attention import mosaic_tpu as attn_tpu
from pallas_kernels.quant import int8_block_sizes as int8_bs
from pallas_kernels.quant import block_sizes as quant_bs

GENERATIONS = _backend.TPU_GENERATIONS
# v4 rows (512 x 512) whose rough estimate with a bias passes 3/4 of 16 MiB
# (12.3-14.8 MiB): the chooser does not shrink blocks for a bias yet.
V4_BIAS_OVER = {(128, 4), (256, 2), (256, 4)}


def _fits(generation, used, limit):
  vmem = _backend.TPU_VMEM_BYTES[generation]
  return used <= vmem * 3 // 4 and (limit or 0) <= vmem


def _attention_cases():
  for generation in GENERATIONS:
    for head_dim in (64, 128, 256):
      for itemsize in (2, 4):
        for bias in (False, True):
          marks = ()
          if generation == "v4" and bias and (head_dim, itemsize) in (
              V4_BIAS_OVER):
            marks = pytest.mark.xfail(strict=True,
                                      reason="blocks not shrunk for a bias")
          yield pytest.param(generation, head_dim, itemsize, bias,
                             marks=marks)


@pytest.mark.parametrize("generation,head_dim,itemsize,bias",
                         list(_attention_cases()))
def test_attention_rows_fit(generation, head_dim, itemsize, bias):
  dim = attn_bs.padded_head_dim(head_dim)
  for row in _reachable_rows(generation, head_dim):
    for bq, bk in (row.fwd, row.bwd):
      used = attn_tpu.vmem_bytes(bq, bk, dim, itemsize, bias)
      with _backend.target_override(tpu_generation=generation):
        params = attn_tpu._compiler_params(("parallel",), used)
      assert _fits(generation, used, params.vmem_limit_bytes), (row, used)


def _reachable_rows(generation, head_dim):
  """The rows ``choose`` can pick for a head_dim, masked or not, any length."""
  for row in attn_bs.TABLE[generation]:
    if row.head_dim is not None and head_dim > row.head_dim:
      continue
    yield row
    if row.mask == "any" and row.length is None:
      return


@pytest.mark.parametrize("generation", GENERATIONS)
@pytest.mark.parametrize("head_dim,v_head_dim", [(192, 128), (64, 256),
                                                 (256, 64)])
@pytest.mark.parametrize("itemsize", [2, 4])
def test_attention_rows_fit_mla(generation, head_dim, v_head_dim, itemsize):
  """v's head dim != q's (MLA): the row of the wider one, q/k tiles at D
  and v/dO/out tiles at Dv."""
  table = attn_bs.table_block_sizes(generation, max(head_dim, v_head_dim))
  dim, dim_v = (attn_bs.padded_head_dim(d) for d in (head_dim, v_head_dim))
  for bq, bk in ((table.block_q, table.block_kv),
                 (table.block_q_bwd, table.block_kv_bwd)):
    used = attn_tpu.vmem_bytes(bq, bk, dim, itemsize, False, dim_v)
    with _backend.target_override(tpu_generation=generation):
      params = attn_tpu._compiler_params(("parallel",), used)
    assert _fits(generation, used, params.vmem_limit_bytes), (bq, bk, used)


def test_attention_table_has_every_generation():
  assert set(attn_bs.TABLE) == set(GENERATIONS)


@pytest.mark.parametrize("generation", GENERATIONS)
def test_int8_and_quantized_plans_fit(generation):
  for m in (1, 16, 128, 512, 1024, 4096, 16384):
    for k, n in ((8192, 8192), (16384, 4096), (4096, 28672)):
      for mode, x_bytes, out_bytes in (("raw", 1, 4), ("dequant", 1, 2),
                                       ("weight_only", 2, 2)):
        plan = int8_bs.plan_tpu(m, k, n, x_bytes=x_bytes, out_bytes=out_bytes,
                                mode=mode, generation=generation)
        assert _fits(generation, plan.vmem_bytes, plan.vmem_limit_bytes), (
            m, k, n, mode, plan)
      for w_bits, group in ((4, 128), (8, None)):
        plan = quant_bs.plan_tpu(m, k, n, x_bytes=2, w_bits=w_bits,
                                 out_bytes=2, compute_bytes=2,
                                 generation=generation, group_size=group)
        assert _fits(generation, plan.vmem_bytes, plan.vmem_limit_bytes), (
            m, k, n, w_bits, plan)
      # quantized x with group scales: 8-bit tiles, bf16 copies off the
      # generations whose MXU takes them
      for group, upcast in ((32, False), (128, True)):
        plan = quant_bs.plan_tpu(m, k, n, x_bytes=1, w_bits=8, out_bytes=2,
                                 compute_bytes=2 if upcast else 0,
                                 generation=generation, group_size=group,
                                 x_upcast=upcast, group_products=True)
        assert _fits(generation, plan.vmem_bytes, plan.vmem_limit_bytes), (
            m, k, n, group, plan)
        assert plan.bk <= max(quant_bs.k_unit(group),
                              quant_bs.MAX_GROUP_DOTS * group)


def test_a_row_over_vmem_fails():
  """The check catches a row that does not fit (v4: 16 MiB)."""
  used = attn_tpu.vmem_bytes(2048, 2048, 128, 2)
  assert not _fits("v4", used, None)
  assert _fits("v5e", attn_tpu.vmem_bytes(1024, 1024, 128, 2), 48 << 20)
