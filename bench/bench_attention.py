"""Flash attention benchmark: this package's GPU kernel against its peers.

On a CUDA machine (the H100): batch 4, heads 16, seq 4096, head_dim 128, bf16,
causal and not, forward and forward+backward, for
  ours         pallas_kernels.attention.gpu.forward/backward: on a Hopper the
               Mosaic GPU forward (attention/mosaic_gpu.py) and backward
               (attention/mosaic_gpu_bwd.py) where they apply, else Triton
  ours_triton_fwd   the same with the Triton forward
  ours_triton_bwd   the same with the Triton dq and dk/dv kernels
  ours_plain_order  the same without the chunked causal launch order
  ours_api     the public op (flash_attention, backend="gpu")
  cudnn / xla  jax.nn.dot_product_attention(implementation=...)
  jax_mha      jax.experimental.pallas.ops.gpu.attention.mha (Pallas Triton)
  jax_mgpu     jax.experimental.pallas.ops.gpu.attention_mgpu (Mosaic GPU)
  tokamax      tokamax.dot_product_attention(implementation="mosaic"), if
               importable (its wheels travel in the repo's ignored .whl/;
               an absent xprof is stubbed, see _stub_xprof)
  torch_flash / torch_cudnn   torch SDPA with that backend forced
plus an 8192^3 bf16 matmul (jax and torch) as the measured peak; then, for
each ``--head-dims`` value, the ``--head-dim-impls`` (ours, Triton backward,
cuDNN by default). FLOPs:
forward 4*B*H*L*L*D (causal: half); forward+backward 3.5x that (backward does
5 of the 7 matmuls; the recomputed QK^T is not counted, as is usual). Before
timing it checks the kernel's forward and gradients against a float32
reference on several feature combinations (odd lengths, GQA, masks, bias,
soft cap, both forwards), in parallel processes (once still compiling
after 2.5 minutes on the H100: use ``--no-check`` in a shorter device
call). The results file is rewritten after each implementation, so a run
cut short keeps its rows.

``--sweep`` times kernel variants (``sweep_jobs``) with several processes
compiling in parallel and taking turns on the GPU; ``--tune`` sweeps the
block sizes of one kernel at a time; ``--probe`` checks the Mosaic GPU
backward and times its block-size variants against the Triton backward
(``probe``), writing attention_probe.json.

Elsewhere (CPU) ``--quick`` runs a small shape with the kernel in interpret
mode beside the reference: a smoke test, not a speed figure.

  python bench/bench_attention.py [--quick] [--tune] [--sweep] [--probe]
      [--no-check] [--no-peers] [--impls ours,cudnn,...] [--head-dims 64,256]
      [--head-dim-impls ours,cudnn] [--results-name NAME] [--note TEXT]
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import harness  # noqa: E402
from pallas_kernels.attention import gpu  # noqa: E402


def attention_flops(batch, heads, lq, lk, dim, causal, backward):
  flops = 4.0 * batch * heads * lq * lk * dim
  if causal:
    flops /= 2
  return flops * (3.5 if backward else 1.0)


def reference_attention(q, k, v, q_seg=None, kv_seg=None, bias=None, *,
                        sm_scale, causal=False, left=None, right=None,
                        cap=None):
  """float32 attention, [B,H,L,D] layout, same semantics as the kernel."""
  q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  group = q.shape[1] // k.shape[1]
  k = jnp.repeat(k, group, axis=1)
  v = jnp.repeat(v, group, axis=1)
  s = jnp.einsum("bhid,bhjd->bhij", q, k,
                 precision=jax.lax.Precision.HIGHEST) * sm_scale
  if cap is not None:
    s = cap * jnp.tanh(s / cap)
  if bias is not None:
    s = s + bias.astype(jnp.float32)
  lq, lk = q.shape[2], k.shape[2]
  rows = jnp.arange(lq)[:, None] + (lk - lq)
  cols = jnp.arange(lk)[None, :]
  ok = jnp.ones((lq, lk), bool)
  if causal:
    right = 0 if right is None else min(right, 0)
  if right is not None:
    ok &= cols <= rows + right
  if left is not None:
    ok &= cols >= rows - left
  ok = ok[None, None]
  if q_seg is not None:
    ok = ok & (q_seg[:, None, :, None] == kv_seg[:, None, None, :])
  ok = jnp.broadcast_to(ok, s.shape)
  m = jax.lax.stop_gradient(jnp.max(jnp.where(ok, s, -jnp.inf), -1,
                                    keepdims=True))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  e = jnp.where(ok, jnp.exp(jnp.where(ok, s, 0.0) - m), 0.0)
  total = e.sum(-1, keepdims=True)
  p = e / jnp.where(total > 0, total, 1.0)
  return jnp.einsum("bhij,bhjd->bhid", p, v,
                    precision=jax.lax.Precision.HIGHEST)


def ours_fn(causal, sm_scale, sizes=None, interpret=False, **features):
  """Differentiable (q, k, v) -> out through the kernel's forward/backward."""
  arrays = dict(q_seg=None, kv_seg=None, bias=None)
  arrays.update({k: features.pop(k) for k in list(features) if k in arrays})
  kw = dict(sm_scale=sm_scale, causal=causal,
            window_left=features.get("left"),
            window_right=features.get("right"),
            logit_soft_cap=features.get("cap"), block_sizes=sizes,
            interpret=interpret)
  extra = (arrays["q_seg"], arrays["kv_seg"], arrays["bias"])

  @jax.custom_vjp
  def attend(q, k, v):
    return gpu.forward(q, k, v, *extra, **kw)[0]

  def attend_fwd(q, k, v):
    out, lse = gpu.forward(q, k, v, *extra, **kw)
    return out, (q, k, v, out, lse)

  def attend_bwd(res, d_out):
    q, k, v, out, lse = res
    dq, dk, dv, _ = gpu.backward(q, k, v, *extra, out, lse, d_out, **kw)
    return dq, dk, dv

  attend.defvjp(attend_fwd, attend_bwd)
  return attend


