"""Decode attention (one new token per sequence) against JAX's and torch's
attention and the package's flash_attention on the padded cache.

    python -m bench.decode_attention [--quick] [--cases B1] [--tag T] [--out DIR]

ours: ``pallas_kernels.decode_attention`` on the contiguous cache, and
``ours_paged`` on the same tokens in shuffled pages (backend=None: the GPU
kernel on a GPU). Peers in the same run, each on the cache in its own
layout: ``jax.nn.dot_product_attention(key_value_seq_lengths=...)`` with the
XLA and (on a GPU) cuDNN implementations; ``flash``:
``pk.flash_attention`` over the whole padded cache (no lengths); torch
SDPA (``enable_gqa``) over the padded cache where torch is installed.
Cases: H=32, Hkv=8, D=128, bf16, batch 1 and 64, caches 8k..128k (batch 16
at 128k: two copies of a batch-64 cache do not fit in 80 GB), all
sequences full, plus a ragged batch (lengths uniform in [1, S]), and
``int8 kv`` rows (B1 8k, B64 32k): ours on an int8 cache with per-head scales,
the peers on its dequantized bfloat16 copy; head_dim 80 and 96 at B1
32k and B64 8k; and ``page 16`` rows (B1 32k, B64 8k): ours_paged on pages
of 16 rows instead of 64.
JAX impls are timed ``COPIES`` (8) calls per jitted program (each on its own
copy of the inputs, ``Timer.jax``) where K and V take at most 1 GiB (the
batch-1 cases): the host's dispatch of one program (tens of microseconds)
exceeds a B1 8k call, and one call per program would time the host, not
the GPU; within a model's step the calls are also back to back. Larger cases: one call per program.
``hbm`` is the fraction of peak HBM bandwidth (``bench/roofline.py``) the
call reaches on the K/V bytes a decode must read (2 · sum(lengths) · Hkv ·
D · itemsize, at the itemsize of the cache the impl reads: 1 for ours on
an int8 cache); ``err`` is ours against the XLA peer. TPU rows: the Mosaic kernel's work at full length on each
chip's roofline (``mosaic_tpu.cost``); no TPU is measured.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from bench import harness, roofline

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 64
# Calls per timed program where one copy of K and V is at most 1 GiB.
COPIES, COPIES_MAX_BYTES = 8, 1 << 30
CASES = ([dict(batch=1, seq=s, ragged=False) for s in (8192, 32768, 131072)]
         + [dict(batch=64, seq=s, ragged=r) for s in (8192, 32768)
            for r in (False, True)]
         + [dict(batch=16, seq=131072, ragged=False),
            dict(batch=1, seq=8192, ragged=False, cache="int8"),
            dict(batch=64, seq=32768, ragged=False, cache="int8")]
         # head_dims off the powers of two (the GPU kernel reads pieces)
         + [dict(batch=b, seq=s, ragged=False, head_dim=d)
            for b, s in ((1, 32768), (64, 8192)) for d in (80, 96)]
         # pages of 16 rows (vLLM's default) for ours_paged
         + [dict(batch=b, seq=s, ragged=False, page=16)
            for b, s in ((1, 32768), (64, 8192))])
CASES = [dict(dict(heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                   dtype="bfloat16", page=PAGE), **c) for c in CASES]
QUICK = [dict(batch=b, seq=256, ragged=r, heads=4, kv_heads=2, head_dim=64,
              dtype="float32", page=32, **extra)
         for b, r, extra in ((1, False, {}), (3, True, {}),
                             (2, False, dict(cache="int8")))]


def label(case):
  return (f"B{case['batch']} S{case['seq']} H{case['heads']}/"
          f"{case['kv_heads']} D{case['head_dim']}"
          + (" ragged" if case["ragged"] else "")
          + (" int8 kv" if case.get("cache") == "int8" else "")
          + (f" page {case['page']}" if case["page"] != PAGE else ""))


def _inputs(case):
  b, s, hk, d = case["batch"], case["seq"], case["kv_heads"], case["head_dim"]
  dtype = jnp.dtype(case["dtype"])
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (b, case["heads"], 1, d), dtype)
  k = jax.random.normal(keys[1], (b, hk, s, d), dtype)
  v = jax.random.normal(keys[2], (b, hk, s, d), dtype)
  rng = np.random.default_rng(0)
  lengths = (rng.integers(1, s + 1, b) if case["ragged"]
             else np.full(b, s)).astype(np.int32)
  return q, k, v, jnp.asarray(lengths)


def _int8(x):
  """(int8 cache, float32 scales [Hkv]) of x [B, Hkv, S, D]: symmetric,
  one scale per kv head; and the dequantized copy in x's dtype."""
  scale = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=(0, 2, 3)) / 127
  stored = jnp.round(x.astype(jnp.float32) / scale[:, None, None])
  stored = stored.astype(jnp.int8)
  real = stored.astype(jnp.float32) * scale[:, None, None]
  return stored, scale, real.astype(x.dtype)


def _paged(case, k, v):
  b, s, hk, d, page = (case["batch"], case["seq"], case["kv_heads"],
                       case["head_dim"], case["page"])
  pages = s // page
  table = np.random.default_rng(1).permutation(b * pages).reshape(b, pages)

  def to_pages(x):
    out = jnp.zeros((b * pages, hk, page, d), x.dtype)
    return out.at[table].set(
        x.reshape(b, hk, pages, page, d).transpose(0, 2, 1, 3, 4))
  return to_pages(k), to_pages(v), jnp.asarray(table, jnp.int32)


