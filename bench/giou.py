"""GIoU loss and pairwise GIoU against jitted JAX and torchvision.

    python -m bench.giou [--quick] [--cases pairwise] [--tag T] [--out DIR]

Cases: ``pk.giou_loss`` forward (reduction="none") and forward+backward
(reduction="mean", gradients for both box sets) at 1024 x 256 boxes and at
16M box pairs; ``pk.pairwise_giou`` at 4096 x 4096. Peers in the same run:
the package's jitted pure-JAX reference (``backend="reference"``, what XLA
makes of the formula), torchvision's ``generalized_box_iou_loss`` /
``generalized_box_iou`` eager, and under ``torch.compile`` for the pairwise
matrix on a GPU. ``gbps``: the op's minimum HBM traffic (inputs read once, outputs
written once) per second; ``pct_copy``: that against a measured copy (the
faster of JAX ``x + 1`` and torch ``copy_`` over 1 GiB, read + write).
``err``: ours against the reference. TPU rows: the roofline of the minimum
traffic (memory bound).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from bench import harness, roofline

F32 = 4
CASES = ([dict(op="loss", shape=s, mode=m, copies=c)
          for s, c in (((1024, 256), 20), ((16 * 2**20,), 2))
          for m in ("fwd", "fwd+bwd")]
         + [dict(op="pairwise", shape=(4096, 4096), mode="fwd", copies=10)])
QUICK = [dict(op="loss", shape=(4, 300), mode=m, copies=1)
         for m in ("fwd", "fwd+bwd")] + [
             dict(op="pairwise", shape=(256, 512), mode="fwd", copies=1)]


def label(case):
  name = "giou_loss" if case["op"] == "loss" else "pairwise_giou"
  return f"{name} {'x'.join(map(str, case['shape']))} {case['mode']}"


def boxes(rng, shape):
  xy = rng.uniform(0.0, 100.0, shape + (2,))
  wh = rng.uniform(1.0, 30.0, shape + (2,))
  return np.concatenate([xy, xy + wh], axis=-1).astype(np.float32)


def jax_op(case, backend):
  if case["op"] == "pairwise":
    return functools.partial(pk.pairwise_giou, backend=backend)
  if case["mode"] == "fwd":
    return functools.partial(pk.giou_loss, backend=backend)
  return jax.value_and_grad(lambda p, t: pk.giou_loss(
      p, t, reduction="mean", backend=backend), argnums=(0, 1))


def torch_peers(case, a, b):
  """name -> thunk with torchvision; {} without it."""
  torch = harness.torch_module()
  try:
    import torchvision.ops as tv
  except ImportError:
    tv = None
  if torch is None or tv is None:
    return {}
  device = "cuda" if torch.cuda.is_available() else "cpu"
  ta, tb = (torch.from_numpy(x.reshape(-1, 4)).to(device) for x in (a, b))
  if case["op"] == "pairwise":
    peers = {"torchvision": lambda: tv.generalized_box_iou(ta, tb)}
    if device == "cuda":  # compiling for the CPU takes a minute
      peers["torchvision_compiled"] = functools.partial(
          torch.compile(tv.generalized_box_iou), ta, tb)
    return peers
  if case["mode"] == "fwd":
    def fwd():
      with torch.no_grad():
        return tv.generalized_box_iou_loss(ta, tb)
    return {"torchvision": fwd}
  ta.requires_grad_(True)
  tb.requires_grad_(True)
  return {"torchvision": lambda: torch.autograd.grad(
      tv.generalized_box_iou_loss(ta, tb, reduction="mean"), (ta, tb))}


@functools.cache
def copy_gbps(quick):
  """Bytes read + written per second by the faster measured copy."""
  n = 2**20 if quick else 2**28
  timer = harness.Timer(quick=quick)
  rates = [2 * n * F32 / timer.jax(lambda v: v + 1.0,
                                   jnp.ones((n,), jnp.float32))[0]]
  torch = harness.torch_module()
  if torch is not None and torch.cuda.is_available():
    src = torch.ones(n, device="cuda")
    dst = torch.empty_like(src)
    rates.append(2 * n * F32 / timer.torch(lambda: dst.copy_(src)))
  return max(rates) / 1e9


def traffic(case):
  """Minimum HBM bytes of the op: inputs once, outputs once."""
  if case["op"] == "pairwise":
    n, m = case["shape"]
    return n * m * F32 + (n + m) * 4 * F32
  pairs = int(np.prod(case["shape"]))
  if case["mode"] == "fwd":
    return pairs * (2 * 4 * F32 + F32)
  return pairs * 2 * 4 * F32 * 3  # read both sets twice, write both grads


def run(case, timer):
  rng = np.random.default_rng(0)
  if case["op"] == "pairwise":
    a, b = (boxes(rng, (n,)) for n in case["shape"])
  else:
    a, b = boxes(rng, case["shape"]), boxes(rng, case["shape"])
  rows, name, bytes_moved = [], label(case), traffic(case)
  outs = {}
  for impl, backend in (("ours", None), ("jax_reference", "reference")):
    def timed(impl=impl, backend=backend):
      seconds, outs[impl] = timer.jax(jax_op(case, backend), a, b,
                                      copies=case["copies"])
      return seconds
    harness.measure(rows, name, impl, timed)
  for impl, thunk in torch_peers(case, a, b).items():
    harness.measure(rows, name, impl,
                    lambda t=thunk: timer.torch(t, reps=case["copies"]))
  if len(outs) == 2:
    rows[0]["err"] = max(harness.rel_error(x, y) for x, y in zip(
        jax.tree.leaves(outs["ours"]), jax.tree.leaves(outs["jax_reference"])))
  copy = copy_gbps(timer.quick)
  for row in rows:
    if row["ms"]:
      row["gbps"] = bytes_moved / row["ms"] / 1e6
      row["pct_copy"] = 100 * row["gbps"] / copy
  return rows


def tpu_rows(cases):
  return [row for case in cases
          for row in roofline.rows(label(case), 0.0, traffic(case))]


def main(argv=None):
  return harness.main(
      "giou", CASES, QUICK, run, label=label, tpu_rows=tpu_rows, argv=argv,
      doc=__doc__,
      columns=["case", "impl", "ms", "gbps", "pct_copy", "err",
               "vs_jax_reference", "vs_torchvision", "vs_torchvision_compiled",
               "error"])


if __name__ == "__main__":
  main()