def rel_err(x, ref):
  x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
  if not np.isfinite(x).all():
    return float("inf")
  return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


CHECK_CASES = [
    # (B, H, Hkv, Lq, Lk, D, dtype, features)
    (2, 4, 4, 256, 256, 128, "bfloat16", dict()),
    (2, 4, 4, 256, 256, 128, "bfloat16", dict(causal=True)),
    (1, 8, 2, 300, 300, 64, "bfloat16", dict(causal=True)),
    (1, 4, 1, 129, 517, 80, "bfloat16", dict(causal=True, left=100)),
    (2, 2, 2, 200, 200, 64, "bfloat16", dict(segments=True, left=50, right=7)),
    (1, 4, 2, 130, 260, 128, "bfloat16", dict(bias=True, cap=20.0)),
    (1, 2, 1, 7, 1000, 32, "float32", dict(causal=True)),
    (1, 2, 2, 1, 33, 16, "float32", dict()),
    # The Triton forward (on a Hopper the default forward is the Mosaic GPU
    # kernel where it applies) and the plain causal launch order.
    (2, 4, 4, 256, 256, 128, "bfloat16", dict(causal=True, sizes="triton")),
    (1, 4, 2, 300, 300, 64, "bfloat16", dict(causal=True, left=70,
                                             sizes="triton")),
    (1, 4, 4, 1024, 1024, 256, "bfloat16", dict(causal=True,
                                                sizes="triton")),
    (1, 4, 4, 1024, 1024, 256, "bfloat16", dict(sizes="triton")),
    (2, 4, 2, 1024, 1024, 128, "bfloat16", dict(causal=True,
                                                sizes="order0")),
    (1, 4, 2, 1024, 1024, 128, "bfloat16", dict(causal=True, bias=True)),
    # Default tiles of the other table rows, at sizes that fill them.
    (1, 4, 2, 1024, 1024, 128, "float32", dict(causal=True)),
    (1, 4, 4, 1024, 1024, 256, "bfloat16", dict()),
    (1, 4, 4, 1024, 1024, 256, "bfloat16", dict(causal=True)),
    (2, 4, 4, 1024, 1024, 64, "bfloat16", dict(causal=True)),
    (1, 4, 4, 1024, 1024, 64, "bfloat16", dict()),
]


def run_checks(key, interpret=False, part=(0, 1)):
  """Checks CHECK_CASES[part[0]::part[1]] against the float32 reference."""
  rows = []
  for case in CHECK_CASES[part[0]::part[1]]:
    try:
      rows.append(_check_case(case, key, interpret))
    except Exception as e:  # report and go on: the timings still matter
      traceback.print_exc(limit=3)
      rows.append(dict(case=str(case), ok=False,
                       error=f"{type(e).__name__}: {str(e)[:300]}"))
    key = jax.random.split(key)[0]
  return rows


def _check_case(case, key, interpret):
  b, h, hkv, lq, lk, d, dtype, feat = case
  feat = dict(feat)
  keys = jax.random.split(key, 8)
  key = keys[0]
  dt = jnp.dtype(dtype)
  q = jax.random.normal(keys[1], (b, h, lq, d), dt)
  k = jax.random.normal(keys[2], (b, hkv, lk, d), dt)
  v = jax.random.normal(keys[3], (b, hkv, lk, d), dt)
  do = jax.random.normal(keys[4], (b, h, lq, d), dt)
  arrays = {}
  if feat.pop("segments", False):
    arrays["q_seg"] = jnp.sort(jax.random.randint(keys[5], (b, lq), 0, 3), 1)
    arrays["kv_seg"] = jnp.sort(jax.random.randint(keys[6], (b, lk), 0, 3), 1)
  if feat.pop("bias", False):
    arrays["bias"] = jax.random.normal(keys[7], (1, h, lq, lk), jnp.float32)
  causal = feat.pop("causal", False)
  variant = feat.pop("sizes", None)
  sizes = {None: None, "order0": gpu.GpuBlockSizes(band_chunk=0),
           "triton": gpu.GpuBlockSizes(forward_kernel="triton")}[variant]
  scale = 1 / math.sqrt(d)
  ours = ours_fn(causal, scale, sizes, interpret=interpret, **arrays, **feat)
  ref = functools.partial(reference_attention, **arrays, sm_scale=scale,
                          causal=causal, **feat)
  out, vjp = jax.vjp(ours, q, k, v)
  grads = vjp(do)
  ref_out, ref_vjp = jax.vjp(lambda *a: ref(*a), q, k, v)
  ref_grads = ref_vjp(do.astype(jnp.float32))
  errs = [rel_err(out, ref_out)] + [rel_err(g, r)
                                    for g, r in zip(grads, ref_grads)]
  if "bias" in arrays:
    _, vjp_bias = jax.vjp(
        lambda bb: reference_attention(
            q, k, v, arrays.get("q_seg"), arrays.get("kv_seg"), bb,
            sm_scale=scale, causal=causal, **feat), arrays["bias"])
    ref_db = vjp_bias(do.astype(jnp.float32))[0]
    kw = dict(sm_scale=scale, causal=causal, window_left=feat.get("left"),
              window_right=feat.get("right"),
              logit_soft_cap=feat.get("cap"), block_sizes=None,
              interpret=interpret)
    o, lse = gpu.forward(q, k, v, None, None, arrays["bias"], **kw)
    db = gpu.backward(q, k, v, None, None, arrays["bias"], o, lse, do,
                      **kw)[3]
    errs.append(rel_err(db, ref_db))
  tol = 2e-2 if dtype == "bfloat16" else 2e-3
  return dict(
      case=f"B{b} H{h}/{hkv} L{lq}x{lk} D{d} {dtype} causal={causal} "
           + " ".join(f"{k}" for k in list(arrays) + list(feat))
           + (f" [{variant}]" if variant else ""),
      err_out=errs[0], err_dq=errs[1], err_dk=errs[2], err_dv=errs[3],
      err_dbias=errs[4] if len(errs) > 4 else None,
      ok=all(e <= tol for e in errs))


