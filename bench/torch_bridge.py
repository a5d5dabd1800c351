"""torch_bridge on torch tensors against the JAX op directly and torch's own op.

    python -m bench.torch_bridge [--quick] [--cases nms] [--tag T] [--out DIR]

Impls of each case, in one run on the same tensors:

  ours      ``torch_bridge.<op>`` on CUDA tensors (CPU tensors where torch
            has no CUDA, and with ``--quick``): the eager fast path
            (docs/torch.md). fwd: inputs that need no gradient.
            fwd+bwd: inputs that do; the op, ``.float().sum()`` and
            ``torch.autograd.grad`` to them (the forward saves residuals,
            the backward runs from them).
  ours_op   the same calls through the registered custom ops
            (``torch.ops.pallas_kernels_impl.*``, what torch.compile and XLA
            tensors use), the fast path switched off.
  jax       the jitted ``pallas_kernels`` op on the same buffers (DLPack,
            no copy); fwd+bwd: ``jax.jit(jax.grad)`` of the same sum.
  torch     PyTorch's own op (SDPA, ``F.linear`` in bf16, torchvision's GIoU
            loss and NMS), the same way.

Every impl is timed two ways, both host wall time:

  ms           one call with the device synchronised after it
               (``Timer.synced``: median of 21 calls after 2 warm-up
               calls), so a bridge's fixed per-call cost shows at small
               shapes and fades at large ones;
  loop_ms      calls launched back to back, one wait at the end
               (``Timer.back_to_back``): what an eager training loop pays
               per call, the host's work or the device's, whichever is
               longer.

``overhead_us`` = ours - jax by the first, ``loop_overhead_us`` by the
second (per forward, or per forward+backward); ``op_overhead_us`` = ours_op
- jax. ``err``: ours against torch (NMS: ``same`` indices).
"""
from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from bench import harness

ATTENTION = [(1, 4, 128, 64), (4, 16, 1024, 64), (4, 16, 4096, 128)]
CASES = ([dict(op="flash_attention", shape=s, mode=m) for s in ATTENTION
          for m in ("fwd", "fwd+bwd")]
         + [dict(op="int8_dense", shape=s) for s in ((128, 1024, 1024),
                                                     (8192, 4096, 4096))]
         + [dict(op="giou_loss", shape=(n,)) for n in (4096, 2**20)]
         + [dict(op="nms", shape=(n,)) for n in (1024, 4096)])
QUICK = ([dict(op="flash_attention", shape=(1, 2, 128, 64), mode=m)
          for m in ("fwd", "fwd+bwd")]
         + [dict(op="int8_dense", shape=(64, 256, 256)),
            dict(op="giou_loss", shape=(4096,)), dict(op="nms", shape=(256,))])


def label(case):
  return " ".join([case["op"], "x".join(map(str, case["shape"])),
                   case.get("mode", "fwd")])


