"""Every op compiles for every TPU generation the installed libtpu knows,
with that generation's block tables, inside that generation's VMEM.

Each kernel's scoped VMEM (what the compiler reserved for the Mosaic custom
call) must fit the generation's VMEM per core. Default: every op at small
shapes on each generation (about a second per compile); ``--runslow``:
shapes with full-size blocks.
"""
from __future__ import annotations

import functools
from unittest import mock

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels as pk
from pallas_kernels import _backend, _compat, tpu_aot
from pallas_kernels.attention import block_sizes

pytestmark = pytest.mark.tpu_aot
S = jax.ShapeDtypeStruct


def _attention(q, k, v):
  return jax.value_and_grad(
      lambda q, k, v: pk.flash_attention(q, k, v, causal=True).astype(
          jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v)


def _giou_loss(a, b):
  return jax.value_and_grad(
      lambda a, b: pk.giou_loss(a, b, reduction="mean"), argnums=(0, 1))(a, b)


def _ops(length, mkn, boxes, pairs):
  """op -> (function, argument specs, expected kernel-name prefixes)."""
  m, k, n = mkn
  return {
      "flash_attention": (_attention, [S((1, 2, length, 128), jnp.bfloat16)] * 3,
                          ("flash_attention_fwd", "flash_attention_dq",
                           "flash_attention_dkv")),
      "int8_matmul": (pk.int8_matmul, [S((m, k), jnp.int8),
                                       S((k, n), jnp.int8)],
                      ("int8_matmul_raw",)),
      "int8_matmul_dynamic": (
          lambda x, w, s: pk.int8_matmul(x, w, w_scale=s),
          [S((m, k), jnp.bfloat16), S((k, n), jnp.int8), S((n,), jnp.float32)],
          ("quantize_int8_rows", "int8_matmul_dequant")),
      "quantized_matmul_int4": (
          lambda x, w, s: pk.quantized_matmul(x, w, w_scale=s, group_size=128,
                                              weight_only=True),
          [S((m, k), jnp.bfloat16), S((k, n), jnp.int4),
           S((k // 128, n), jnp.float32)],
          ("quantized_matmul_weight_only_int4_grouped",)),
      "quantized_matmul_fp8": (
          lambda x, w, a, b: pk.quantized_matmul(x, w, x_scale=a, w_scale=b),
          [S((m, k), jnp.float8_e4m3fn), S((k, n), jnp.float8_e4m3fn),
           S((m,), jnp.float32), S((n,), jnp.float32)],
          ("quantized_matmul_dequant_float8_e4m3fn",)),
      "grouped_matmul": (
          lambda x, w, g: jax.value_and_grad(
              lambda a, b: pk.grouped_matmul(a, b, g).astype(
                  jnp.float32).sum(), (0, 1))(x, w),
          [S((m, k), jnp.bfloat16), S((8, k, n), jnp.bfloat16),
           S((8,), jnp.int32)],
          ("grouped_matmul", "grouped_matmul_tgmm")),
      "giou_loss": (_giou_loss, [S((boxes, 4), jnp.float32)] * 2,
                    ("giou_loss_sum", "giou_grad")),
      "pairwise_iou": (pk.pairwise_iou, [S((pairs, 4), jnp.float32)] * 2,
                       ("pairwise_iou",)),
      "nms": (functools.partial(pk.nms, iou_threshold=0.5,
                                max_output_size=100),
              [S((pairs, 4), jnp.float32), S((pairs,), jnp.float32)],
              ("nms_keep_mask",)),
  }


SMALL = _ops(256, (256, 512, 256), 1024, 512)
FULL = _ops(4096, (2048, 8192, 4096), 1 << 18, 4096)


def _check(generation, op, ops, tpu_topologies):
  topology = tpu_aot.GENERATION_TOPOLOGY[generation]
  if topology not in tpu_topologies:
    pytest.skip(f"the installed libtpu lacks {topology}")
  fn, specs, names = ops[op]
  result = tpu_aot.compile_for_tpu(fn, *specs, topology=topology)
  assert tpu_aot.topology_generation(topology) == generation
  vmem = result.kernel_vmem_bytes
  for name in names:
    assert any(call.startswith(name) for call in vmem), (name, vmem)
  limit = _backend.TPU_VMEM_BYTES[generation]
  assert max(vmem.values()) <= limit, (generation, vmem)
  return vmem


@pytest.mark.parametrize("op", sorted(SMALL))
@pytest.mark.parametrize("generation", _backend.TPU_GENERATIONS)
def test_compiles_for_each_generation(generation, op, tpu_topologies):
  _check(generation, op, SMALL, tpu_topologies)


@pytest.mark.parametrize("generation", _backend.TPU_GENERATIONS)
def test_attention_table_row_compiles(generation, tpu_topologies):
  """The forward kernel at the generation's own table row (a sequence as
  long as the row's blocks, so no block shrinks) compiles within the
  generation's VMEM."""
  topology = tpu_aot.GENERATION_TOPOLOGY[generation]
  if topology not in tpu_topologies:
    pytest.skip(f"the installed libtpu lacks {topology}")
  row = block_sizes.table_block_sizes(generation, 128)
  length = max(row.block_q, row.block_kv)
  spec = S((1, 1, length, 128), jnp.bfloat16)
  calls = []
  original = _compat.pl.pallas_call

  def recording(kernel, *args, **kwargs):
    calls.append([s.block_shape[-2] for s in kwargs["grid_spec"].in_specs
                  [:2]] if "grid_spec" in kwargs else None)
    return original(kernel, *args, **kwargs)

  with mock.patch.object(_compat.pl, "pallas_call", recording):
    result = tpu_aot.compile_for_tpu(
        lambda q, k, v: pk.flash_attention(q, k, v, backend="mosaic_tpu"),
        spec, spec, spec, topology=topology)
  assert [row.block_q, row.block_kv] in calls, calls
  vmem = result.kernel_vmem_bytes
  assert 0 < max(vmem.values()) <= _backend.TPU_VMEM_BYTES[generation]


@pytest.mark.slow
@pytest.mark.parametrize("op", sorted(FULL))
@pytest.mark.parametrize("generation", _backend.TPU_GENERATIONS)
def test_full_blocks_fit_each_generations_vmem(generation, op,
                                               tpu_topologies):
  vmem = _check(generation, op, FULL, tpu_topologies)
  assert max(vmem.values()) > 0, vmem   # the compiler reported it
