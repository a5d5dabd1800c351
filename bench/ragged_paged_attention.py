"""Ragged paged attention (vLLM-like serving steps) against torch SDPA per
sequence over contiguous caches.

    python -m bench.ragged_paged_attention [--quick] [--cases RE] [--tag T]

Cases (H=32, Hkv=8, D=128, bf16, pages of 16; page tables shuffled):
``mixed``: 1 prefill of 2048 new tokens + 127 decodes over 8k caches;
``decode``: 256 decodes over 8k caches; ``chunk``: one 2048-token chunk of
an 8k prompt (its cache holds 6144 earlier tokens); ``decode page 32``.
ours: ``pk.ragged_paged_attention`` (backend=None: the Triton kernel on a
GPU), timed in-program (``Timer.jax``). ``ours[...]``: tile variants of
the short- or long-item launch (``RPA_VARIANTS=1``; ``hf``: kv heads the
fastest grid axis). Peer: torch SDPA on the same
tokens in contiguous ``[B, H, S, D]`` caches, one call per group of
equal-length sequences (the decodes batched, the prefill its own call;
the chunk's causal mask bottom-right aligned, K/V heads repeated); ``err``
is ours against it (max |diff| / max |ref|).
``hbm``: bytes read (the used cache pages + q + out) / time / 4.8 TB/s;
``mxu``: attention FLOPs (4 · visible pairs · H · D) / time / 989 TFLOP/s
(the H200's dense bf16 peak).
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from bench import harness, roofline

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
CASES = [
    dict(name="mixed", prefill=2048, prefill_cache=2048, decodes=127,
         cache=8192),
    dict(name="decode", prefill=0, prefill_cache=0, decodes=256,
         cache=8192),
    dict(name="chunk", prefill=2048, prefill_cache=8192, decodes=0,
         cache=8192),
    dict(name="decode", prefill=0, prefill_cache=0, decodes=256,
         cache=8192, page=32),
]
CASES = [dict(dict(heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                   dtype="bfloat16", page=PAGE), **c) for c in CASES]
QUICK = [dict(name="mixed", prefill=24, prefill_cache=40, decodes=3,
              cache=64, heads=4, kv_heads=2, head_dim=64, dtype="float32",
              page=16)]


def label(c):
  parts = []
  if c["prefill"]:
    parts.append(f"1x{c['prefill']}q/{c['prefill_cache']}kv")
  if c["decodes"]:
    parts.append(f"{c['decodes']}x1q/{c['cache']}kv")
  return (f"{c['name']} {' + '.join(parts)} H{c['heads']}/{c['kv_heads']} "
          f"D{c['head_dim']} page {c['page']}")


def _inputs(c):
  """The paged call's arguments and the contiguous K/V [B, Hkv, S, D] of
  every sequence (prefill first), and the (q_len, kv_len) list."""
  hk, d, page = c["kv_heads"], c["head_dim"], c["page"]
  dtype = jnp.dtype(c["dtype"])
  seqs = ([(c["prefill"], c["prefill_cache"])] if c["prefill"] else []) + [
      (1, c["cache"])] * c["decodes"]
  n = len(seqs)
  capacity = max(kv for _, kv in seqs)
  pages = capacity // page
  keys = jax.random.split(jax.random.key(0), 3)
  k = jax.random.normal(keys[0], (n, hk, capacity, d), dtype)
  v = jax.random.normal(keys[1], (n, hk, capacity, d), dtype)
  tokens = sum(q for q, _ in seqs)
  q = jax.random.normal(keys[2], (tokens, c["heads"], d), dtype)
  table = np.random.default_rng(1).permutation(n * pages).reshape(n, pages)
  both = jnp.stack([k, v], axis=2)                    # [n, hk, 2, S, d]
  both = both.reshape(n, hk, 2, pages, page, d).transpose(0, 3, 4, 1, 2, 5)
  pool = jnp.zeros((n * pages, page, 2 * hk, d), dtype).at[
      jnp.asarray(table.reshape(-1))].set(
          both.reshape(n * pages, page, 2 * hk, d))
  cu = np.concatenate([[0], np.cumsum([s for s, _ in seqs])]).astype(np.int32)
  args = (q, pool, jnp.asarray([kv for _, kv in seqs], jnp.int32),
          jnp.asarray(table, jnp.int32), jnp.asarray(cu),
          jnp.asarray([n], jnp.int32))
  return args, k, v, seqs


def _work(c, seqs):
  """(bytes read: used pages + q + out, FLOPs of the visible pairs)."""
  hk, d, page = c["kv_heads"], c["head_dim"], c["page"]
  itemsize = jnp.dtype(c["dtype"]).itemsize
  pages = sum(-(-kv // page) for _, kv in seqs)
  tokens = sum(q for q, _ in seqs)
  cache = pages * page * 2 * hk * d * itemsize
  qo = 2 * tokens * c["heads"] * d * itemsize
  pairs = sum(q * kv - q * (q - 1) // 2 for q, kv in seqs)
  return cache + qo, 4 * pairs * c["heads"] * d


def _torch_peer(q, k, v, seqs, heads):
  """A thunk of torch SDPA over the contiguous caches (one call per group
  of equal (q_len, kv_len)), returning [T, H, D]; None without torch."""
  torch = harness.torch_module()
  if torch is None:
    return None
  from torch.utils import dlpack
  device = "cuda" if torch.cuda.is_available() else "cpu"
  dt = torch.bfloat16 if q.dtype == jnp.bfloat16 else torch.float32

  def tt(x):
    try:
      return dlpack.from_dlpack(x).to(device)
    except Exception:  # noqa: BLE001  (CPU copies for the quick run)
      return torch.from_numpy(np.array(x, np.float32)).to(device, dt)

  calls = []
  groups = []
  for key in dict.fromkeys(seqs):
    idx = [i for i, x in enumerate(seqs) if x == key]
    groups.append((key, idx))
  qt, kt, vt = tt(q), tt(k), tt(v)
  starts = np.concatenate([[0], np.cumsum([x for x, _ in seqs])])
  from torch.nn.attention.bias import causal_lower_right
  for (ql, kvl), idx in groups:
    rows = torch.as_tensor(np.concatenate(
        [np.arange(starts[i], starts[i] + ql) for i in idx]), device=device)
    qg = qt[rows].reshape(len(idx), ql, heads, -1).transpose(1, 2)
    sel = torch.as_tensor(idx, device=device)
    kg, vg = kt[sel][:, :, :kvl], vt[sel][:, :, :kvl]
    if ql > 1:   # causal, bottom-right aligned; heads repeated (GQA)
      rep = heads // kg.shape[1]
      kg = kg.repeat_interleave(rep, 1).contiguous()
      vg = vg.repeat_interleave(rep, 1).contiguous()
      calls.append((rows, qg.contiguous(), kg, vg,
                    dict(attn_mask=causal_lower_right(ql, kvl))))
    else:
      calls.append((rows, qg.contiguous(), kg.contiguous(), vg.contiguous(),
                    dict(enable_gqa=True)))

  def thunk():
    with torch.no_grad():
      return [torch.nn.functional.scaled_dot_product_attention(
          qg, kg, vg, **kw) for _, qg, kg, vg, kw in calls]

  def gather(outs):
    full = torch.zeros_like(qt)
    for (rows, *_), out in zip(calls, outs):
      full[rows] = out.transpose(1, 2).reshape(len(rows), heads, -1)
    return np.asarray(full.float().cpu())
  return thunk, gather


SHORT_VARIANTS = [  # (block, warps, stages, heads_first): short items
    (64, 4, 3, False), (128, 4, 3, True)]
LONG_VARIANTS = [  # (rows, block, warps, stages, heads_first): long items
    (128, 64, 8, 3, False), (128, 128, 8, 2, True), (64, 64, 4, 3, True),
    (128, 64, 4, 3, True), (128, 32, 8, 3, True)]


def run(case, timer):
  args, k, v, seqs = _inputs(case)
  total_bytes, flops = _work(case, seqs)
  sm_scale = case["head_dim"] ** -0.5
  peak = roofline.SPECS["h200"]
  rows, outs = [], {}
  impls = {"ours": functools.partial(pk.ragged_paged_attention,
                                     sm_scale=sm_scale)}
  if os.environ.get("RPA_VARIANTS"):
    from pallas_kernels.ragged import triton as rt
    group = case["heads"] // case["kv_heads"]
    short, long = rt.tiles(group, case["head_dim"])
    variants = {}
    if case["decodes"]:
      for block, warps, stages, first in SHORT_VARIANTS:
        variants[f"ours[short b{block} w{warps} s{stages}"
                 f"{' hf' if first else ''}]"] = (rt.Tiles(
                     short.tq, short.rows, block, warps, stages, first), long)
    if case["prefill"]:
      for n, block, warps, stages, first in LONG_VARIANTS:
        variants[f"ours[long r{n} b{block} w{warps} s{stages}"
                 f"{' hf' if first else ''}]"] = (short, rt.Tiles(
                     n // group, n, block, warps, stages, first))
    for name, tiles in variants.items():
      impls[name] = functools.partial(_variant, tiles=tiles,
                                      sm_scale=sm_scale)
  for impl, fn in impls.items():
    def timed(fn=fn, impl=impl):
      seconds, out = timer.jax(fn, *args)
      outs[impl] = out
      return seconds
    row = harness.measure(rows, label(case), impl, timed)
    _fractions(row, total_bytes, flops, peak)
  peer = _torch_peer(args[0], k, v, seqs, case["heads"])
  if peer is not None:
    thunk, gather = peer
    row = harness.measure(rows, label(case), "torch_sdpa",
                          lambda: timer.torch(thunk))
    _fractions(row, total_bytes, flops, peak)
    try:
      want = gather(thunk())
      for r in rows:
        if r["impl"] in outs:
          r["err"] = harness.rel_error(np.asarray(outs[r["impl"]],
                                                  np.float32), want)
    except Exception as e:  # noqa: BLE001
      rows[-1]["error"] = f"{type(e).__name__}: {str(e)[:300]}"
  return rows


def _variant(*args, tiles, sm_scale):
  from pallas_kernels.ragged import triton as rt
  return rt.ragged(*args, sm_scale=sm_scale, sliding_window=None,
                   soft_cap=None, k_scale=None, v_scale=None,
                   num_queries_per_block=None, num_kv_pages_per_block=None,
                   vmem_limit_bytes=None, interpret=False,
                   tiles_override=tiles)


def _fractions(row, total_bytes, flops, peak):
  if row["ms"]:
    seconds = row["ms"] / 1e3
    row["hbm"] = total_bytes / seconds / peak["hbm"]
    row["mxu"] = flops / seconds / peak["bf16"]
    row["tb_s"] = total_bytes / seconds / 1e12
    row["tflops"] = flops / seconds / 1e12


def main(argv=None):
  return harness.main("ragged_paged_attention", CASES, QUICK, run,
                      label=label, argv=argv, doc=__doc__,
                      columns=["case", "impl", "ms", "hbm", "tb_s", "mxu",
                               "tflops", "err", "vs_torch_sdpa", "error"])


if __name__ == "__main__":
  main()
