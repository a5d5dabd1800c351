"""torch_bridge overhead: the ops on CUDA torch tensors vs calling JAX directly.

The CUDA path hands torch tensors to JAX through DLPack (no copy), runs the
jitted op (the GPU Pallas kernels via ``backend=None``) and hands the result
back through DLPack. Per op this times, as host wall time with the device
synchronised after each call (both paths the same way):

  jax          the jitted JAX op on JAX arrays (``pallas_kernels.<op>``)
  bridge       ``torch_bridge.<op>`` on CUDA tensors (+ autograd for "fwd+bwd")
  torch        the plain PyTorch equivalent, where there is one (SDPA,
               F.linear in bf16, the GIoU loss formula, torchvision's nms)

and reports ``overhead_us = bridge - jax`` and the ratios
``bridge_vs_jax = jax / bridge`` and ``bridge_vs_torch = torch / bridge``
(> 1: the bridge is faster). Small shapes show the fixed per-call cost,
large ones how much of it remains. Before timing, the bridge's results are
checked against the torch equivalents (max abs error printed).

Elsewhere (CPU) ``--quick`` runs small shapes on CPU tensors (kernels in the
Pallas interpreter): a smoke test, not a speed figure.

  python bench/bench_torch_bridge.py [--quick]
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness  # noqa: E402


def _synced(fn, sync):
  def run():
    out = fn()
    sync(out)
    return out
  return run


def _cases(quick: bool, torch, device):
  """(name, shape text, jax thunk factory, bridge thunk, torch thunk, check)."""
  import jax
  import jax.numpy as jnp
  import torch.nn.functional as F

  import pallas_kernels as pk
  import torch_bridge as tb
  from pallas_kernels import nn as pk_nn
  from torch_bridge import _convert

  gen = torch.Generator(device="cpu").manual_seed(0)
  cases = []

  def rand(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(device=device,
                                                           dtype=dtype)

  def as_jax(t):
    return _convert.to_jax(t, _convert.jax_device_for(t.device))

  # attention
  shapes = ([(1, 2, 128, 64)] if quick else
            [(1, 4, 128, 64), (4, 16, 1024, 64), (4, 16, 4096, 128)])
  for b, h, s, d in shapes:
    dtype = torch.float32 if quick else torch.bfloat16
    q, k, v = (rand(b, h, s, d, dtype=dtype) for _ in range(3))
    jq, jk, jv = as_jax(q), as_jax(k), as_jax(v)
    fwd = jax.jit(lambda q, k, v: pk.flash_attention(q, k, v, causal=True))
    cases.append(dict(
        op="flash_attention fwd", shape=f"{b}x{h}x{s}x{d} {dtype}".replace(
            "torch.", ""),
        jax=lambda fwd=fwd, a=(jq, jk, jv): fwd(*a),
        bridge=lambda q=q, k=k, v=v: tb.flash_attention(q, k, v, causal=True),
        torch=lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
            q, k, v, is_causal=True),
        tol=2e-2 if dtype == torch.bfloat16 else 1e-4))
    grad = jax.jit(jax.grad(lambda q, k, v: pk.flash_attention(
        q, k, v, causal=True).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))

    def bridge_bwd(q=ql, k=kl, v=vl):
      out = tb.flash_attention(q, k, v, causal=True)
      return torch.autograd.grad(out.float().sum(), (q, k, v))

    def torch_bwd(q=ql, k=kl, v=vl):
      out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
      return torch.autograd.grad(out.float().sum(), (q, k, v))
    cases.append(dict(
        op="flash_attention fwd+bwd", shape=cases[-1]["shape"],
        jax=lambda grad=grad, a=(jq, jk, jv): grad(*a), bridge=bridge_bwd,
        torch=torch_bwd, tol=5e-2 if dtype == torch.bfloat16 else 1e-3))

  # int8 dense (nn.Linear layout)
  shapes = [(64, 256, 256)] if quick else [(128, 1024, 1024),
                                           (8192, 4096, 4096)]
  for m, k_, n in shapes:
    dtype = torch.float32 if quick else torch.bfloat16
    x = rand(m, k_, dtype=dtype)
    w = rand(n, k_, dtype=dtype, scale=k_ ** -0.5)
    jx, jw = as_jax(x), as_jax(w)
    dense = jax.jit(lambda x, w: pk_nn.int8_dense(x, w.T))
    cases.append(dict(
        op="int8_dense fwd", shape=f"{m}x{k_}x{n} {dtype}".replace(
            "torch.", ""),
        jax=lambda dense=dense, a=(jx, jw): dense(*a),
        bridge=lambda x=x, w=w: tb.int8_dense(x, w),
        torch=lambda x=x, w=w: F.linear(x, w),
        tol=None))

  # GIoU loss
  counts = [4096] if quick else [4096, 1 << 20]
  for n in counts:
    xy = torch.rand(n, 2, generator=gen) * 100
    pred = torch.cat([xy, xy + torch.rand(n, 2, generator=gen) * 50 + 1],
                     -1).to(device)
    xy = torch.rand(n, 2, generator=gen) * 100
    target = torch.cat([xy, xy + torch.rand(n, 2, generator=gen) * 50 + 1],
                       -1).to(device)
    jp, jt = as_jax(pred), as_jax(target)
    loss = jax.jit(lambda p, t: pk.giou_loss(p, t, reduction="mean"))

    def torch_giou_loss(p=pred, t=target, eps=1e-7):
      lt = torch.maximum(p[:, :2], t[:, :2])
      rb = torch.minimum(p[:, 2:], t[:, 2:])
      wh = (rb - lt).clamp(min=0)
      inter = wh[:, 0] * wh[:, 1]
      area = lambda b: (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
      union = area(p) + area(t) - inter
      hull = (torch.maximum(p[:, 2:], t[:, 2:]) -
              torch.minimum(p[:, :2], t[:, :2]))
      hull = hull[:, 0] * hull[:, 1]
      iou = inter / (union + eps)
      return (1 - (iou - (hull - union) / (hull + eps))).mean()
    cases.append(dict(
        op="giou_loss fwd", shape=f"{n} boxes",
        jax=lambda loss=loss, a=(jp, jt): loss(*a),
        bridge=lambda p=pred, t=target: tb.giou_loss(p, t, reduction="mean"),
        torch=torch_giou_loss, tol=1e-5))

  # NMS
  counts = [256] if quick else [1024, 4096]
  for n in counts:
    xy = torch.rand(n, 2, generator=gen) * 500
    boxes = torch.cat([xy, xy + torch.rand(n, 2, generator=gen) * 80 + 4],
                      -1).to(device)
    scores = torch.rand(n, generator=gen).to(device)
    jb, js = as_jax(boxes), as_jax(scores)
    nms = jax.jit(lambda b, s: pk.nms(b, s, iou_threshold=0.5,
                                      max_output_size=128))
    torch_nms = None
    try:
      import torchvision
      torch_nms = lambda b=boxes, s=scores: torchvision.ops.nms(b, s, 0.5)[
          :128]
    except Exception:
      pass
    cases.append(dict(
        op="nms", shape=f"{n} boxes, max 128",
        jax=lambda nms=nms, a=(jb, js): nms(*a),
        bridge=lambda b=boxes, s=scores: tb.nms(b, s, iou_threshold=0.5,
                                                max_output_size=128),
        torch=torch_nms, tol="nms"))
  return cases


def _check(case, torch):
  """Max abs difference between the bridge and the torch equivalent."""
  if case["torch"] is None or case["tol"] is None:
    return None
  got, want = case["bridge"](), case["torch"]()
  if case["tol"] == "nms":
    idx, num = got
    kept = idx[:int(num)].long().cpu()
    return float(0.0 if torch.equal(kept, want.cpu()[:len(kept)]) and
                 len(kept) == min(len(want), 128) else 1.0)
  if isinstance(got, (tuple, list)):
    return max(float((g.float() - w.float()).abs().max())
               for g, w in zip(got, want))
  return float((got.float() - want.float()).abs().max())


def _profile(cases, sync, calls=200):
  import cProfile
  import pstats
  seen = set()
  for case in cases:
    if case["op"] in seen:
      continue
    seen.add(case["op"])
    run = _synced(case["bridge"], sync)
    for _ in range(3):
      run()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
      run()
    profiler.disable()
    print(f"\n== profile: {case['op']} {case['shape']}, {calls} calls")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(12)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="small shapes (CPU smoke test)")
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--profile", action="store_true",
                      help="also cProfile the smallest case of each op "
                      "(where the per-call overhead goes)")
  args = parser.parse_args(argv)

  import jax
  try:
    import torch
  except ImportError:
    print("bench_torch_bridge: torch is not installed here; nothing to measure")
    return []

  cuda = torch.cuda.is_available() and any(
      d.platform == "gpu" for d in jax.devices())
  device = torch.device("cuda" if cuda else "cpu")
  quick = args.quick or not cuda
  iters = 3 if not cuda else args.iters
  warmup = 1 if not cuda else 3

  def sync(out):
    leaves = jax.tree_util.tree_leaves(out)
    if leaves and not isinstance(leaves[0], torch.Tensor):
      jax.block_until_ready(out)
    if cuda:  # every stream: JAX's and torch's
      torch.cuda.synchronize()

  rows = []
  for case in _cases(quick, torch, device):
    row = dict(op=case["op"], shape=case["shape"])
    try:
      row["check_max_err"] = _check(case, torch)
      if isinstance(case["tol"], float) and row["check_max_err"] is not None:
        row["check_ok"] = row["check_max_err"] <= case["tol"]
      elif case["tol"] == "nms" and row["check_max_err"] is not None:
        row["check_ok"] = row["check_max_err"] == 0.0
      for name in ("jax", "bridge", "torch"):
        fn = case[name]
        if fn is None:
          continue
        row[f"{name}_ms"] = 1e3 * harness.time_host(
            _synced(fn, sync), warmup=warmup, iters=iters)
      row["overhead_us"] = 1e3 * (row["bridge_ms"] - row["jax_ms"])
      row["bridge_vs_jax"] = harness.ratio(row["jax_ms"], row["bridge_ms"])
      row["bridge_vs_torch"] = harness.ratio(row.get("torch_ms"),
                                             row["bridge_ms"])
    except Exception as e:  # keep measuring the other ops
      row["error"] = f"{type(e).__name__}: {e}"[:300]
      traceback.print_exc()
    rows.append(row)
    harness.print_table([row], ["op", "shape", "jax_ms", "bridge_ms",
                                "torch_ms", "overhead_us", "bridge_vs_jax",
                                "bridge_vs_torch", "check_max_err"])
  if args.profile:
    _profile(_cases(quick, torch, device), sync)
  print()
  harness.print_table(rows, ["op", "shape", "jax_ms", "bridge_ms", "torch_ms",
                             "overhead_us", "bridge_vs_jax",
                             "bridge_vs_torch", "check_max_err", "check_ok",
                             "error"])
  path = harness.write_results(
      "torch_bridge" + ("-quick" if quick else ""), rows,
      extra=dict(timing="host wall time, device synchronised per call",
                 torch_device=str(device)))
  print(f"results: {path}")
  return rows


if __name__ == "__main__":
  main()