# ---------------------------------------------------------------------------
# Peers. Each builder returns (fwd_callable, fwd_bwd_callable) or raises.


def _jax_pair(fn, q, k, v, do):
  fwd = jax.jit(fn)
  fwd_bwd = jax.jit(lambda q, k, v, do: jax.vjp(fn, q, k, v)[1](do))
  return (lambda: fwd(q, k, v)), (lambda: fwd_bwd(q, k, v, do))


def build_ours(causal, q, k, v, do, sizes=None):
  fn = ours_fn(causal, 1 / math.sqrt(q.shape[-1]), sizes)
  return _jax_pair(fn, q, k, v, do)


def build_ours_api(causal, q, k, v, do):
  """The public op (its own custom_vjp) on the gpu backend."""
  from pallas_kernels.attention import api
  fn = functools.partial(api.flash_attention, causal=causal, backend="gpu")
  return _jax_pair(fn, q, k, v, do)


def build_dpa(implementation, causal, q, k, v, do):
  t = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731  [B,L,H,D]
  fn = functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                         implementation=implementation)
  return _jax_pair(fn, t(q), t(k), t(v), t(do))


def build_jax_mha(causal, q, k, v, do):
  from jax.experimental.pallas.ops.gpu import attention as jax_attention
  t = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
  fn = functools.partial(jax_attention.mha, segment_ids=None,
                         sm_scale=1 / math.sqrt(q.shape[-1]), causal=causal)
  return _jax_pair(fn, t(q), t(k), t(v), t(do))


def build_jax_mgpu(causal, q, k, v, do):
  from jax.experimental.pallas.ops.gpu import attention_mgpu
  t = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
  # Its kernel applies no softmax scale: pre-scale q to match. It only takes
  # float16 (bf16 fails to lower), so it runs on float16 copies.
  scale = 1 / math.sqrt(q.shape[-1])
  qs = (q * scale).astype(jnp.float16)
  k, v, do = (x.astype(jnp.float16) for x in (k, v, do))
  config = attention_mgpu.TuningConfig(
      block_q=64, block_kv=128, max_concurrent_steps=2, causal=causal,
      block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)
  fn = functools.partial(attention_mgpu.attention, config=config)
  fwd, fwd_bwd = _jax_pair(fn, t(qs), t(k), t(v), t(do))
  return fwd, (None if causal else fwd_bwd)


def _stub_xprof():
  """tokamax/_src/benchmarking.py imports
  ``xprof.cli.tools.get_kernel_stats_tool`` at import time, only for its own
  profiling tools; xprof is not installed on the GPU machine, so empty
  modules stand in for it (the attention op never calls it)."""
  import types
  try:
    import xprof.cli.tools  # noqa: F401
    return
  except ImportError:
    pass
  for name in ("xprof", "xprof.cli", "xprof.cli.tools"):
    sys.modules.setdefault(name, types.ModuleType(name))
  sys.modules["xprof.cli.tools"].get_kernel_stats_tool = None


def build_tokamax(causal, q, k, v, do):
  _stub_xprof()
  import tokamax  # wheels carried to the GPU machine (.whl/)
  t = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731  [B,L,H,D]
  fn = functools.partial(tokamax.dot_product_attention, is_causal=causal,
                         implementation="mosaic")
  return _jax_pair(fn, t(q), t(k), t(v), t(do))


def build_torch(backend_name, causal, q, k, v, do):
  import torch
  from torch.nn.attention import SDPBackend, sdpa_kernel
  backend = {"flash": SDPBackend.FLASH_ATTENTION,
             "cudnn": SDPBackend.CUDNN_ATTENTION}[backend_name]
  conv = lambda x: torch.from_numpy(  # noqa: E731
      np.asarray(x.astype(jnp.float32))).to("cuda", torch.bfloat16)
  tq, tk, tv, tdo = (conv(x) for x in (q, k, v, do))
  for x in (tq, tk, tv):
    x.requires_grad_(True)
  sdpa = torch.nn.functional.scaled_dot_product_attention

  def fwd():
    with sdpa_kernel([backend]), torch.no_grad():
      return sdpa(tq, tk, tv, is_causal=causal)

  def fwd_bwd():
    with sdpa_kernel([backend]):
      out = sdpa(tq, tk, tv, is_causal=causal)
      return torch.autograd.grad(out, (tq, tk, tv), tdo)

  return fwd, fwd_bwd


REPS = 5  # calls per timing sample: hides JAX's per-call host overhead


def time_callable(name, fn, iters):
  """Median seconds per call. A sample is REPS calls queued back to back."""
  if name.startswith("torch"):
    def batch():
      for _ in range(REPS - 1):
        fn()
      return fn()
    return harness.time_torch_cuda(batch, warmup=1, iters=iters) / REPS

  def batch():
    for _ in range(REPS - 1):
      fn()
    return fn()
  return harness.time_jax(batch, warmup=1, iters=iters) / REPS


def matmul_peak(iters=20):
  """bf16 8192^3 matmul rate (FLOP/s) through jax and through torch."""
  n = 8192
  a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(2), (n, n), jnp.bfloat16)
  f = jax.jit(lambda a, b: a @ b)
  rates = {"jax": 2.0 * n ** 3 / time_callable("jax", lambda: f(a, b), iters)}
  try:
    import torch
    ta = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    tb = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    rates["torch"] = 2.0 * n ** 3 / time_callable(
        "torch", lambda: ta @ tb, iters)
  except Exception as e:
    print(f"torch matmul: {type(e).__name__}: {e}")
  return rates


