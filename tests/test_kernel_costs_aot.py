"""Every TPU kernel launch carries its name and a cost estimate.

Each op is AOT-compiled for a v5e topology (small shapes, a few seconds
each). The HLO must show the kernels under their own names, and XLA's cost
analysis must count the kernels' work: a custom call without a
``pl.CostEstimate`` counts zero flops, and the glue around the kernels
(padding, sorting, sums) is far below the bounds checked here.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels as pk
from pallas_kernels import tpu_aot
from test_generations_aot import _attention, _giou_loss  # the same programs

pytestmark = pytest.mark.tpu_aot
S = jax.ShapeDtypeStruct
TOPOLOGY = "v5e:2x2"

B, H, L, D = 1, 2, 256, 128
P = 1024        # boxes of the elementwise losses
N = 512         # boxes of pairwise IoU and NMS
MKN = (256, 512, 256)


PAGES, PAGE, SEQS, CACHE = 64, 16, 4, 256  # paged caches: 4 x 256 tokens


def _ciou_loss(a, b):
  return jax.vjp(lambda a, b: pk.ciou_loss(a, b), a, b)[0]


# op -> (function, argument specs, kernel names, min flops, min transcendentals)
OPS = {
    "flash_attention": (
        _attention, [S((B, H, L, D), jnp.bfloat16)] * 3,
        ["flash_attention_fwd", "flash_attention_dq", "flash_attention_dkv"],
        # causal forward alone: two matmuls over half the score matrix
        2 * B * H * L * L * D, B * H * L * L // 2),
    "int8_matmul_raw": (
        pk.int8_matmul, [S(MKN[:2], jnp.int8), S(MKN[1:], jnp.int8)],
        ["int8_matmul_raw"], 2 * MKN[0] * MKN[1] * MKN[2], 0),
    "int8_matmul_dynamic": (
        lambda x, w, s: pk.int8_matmul(x, w, w_scale=s),
        [S(MKN[:2], jnp.bfloat16), S(MKN[1:], jnp.int8),
         S(MKN[2:], jnp.float32)],
        ["quantize_int8_rows", "int8_matmul_dequant"],
        2 * MKN[0] * MKN[1] * MKN[2], 0),
    "giou_loss": (
        _giou_loss, [S((P, 4), jnp.float32)] * 2,
        ["giou_loss_sum", "giou_grad"], 30 * P, 0),
    "ciou_loss": (
        _ciou_loss, [S((P, 4), jnp.float32)] * 2, ["ciou_loss"], 100 * P, 0),
    "pairwise_iou": (
        pk.pairwise_iou, [S((N, 4), jnp.float32)] * 2, ["pairwise_iou"],
        10 * N * N, 0),
    "nms": (
        functools.partial(pk.nms, iou_threshold=0.5, max_output_size=64),
        [S((N, 4), jnp.float32), S((N,), jnp.float32)], ["nms_keep_mask"],
        8 * N * N, 0),
    "decode_attention": (
        pk.decode_attention,
        [S((SEQS, 8, 1, D), jnp.bfloat16),
         *[S((SEQS, 2, CACHE, D), jnp.bfloat16)] * 2, S((SEQS,), jnp.int32)],
        ["decode_attention"], 4 * SEQS * 8 * CACHE * D // 2, 0),
    "quantized_matmul": (
        lambda x, w, s: pk.quantized_matmul(x, w, w_scale=s, group_size=128,
                                            weight_only=True),
        [S(MKN[:2], jnp.bfloat16), S(MKN[1:], jnp.int4),
         S((MKN[1] // 128, MKN[2]), jnp.float32)],
        ["quantized_matmul"], 2 * MKN[0] * MKN[1] * MKN[2], 0),
    "grouped_matmul": (
        lambda x, w, g: jax.vjp(lambda x, w: pk.grouped_matmul(x, w, g),
                                x, w)[0],
        [S(MKN[:2], jnp.bfloat16), S((4,) + MKN[1:], jnp.bfloat16),
         S((4,), jnp.int32)],
        ["grouped_matmul"], 2 * MKN[0] * MKN[1] * MKN[2], 0),
    "ragged_paged_attention": (
        pk.ragged_paged_attention,
        # float32: jax < 0.12 runs the kernel on 32-bit caches only
        [S((SEQS, 8, D), jnp.float32),
         S((PAGES, PAGE, 2 * 2, D), jnp.float32), S((SEQS,), jnp.int32),
         S((SEQS, CACHE // PAGE), jnp.int32), S((SEQS + 1,), jnp.int32),
         S((1,), jnp.int32)],
        # Counted for full caches: one token per sequence over 256 keys.
        ["ragged_paged_attention"], 4 * SEQS * 8 * CACHE * D // 2, 0),
    "mla_ragged_paged_attention": (
        functools.partial(pk.mla_ragged_paged_attention, latent_dim=512),
        # rows of latent 512 + rope 128 (jax < 0.12 takes D % 128 == 0)
        [S((SEQS, 16, 640), jnp.float32),
         S((PAGES, PAGE, 640), jnp.float32), S((SEQS,), jnp.int32),
         S((SEQS, CACHE // PAGE), jnp.int32), S((SEQS + 1,), jnp.int32),
         S((1,), jnp.int32)],
        # one token per sequence: q.k over 640 lanes, p.v over 512
        ["mla_ragged_paged_attention"],
        2 * SEQS * 16 * CACHE * (640 + 512) // 2, 0),
    "write_kv_pages": (
        pk.write_kv_pages,
        [S((PAGES, PAGE, 2 * 2, D), jnp.bfloat16),
         S((SEQS, 2 * 2, D), jnp.bfloat16), S((SEQS,), jnp.int32),
         S((SEQS, CACHE // PAGE), jnp.int32), S((SEQS + 1,), jnp.int32),
         S((1,), jnp.int32)],
        ["write_kv_pages"], 0, 0),
}
# Registered kernel ops this module leaves to another's costs test.
COVERED_ELSEWHERE = {
    "quantize_int8": "int8_matmul_dynamic quantizes x in its own kernel",
    "quantize": "symmetric int8 runs quantize_int8's kernel; the other "
                "formats are plain XLA",
    "iou": "ciou_loss and giou_loss cover the elementwise kernels",
    "giou": "as iou", "diou": "as iou", "ciou": "as iou",
    "iou_loss": "as iou", "diou_loss": "as iou",
    "pairwise_giou": "pairwise_iou covers the pairwise kernel",
    "pairwise_diou": "as pairwise_giou", "pairwise_ciou": "as pairwise_giou",
    "box_iou": "as pairwise_giou",
    "batched_nms": "nms covers the kernel",
    "soft_nms": "reference only: no kernel exists",
}


@pytest.mark.parametrize("op", sorted(OPS))
def test_kernels_are_named_and_costed(op, tpu_topologies):
  if TOPOLOGY not in tpu_topologies:
    pytest.skip(f"libtpu lacks {TOPOLOGY}")
  fn, specs, names, min_flops, min_transcendentals = OPS[op]
  result = tpu_aot.compile_for_tpu(fn, *specs, topology=TOPOLOGY)
  calls = [line for line in result.hlo_text.splitlines()
           if 'custom_call_target="tpu_custom_call"' in line]
  for name in names:
    assert any(f"%{name}" in line.split("=")[0] for line in calls), (
        name, [line.split("=")[0] for line in calls])
  assert result.cost.get("flops", 0) >= min_flops, result.cost.get("flops")
  assert result.cost.get("transcendentals", 0) >= min_transcendentals, (
      result.cost.get("transcendentals"))
  assert result.cost.get("bytes accessed", 0) > 0