def thunks(case, torch, device, dtype):
  """(bridge, jax, torch) thunks of the case on the same tensors."""
  import torch_bridge as tb
  gen = torch.Generator().manual_seed(0)

  def rand(*shape, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)

  def boxes(n, span):
    xy = torch.rand(n, 2, generator=gen) * span
    return torch.cat([xy, xy + torch.rand(n, 2, generator=gen) * span / 5 + 1],
                     -1).to(device)

  def as_jax(*tensors):
    return [jax.dlpack.from_dlpack(t.detach()) for t in tensors]

  if case["op"] == "flash_attention":
    training = case["mode"] == "fwd+bwd"
    q, k, v = (rand(*case["shape"]).requires_grad_(training)
               for _ in range(3))
    sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention,
                             is_causal=True)
    bridge = functools.partial(tb.flash_attention, causal=True)
    ours = functools.partial(pk.flash_attention, causal=True)
    if case["mode"] == "fwd":
      return (lambda: bridge(q, k, v), functools.partial(
          jax.jit(ours), *as_jax(q, k, v)), lambda: sdpa(q, k, v))
    grad = jax.jit(jax.grad(lambda *a: ours(*a).astype(jnp.float32).sum(),
                            argnums=(0, 1, 2)))

    def torch_grad(fn):
      return lambda: torch.autograd.grad(fn(q, k, v).float().sum(), (q, k, v))
    return (torch_grad(bridge), functools.partial(grad, *as_jax(q, k, v)),
            torch_grad(sdpa))
  if case["op"] == "int8_dense":
    m, k, n = case["shape"]
    x, w = rand(m, k), rand(n, k, scale=k ** -0.5)
    dense = jax.jit(lambda x, w: pk.nn.int8_dense(x, w.T))
    return (lambda: tb.int8_dense(x, w), functools.partial(
        dense, *as_jax(x, w)), lambda: torch.nn.functional.linear(x, w))
  import torchvision.ops as tv
  if case["op"] == "giou_loss":
    pred, target = boxes(case["shape"][0], 100), boxes(case["shape"][0], 100)
    loss = jax.jit(functools.partial(pk.giou_loss, reduction="mean"))
    return (lambda: tb.giou_loss(pred, target, reduction="mean"),
            functools.partial(loss, *as_jax(pred, target)),
            lambda: tv.generalized_box_iou_loss(pred, target, reduction="mean"))
  b, s = boxes(case["shape"][0], 500), torch.rand(case["shape"][0],
                                                   generator=gen).to(device)
  nms = jax.jit(functools.partial(pk.nms, iou_threshold=0.5,
                                  max_output_size=128))
  return (lambda: tb.nms(b, s, iou_threshold=0.5, max_output_size=128),
          functools.partial(nms, *as_jax(b, s)),
          lambda: tv.nms(b, s, 0.5)[:128])


@contextlib.contextmanager
def custom_ops_only():
  """The bridge with its eager fast path off: every call dispatches
  through ``torch.ops.pallas_kernels_impl.*``."""
  from torch_bridge import _eager
  plain_device = _eager.plain_device
  _eager.plain_device = lambda tensors: None
  try:
    yield
  finally:
    _eager.plain_device = plain_device


def run(case, timer):
  torch = harness.torch_module()
  if torch is None:
    raise ImportError("torch_bridge bench: torch is not installed")
  device = "cuda" if torch.cuda.is_available() and not timer.quick else "cpu"
  dtype = torch.bfloat16 if device == "cuda" else torch.float32
  bridge, direct, peer = thunks(case, torch, device, dtype)
  rows, name = [], label(case)
  ours = harness.measure(rows, name, "ours", lambda: timer.synced(bridge))
  with custom_ops_only():
    via_op = harness.measure(rows, name, "ours_op",
                             lambda: timer.synced(bridge))
  jax_row = harness.measure(rows, name, "jax", lambda: timer.synced(direct))
  torch_row = harness.measure(rows, name, "torch",
                              lambda: timer.synced(peer))
  for row, fn in ((ours, bridge), (jax_row, direct), (torch_row, peer)):
    try:
      row["loop_ms"] = 1e3 * timer.back_to_back(fn)
    except Exception as e:  # noqa: BLE001 -- one failing loop hides nothing
      row["error"] = f"loop: {type(e).__name__}: {e}"[:300]
  if jax_row["ms"]:
    for row, key in ((ours, "overhead_us"), (via_op, "op_overhead_us")):
      if row["ms"]:
        row[key] = 1e3 * (row["ms"] - jax_row["ms"])
  if ours.get("loop_ms") and jax_row.get("loop_ms"):
    ours["loop_overhead_us"] = 1e3 * (ours["loop_ms"] - jax_row["loop_ms"])
  got, want = bridge(), peer()
  if case["op"] == "nms":
    kept, want = got[0][:int(got[1])].long().cpu(), want.cpu()
    ours["same"] = len(kept) == len(want) and bool(torch.equal(kept, want))
  elif case["op"] != "int8_dense":  # int8 rounding is no error
    ours["err"] = max(harness.rel_error(g.detach().float().cpu(),
                                        w.detach().float().cpu())
                      for g, w in zip(jax.tree.leaves(got),
                                      jax.tree.leaves(want)))
  return rows


def main(argv=None):
  return harness.main(
      "torch_bridge", CASES, QUICK, run, label=label, argv=argv, doc=__doc__,
      columns=["case", "impl", "ms", "loop_ms", "overhead_us",
               "loop_overhead_us", "op_overhead_us", "err",
               "same", "vs_jax", "vs_torch", "error"])


if __name__ == "__main__":
  main()