TUNE_FWD = {
    False: [(128, 128, 8, 3), (128, 128, 8, 4), (128, 128, 4, 3),
            (128, 64, 8, 3), (256, 64, 8, 3), (128, 64, 4, 4)],
    True: [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 3),
           (64, 64, 4, 3), (64, 64, 4, 4), (128, 32, 4, 3)],
}
# (block_q, block_k, num_warps, num_stages) of one backward kernel; the other
# keeps its default while one is swept.
TUNE_DQ = [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 4, 2),
           (64, 128, 4, 2), (128, 32, 4, 2), (64, 32, 4, 3)]
TUNE_DKV = [(64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 8, 2), (32, 128, 4, 2),
            (128, 64, 8, 2), (32, 64, 4, 3), (64, 128, 4, 2)]


def _backward_only(causal, q, k, v, do, sizes):
  kw = dict(sm_scale=1 / math.sqrt(q.shape[-1]), causal=causal,
            window_left=None, window_right=None, logit_soft_cap=None,
            block_sizes=sizes, interpret=False)
  out, lse = jax.jit(lambda q, k, v: gpu.forward(q, k, v, None, None, None,
                                                 **kw))(q, k, v)
  bwd = jax.jit(lambda q, k, v, out, lse, do: gpu.backward(
      q, k, v, None, None, None, out, lse, do, **kw)[:3])
  return lambda: bwd(q, k, v, out, lse, do)


def tune(q, k, v, do, iters):
  rows = []

  def measure(kind, causal, cfg, make):
    try:
      seconds = time_callable("ours", make(), iters)
    except Exception as e:  # a config that fails to compile is a result too
      seconds = float("nan")
      print(f"tune {kind} {cfg}: {type(e).__name__}: {str(e)[:200]}")
    rows.append(dict(kind=kind, causal=causal, config=str(cfg),
                     ms=seconds * 1e3))
    print("tune", rows[-1], flush=True)

  for causal in (False, True):
    for cfg in TUNE_FWD[causal]:
      sizes = gpu.GpuBlockSizes(block_q=cfg[0], block_k=cfg[1],
                                num_warps=cfg[2], num_stages=cfg[3])
      measure("fwd", causal, cfg,
              lambda: build_ours(causal, q, k, v, do, sizes)[0])
    for cfg in TUNE_DQ:
      sizes = gpu.GpuBlockSizes(block_q_dq=cfg[0], block_k_dq=cfg[1],
                                num_warps_dq=cfg[2], num_stages_dq=cfg[3])
      measure("bwd(dq swept)", causal, cfg,
              lambda: _backward_only(causal, q, k, v, do, sizes))
    for cfg in TUNE_DKV:
      sizes = gpu.GpuBlockSizes(block_q_dkv=cfg[0], block_k_dkv=cfg[1],
                                num_warps_dkv=cfg[2], num_stages_dkv=cfg[3])
      measure("bwd(dkv swept)", causal, cfg,
              lambda: _backward_only(causal, q, k, v, do, sizes))
  return rows


# ---------------------------------------------------------------------------
# Sweep (--sweep): kernel variants at B4 H16 L4096 bf16, several worker
# processes compile in parallel and take turns on the GPU (a file lock), so
# one device call covers many variants. Rows go to one JSON-lines file.

def _g(prefix, cfg):
  """GpuBlockSizes fields for (block_q, block_k, num_warps, num_stages)."""
  names = ("block_q", "block_k", "num_warps", "num_stages")
  return {f"{n}{prefix}": c for n, c in zip(names, cfg)}


def sweep_jobs():
  """The variants to time: edit to explore (each row records its fields)."""
  jobs = []

  def add(kind, d, causal, label, **sizes):
    jobs.append(dict(kind=kind, head_dim=d, causal=causal, label=label,
                     sizes=sizes))

  for d in (128, 64, 256):
    for causal in (False, True):
      add("fwd", d, causal, "triton default", forward_kernel="triton")
      add("fwd", d, causal, "mosaic", forward_kernel="mosaic")
      add("bwd", d, causal, "split default")
  for d in (128, 64):
    add("fwd", d, True, "triton plain order", forward_kernel="triton",
        band_chunk=0)
    for chunk in (0, 8):
      add("bwd", d, True, f"band_chunk {chunk}", band_chunk=chunk)
  for cfg in [(64, 64, 4, 2), (32, 64, 4, 2), (64, 32, 8, 2)]:
    add("bwd", 256, False, f"dq {cfg}", **_g("_dq", cfg))
  return jobs


def _sweep_inputs(d, b=4, h=16, l=4096):
  if _SWEEP_INTERPRET:
    b, h, l = 1, 2, 128
  keys = jax.random.split(jax.random.key(d), 4)
  return [jax.random.normal(kk, (b, h, l, d), jnp.bfloat16) for kk in keys]


