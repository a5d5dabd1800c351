"""Probe: where the eager fast path's host time goes on CUDA (not a bench).

    python -m bench.torch_bridge_probe [--out DIR]

Flash attention 1x4x128x64 bf16 causal on CUDA tensors. Prints medians (us)
of: the fast path's pieces inside a forward+backward step (marks around
to_jax, the jitted calls, to_torch, the autograd hand-offs; the backward's
thread), the same jitted calls in a plain loop (main thread, another
thread, on a freshly imported cotangent), whether a jitted call or an
export blocks while the GPU is busy, and a minimal autograd.Function doing
the same DLPack + jitted calls with everything precomputed. ``--pin``: the
same with every thread on one CPU after warm-up (cross-core hand-offs).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import threading
import time

import jax
import jax.numpy as jnp
import torch

import pallas_kernels as pk
import torch_bridge as tb
from torch_bridge import _convert, _eager

T = time.perf_counter
RESULTS: dict = {}
CUDA = torch.cuda.is_available()


def sync():
  if CUDA:
    torch.cuda.synchronize()


def med(samples):
  return round(1e6 * statistics.median(samples), 1)


def loop(fn, n=200, warm=20, synced=False):
  for _ in range(warm):
    fn()
  sync()
  ts = []
  for _ in range(n):
    t = T()
    fn()
    if synced:
      sync()
    ts.append(T() - t)
  sync()
  return med(ts)


def report(key, value):
  RESULTS[key] = value
  print(f"{key:60s} {value}", flush=True)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default=None)
  parser.add_argument("--pin", action="store_true",
                      help="after warm-up, every thread on one CPU; only "
                      "the totals, the pieces and the minimal Function")
  args = parser.parse_args()
  dev = torch.device("cuda" if CUDA else "cpu")
  dtype = torch.bfloat16 if CUDA else torch.float32
  shape = (1, 4, 128, 64)
  g = torch.Generator().manual_seed(0)
  q, k, v = (torch.randn(*shape, generator=g).to(dev, dtype)
             .requires_grad_(True) for _ in range(3))
  qn, kn, vn = (t.detach() for t in (q, k, v))
  report("threads", [t.name for t in threading.enumerate()])
  report("switchinterval", sys.getswitchinterval())

  misses = [0]
  from jax._src import pjit
  helper_name = ("_run_python_pjit" if hasattr(pjit, "_run_python_pjit")
                 else "_python_pjit_helper")
  real_helper = getattr(pjit, helper_name)

  def counting(*a, **kw):
    misses[0] += 1
    return real_helper(*a, **kw)
  setattr(pjit, helper_name, counting)

  def bridge_step():
    return torch.autograd.grad(
        tb.flash_attention(q, k, v, causal=True).float().sum(), (q, k, v))

  def bridge_fwd():
    return tb.flash_attention(qn, kn, vn, causal=True)

  def bridge_fwd_grad():
    return tb.flash_attention(q, k, v, causal=True)

  ours = lambda *a: pk.flash_attention(*a, causal=True)  # noqa: E731
  jq = [jax.dlpack.from_dlpack(t) for t in (qn, kn, vn)]
  jfwd = jax.jit(ours)
  jgrad = jax.jit(jax.grad(lambda *a: ours(*a).astype(jnp.float32).sum(),
                           argnums=(0, 1, 2)))

  def sdpa_step():
    return torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True).float().sum(), (q, k, v))

  kinds = {}
  real_jitted = _eager._jitted

  def spy(name, st, flavour, kind, mask):
    f = real_jitted(name, st, flavour, kind, mask)
    kinds[kind] = f
    return f
  _eager._jitted = spy
  bridge_step(); bridge_fwd(); jfwd(*jq); jgrad(*jq)
  _eager._jitted = real_jitted
  sync()

  if args.pin:  # threads created later (none expected) are not pinned
    cpu = min(os.sched_getaffinity(0))
    for tid in os.listdir("/proc/self/task"):
      os.sched_setaffinity(int(tid), {cpu})
    report("pinned to cpu", cpu)

  # 1. totals
  for name, fn in (("bridge fwd", bridge_fwd), ("bridge fwd(grad)",
                    bridge_fwd_grad), ("bridge fwd+bwd", bridge_step),
                   ("sdpa fwd+bwd", sdpa_step),
                   ("jax fwd", lambda: jfwd(*jq)),
                   ("jax grad", lambda: jgrad(*jq))):
    m0 = misses[0]
    report(f"total {name} back-to-back", loop(fn))
    report(f"total {name} synced", loop(fn, synced=True))
    report(f"  jit cache misses during {name}", misses[0] - m0)

  # 2. pieces inside a step
  marks = collections.defaultdict(list)

  def wrap(name, fn):
    def w(*a, **kw):
      t = T()
      out = fn(*a, **kw)
      marks[name].append(T() - t)
      return out
    return w
  real_to_jax, real_to_torch = _convert.to_jax, _convert.to_torch
  real_bwd = _eager.Residuals.backward
  stamp = {}

  def bwd(ctx, *grads):
    stamp["in"] = T()
    stamp["thread"] = threading.current_thread().name
    out = real_bwd(ctx, *grads)
    stamp["out"] = T()
    return out
  _convert.to_jax = wrap("to_jax", real_to_jax)
  _convert.to_torch = wrap("to_torch", real_to_torch)
  _eager._jitted = lambda *a: wrap("jit_" + a[3], real_jitted(*a))
  _eager.Residuals.backward = staticmethod(bwd)

  def step(synced):
    t0 = T()
    y = tb.flash_attention(q, k, v, causal=True)
    t1 = T()
    loss = y.float().sum()
    t2 = T()
    torch.autograd.grad(loss, (q, k, v))
    t3 = T()
    if synced:
      sync()
    t4 = T()
    for key, val in (("fwd", t1 - t0), ("float.sum", t2 - t1),
                     ("grad", t3 - t2), ("grad->bwd", stamp["in"] - t2),
                     ("bwd body", stamp["out"] - stamp["in"]),
                     ("bwd->ret", t3 - stamp["out"]), ("sync", t4 - t3)):
      marks[key].append(val)
  for synced in (False, True):
    for _ in range(20):
      step(synced)
    marks.clear()
    for _ in range(200):
      step(synced)
    for key, val in marks.items():
      report(f"piece {'synced' if synced else 'b2b'} {key}", med(val))
  report("backward thread", stamp["thread"])
  _convert.to_jax, _convert.to_torch = real_to_jax, real_to_torch
  _eager._jitted = real_jitted
  _eager.Residuals.backward = staticmethod(real_bwd)

  # 3. the jitted calls in plain loops
  save, restore, forward = kinds["save"], kinds["restore"], kinds["forward"]
  if not args.pin:
    arrays = real_to_jax([qn, kn, vn], dev)
    flat = save(*arrays)
    ct = jnp.ones_like(flat[0])
    report("loop save", loop(lambda: save(*arrays)))
    report("loop restore", loop(lambda: restore(*arrays, *flat, ct)))
    report("loop forward", loop(lambda: forward(*arrays)))
    report("loop to_jax q,k,v (cached views)",
           loop(lambda: real_to_jax([qn, kn, vn], dev)))
    out0 = forward(*arrays)
    report("loop to_torch 1 output", loop(lambda: real_to_torch(out0, dev)))
    ctt = torch.ones(shape, device=dev, dtype=dtype)
    report("loop restore on fresh ct import (new tensor each)", loop(
        lambda: restore(*arrays, *flat, real_to_jax([ctt * 1], dev)[0])))
    report("loop to_jax fresh ct alone", loop(
        lambda: real_to_jax([ctt * 1], dev)))
    kept = []

    def new_address():
      t = ctt * 1
      kept.append(t)
      return restore(*arrays, *flat, real_to_jax([t], dev)[0])
    report("loop restore on a new address each call", loop(new_address, n=100))
    kept.clear()
    sync()

    def in_thread(fn):
      out = []
      th = threading.Thread(target=lambda: out.append(loop(fn)))
      th.start()
      th.join()
      return out[0]
    report("thread save", in_thread(lambda: save(*arrays)))
    report("thread restore", in_thread(lambda: restore(*arrays, *flat, ct)))

    # interleaved with torch work (cold caches)
    def interleaved(fn, between):
      ts = []
      for i in range(220):
        between()
        t = T()
        fn()
        ts.append(T() - t)
      sync()
      return med(ts[20:])
    report("interleaved(sdpa step) save",
           interleaved(lambda: save(*arrays), sdpa_step))
    report("interleaved(sdpa step) restore",
           interleaved(lambda: restore(*arrays, *flat, ct), sdpa_step))

    # 4. blocking while the GPU is busy
    big = torch.randn(*((8192, 8192) if CUDA else (512, 512)), device=dev, dtype=dtype)

    def busy():
      for _ in range(4):
        big @ big
    sync()
    t = T(); busy(); sync(); report("busy() alone synced", med([T() - t]))
    for name, fn in (("save call", lambda: save(*arrays)),
                     ("restore call", lambda: restore(*arrays, *flat, ct)),
                     ("to_jax", lambda: real_to_jax([qn, kn, vn], dev)),
                     ("to_torch", lambda: real_to_torch(out0, dev)),
                     ("bridge fwd", bridge_fwd), ("bridge fwd(grad)",
                                                  bridge_fwd_grad),
                     ("bridge fwd+bwd", bridge_step),
                     ("sdpa fwd+bwd", sdpa_step)):
      ts = []
      for _ in range(15):
        sync()
        busy()
        t = T()
        fn()
        ts.append(T() - t)
      sync()
      report(f"while GPU busy: {name}", med(ts))

  # 5. a minimal Function: same calls, everything precomputed
  views = _convert._VIEWS[_convert.jax_device_for(dev)]
  stream_ptr = torch._C._cuda_getCurrentRawStream(0) or 1 if CUDA else None

  class Lean(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *tensors):
      if CUDA:
        _convert._after_torch_work(dev, views.importer)
      arrs = [views.get(t) for t in tensors]
      fl = save(*arrs)
      out = torch.utils.dlpack.from_dlpack(_convert._TO_CAPSULE(
          fl[0], stream=stream_ptr))
      ctx.arrs, ctx.fl = arrs, fl
      return out

    @staticmethod
    def backward(ctx, grad):
      if CUDA:
        _convert._after_torch_work(dev, views.importer)
      c = views.importer(grad.contiguous())
      d = restore(*ctx.arrs, *ctx.fl, c)
      return tuple(torch.utils.dlpack.from_dlpack(_convert._TO_CAPSULE(
          x, stream=stream_ptr)) for x in d)

  def lean_step():
    return torch.autograd.grad(Lean.apply(q, k, v).float().sum(), (q, k, v))

  class Empty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *tensors):
      return tensors[0].clone()

    @staticmethod
    def backward(ctx, grad):
      return grad, grad, grad

  def empty_step():
    return torch.autograd.grad(Empty.apply(q, k, v).float().sum(), (q, k, v))

  for name, fn in (("lean fwd+bwd", lean_step), ("empty Function fwd+bwd",
                                                 empty_step)):
    report(f"total {name} back-to-back", loop(fn))
    report(f"total {name} synced", loop(fn, synced=True))
  for name, fn in (("bridge fwd+bwd", bridge_step), ("jax grad",
                                                     lambda: jgrad(*jq))):
    report(f"again total {name} back-to-back", loop(fn))
  if args.out:
    with open(os.path.join(args.out, "probe.json"), "w") as f:
      json.dump(RESULTS, f, indent=1)


if __name__ == "__main__":
  main()