def _peak_bandwidth():
  device = jax.devices()[0]
  spec = roofline.SPECS.get(harness.device_slug(device.device_kind))
  return spec["hbm"] if spec else None


def run(case, timer):
  q, k, v, lengths = _inputs(case)
  ours_k, ours_v, scales = k, v, {}
  if case.get("cache") == "int8":   # ours reads int8, the peers its copy
    ours_k, k_scale, k = _int8(k)
    ours_v, v_scale, v = _int8(v)
    scales = dict(k_scale=k_scale, v_scale=v_scale)
  positions = (2 * int(np.sum(np.asarray(lengths))) * case["kv_heads"]
               * case["head_dim"])
  peak = _peak_bandwidth()
  # Layouts: ours and flash [B, H, T, D] / [B, Hkv, S, D]; jax.nn [B, T, H, D].
  qt, kt, vt = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
  k_pages, v_pages, table = _paged(case, ours_k, ours_v)
  quick = timer.quick
  copies = COPIES if 2 * k.nbytes <= COPIES_MAX_BYTES else 1
  ours = functools.partial(pk.decode_attention, **scales)
  impls = {
      "ours": (ours, (q, ours_k, ours_v, lengths), False),
      "ours_paged": (lambda q, k, v, n, t: ours(q, k, v, n, page_table=t),
                     (q, k_pages, v_pages, lengths, table), False),
  }
  for peer in ("xla",) if quick else ("xla", "cudnn"):
    dpa = functools.partial(jax.nn.dot_product_attention, implementation=peer)
    impls[peer] = (lambda q, k, v, n, dpa=dpa: dpa(
        q, k, v, key_value_seq_lengths=n), (qt, kt, vt, lengths), True)
  impls["flash"] = (functools.partial(pk.flash_attention, causal=True),
                    (q, k, v), False)
  rows, outs = [], {}
  for impl, (fn, args, transposed) in impls.items():
    def timed(fn=fn, args=args, impl=impl, transposed=transposed):
      seconds, out = timer.jax(fn, *args, copies=copies)
      outs[impl] = jnp.swapaxes(out, 1, 2) if transposed else out
      return seconds
    row = harness.measure(rows, label(case), impl, timed)
    cache = ours_k if impl.startswith("ours") else k
    _hbm(row, positions * cache.dtype.itemsize, peak)
  torch_peer = _torch_sdpa(q, k, v, quick)
  if torch_peer is not None:
    row = harness.measure(rows, label(case), "torch_sdpa",
                          lambda: timer.torch(torch_peer))
    _hbm(row, positions * k.dtype.itemsize, peak)
  for row in rows:
    if row["impl"].startswith("ours") and row["impl"] in outs and "xla" in outs:
      row["err"] = harness.rel_error(outs[row["impl"]], outs["xla"])
  return rows


def _hbm(row, kv_bytes, peak):
  if row["ms"] and peak:
    row["hbm"] = kv_bytes / (row["ms"] / 1e3) / peak


def _torch_sdpa(q, k, v, quick):
  """A thunk of torch SDPA over the padded cache, or None without torch."""
  torch = harness.torch_module()
  if torch is None:
    return None
  device = "cuda" if torch.cuda.is_available() and not quick else "cpu"
  dtype = torch.bfloat16 if q.dtype == jnp.bfloat16 else torch.float32
  qt, kt, vt = (torch.from_numpy(np.array(x, np.float32)).to(device, dtype)
                for x in (q, k, v))

  def thunk():
    with torch.no_grad():
      return torch.nn.functional.scaled_dot_product_attention(
          qt, kt, vt, enable_gqa=True)
  return thunk


def tpu_rows(cases):
  """The Mosaic TPU kernel's work at full length per chip, on the roofline."""
  try:
    from pallas_kernels.decode import mosaic_tpu
  except ImportError:
    return []
  rows = []
  for case in cases:
    b, s, hk, d = (case["batch"], case["seq"], case["kv_heads"],
                   case["head_dim"])
    compute = jnp.dtype(case["dtype"]).itemsize
    itemsize = jnp.dtype(case.get("cache", case["dtype"])).itemsize
    group = case["heads"] // hk
    for chip in roofline.TPUS:
      plan = mosaic_tpu.make_plan(b, hk, group, s, d, itemsize,
                                  generation=chip, compute_itemsize=compute)
      work = mosaic_tpu.cost(b, hk, plan, d, itemsize, s,
                             compute_itemsize=compute)
      vmem = mosaic_tpu.vmem_bytes(plan, d, itemsize, compute)
      for row in roofline.rows(label(case), work["flops"],
                               work["bytes_accessed"], chips=(chip,),
                               useful_flops=4 * b * case["heads"] * s * d):
        rows.append(dict(row, vmem_mib=vmem / 2**20,
                         fits_vmem=vmem <= roofline.SPECS[chip]["vmem"]))
  return rows


def main(argv=None):
  return harness.main("decode_attention", CASES, QUICK, run, label=label,
                      tpu_rows=tpu_rows, argv=argv, doc=__doc__,
                      columns=["case", "impl", "ms", "hbm", "err", "vs_xla",
                               "vs_cudnn", "vs_flash", "vs_torch_sdpa",
                               "error"])


if __name__ == "__main__":
  main()
