"""TPU speed from the compiler's final bundle listings (no TPU needed).

    python -m bench.tpu [--ops OP ...] [--generations G ...] [--quick]
                        [--jobs N] [--tag TAG] [--write-budget]

For each case (an op of this package at one shape, or an anchor: JAX's own
Pallas TPU kernels or XLA at the same shape) and TPU generation, one
subprocess AOT-compiles one program with libtpu's final-bundles dump
(``LIBTPU_INIT_ARGS``, read once per process) and walks its listings
(``bench.tpu_bundles``): grid, bundles per grid-loop trip (first / steady /
last), the bundle path (bundles issued, skipped branches not counted), the
time it implies at the generation's clock (``bench.roofline.SPECS``), and the
op mix. A row's ``ratio`` is ours / the best anchor of its group.

Writes ``bench/results/tpu-bundles-<libtpu>-<date>.json`` and ``.md``
(``--tag`` adds to the name). ``--write-budget`` (re)writes
``tests/tpu_bundles_budget.json`` from the budget cases (the CI test
``tests/test_tpu_bundles_budget.py`` compiles the same programs).
Not counted: DMA waits, MXU result stalls, HBM contention (see
docs/benchmarks.md, "Bundle paths").
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import functools
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
BUDGET = ROOT / "tests" / "tpu_bundles_budget.json"
DUMP_FLAGS = ("--xla_jf_dump_to={dir} --xla_jf_dump_llo_text=true "
              "--xla_jf_dump_llo_pass_label_regex=final_bundles")
DEFAULT_GENERATIONS = ("v5e", "v6e", "v5p")
# Budget: bundles per steady step may grow this much before the test fails.
BUDGET_SLACK = 1.05
# Cases the CI budget test compiles (small shapes, a few seconds each).
BUDGET_CASES = ("budget flash_attention fwd causal|ours",
                "budget decode_attention|ours",
                "budget int8_matmul M=256|ours", "budget giou_loss|ours",
                "budget grouped_matmul|ours")
BUDGET_GENERATION = "v5e"


# ------------------------------------------------------------------ cases
def _S(shape, dtype):
  import jax
  return jax.ShapeDtypeStruct(shape, dtype)


TOPOLOGY = None                    # set by compile_and_walk
GENERATION = None                  # set by compile_and_walk
ATTN = (1, 8, 2048, 128)          # batch, heads, length, head_dim
DECODE = dict(batch=8, heads=32, kv_heads=8, length=4096, head_dim=128,
              page=64)
MM = dict(k=4096, n=4096)


def _attention_cases(quick):
  import jax
  import jax.numpy as jnp
  import pallas_kernels as pk
  from jax.experimental.pallas.ops.tpu import flash_attention as jfa
  from jax.experimental.pallas.ops.tpu.splash_attention import (
      splash_attention_kernel as sk, splash_attention_mask as sm)
  b, h, l, d = ATTN
  qkv = [_S(ATTN, jnp.bfloat16)] * 3
  scale = d ** -0.5
  out = {}
  group = "flash_attention fwd causal"
  out[f"{group}|ours"] = (lambda q, k, v: pk.flash_attention(
      q, k, v, causal=True), qkv, None)
  # 128 (both kernels' default) ran ~3.5x slower than 512 here: not rerun.
  blocks = (1024,) if quick else (512, 1024)
  for bs in blocks:
    sizes = jfa.BlockSizes(block_q=bs, block_k_major=bs, block_k=bs,
                           block_b=1, block_q_major_dkv=bs,
                           block_k_major_dkv=bs, block_k_dkv=bs,
                           block_q_dkv=bs, block_k_major_dq=bs,
                           block_k_dq=bs, block_q_dq=bs)
    out[f"{group}|jax flash_attention {bs}"] = (functools.partial(
        lambda q, k, v, sizes: jfa.flash_attention(
            q, k, v, causal=True, sm_scale=scale, block_sizes=sizes),
        sizes=sizes), qkv, None)

    def splash(q, k, v, bs=bs):
      mask = sm.MultiHeadMask([sm.CausalMask((l, l))] * h)
      kernel = sk.make_splash_mha(
          mask, head_shards=1, q_seq_shards=1,
          block_sizes=sk.BlockSizes(block_q=bs, block_kv=bs,
                                    block_kv_compute=bs, block_q_dkv=bs,
                                    block_kv_dkv=bs, block_kv_dkv_compute=bs,
                                    block_q_dq=bs, block_kv_dq=bs))
      return jax.vmap(kernel)(q * scale, k, v)
    out[f"{group}|splash_attention {bs}"] = (splash, qkv, None)

  group = "flash_attention fwd+bwd causal"

  def ours_bwd(q, k, v):
    return jax.grad(lambda *a: pk.flash_attention(*a, causal=True).astype(
        jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v)
  out[f"{group}|ours"] = (ours_bwd, qkv, None)
  for bs in (512,):
    sizes = jfa.BlockSizes(block_q=bs, block_k_major=bs, block_k=bs,
                           block_b=1, block_q_major_dkv=bs,
                           block_k_major_dkv=bs, block_k_dkv=bs,
                           block_q_dkv=bs, block_k_major_dq=bs,
                           block_k_dq=bs, block_q_dq=bs)

    def jax_bwd(q, k, v, sizes=sizes):
      return jax.grad(lambda *a: jfa.flash_attention(
          *a, causal=True, sm_scale=scale, block_sizes=sizes).astype(
              jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v)
    out[f"{group}|jax flash_attention {bs}"] = (jax_bwd, qkv, None)
  return out


def _on_target(fn, *args, **kwargs):
  """Calls ``fn`` under an abstract mesh of the target TPU (kernels that
  read the chip's kind from the default device, absent on a CPU host)."""
  import jax
  from jax._src import mesh as mesh_lib
  import pallas_kernels.tpu_aot as tpu_aot
  dev = tpu_aot.topology_devices(TOPOLOGY)[0]
  abstract = mesh_lib.AbstractMesh(
      (1,), ("_",), abstract_device=mesh_lib.AbstractDevice(
          device_kind=dev.device_kind, num_cores=getattr(dev, "num_cores", 1),
          platform="tpu"))
  with jax.sharding.use_abstract_mesh(abstract):
    return fn(*args, **kwargs)


def _decode_cases(quick):
  import jax.numpy as jnp
  import numpy as np
  import pallas_kernels as pk
  from jax.experimental.pallas.ops.tpu.paged_attention import (
      paged_attention_kernel as pak)
  from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
      kernel as rpa)
  c = DECODE
  b, h, hk, s, d, page = (c["batch"], c["heads"], c["kv_heads"], c["length"],
                          c["head_dim"], c["page"])
  pps = s // page
  lengths = [s] * b
  table = np.arange(b * pps).reshape(b, pps).tolist()
  flat_table = sum(table, [])
  out = {}
  group = "decode_attention"
  out[f"{group}|ours"] = (
      lambda q, k, v, n: pk.decode_attention(q, k, v, n),
      [_S((b, h, 1, d), jnp.bfloat16), _S((b, hk, s, d), jnp.bfloat16),
       _S((b, hk, s, d), jnp.bfloat16), _S((b,), jnp.int32)], {3: lengths})
  out[f"{group}|ours paged {page}"] = (
      lambda q, k, v, n, t: pk.decode_attention(q, k, v, n, page_table=t),
      [_S((b, h, 1, d), jnp.bfloat16), _S((b * pps, hk, page, d),
                                          jnp.bfloat16),
       _S((b * pps, hk, page, d), jnp.bfloat16), _S((b,), jnp.int32),
       _S((b, pps), jnp.int32)], {3: lengths, 4: flat_table})
  for ppcb in (16,) if quick else (8, 16):
    out[f"{group}|jax paged_attention {ppcb}x{page}"] = (
        functools.partial(lambda q, k, v, n, t, p: pak.paged_attention(
            q, k, v, n, t, pages_per_compute_block=p), p=ppcb),
        [_S((b, h, d), jnp.bfloat16), _S((hk, b * pps, page, d),
                                         jnp.bfloat16),
         _S((hk, b * pps, page, d), jnp.bfloat16), _S((b,), jnp.int32),
         _S((b, pps), jnp.int32)], {3: lengths, 4: flat_table})
  # Explicit blocks: its tuned table needs an attached TPU to look up.
  for kvp in () if quick else (16,):
    out[f"{group}|jax ragged_paged_attention {kvp}x{page}"] = (
        functools.partial(
            lambda q, kv, n, t, cu, ns, p: _on_target(
                rpa.ragged_paged_attention, q, kv, n, t, cu, ns,
                sm_scale=d ** -0.5, num_kv_pages_per_block=p,
                num_queries_per_block=8), p=kvp),
        [_S((b, h, d), jnp.bfloat16),
         _S((b * pps, page, 2 * hk, d), jnp.bfloat16), _S((b,), jnp.int32),
         _S((b, pps), jnp.int32), _S((b + 1,), jnp.int32),
         _S((1,), jnp.int32)],
        {2: lengths, 3: flat_table, 4: list(range(b + 1)), 5: [b]})
  return out


