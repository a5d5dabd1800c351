"""Greedy NMS against torchvision.

    python -m bench.nms [--quick] [--cases "N=20000 "] [--tag T] [--out DIR]

Cases: N = 1k, 5k, 20k, 100k boxes at IoU thresholds 0.1 and 0.5 with
max_output_size 128 and N (``pk.nms``), and 16 images x 5k boxes in one
``pk.batched_nms`` call. Boxes: integer corners in a 1024 x 1024 image,
sizes 1..1023, distinct scores (orders are unique, so indices compare
exactly). ours: ``ms``, calls dispatched back to back (``Timer.jax`` with
one copy per program: what a model that never syncs on the result sees;
the op needs no host sync), and ``synced_ms``, one call dispatched and
waited for. Peer: torchvision's
``nms`` / ``batched_nms``, whose host-side pass syncs each call, timed
synced. ``vs_torchvision`` compares ours in-program, ``synced_vs_torchvision``
synced with synced. ``same``: ours keeps torchvision's indices.
"""
from __future__ import annotations

import functools

import numpy as np

import pallas_kernels as pk
from bench import harness

CASES = ([dict(n=n, thr=t, m=m) for n in (1000, 5000, 20000, 100000)
          for t in (0.1, 0.5) for m in (128, n)]
         + [dict(batch=16, n=5000, thr=0.5, m=m) for m in (128, 5000)])
QUICK = [dict(n=300, thr=0.5, m=300), dict(batch=2, n=200, thr=0.5, m=64)]


def label(case):
  count = f"{case['batch']}x{case['n']}" if "batch" in case else case["n"]
  return f"N={count} thr={case['thr']} max={case['m']}"


def boxes(rng, n, image=1024):
  sizes = rng.integers(1, image, (n, 2))
  top_left = rng.integers(0, image - 1, (n, 2))
  bottom_right = np.clip(top_left + sizes, 0, image - 1)
  corners = np.concatenate([top_left, bottom_right], 1).astype(np.float32)
  return corners, (rng.permutation(n) / max(n, 1)).astype(np.float32)


def torchvision_peer(case, data):
  """(thunk that syncs, function of its result -> kept indices per image)."""
  import torchvision.ops as tv
  torch = harness.torch_module()
  device = "cuda" if torch.cuda.is_available() else "cpu"
  b = torch.from_numpy(data[0].reshape(-1, 4)).to(device)
  s = torch.from_numpy(data[1].reshape(-1)).to(device)
  n, m = case["n"], case["m"]
  if "batch" not in case:
    return (lambda: tv.nms(b, s, case["thr"])[:m],
            lambda keep: [keep.cpu().numpy()])
  ids = torch.arange(case["batch"], device=device).repeat_interleave(n)

  def per_image(keep):
    keep = keep.cpu().numpy()
    return [keep[(keep >= i * n) & (keep < (i + 1) * n)][:m] - i * n
            for i in range(case["batch"])]
  return lambda: tv.batched_nms(b, s, ids, case["thr"]), per_image


def run(case, timer):
  rng = np.random.default_rng(0)
  if "batch" in case:
    data = [np.stack(x) for x in zip(*(boxes(rng, case["n"])
                                       for _ in range(case["batch"])))]
    op = pk.batched_nms
  else:
    data, op = boxes(rng, case["n"]), pk.nms
  op = functools.partial(op, iou_threshold=case["thr"],
                         max_output_size=case["m"])
  iters = 3 if case["n"] * case.get("batch", 1) >= 50_000 else None
  rows, name, got = [], label(case), {}

  def timed():
    seconds, got["out"] = timer.jax(op, *data, iters=iters)
    return seconds
  ours = harness.measure(rows, name, "ours", timed)
  if ours["ms"]:
    ours["kept"] = int(np.sum(got["out"][1]))
    ours["synced_ms"] = 1e3 * timer.jax_synced(op, *data, iters=iters)
  try:
    call, kept = torchvision_peer(case, data)
  except ImportError:
    return rows
  tv = harness.measure(rows, name, "torchvision",
                       lambda: timer.synced(call, iters=iters))
  if ours["ms"] and tv["ms"]:
    ours["synced_vs_torchvision"] = tv["ms"] / ours["synced_ms"]
    indices = np.asarray(got["out"][0]).reshape(-1, case["m"])
    ours["same"] = all(np.array_equal(mine[mine >= 0], theirs)
                       for mine, theirs in zip(indices, kept(call())))
  return rows


def main(argv=None):
  return harness.main(
      "nms", CASES, QUICK, run, label=label, argv=argv, doc=__doc__,
      columns=["case", "impl", "ms", "synced_ms", "kept", "same",
               "vs_torchvision", "synced_vs_torchvision", "error"])


if __name__ == "__main__":
  main()