def _sweep_one(job, iters):
  """Compiles and times one job; returns the row (ms None on failure)."""
  import fcntl
  d, causal = job["head_dim"], job["causal"]
  q, k, v, do = _sweep_inputs(d)
  fields = dict(job["sizes"])
  if job["kind"] == "bwd":  # its inputs come from the Triton forward
    fields.setdefault("forward_kernel", "triton")
  sizes = gpu.GpuBlockSizes(**fields)
  kw = dict(sm_scale=1 / math.sqrt(d), causal=causal, window_left=None,
            window_right=None, logit_soft_cap=None, block_sizes=sizes,
            interpret=_SWEEP_INTERPRET)
  row = dict(job, sizes=str(job["sizes"]), ms=None, note="")
  t0 = time.time()
  try:
    fwd = jax.jit(lambda q, k, v: gpu.forward(q, k, v, None, None, None,
                                              **kw))
    if job["kind"] == "fwd":
      fn, args = fwd, (q, k, v)
      if job["sizes"].get("forward_kernel") == "mosaic":
        txt = fwd.lower(q, k, v).as_text()
        if "flash_attention_fwd_gpu" in txt:
          raise RuntimeError("mosaic forward not used (Triton lowered)")
    else:
      base = jax.jit(lambda q, k, v: gpu.forward(
          q, k, v, None, None, None, **dict(
              kw, block_sizes=gpu.GpuBlockSizes(forward_kernel="triton"))))
      with open(os.path.join(_SWEEP_DIR, "gpu.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        out, lse = jax.block_until_ready(base(q, k, v))
      fn = jax.jit(lambda q, k, v, out, lse, do: gpu.backward(
          q, k, v, None, None, None, out, lse, do, **kw)[:3])
      args = (q, k, v, out, lse, do)
    compiled = fn.lower(*args).compile()
    row["compile_s"] = time.time() - t0
    # Everything that runs on the GPU holds the lock: other workers only
    # compile meanwhile, so they cannot disturb the timing.
    with open(os.path.join(_SWEEP_DIR, "gpu.lock"), "w") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)
      seconds = time_callable("ours", lambda: compiled(*args), iters)
      row["ms"] = seconds * 1e3
      row.update(_variant_errors(job["kind"], q, k, v, do, kw,
                                 compiled(*args)))
  except Exception as e:
    row["note"] = f"{type(e).__name__}: {str(e)[:300]}"
  row["total_s"] = time.time() - t0
  return row


_SWEEP_DIR = "."
# BENCH_ATTENTION_SWEEP_SMOKE=1: interpret mode, tiny shapes, three jobs (a
# CPU check of the sweep's plumbing).
_SWEEP_INTERPRET = bool(os.environ.get("BENCH_ATTENTION_SWEEP_SMOKE"))


def _variant_errors(kind, q, k, v, do, kw, results):
  """Relative errors of this variant's results on two heads vs float32."""
  sl = lambda x: x[:1, :2].astype(jnp.float32)  # noqa: E731
  ref = functools.partial(reference_attention, sm_scale=kw["sm_scale"],
                          causal=kw["causal"])
  ref_out, ref_vjp = jax.vjp(ref, sl(q), sl(k), sl(v))
  if kind == "fwd":
    return dict(err_out=rel_err(sl(results[0]), ref_out))
  return dict(err_grads=max(rel_err(sl(g), r) for g, r in
                            zip(results, ref_vjp(sl(do)))))


def sweep(args):
  """Runs the sweep with ``args.workers`` processes; returns the rows."""
  import subprocess
  global _SWEEP_DIR
  _SWEEP_DIR = args.out or "."
  os.makedirs(_SWEEP_DIR, exist_ok=True)
  path = os.path.join(_SWEEP_DIR, "sweep.jsonl")
  if args.worker is not None:
    import fcntl
    import json
    index, count = args.worker
    jobs = sweep_jobs()[:3] if _SWEEP_INTERPRET else sweep_jobs()
    for n, job in enumerate(jobs):
      if n % count != index:
        continue
      row = _sweep_one(job, args.iters)
      print(json.dumps(row), flush=True)
      with open(os.path.join(_SWEEP_DIR, "gpu.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with open(path, "a") as f:
          f.write(json.dumps(row) + "\n")
    return []
  procs = [subprocess.Popen(
      [sys.executable, os.path.abspath(__file__), "--sweep", "--out",
       _SWEEP_DIR, "--iters", str(args.iters), "--worker",
       f"{i}/{args.workers}"]) for i in range(args.workers)]
  for p in procs:
    p.wait()
  import json
  rows = [json.loads(line) for line in open(path)] if os.path.exists(
      path) else []
  rows.sort(key=lambda r: (r["head_dim"], r["kind"], r["causal"],
                           r["label"]))
  harness.print_table(rows, ["head_dim", "kind", "causal", "label", "ms",
                             "err_out", "err_grads", "compile_s", "note"])
  return rows


PEERS = ["ours", "ours_triton_fwd", "ours_triton_bwd", "ours_plain_order",
         "ours_api", "cudnn",
         "xla", "jax_mha", "jax_mgpu", "tokamax", "torch_flash", "torch_cudnn"]


def builder(name):
  return {
      "ours": build_ours,
      # The same kernels with the Triton forward (the default on a Hopper is
      # the Mosaic GPU forward where it applies) and with the plain launch
      # order (no chunked heavy-first order for causal masks).
      "ours_triton_fwd": functools.partial(
          build_ours, sizes=gpu.GpuBlockSizes(forward_kernel="triton")),
      # The Triton dk/dv kernel instead of the Mosaic GPU one.
      "ours_triton_bwd": functools.partial(
          build_ours, sizes=gpu.GpuBlockSizes(backward_kernel="triton")),
      "ours_plain_order": functools.partial(
          build_ours, sizes=gpu.GpuBlockSizes(band_chunk=0)),
      "ours_api": build_ours_api,
      "cudnn": functools.partial(build_dpa, "cudnn"),
      "xla": functools.partial(build_dpa, "xla"),
      "jax_mha": build_jax_mha,
      "jax_mgpu": build_jax_mgpu,
      "tokamax": build_tokamax,
      "torch_flash": functools.partial(build_torch, "flash"),
      "torch_cudnn": functools.partial(build_torch, "cudnn"),
  }[name]


def run_checks_parallel(args):
  """run_checks split over processes (compiling dominates), before timing."""
  import json
  import subprocess
  import tempfile
  workers = max(1, args.workers // 2)
  seed = int(time.time())
  with tempfile.TemporaryDirectory() as tmp:
    procs = [subprocess.Popen(
        [sys.executable, "-c",
         "import sys, json, jax; sys.path.insert(0, sys.argv[1]); "
         "import bench_attention as b; "
         "rows = b.run_checks(jax.random.key(int(sys.argv[2])), "
         "part=(int(sys.argv[3]), int(sys.argv[4]))); "
         "json.dump(rows, open(sys.argv[5], 'w'))",
         HERE, str(seed), str(i), str(workers),
         os.path.join(tmp, f"{i}.json")]) for i in range(workers)]
    rows = []
    for i, p in enumerate(procs):
      p.wait()
      try:
        rows += json.load(open(os.path.join(tmp, f"{i}.json")))
      except Exception as e:  # a crashed worker is a failed check
        rows.append(dict(case=f"check worker {i}", ok=False,
                         error=f"{type(e).__name__}: {e}"))
  return rows


def random_qkv_do(shape, dtype, seed=0):
  """Standard-normal q, k, v and output cotangent of one shape."""
  keys = jax.random.split(jax.random.key(seed), 4)
  return tuple(jax.random.normal(key, shape, dtype) for key in keys)


def bench_gpu(args):
  b, h, l, d = args.batch, args.heads, args.seq, args.head_dim
  q, k, v, do = random_qkv_do((b, h, l, d), jnp.bfloat16)
  extra = {"shape": dict(batch=b, heads=h, seq=l, head_dim=d, dtype="bf16")}
  if getattr(args, "note", None):
    extra["note"] = args.note

  if not args.no_check:
    checks = run_checks_parallel(args)
    harness.print_table(checks, ["case", "err_out", "err_dq", "err_dk",
                                 "err_dv", "err_dbias", "ok"])
    extra["checks"] = checks
  if args.tune:
    tuned = tune(q, k, v, do, args.iters)
    harness.print_table(tuned, ["kind", "causal", "ms", "config"])
    extra["tuning"] = tuned

  rates = matmul_peak()
  peak = max(rates.values())
  extra["matmul_bf16_8192_tflops"] = {k: r / 1e12 for k, r in rates.items()}
  extra["peak_used_tflops"] = peak / 1e12
  print("measured bf16 matmul (8192^3) TFLOP/s:",
        {k: round(r / 1e12, 1) for k, r in rates.items()}, flush=True)

  names = PEERS if not args.no_peers else ["ours", "cudnn"]
  if args.impls:
    unknown = sorted(set(args.impls) - set(PEERS))
    if unknown:
      raise SystemExit(f"--impls: unknown {unknown}; known: {PEERS}")
    names = args.impls
  rows = []
  for causal in (False, True):
    for name in names:
      if name == "ours_plain_order" and not causal:
        continue  # the launch order differs only under a causal mask
      try:
        fwd, fwd_bwd = builder(name)(causal, q, k, v, do)
      except Exception as e:
        reason = f"not available: {type(e).__name__}: {str(e)[:160]}"
        for mode in ("fwd", "fwd+bwd"):
          rows.append(dict(impl=name, causal=causal, mode=mode, ms=None,
                           note=reason))
        continue
      for mode, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
        row = dict(impl=name, causal=causal, mode=mode, ms=None,
                   note="float16 inputs (no bf16 path)"
                   if name == "jax_mgpu" else "")
        if fn is None:
          row["note"] = "not supported by this implementation"
        else:
          try:
            seconds = time_callable(name, fn, args.iters)
            flops = attention_flops(b, h, l, l, d, causal, mode != "fwd")
            row.update(ms=seconds * 1e3, tflops=flops / seconds / 1e12,
                       frac_peak=flops / seconds / peak)
          except Exception as e:
            row["note"] += f" failed: {type(e).__name__}: {str(e)[:160]}"
            traceback.print_exc(limit=2)
        rows.append(row)
        print(f"{name:12s} causal={causal!s:5s} {mode:8s} "
              f"{row['ms'] if row['ms'] is None else round(row['ms'], 3)} ms "
              f"{row['note']}", flush=True)
      publish(rows, extra, args)  # a run cut short keeps what it timed
  for dim in args.head_dims:
    # Other head dims: ours (both forwards) and cuDNN.
    dq, dk, dv, ddo = random_qkv_do((b, h, l, dim), jnp.bfloat16, seed=dim)
    for causal in (False, True):
      for name in args.head_dim_impls:
        for mode in ("fwd", "fwd+bwd"):
          row = dict(impl=name, causal=causal, mode=mode, head_dim=dim,
                     ms=None, note="")
          try:
            fns = builder(name)(causal, dq, dk, dv, ddo)
            seconds = time_callable(name, fns[mode != "fwd"], args.iters)
            flops = attention_flops(b, h, l, l, dim, causal, mode != "fwd")
            row.update(ms=seconds * 1e3, tflops=flops / seconds / 1e12,
                       frac_peak=flops / seconds / peak)
          except Exception as e:
            row["note"] = f"failed: {type(e).__name__}: {str(e)[:160]}"
          rows.append(row)
          print(row, flush=True)
    publish(rows, extra, args)
  publish(rows, extra, args, final=True)
  return 0


def publish(rows, extra, args, final=False):
  """Ratios, table and results file; called after each section so that a
  run cut short still leaves its rows."""
  d = args.head_dim
  for row in rows:
    row.setdefault("head_dim", d)
  # Ratios: how many times faster ours is than each peer (>1: ours faster).
  for row in rows:
    same = lambda r: (r["causal"] == row["causal"]  # noqa: E731
                      and r["mode"] == row["mode"]
                      and r.get("head_dim", d) == row.get("head_dim", d))
    ours = next((r for r in rows if r["impl"] == "ours" and same(r)), None)
    cudnn = next((r for r in rows if r["impl"] == "cudnn" and same(r)), None)
    if row["ms"] and ours and ours["ms"]:
      row["ours_speedup_vs_this"] = row["ms"] / ours["ms"]
    if row["ms"] and cudnn and cudnn["ms"]:
      row["this_vs_cudnn"] = cudnn["ms"] / row["ms"]
  path = harness.write_results(args.results_name, rows, extra=extra,
                               directory=args.out)
  if final:
    columns = ["impl", "head_dim", "causal", "mode", "ms", "tflops",
               "frac_peak", "this_vs_cudnn", "ours_speedup_vs_this", "note"]
    harness.print_table(rows, columns)
    print("wrote", path)


def bench_cpu(args):
  """Smoke run: the kernel in Pallas' interpreter beside the reference."""
  b, h, l, d = 1, 2, 256, 64
  q, k, v, do = random_qkv_do((b, h, l, d), jnp.float32)
  rows = []
  for causal in (False, True):
    scale = 1 / math.sqrt(d)
    impls = {
        "ours (interpret)": ours_fn(causal, scale, interpret=True),
        "reference": functools.partial(reference_attention, sm_scale=scale,
                                       causal=causal),
        "xla": lambda q, k, v, c=causal: jnp.swapaxes(
            jax.nn.dot_product_attention(
                *(jnp.swapaxes(x, 1, 2) for x in (q, k, v)), is_causal=c,
                implementation="xla"), 1, 2),
    }
    ref_out = impls["reference"](q, k, v)
    for name, fn in impls.items():
      fwd, fwd_bwd = _jax_pair(fn, q, k, v, do)
      for mode, call in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
        seconds = harness.time_jax(call, warmup=1, iters=3)
        rows.append(dict(impl=name, causal=causal, mode=mode,
                         ms=seconds * 1e3,
                         err=rel_err(fwd(), ref_out) if mode == "fwd" else None))
  harness.print_table(rows, ["impl", "causal", "mode", "ms", "err"])
  if args.write:
    print("wrote", harness.write_results(
        "attention", rows, extra={"note": "CPU smoke run (interpret mode)"},
        directory=args.out))
  return 0


# ---------------------------------------------------------------------------
# Probe (--probe): one device call's worth of diagnosis for the backward:
# checks of the Mosaic GPU dk/dv kernel, backward-only and fwd+bwd timings of
# its variants against the Triton dk/dv kernel, and the compiled fwd+bwd
# program's non-kernel ops (copies/transposes between forward and backward).

PROBE_CASES = [
    (2, 4, 4, 256, 256, 128, "bfloat16", dict()),
    (2, 4, 4, 256, 256, 128, "bfloat16", dict(causal=True)),
    (1, 8, 2, 300, 300, 64, "bfloat16", dict(causal=True)),
    (1, 4, 1, 129, 517, 64, "bfloat16", dict(causal=True, left=100,
                                             cap=5.0)),
    (1, 4, 2, 1000, 700, 128, "bfloat16", dict(left=70, right=30)),
    (1, 2, 2, 200, 40, 128, "bfloat16", dict(causal=True)),
]


def _hlo_summary(fn, *args):
  """Ops of the optimized HLO that are not kernels: copies, transposes."""
  import re
  text = jax.jit(fn).lower(*args).compile().as_text()
  entry = text[text.find("ENTRY"):]
  kinds = {}
  for line in entry.splitlines():
    m = re.search(r"= \S+ (\w[\w-]*)\(", line)
    if m:
      kinds[m.group(1)] = kinds.get(m.group(1), 0) + 1
  interesting = [line.strip()[:300] for line in entry.splitlines()
                 if re.search(r" (copy|transpose|fusion|custom-call)", line)]
  return dict(op_counts=kinds, lines=interesting[:60])


def probe(args):
  import json
  from pallas_kernels.attention import mosaic_gpu_bwd
  out_dir = args.out or os.path.join(HERE, "results")
  os.makedirs(out_dir, exist_ok=True)
  result = dict(device=harness.device_info())
  path = os.path.join(out_dir, "attention_probe.json")

  def save():
    with open(path, "w") as f:
      json.dump(result, f, indent=1, default=str)

  key = jax.random.key(int(time.time()))
  checks = []
  for case in PROBE_CASES if not args.no_check else ():
    try:
      checks.append(_check_case(case, key, False))
    except Exception as e:
      traceback.print_exc(limit=3)
      checks.append(dict(case=str(case), ok=False,
                         error=f"{type(e).__name__}: {str(e)[:400]}"))
    print(checks[-1], flush=True)
  result["checks"] = checks
  save()

  b, h, l = args.batch, args.heads, args.seq
  timings = []
  result["timings"] = timings

  def time_variants(d, causals=(False, True), skip=()):
    q, k, v, do = random_qkv_do((b, h, l, d), jnp.bfloat16, seed=d)
    dkv_sizes = mosaic_gpu_bwd.MosaicGpuBwdBlockSizes
    dq_sizes = mosaic_gpu_bwd.MosaicGpuDqBlockSizes
    for causal in causals:
      variants = [
          ("bwd triton dq+dkv", "bwd", gpu.GpuBlockSizes(
              backward_kernel="triton"), None),
          ("bwd mosaic dq+dkv", "bwd", None, None),
          ("fwd+bwd ours", "fwd+bwd", None, None),
      ]
      if d == 128:
        variants.append(("fwd+bwd ours_triton_bwd", "fwd+bwd",
                         gpu.GpuBlockSizes(backward_kernel="triton"), None))
      else:
        variants += [
            ("bwd mosaic, dkv stages=3", "bwd", None,
             dict(dkv=dkv_sizes(stages=3))),
            ("bwd mosaic, dq block_k=128", "bwd", None,
             dict(dq=dq_sizes(block_k=128))),
            ("bwd mosaic, dkv block_q=128", "bwd", None,
             dict(dkv=dkv_sizes(block_q=128))),
            ("bwd mosaic, dq block_k=128 stages=3", "bwd", None,
             dict(dq=dq_sizes(block_k=128, stages=3)))]
      for label, kind, sizes, mosaic_sizes in variants:
        if label in skip:
          continue
        mosaic_sizes = mosaic_sizes or {}
        mosaic_gpu_bwd.DEFAULT_BLOCK_SIZES = mosaic_sizes.get(
            "dkv", dkv_sizes())
        mosaic_gpu_bwd.DEFAULT_DQ_BLOCK_SIZES = mosaic_sizes.get(
            "dq", dq_sizes())
        mosaic_gpu_bwd.DQ_KERNEL = mosaic_sizes.get("dq_kernel", True)
        row = dict(label=label, head_dim=d, causal=causal, ms=None)
        try:
          if kind == "bwd":
            fn = _backward_only(causal, q, k, v, do, sizes)
          else:
            fn = build_ours(causal, q, k, v, do, sizes)[1]
          row["ms"] = time_callable("ours", fn, args.iters) * 1e3
        except Exception as e:
          traceback.print_exc(limit=2)
          row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        mosaic_gpu_bwd.DEFAULT_BLOCK_SIZES = dkv_sizes()
        mosaic_gpu_bwd.DEFAULT_DQ_BLOCK_SIZES = dq_sizes()
        mosaic_gpu_bwd.DQ_KERNEL = True
        timings.append(row)
        print(row, flush=True)
      for name in ("cudnn", "tokamax") if d == 128 else ("cudnn",):
        for mode in ("fwd", "fwd+bwd"):
          row = dict(label=f"{mode} {name}", head_dim=d, causal=causal,
                     ms=None)
          try:
            fns = builder(name)(causal, q, k, v, do)
            row["ms"] = time_callable(name, fns[mode != "fwd"],
                                      args.iters) * 1e3
          except Exception as e:
            traceback.print_exc(limit=2)
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
          timings.append(row)
          print(row, flush=True)
      save()

  q, k, v, do = random_qkv_do((b, h, l, 128), jnp.bfloat16)
  hlo = {}
  for label, sizes in (("mosaic fwd, triton bwd", gpu.GpuBlockSizes(
      backward_kernel="triton")), ("triton fwd, triton bwd", gpu.GpuBlockSizes(
          forward_kernel="triton", backward_kernel="triton")),
                       ("default", None)):
    fn = ours_fn(False, 1 / math.sqrt(128), sizes)
    try:
      hlo[label] = _hlo_summary(
          lambda q, k, v, do, fn=fn: jax.vjp(fn, q, k, v)[1](do), q, k, v, do)
    except Exception as e:
      hlo[label] = f"{type(e).__name__}: {str(e)[:300]}"
  result["hlo"] = hlo
  save()
  print(json.dumps(hlo, indent=1)[:3000])
  # The first probe run (checks, D128 non-causal) is in
  # results/attention_backward_probe-h100-*.json; this one goes on from there.
  time_variants(128, causals=(True,))
  time_variants(64)
  return 0


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="small CPU-sized smoke run when no GPU is present")
  parser.add_argument("--tune", action="store_true",
                      help="also sweep the kernel's block sizes")
  parser.add_argument("--no-check", action="store_true")
  parser.add_argument("--no-peers", action="store_true")
  parser.add_argument("--impls", type=lambda x: [v for v in x.split(",") if v],
                      default=None, help=f"subset of {','.join(PEERS)}")
  parser.add_argument("--write", action="store_true",
                      help="write a results file for the CPU smoke run too")
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--seq", type=int, default=4096)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--head-dims", type=lambda x: [int(v) for v in
                                                     x.split(",") if v],
                      default=[], help="extra head dims (ours vs cuDNN)")
  parser.add_argument("--results-name", default="attention",
                      help="results file name (before -<device>-<date>)")
  parser.add_argument("--head-dim-impls",
                      type=lambda x: [v for v in x.split(",") if v],
                      default=["ours", "ours_triton_bwd", "cudnn"],
                      help="what --head-dims times")
  parser.add_argument("--out", default=None, help="results directory")
  parser.add_argument("--note", default=None,
                      help="a note stored in the results file")
  parser.add_argument("--sweep", action="store_true",
                      help="GPU: time kernel variants (parallel compiles)")
  parser.add_argument("--workers", type=int, default=6)
  parser.add_argument("--worker", default=None,
                      type=lambda x: tuple(int(v) for v in x.split("/")),
                      help=argparse.SUPPRESS)
  parser.add_argument("--probe", action="store_true",
                      help="GPU: check and time the backward variants")
  parser.add_argument("--tpu-roofline", action="store_true",
                      help="only print the TPU roofline estimate")
  args = parser.parse_args(argv)
  if args.sweep:
    sweep(args)
    return 0
  if args.probe:
    return probe(args)
  print_tpu_roofline(args)
  if args.tpu_roofline:
    return 0
  if jax.devices()[0].platform == "gpu":
    return bench_gpu(args)
  return bench_cpu(args)


def print_tpu_roofline(args):
  """TPU estimate (no TPU here): the kernels' FLOPs/bytes vs peak rates."""
  from pallas_kernels.attention import mosaic_tpu
  rows = mosaic_tpu.roofline_rows(batch=args.batch, heads=args.heads,
                                  seq=args.seq, head_dim=args.head_dim)
  print(f"TPU roofline estimate, B{args.batch} H{args.heads} L{args.seq} "
        f"D{args.head_dim} bf16 (model, not a measurement):")
  harness.print_table(rows)


if __name__ == "__main__":
  sys.exit(main())