# vLLM-like ragged batches (Llama-3-8B attention: 32 q heads, 8 kv heads,
# head_dim 128, bf16 cache of 32-token pages, 256 pages per sequence):
# name -> (new tokens per sequence, cache length per sequence).
# The cache has at least 8192 pages (1 GiB): a cache that fits VMEM is put
# there by XLA, which no serving cache is.
RAGGED = dict(heads=32, kv_heads=8, head_dim=128, page=32, pages_per_seq=256,
              min_pages=8192)
RAGGED_BATCHES = {
    "mixed 2048+127x1 kv8k": ([2048] + [1] * 127, [8192] * 128),
    "decode 256x1 kv4k-8k": ([1] * 256,
                             [4096 + (i * 4096) // 256 for i in range(256)]),
    "prefill chunk 2048 of kv8k": ([2048], [8192]),
}
# JAX's (num_kv_pages_per_block, num_queries_per_block): its tuned table's
# choice at this key (8, 32) and larger blocks.
RAGGED_JAX_BLOCKS = ((8, 32), (16, 32), (16, 64), (32, 64), (16, 128))


def ragged_metadata(q_lens, kv_lens, pps=None):
  """Concrete (kv_lens, flat page table, cu_q_lens, num_seqs) of a batch:
  pages in order, sequence i's pages after sequence i - 1's."""
  import numpy as np
  pps = pps or RAGGED["pages_per_seq"]
  s = len(q_lens)
  table = np.arange(s * pps, dtype=np.int32).reshape(s, pps)
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  return (np.asarray(kv_lens, np.int32), table, cu,
          np.asarray([s], np.int32))


def _ragged_cases(quick):
  """``ragged_paged_attention`` at the ``RAGGED_BATCHES``: ours against
  JAX's kernel at explicit blocks, and ``write_kv_pages`` against XLA's
  scatter (its tuned table needs an attached TPU).
  Ours' work items (XLA fusions from the metadata) are entry parameters
  with the values those fusions compute, so the walk follows its data-
  dependent steps exactly; the XLA work that computes them is not
  counted (a few small fusions over S and T)."""
  import jax.numpy as jnp
  import pallas_kernels as pk
  from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
      kernel as rpa)
  from pallas_kernels.ragged import mosaic_tpu
  c = RAGGED
  h, hk, d, page, pps = (c["heads"], c["kv_heads"], c["head_dim"], c["page"],
                         c["pages_per_seq"])
  out = {}
  batches = list(RAGGED_BATCHES.items())[:1] if quick else RAGGED_BATCHES.items()
  for name, (q_lens, kv_lens) in batches:
    group = f"ragged_paged_attention {name}"
    t, s = sum(q_lens), len(q_lens)
    lens, table, cu, ns = ragged_metadata(q_lens, kv_lens)
    pool = (max(s * pps, c["min_pages"]), page, 2 * hk, d)
    base, params = _ragged_entry(t, h, pool, pps, lens, table, cu, ns)
    # Ours at its default (a query block per class of sequence), and at
    # one query block for all: 32 (the single-class default before the
    # classes) and the one that suits the batch (1 token per item for
    # decodes, 128 for prefill).
    for nq in (None, 32, 1 if max(q_lens) == 1 else 128):
      plans = mosaic_tpu.make_plans(t, h, hk, d, s, page, pps, 2, 2,
                                    num_queries_per_block=nq,
                                    generation=GENERATION or "v5e")
      call = functools.partial(pk.ragged_paged_attention, sm_scale=d ** -0.5,
                               num_queries_per_block=nq)
      out[f"{group}|ours{'' if nq is None else f' q{nq}'}"] = (
          _with_work_items(call, plans, cu, ns, lens, t, base, params))
    for kvp, nq in RAGGED_JAX_BLOCKS[:1] if quick else RAGGED_JAX_BLOCKS:
      out[f"{group}|jax ragged_paged_attention {kvp}x{page} q{nq}"] = (
          functools.partial(
              lambda q, kv, n, tb, cu_, ns_, p, b: _on_target(
                  rpa.ragged_paged_attention, q, kv, n, tb, cu_, ns_,
                  sm_scale=d ** -0.5, num_kv_pages_per_block=p,
                  num_queries_per_block=b,
                  # Larger blocks overflow the default 16 MiB scope.
                  vmem_limit_bytes=None if p * b <= 1024 else 64 << 20),
              p=kvp, b=nq),
          base, params)
    # The step before: the batch's new K/V rows into their pages, against
    # the XLA scatter (backend="reference"); the cache is donated, as a
    # serving loop does (else both copy the whole pool first).
    new_kv = _S((t, 2 * hk, d), jnp.bfloat16)
    for backend, label in ((None, "ours"), ("reference", "xla reference")):
      out[f"write_kv_pages {name}|{label}"] = (
          functools.partial(
              lambda kv, new, n, tb, cu_, ns_, be: pk.write_kv_pages(
                  kv, new, n, tb, cu_, ns_, backend=be), be=backend),
          [base[1], new_kv] + base[2:], params, (0,))
  return out


# DeepSeek-V3's absorbed MLA row (latent 512 + rope 64), bf16, 64-token pages
# (16-token ones: the 256 x 512 table would not fit SMEM); 16 heads (128 over
# 8-way tensor parallelism) and 128. name -> (heads, q lens, kv lens).
MLA = dict(latent=512, rope=64, page=64, pages_per_seq=128, min_pages=8192)
MLA_BATCHES = {
    f"decode 256x1 kv8k H{h}": (h, [1] * 256, [8192] * 256) for h in (16, 128)}


def _mla_cases(quick):
  """``mla_ragged_paged_attention`` at the ``MLA_BATCHES``, ours only (JAX
  has no MLA paged kernel), at the default query block and at one token per
  item; work items as entry parameters as in ``_ragged_cases``."""
  import pallas_kernels as pk
  from pallas_kernels.ragged import mosaic_tpu
  c = MLA
  d, page, pps = c["latent"] + c["rope"], c["page"], c["pages_per_seq"]
  out = {}
  batches = list(MLA_BATCHES.items())[:1] if quick else MLA_BATCHES.items()
  for name, (h, q_lens, kv_lens) in batches:
    group = f"mla_ragged_paged_attention {name}"
    t, s = sum(q_lens), len(q_lens)
    lens, table, cu, ns = ragged_metadata(q_lens, kv_lens, pps)
    pool = (max(s * pps, c["min_pages"]), page, d)
    base, params = _ragged_entry(t, h, pool, pps, lens, table, cu, ns)
    for nq in (None, 1):
      plans = mosaic_tpu.make_plans(t, h, 1, d, s, page, pps, 2, 2,
                                    num_queries_per_block=nq, channels=1,
                                    generation=GENERATION or "v5e")
      call = functools.partial(pk.mla_ragged_paged_attention,
                               latent_dim=c["latent"], sm_scale=192 ** -0.5,
                               num_queries_per_block=nq)
      out[f"{group}|ours{'' if nq is None else f' q{nq}'}"] = (
          _with_work_items(call, plans, cu, ns, lens, t, base, params))
  return out


def _ragged_entry(t, h, pool, pps, lens, table, cu, ns):
  """The ragged ops' entry specs (bf16 q [t, h, D] and page pool ``pool``,
  int32 metadata) and the metadata's values as entry parameters."""
  import jax.numpy as jnp
  s = len(lens)
  base = [_S((t, h, pool[-1]), jnp.bfloat16), _S(pool, jnp.bfloat16),
          _S((s,), jnp.int32), _S((s, pps), jnp.int32),
          _S((s + 1,), jnp.int32), _S((1,), jnp.int32)]
  params = {2: lens.tolist(), 3: table.ravel().tolist(), 4: cu.tolist(),
            5: ns.tolist()}
  return base, params


def _with_work_items(call, plans, cu, ns, lens, t, base, params):
  """(fn, specs, params) of ``call(q, kv, lens, table, cu, ns)`` whose work
  items (XLA fusions of the metadata, one set per launch's plan) are entry
  parameters holding the values those fusions compute, so the walk follows
  the kernel's data-dependent steps exactly."""
  import jax.numpy as jnp
  import numpy as np
  from pallas_kernels.ragged import mosaic_tpu, reference
  bounds = reference.seq_bounds(jnp.asarray(cu), jnp.asarray(ns), t)

  def key(p):   # what fixes a plan's items
    return p.tq, p.items, p.min_q, p.max_q
  per_plan = [(key(p), [np.asarray(v, np.int32) for v in
                        mosaic_tpu.work_items(bounds, jnp.asarray(lens), p)])
              for p in plans]
  items = [v for _, vs in per_plan for v in vs]

  def ours(q, kv, n, tb, cu_, ns_, *fixed):
    table, at = {}, 0
    for k, vs in per_plan:
      table[k] = tuple(fixed[at:at + len(vs)])
      at += len(vs)
    original = mosaic_tpu.work_items
    # Other kernels traced beside (the GPU branch) compute their own.
    mosaic_tpu.work_items = lambda b, l, p: table.get(key(p)) or original(
        b, l, p)
    try:
      return call(q, kv, n, tb, cu_, ns_)
    finally:
      mosaic_tpu.work_items = original
  return (ours, base + [_S(v.shape, jnp.int32) for v in items],
          {**params, **{6 + i: v.ravel().tolist()
                        for i, v in enumerate(items)}})


def _matmul_cases(quick):
  import jax
  import jax.numpy as jnp
  import pallas_kernels as pk
  k, n = MM["k"], MM["n"]
  out = {}
  for m in (16,) if quick else (16, 2048):
    group = f"int8_matmul M={m}"
    xw = [_S((m, k), jnp.int8), _S((k, n), jnp.int8)]
    out[f"{group}|ours"] = (pk.int8_matmul, xw, None)
    out[f"{group}|xla int8 dot_general"] = (
        lambda x, w: jax.lax.dot_general(
            x, w, (((1,), (0,)), ((), ())),
            preferred_element_type=jnp.int32), xw, None)
  for m in (16,) if quick else (16, 64):
    for fmt in ("int8",) if quick else ("int8", "int4 g128", "fp8"):
      group = f"quantized_matmul {fmt} weight-only M={m}"
      if fmt in ("int8", "fp8"):  # per output channel scales
        dtype = jnp.int8 if fmt == "int8" else jnp.float8_e4m3fn
        args = [_S((m, k), jnp.bfloat16), _S((k, n), dtype),
                _S((n,), jnp.float32)]
        ours = lambda x, w, s: pk.quantized_matmul(x, w, w_scale=s,
                                                   weight_only=True)
        xla = lambda x, w, s: (jnp.dot(x, w.astype(jnp.bfloat16),
                                       preferred_element_type=jnp.float32)
                               * s).astype(jnp.bfloat16)
      else:
        args = [_S((m, k), jnp.bfloat16), _S((k, n), jnp.int4),
                _S((k // 128, n), jnp.float32)]
        ours = lambda x, w, s: pk.quantized_matmul(
            x, w, w_scale=s, group_size=128, weight_only=True)
        xla = lambda x, w, s: jnp.dot(
            x, (w.astype(jnp.float32).reshape(k // 128, 128, n)
                * s[:, None, :]).reshape(k, n).astype(jnp.bfloat16),
            preferred_element_type=jnp.float32).astype(jnp.bfloat16)
      out[f"{group}|ours"] = (ours, args, None)
      out[f"{group}|xla bf16 dot (dequantized w)"] = (xla, args, None)
  return out


def _box_cases(quick):
  import jax.numpy as jnp
  import pallas_kernels as pk
  out = {}
  n = 1 << 16
  pair = [_S((n, 4), jnp.float32)] * 2
  for backend, label in ((None, "ours"), ("reference", "xla reference")):
    out[f"giou_loss|{label}"] = (functools.partial(
        lambda a, b, be: pk.giou_loss(a, b, reduction="mean", backend=be),
        be=backend), pair, None)
    out[f"box_iou 1024x1024|{label}"] = (functools.partial(
        lambda a, b, be: pk.box_iou(a, b, backend=be), be=backend),
        [_S((1024, 4), jnp.float32)] * 2, None)
    out[f"nms 4096|{label}"] = (functools.partial(
        lambda bx, sc, be: pk.nms(bx, sc, iou_threshold=0.5,
                                  max_output_size=100, backend=be),
        be=backend), [_S((4096, 4), jnp.float32), _S((4096,), jnp.float32)],
        None)
    if quick:
      continue
    out[f"batched_nms 4x4096 8 classes|{label}"] = (functools.partial(
        lambda bx, sc, c, be: pk.batched_nms(
            bx, sc, class_ids=c, iou_threshold=0.5, max_output_size=100,
            backend=be), be=backend),
        [_S((4, 4096, 4), jnp.float32), _S((4, 4096), jnp.float32),
         _S((4, 4096), jnp.int32)], None)
    for kind in ("iou", "giou", "diou", "ciou"):
      metric, loss = getattr(pk, kind), getattr(pk, f"{kind}_loss")
      out[f"{kind} {n}|{label}"] = (functools.partial(
          lambda a, b, f, be: f(a, b, backend=be), f=metric, be=backend),
          pair, None)
      if kind != "giou":  # giou_loss: above
        out[f"{kind}_loss|{label}"] = (functools.partial(
            lambda a, b, f, be: f(a, b, reduction="mean", backend=be),
            f=loss, be=backend), pair, None)
      if kind != "iou":  # box_iou: above
        out[f"pairwise_{kind} 1024x1024|{label}"] = (functools.partial(
            lambda a, b, f, be: f(a, b, backend=be),
            f=getattr(pk, f"pairwise_{kind}"), be=backend),
            [_S((1024, 4), jnp.float32)] * 2, None)
  return out


def _quantize_cases(quick):
  import jax.numpy as jnp
  import pallas_kernels as pk
  x = [_S((4096, 4096), jnp.bfloat16)]
  out = {}
  for backend, label in ((None, "ours"), ("reference", "xla reference")):
    out[f"quantize_int8 4096x4096 bf16|{label}"] = (functools.partial(
        lambda x, be: pk.quantize_int8(x, backend=be), be=backend), x, None)
    if quick:
      continue
    out[f"quantize int4 g128 4096x4096 bf16|{label}"] = (functools.partial(
        lambda x, be: pk.quantize(x, "int4", group_size=128, backend=be),
        be=backend), x, None)
  return out


# Per-device MoE projections: (tokens, d_model, d_expert, experts, top_k).
MOE = {"mixtral-8x7b": (2048, 4096, 14336, 8, 2),
       "deepseek-v3": (2048, 7168, 2048, 256, 8),
       "qwen3-30b-a3b": (2048, 2048, 768, 128, 8)}


def moe_group_sizes(rows: int, experts: int, routing: str):
  """Rows per expert: "balanced" (equal) or "skewed" (Zipf-like, a quarter
  of the experts empty), summing to ``rows``."""
  import numpy as np
  if routing == "balanced":
    sizes = np.full(experts, rows // experts)
    sizes[: rows % experts] += 1
    return sizes.astype(np.int32)
  weights = 1.0 / np.arange(1, experts + 1)
  weights[experts - experts // 4:] = 0
  sizes = np.floor(rows * weights / weights.sum()).astype(np.int32)
  sizes[0] += rows - sizes.sum()
  return sizes


GMM_TILES = (512, 1024, 1024)  # ours' default on v5e, v6e, v5p


def _gmm_ours(rows, e, sizes, tgmm, tiles=None):
  """(fn, metadata shapes, walker params): ours' gmm or tgmm with its work
  list as entry parameters 2.. (values computed here from ``sizes``), at
  ``tiles`` or the generation's default (v4's 16 MiB takes smaller ones)."""
  import jax.numpy as jnp
  import numpy as np
  from pallas_kernels.gmm import mosaic_tpu
  tiles = tiles or mosaic_tpu.DEFAULT_TILES.get(GENERATION, GMM_TILES)
  items = mosaic_tpu.metadata(jnp.asarray(sizes), rows, min(tiles[0], rows),
                              e, with_uncovered=not tgmm)
  params = {2 + i: np.ravel(np.asarray(v)) for i, v in enumerate(items)}
  shapes = [_S(np.shape(v), jnp.int32) for v in items]

  def fn(a, b, *items):
    if tgmm:
      return mosaic_tpu.tgmm(a, b, None, e, tiles=tiles, items=items)
    return mosaic_tpu.gmm(a, b, None, tiles=tiles, items=items)
  return fn, shapes, params


def _gmm_cases(quick):
  """The up-projection (lhs [rows, D] x [E, D, F]) forward and its weight
  gradient (tgmm), ours against megablox at two tilings. Each kernel's
  group metadata (its scalar-prefetched work list and dynamic grid bound)
  is an entry parameter whose values, computed here from the routing, the
  walker is given: the data-dependent steps are followed exactly."""
  import importlib
  import jax.numpy as jnp
  import numpy as np
  # The module (its package exports the function under the same name).
  mb = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")

  def megablox(rows, e, sizes, tiling, tgmm):
    (offsets, ids, tile_ids), count = mb.make_group_metadata(
        group_sizes=jnp.asarray(sizes), m=rows, tm=min(tiling[0], rows),
        start_group=jnp.int32(0), num_nonzero_groups=e,
        visit_empty_groups=tgmm)
    values = (offsets, ids, tile_ids, count)
    params = {2 + i: np.ravel(np.asarray(v)) for i, v in enumerate(values)}
    shapes = [_S(np.shape(v), jnp.int32) for v in values]

    def fn(a, b, *meta):
      original = mb.make_group_metadata
      mb.make_group_metadata = lambda **_: (tuple(meta[:3]), meta[3])
      try:
        if tgmm:
          return mb.tgmm(a.T, b, jnp.asarray(sizes),
                         preferred_element_type=jnp.bfloat16, tiling=tiling)
        return mb.gmm(a, b, jnp.asarray(sizes),
                      preferred_element_type=jnp.bfloat16, tiling=tiling)
      finally:
        mb.make_group_metadata = original
    return fn, shapes, params

  out = {}
  models = ("mixtral-8x7b",) if quick else tuple(MOE)
  for model in models:
    tokens, d, f, e, top_k = MOE[model]
    rows = tokens * top_k
    for routing in ("balanced",) if quick else ("balanced", "skewed"):
      sizes = moe_group_sizes(rows, e, routing)
      for tgmm in (False, True):
        group = f"grouped_matmul {'tgmm ' if tgmm else ''}{model} {routing}"
        args = [_S((rows, d), jnp.bfloat16),
                _S((rows, f) if tgmm else (e, d, f), jnp.bfloat16)]
        fn, shapes, params = _gmm_ours(rows, e, sizes, tgmm)
        out[f"{group}|ours"] = (fn, args + shapes, params)
        # megablox's default tiling, and the one MaxText passes (faster).
        tilings = ((128, 128, 128), (512, 1024, 1024))
        for tiling in tilings if model == "mixtral-8x7b" else tilings[1:]:
          fn, shapes, params = megablox(rows, e, sizes, tiling, tgmm)
          name = f"megablox {'tgmm' if tgmm else 'gmm'} {tiling}"
          out[f"{group}|{name}"] = (fn, args + shapes, params)
  return out


def _gmm_budget():
  import jax.numpy as jnp
  sizes = moe_group_sizes(1000, 4, "skewed")
  fn, shapes, params = _gmm_ours(1024, 4, sizes, False, (256, 512, 512))
  return (fn, [_S((1024, 512), jnp.bfloat16), _S((4, 512, 512), jnp.bfloat16)]
          + shapes, params)


def _budget_cases(quick):
  """Small shapes of four kernels for tests/test_tpu_bundles_budget.py."""
  import jax.numpy as jnp
  import pallas_kernels as pk
  qkv = [_S((1, 2, 1024, 128), jnp.bfloat16)] * 3
  return {
      # Blocks pinned: the budget tracks the kernel, not the table.
      "budget flash_attention fwd causal|ours": (
          lambda q, k, v: pk.flash_attention(q, k, v, causal=True,
                                             block_sizes=(1024, 1024)), qkv,
          None),
      "budget decode_attention|ours": (
          lambda q, k, v, n: pk.decode_attention(q, k, v, n),
          [_S((2, 8, 1, 128), jnp.bfloat16),
           _S((2, 2, 1024, 128), jnp.bfloat16),
           _S((2, 2, 1024, 128), jnp.bfloat16), _S((2,), jnp.int32)],
          {3: [1024, 1024]}),
      "budget int8_matmul M=256|ours": (
          pk.int8_matmul, [_S((256, 1024), jnp.int8),
                           _S((1024, 1024), jnp.int8)], None),
      "budget grouped_matmul|ours": _gmm_budget(),
      "budget giou_loss|ours": (
          lambda a, b: pk.giou_loss(a, b, reduction="mean"),
          [_S((4096, 4), jnp.float32)] * 2, None),
  }


OPS = {"attention": _attention_cases, "decode": _decode_cases,
       "ragged": _ragged_cases, "mla": _mla_cases, "matmul": _matmul_cases, "boxes": _box_cases, "gmm": _gmm_cases,
       "quantize": _quantize_cases}


def cases(ops=tuple(OPS), quick=False) -> dict:
  """name -> (fn, entry specs, runtime scalar values by argument index for
  the walk or None[, donated argument indices])."""
  out = {}
  for op in ops:
    out.update(OPS[op](quick) if op in OPS else _budget_cases(quick))
  return out


# ----------------------------------------------------------- one compile
def compile_and_walk(case: str, generation: str, dump: str,
                     quick: bool = False, case_table=None) -> dict:
  """In a process started with the dump flags for ``dump`` in
  ``LIBTPU_INIT_ARGS`` (``run_one_subprocess``): compiles ``case`` for
  ``generation`` and walks its listings. ``case_table``: a callable giving
  the case table once ``GENERATION`` is set (default: this module's)."""
  from bench import tpu_bundles
  import pallas_kernels.tpu_aot as tpu_aot
  op = case.split("|")[0]
  global TOPOLOGY, GENERATION
  TOPOLOGY = tpu_aot.GENERATION_TOPOLOGY[generation]
  GENERATION = generation
  table = (case_table() if case_table is not None
           else cases((_family(op),), quick))
  fn, args, params, *donated = table[case]
  t0 = time.time()
  tpu_aot.compile_for_tpu(fn, *args,
                          topology=tpu_aot.GENERATION_TOPOLOGY[generation],
                          donate_argnums=donated[0] if donated else ())
  compile_s = time.time() - t0
  paths = tpu_bundles.program_path(dump, params)
  import shutil
  if not os.environ.get("BENCH_TPU_KEEP_DUMP"):
    shutil.rmtree(dump, ignore_errors=True)
  else:
    print("dump kept in", dump, file=sys.stderr)
  out = summarize(paths, generation, compile_s)
  if os.environ.get("BENCH_TPU_KEEP_DUMP"):
    out["dump"] = dump
  return out


def _rewalk(row: dict, quick: bool) -> dict:
  """``row`` walked again from its kept dump (BENCH_TPU_KEEP_DUMP=1)."""
  from bench import tpu_bundles
  if "dump" not in row or not os.path.isdir(row["dump"]):
    return row
  params = cases((_family(row["group"]),), quick)[row["case"]][2]
  out = summarize(tpu_bundles.program_path(row["dump"], params),
                  row["generation"], row.get("compile_s", 0.0))
  keep = {k: row[k] for k in ("case", "group", "impl", "generation", "dump",
                              "wall_s") if k in row}
  return dict(out, **keep)


def _family(op: str) -> str:
  if op.startswith("budget "):
    return "budget"
  for fam, fn in (("attention", "flash_attention"),
                  ("ragged", "write_kv_pages"),
                  ("mla", "mla_ragged_paged_attention"),
                  ("ragged", "ragged_paged_attention"), ("decode", "decode"),
                  ("gmm", "grouped_matmul"), ("matmul", "matmul"),
                  ("quantize", "quantize")):
    if fn and fn in op:
      return fam
  return "boxes"


def summarize(paths: dict, generation: str, compile_s: float = 0.0) -> dict:
  """One program's figures from its walked listings (``program_path``):
  kernels = listings with a grid loop or that are not the program's
  start-up/finalization; the path sums every listing once."""
  from bench import roofline
  clock = roofline.SPECS[generation]["clock_hz"]
  kernels = {}
  total = 0
  mix = {}
  unresolved = 0
  for name, p in paths.items():
    total += p.total
    unresolved += p.unresolved_branches
    for k, v in p.mix.items():
      mix[k] = mix.get(k, 0) + v
    if name in ("TLP",) or name.startswith("<"):
      continue
    kernels[name] = dict(grid=p.grid, trips=len(p.iterations),
                         first=p.first, steady=p.steady, last=p.last,
                         total=p.total, static=p.static,
                         unresolved=p.unresolved_branches,
                         dma=p.mix["dma"], dma_bytes=p.mix["dma_bytes"])
  main = max(kernels.items(), key=lambda kv: kv[1]["total"],
             default=(None, {}))
  kernel_unresolved = sum(k["unresolved"] for k in kernels.values())
  return dict(generation=generation, bundles=total, time_us=total / clock * 1e6,
              clock_ghz=clock / 1e9, main_kernel=main[0],
              grid=main[1].get("grid"), steps=_prod(main[1].get("grid")),
              first=main[1].get("first"), steady=main[1].get("steady"),
              last=main[1].get("last"), mix=mix, unresolved=unresolved,
              kernel_unresolved=kernel_unresolved,
              kernels=kernels, compile_s=round(compile_s, 2))


def _prod(grid):
  if not grid:
    return None
  n = 1
  for g in grid:
    n *= g
  return n


def run_one_subprocess(case: str, generation: str, quick: bool,
                       timeout: float = 900, module: str = "bench.tpu") -> dict:
  dump = tempfile.mkdtemp(prefix="tpubundles-")
  env = dict(os.environ)
  env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
  # libtpu reads its flags once, when it loads: set them for the child.
  env["LIBTPU_INIT_ARGS"] = (env.get("LIBTPU_INIT_ARGS", "") + " "
                             + DUMP_FLAGS.format(dir=dump)).strip()
  cmd = [sys.executable, "-m", module, "--one", case, generation, dump]
  if quick:
    cmd.append("--quick")
  t0 = time.time()
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=str(ROOT))
  except subprocess.TimeoutExpired:
    return dict(generation=generation, error=f"timed out after {timeout} s")
  finally:
    if not os.environ.get("BENCH_TPU_KEEP_DUMP"):
      import shutil
      shutil.rmtree(dump, ignore_errors=True)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
  if proc.returncode or not lines:
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return dict(generation=generation, error=" / ".join(tail)[-400:])
  out = json.loads(lines[-1])
  out["wall_s"] = round(time.time() - t0, 1)
  return out


# ------------------------------------------------------------------ table
def versions() -> dict:
  import importlib.metadata as md
  out = {}
  for pkg in ("jax", "jaxlib", "libtpu"):
    try:
      out[pkg] = md.version(pkg)
    except md.PackageNotFoundError:
      out[pkg] = None
  return out


def add_ratios(rows: list[dict]) -> None:
  """``ratio`` = ours' bundle path / the best anchor's, per group and
  generation; ``best`` marks that anchor."""
  from bench import roofline
  groups = {}
  for r in rows:
    if "bundles" in r:
      r["hbm_us"] = (r["mix"]["dma_bytes"]
                     / roofline.SPECS[r["generation"]]["hbm"] * 1e6)
      r["bound_us"] = max(r["time_us"], r["hbm_us"])
      groups.setdefault((r["group"], r["generation"]), []).append(r)
  for rs in groups.values():
    anchors = [r for r in rs if not r["impl"].startswith("ours")]
    if not anchors:
      continue
    # A walk with unresolved branches is approximate: prefer exact ones.
    anchors = [r for r in anchors if not r["kernel_unresolved"]] or anchors
    best = min(anchors, key=lambda r: r["bundles"])
    best["best"] = True
    for r in rs:
      if r["impl"].startswith("ours"):
        r["ratio"] = r["bundles"] / best["bundles"]
        best_bound = min(a["bound_us"] for a in anchors)
        r["bound_ratio"] = r["bound_us"] / best_bound
        r["anchor"] = best["impl"]


def markdown(rows: list[dict], meta: dict) -> str:
  out = [f"# Bundle paths ({meta['date']})", "",
         f"jax {meta['jax']}, libtpu {meta['libtpu']}; "
         "`python -m bench.tpu` (docs/benchmarks.md, \"Bundle paths\"). "
         "Bundles issued along the walked path; us = bundles / clock "
         "(v4 1.05, v5e 1.5, v5p/v6e/tpu7x 1.75 GHz; only v5e's is "
         "published); steady = bundles per grid-loop trip in the steady "
         "state; ratio = ours / the best anchor (marked *) of the group. "
         "Not counted: DMA waits, MXU result stalls, HBM contention. "
         "HBM us = the kernels' DMA bytes at the generation's peak HBM rate "
         "(a floor the bundle path does not show; on tpu7x XLA copies "
         "inputs to VMEM outside the kernel, uncounted here). max ratio = "
         "max(us, HBM us) of ours / the smallest of the anchors'.", "",
         "unres: branches of the kernels whose predicate the walk could not "
         "evaluate (runtime data it was not given); it fell through them, "
         "so such a path is approximate.", "",
         "| op | gen | impl | grid | first | steady | last | bundles | us "
         "| ratio | HBM us | max ratio | MXU mm | VALU | XLU | vld | vst | DMAs | DMA MB "
         "| unres |",
         "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: "
         "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
         "| ---: |"]
  from bench import roofline
  for r in rows:
    if "error" in r:
      out.append(f"| {r['group']} | {r['generation']} | {r['impl']} | "
                 f"error: {r['error'][-120:].replace('|', '/')} |" + " |" * 16)
      continue
    m = r["mix"]
    grid = "x".join(map(str, r["grid"])) if r.get("grid") else "-"
    ratio = f"{r['ratio']:.2f}" if "ratio" in r else ""
    star = " *" if r.get("best") else ""
    hbm = m["dma_bytes"] / roofline.SPECS[r["generation"]]["hbm"] * 1e6
    bound = f"{r['bound_ratio']:.2f}" if "bound_ratio" in r else ""
    out.append(
        f"| {r['group']} | {r['generation']} | {r['impl']}{star} | {grid} | "
        f"{r['first'] or ''} | {r['steady'] or ''} | {r['last'] or ''} | "
        f"{r['bundles']} | {r['time_us']:.1f} | {ratio} | {hbm:.1f} | {bound} | "
        f"{m['mxu_matmul']} | {m['valu']} | {m['xlu']} | {m['vld']} | "
        f"{m['vst']} | {m['dma']} | {m['dma_bytes'] / 1e6:.2f} | "
        f"{r['kernel_unresolved'] or ''} |")
  return "\n".join(out) + "\n"


def write_budget(rows: list[dict], meta: dict, path=BUDGET) -> None:
  budget = {r["case"]: dict(steady=r["steady"], bundles=r["bundles"],
                            grid=r["grid"])
            for r in rows if r["case"] in BUDGET_CASES
            and r["generation"] == BUDGET_GENERATION and "bundles" in r}
  missing = set(BUDGET_CASES) - set(budget)
  if missing:
    raise SystemExit(f"--write-budget: no figures for {sorted(missing)}")
  data = dict(libtpu=meta["libtpu"], jax=meta["jax"],
              generation=BUDGET_GENERATION, slack=BUDGET_SLACK,
              date=meta["date"], note="python -m bench.tpu --write-budget",
              cases=budget)
  with open(path, "w") as f:
    json.dump(data, f, indent=1)
    f.write("\n")
  print("wrote", path)


def add_run_arguments(parser) -> None:
  """--no-save, --resume, --report and the child process's --one."""
  parser.add_argument("--no-save", action="store_true")
  parser.add_argument("--resume", metavar="JSONL",
                      help="append each row here; rows already there are "
                      "not compiled again")
  parser.add_argument("--report", action="store_true",
                      help="with --resume: compile nothing, tabulate every "
                      "row of the file")
  parser.add_argument("--one", nargs=3, metavar=("CASE", "GEN", "DUMP"),
                      help=argparse.SUPPRESS)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--ops", nargs="+", choices=sorted(OPS),
                      default=list(OPS))
  parser.add_argument("--generations", nargs="+",
                      default=list(DEFAULT_GENERATIONS))
  parser.add_argument("--quick", action="store_true",
                      help="fewer shapes and anchor block sizes")
  parser.add_argument("--jobs", type=int, default=2)
  parser.add_argument("--tag", default="")
  parser.add_argument("--cases", nargs="+", help="only these case names")
  parser.add_argument("--write-budget", action="store_true",
                      help=f"compile only the budget cases on "
                      f"{BUDGET_GENERATION} and rewrite {BUDGET.name}")
  add_run_arguments(parser)
  parser.add_argument("--rewalk", action="store_true",
                      help="with --resume: walk the kept dumps of its rows "
                      "again (after a change to bench/tpu_bundles.py)")
  parser.add_argument("--ours-only", action="store_true",
                      help="skip the anchors (e.g. for v4 and tpu7x)")
  args = parser.parse_args(argv)
  if args.one:
    print(json.dumps(compile_and_walk(*args.one, quick=args.quick)))
    return 0
  meta = dict(versions(), date=datetime.date.today().isoformat())
  if args.write_budget:
    work = [(c, BUDGET_GENERATION) for c in BUDGET_CASES]
  else:
    names = args.cases or [c for c in cases(tuple(args.ops), args.quick)
                           if not args.ours_only or "|ours" in c]
    work = [(c, g) for g in args.generations for c in names]
  print(f"{len(work)} compiles, {args.jobs} at a time; jax {meta['jax']}, "
        f"libtpu {meta['libtpu']}", flush=True)
  rows = []
  if args.resume and os.path.exists(args.resume):
    with open(args.resume) as f:
      done = [json.loads(l) for l in f if l.strip()]
    keep = {(r["case"], r["generation"]): r for r in done
            if "error" not in r}      # errors are tried again
    if args.rewalk:
      keep = {k: _rewalk(r, args.quick) for k, r in keep.items()}
    if args.report:
      work = list(keep)
    rows = [keep[w] for w in work if w in keep]
    work_left = [w for w in work if w not in keep]
  else:
    work_left = work
  with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
    futures = {pool.submit(run_one_subprocess, c, g, args.quick): (c, g)
               for c, g in work_left}
    for fut in concurrent.futures.as_completed(futures):
      case, gen = futures[fut]
      r = fut.result()
      group, impl = case.split("|")
      r.update(case=case, group=group, impl=impl, generation=gen)
      rows.append(r)
      if args.resume:
        with open(args.resume, "a") as f:
          f.write(json.dumps(r) + "\n")
      print(f"  {gen:5s} {case:60s} " + (
          f"{r['bundles']:>10d} bundles {r['time_us']:9.1f} us"
          f" ({r['wall_s']} s)" if "bundles" in r else
          "ERROR " + r["error"]), flush=True)
  order = {c: i for i, (c, _) in enumerate(work)}
  gens = {g: i for i, g in enumerate(("v5e", "v6e", "v5p", "v4", "tpu7x"))}
  rows.sort(key=lambda r: (r["group"], gens.get(r["generation"], 0),
                           order[r["case"]]))
  add_ratios(rows)
  if args.write_budget:
    write_budget(rows, meta)
    return 0
  print()
  md_text = markdown(rows, meta)
  print(md_text)
  if not args.no_save:
    stem = f"tpu-bundles-{meta['libtpu']}-{meta['date']}"
    if args.tag:
      stem += f"-{args.tag}"
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / f"{stem}.json", "w") as f:
      json.dump(dict(meta, rows=[{k: v for k, v in r.items() if k != "dump"}
                                 for r in rows]), f, indent=1)
    with open(RESULTS / f"{stem}.md", "w") as f:
      f.write(md_text)
    print("wrote", RESULTS / f"{stem}.json")
  return 0


if __name__ == "__main__":
  sys.exit(main())
