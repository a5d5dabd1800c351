"""Greedy NMS benchmark: this package's kernel against its peers.

On a CUDA machine: N = 1k, 5k, 20k, 100k boxes (the write-up's generator:
integer boxes in a 1024x1024 image, sizes 1..1023; distinct scores), IoU
thresholds 0.1 and 0.5, max_output_size 128 and N, plus 16 images x 5k in
one call, for
  ours         pallas_kernels.nms / batched_nms, backend="gpu" (jitted);
               "design" says bitmask/<row chunks> or blocked
  torchvision  torchvision.ops.nms (batched: batched_nms with image ids),
               timed with the host sync its CPU pass needs
  reference    pallas_kernels.reference.nms, jitted pure JAX (while loop)
  nxn_mask     the write-up's design, re-implemented: an N x N "IoU > t"
               matrix in HBM and a max_output_size-step argmax loop (skipped
               where the matrix would not fit)
Each row says whether the indices equal torchvision's and the reference's.
Before timing, ``check`` compares the GPU kernel with numpy's float32 greedy
NMS (``numpy_nms``, the truth: XLA's GPU division need not round correctly,
so the GPU-jitted reference may not) on harder data (float boxes, clusters,
classes, NaN scores, inverted boxes, tiny N).

Elsewhere (CPU) ``--quick`` runs N = 300 with the kernel in interpret mode:
a smoke test, not a speed figure.

  python bench/bench_nms.py [--quick] [--tune] [--tune-scan] [--profile]
                            [--no-check] [--quick-check] [--minimal-check]
                            [--sizes 1000,5000] [--iters 10]
                            [--small-iters 30] [--big-iters 3]
                            [--peers reference,torchvision,nxn_mask]

Timing (also in the results file's "timing"): ``ours_ms`` is one call
dispatched and waited for, so it carries this host's per-call sync floor
("jit_floor", ~0.07-0.08 ms on the H100 VM); ``ours_pipelined_ms`` is
PIPELINE_REPS calls dispatched back to back with one wait, per call: what a
model that never syncs on the result sees (the op needs no host sync).
torchvision is timed per call with the synchronize its host-side pass
needs. ``x_vs_tv`` compares synced with synced, ``x_vs_tv_pipelined``
pipelined ours with torchvision.

``--profile`` reads device time per kernel from a JAX profiler trace (where
the time goes: sort, mask, scan, glue) and the dispatch floor of a trivial
jitted call; ``--tune-scan`` A/Bs scan forms and the small-N chunk length
by device time at max_output_size = N (checked against the reference) and
keeps the fastest. Wall times of calls under ~0.3 ms are dominated by
dispatch and vary by +-20% between runs.

``--forms scan|sizes|overlap`` only A/Bs settings (FORM_SETS; configs
stop starting after NMS_FORMS_BUDGET_S seconds, default 150), each checked
against numpy's float32 greedy NMS on hard data (NaN, inverted boxes, ties,
clusters, classes) and timed by device time; ``--pick`` A/Bs PICK_CONFIGS
before the bench and keeps the fastest correct one.

Stop 11's 20k work: ``--forms overlap`` (bench/results/
nms-forms-overlap-h100-2026-11-23.json), then ``--pick --minimal-check
--sizes 5000,20000 --no-batched --peers torchvision --small-iters 20
--name nms-20k`` (nms-20k-h100-2026-11-23.json: PICK_CONFIGS and the
5k / 20k rows with the defaults it kept). The full H100 table
(bench/results/nms-h100-2026-11-23.json) used
``--pick --minimal-check --sizes 1000,5000,20000,100000 --small-iters 20``;
nms-forms-h100-2026-11-22.json and nms-forms-sizes-h100-2026-11-22.json
hold the scan-form and block-size A/Bs behind its defaults,
nms-scan-tune-h100-2026-11-22.json an earlier scan A/B, and
nms-profile-h100-2026-11-22.json the ``--profile`` run that located the
time (before the pipelined scan and the dead-word skips).
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import harness  # noqa: E402
import pallas_kernels as pk  # noqa: E402
from pallas_kernels.boxes.nms import api, block_sizes, gpu as nms_gpu, reference  # noqa: E402,E501


def writeup_boxes(rng, n, image=1024):
  """The write-up's generator, with distinct scores so orders are unique."""
  sizes = rng.integers(1, image, (n, 2))
  top_left = rng.integers(0, image - 1, (n, 2))
  bottom_right = np.clip(top_left + sizes, 0, image - 1)
  boxes = np.concatenate([top_left, bottom_right], 1).astype(np.float32)
  scores = (rng.permutation(n) / max(n, 1)).astype(np.float32)
  return boxes, scores


def nxn_mask_nms(boxes, scores, *, iou_threshold, max_output_size):
  """The write-up's approach in our words: full mask, argmax loop, M steps."""
  keep_scores = scores - jnp.min(scores) + 1e-5
  planes = tuple(boxes[:, c] for c in range(4)) + (reference.box_areas(boxes),)
  a = tuple(p[:, None] for p in planes)
  b = tuple(p[None, :] for p in planes)
  over = reference.iou_exceeds(a, b, iou_threshold)
  over = over | jnp.eye(scores.shape[0], dtype=bool)

  def step(i, state):
    remaining, out = state
    best = jnp.argmax(remaining)
    live = remaining[best] > 0
    out = out.at[i].set(jnp.where(live, best, -1).astype(jnp.int32))
    remaining = jnp.where(over[best] & live, 0.0, remaining)
    return remaining, out

  out = jnp.full((max_output_size,), -1, jnp.int32)
  _, out = jax.lax.fori_loop(0, max_output_size, step, (keep_scores, out))
  return out


def _same(a, b):
  a = np.asarray(a)
  b = np.asarray(b)
  return a.shape == b.shape and bool((a == b).all())


def _valid(indices):
  indices = np.asarray(indices)
  return indices[indices >= 0]


def numpy_nms(boxes, scores, thr, m, class_ids=None):
  """Greedy NMS in numpy float32 (IEEE, no fused multiply-add): the truth.

  NaN scores are never kept (sorted last, as in ``reference``); with
  ``class_ids`` only boxes of the kept box's class are suppressed.
  """
  scores = np.asarray(scores, np.float32)
  valid = ~np.isnan(scores)
  key = np.where(valid, -np.nan_to_num(scores) + np.float32(0), np.inf)
  order = np.argsort(key, kind="stable")[:int(valid.sum())]
  same = np.ones(len(order), bool)
  b = boxes[order].astype(np.float32)
  x1, y1, x2, y2 = b.T
  area = np.maximum(x2 - x1, 0) * np.maximum(y2 - y1, 0)
  alive = np.ones(len(order), bool)
  keep = []
  for i in range(len(order)):
    if not alive[i]:
      continue
    keep.append(order[i])
    if len(keep) == m:
      break
    rest = slice(i + 1, None)
    if class_ids is not None:
      same = np.asarray(class_ids)[order] == np.asarray(class_ids)[order[i]]
    iw = np.maximum(np.minimum(x2[i], x2[rest]) - np.maximum(x1[i], x1[rest]),
                    np.float32(0))
    ih = np.maximum(np.minimum(y2[i], y2[rest]) - np.maximum(y1[i], y1[rest]),
                    np.float32(0))
    inter = iw * ih
    with np.errstate(invalid="ignore", divide="ignore"):
      iou = inter / ((area[i] + area[rest]) - inter)
    alive[rest] &= ~((iou > np.float32(thr)) & same[rest])
  return np.asarray(keep, np.int32)


def check(rng, backend="gpu", quick=False, minimal=False):
  """Kernel vs reference on data that stresses the semantics.

  Both designs; ``quick``: the bitmask design only, on fewer cases (the
  blocked fallback is unchanged and slow to compile); ``minimal``: only
  the classes, NaN/inverted and ties cases (the timed rows check the rest).
  """
  quick = quick or minimal
  rows = []
  designs = ((("bitmask", 1 << 40),) if quick
             else (("bitmask", 1 << 40), ("blocked", 0)))

  def compare(name, boxes, scores, thr, m, class_ids=None):
    # The truth is numpy's float32 greedy NMS: XLA's GPU division is not
    # correctly rounded, so the jitted reference on the GPU may decide an
    # IoU that equals the threshold differently (integer boxes make exact
    # ties common at 0.5); "ref_ok" records whether it did.
    truth = numpy_nms(boxes, scores, thr, m, class_ids)
    want = (np.full(m, -1, np.int32), len(truth))
    want[0][:len(truth)] = truth
    ref = reference.nms(jnp.asarray(boxes), jnp.asarray(scores),
                        iou_threshold=thr, max_output_size=m,
                        class_ids=None if class_ids is None
                        else jnp.asarray(class_ids))
    ref_ok = _same(ref[0], want[0])
    for design, budget in designs:
      saved = block_sizes.GPU_BITMASK_MAX_BYTES
      block_sizes.GPU_BITMASK_MAX_BYTES = budget
      try:
        got = pk.nms(boxes, scores, iou_threshold=thr, max_output_size=m,
                     class_ids=class_ids, backend=backend)
      finally:
        block_sizes.GPU_BITMASK_MAX_BYTES = saved
      ok = _same(got[0], want[0]) and int(got[1]) == int(want[1])
      rows.append(dict(case=name, design=design, n=len(scores), thr=thr, m=m,
                       kept=int(want[1]), ok=ok, ref_ok=ref_ok))

  for n in (() if minimal else (7, 3001) if quick else (1, 7, 129, 3001)):
    boxes, scores = writeup_boxes(rng, n)
    compare("writeup", boxes, scores, 0.5, n)
  if not minimal:
    boxes, scores = writeup_boxes(rng, 9000)  # several row chunks
    compare("chunks", boxes, scores, 0.5, 9000)
    compare("chunks", boxes, scores, 0.1, 100)
  if not quick:
    xy = rng.random((2000, 2)) * 500
    wh = rng.random((2000, 2)) * 60 + 1
    boxes = np.concatenate([xy, xy + wh], 1).astype(np.float32)
    compare("float", boxes, rng.random(2000).astype(np.float32), 0.5, 2000)
    centres = rng.random((10, 2)) * 400
    xy = centres[rng.integers(0, 10, 1500)] + rng.normal(0, 3, (1500, 2))
    boxes = np.concatenate([xy, xy + 40 + rng.normal(0, 3, (1500, 2))],
                           1).astype(np.float32)
    compare("clusters", boxes, rng.random(1500).astype(np.float32), 0.1, 300)
  boxes, scores = writeup_boxes(rng, 2500)
  compare("classes", boxes, scores, 0.3, 2500,
          class_ids=rng.integers(0, 7, 2500).astype(np.int32))
  scores = scores.copy()
  scores[rng.random(2500) < 0.2] = np.nan
  boxes = boxes.copy()
  flip = rng.random(2500) < 0.2
  boxes[flip] = boxes[flip][:, [2, 3, 0, 1]]
  compare("nan+inverted", boxes, scores, 0.5, 2500)
  ties = np.round(rng.random(2500) * 10).astype(np.float32)
  compare("ties", boxes, ties, 0.5, 64)
  return rows


def torchvision_peer(boxes_np, scores_np, thr, m):
  import torch
  import torchvision
  boxes = torch.from_numpy(boxes_np).cuda()
  scores = torch.from_numpy(scores_np).cuda()

  def call():
    keep = torchvision.ops.nms(boxes, scores, thr)[:m]
    torch.cuda.synchronize()
    return keep

  return call


TIMING_NOTE = (
    "ours_ms: one call, dispatched and waited for (block_until_ready), so it "
    "includes this host's per-call sync floor (the 'jit_floor' entry, "
    "~0.07-0.13 ms synced on the H100 VM); ours_pipelined_ms: "
    "PIPELINE_REPS calls dispatched back to back, waiting for the last "
    "only, divided by "
    "PIPELINE_REPS: what a model that never syncs on the result sees (the "
    "op needs no host sync). tv_ms: torchvision.ops.nms plus the "
    "torch.cuda.synchronize its host-side pass needs, per call. x_vs_tv = "
    "tv_ms / ours_ms (synced vs synced); x_vs_tv_pipelined = tv_ms / "
    "ours_pipelined_ms.")
PIPELINE_REPS = 20


def _time_ours(row, fn, args, iters):
  """Synced per-call time and pipelined (back-to-back) time, in ms."""
  row["ours_ms"] = 1e3 * harness.time_jax(fn, *args, iters=iters)
  row["ours_pipelined_ms"] = 1e3 * harness.time_jax(
      fn, *args, warmup=1, iters=max(3, iters // 3), reps=PIPELINE_REPS)


def _ratios(row, peers):
  for peer in peers:
    if f"{peer}_ms" in row:
      row[f"x_vs_{peer}"] = row[f"{peer}_ms"] / row["ours_ms"]
  if "tv_ms" in row:
    row["x_vs_tv_pipelined"] = row["tv_ms"] / row["ours_pipelined_ms"]


def run_case(rng, n, thr, m, peers, iters, nxn_below=20_001):
  boxes_np, scores_np = writeup_boxes(rng, n)
  boxes, scores = jnp.asarray(boxes_np), jnp.asarray(scores_np)
  layout = nms_gpu.bitmask_layout(1, n, **api._bitmask_sizes(n, m))
  design = "blocked" if layout is None else f"bitmask/{layout[2]}"
  row = dict(n=n, thr=thr, m=m, design=design)
  ours = jax.jit(functools.partial(pk.nms, iou_threshold=thr,
                                   max_output_size=m, backend="gpu"))
  got, count = ours(boxes, scores)
  row["kept"] = int(count)
  _time_ours(row, ours, (boxes, scores), iters)
  if "reference" in peers:
    ref = functools.partial(reference.nms, iou_threshold=thr,
                            max_output_size=m)
    want, _ = ref(boxes, scores)
    row["same_as_ref"] = _same(got, want)
    if not row["same_as_ref"]:  # who is right: exact float32 greedy on host
      truth = numpy_nms(boxes_np, scores_np, thr, m)
      row["ours_equals_numpy"] = _same(_valid(got), truth)
      row["ref_equals_numpy"] = _same(_valid(want), truth)
    row["ref_ms"] = 1e3 * harness.time_jax(ref, boxes, scores, iters=iters)
  if "torchvision" in peers:
    try:
      call = torchvision_peer(boxes_np, scores_np, thr, m)
      tv = call().cpu().numpy().astype(np.int32)
      row["same_as_tv"] = _same(_valid(got), tv)
      row["tv_ms"] = 1e3 * harness.time_host(call, iters=iters)
    except Exception as e:  # noqa: BLE001
      row["tv_error"] = repr(e)[:200]
  if "nxn_mask" in peers and n < nxn_below:
    mask = jax.jit(functools.partial(nxn_mask_nms, iou_threshold=thr,
                                     max_output_size=m))
    row["same_as_nxn"] = _same(_valid(mask(boxes, scores)), _valid(got))
    row["nxn_ms"] = 1e3 * harness.time_jax(mask, boxes, scores,
                                           warmup=1, iters=max(3, iters // 4))
  _ratios(row, ("tv", "ref", "nxn"))
  return row


def run_batched(rng, batch, n, thr, m, peers, iters):
  data = [writeup_boxes(rng, n) for _ in range(batch)]
  boxes_np = np.stack([d[0] for d in data])
  scores_np = np.stack([d[1] for d in data])
  boxes, scores = jnp.asarray(boxes_np), jnp.asarray(scores_np)
  row = dict(n=f"{batch}x{n}", thr=thr, m=m)
  ours = jax.jit(functools.partial(pk.batched_nms, iou_threshold=thr,
                                   max_output_size=m, backend="gpu"))
  got, count = ours(boxes, scores)
  row["kept"] = int(np.asarray(count).sum())
  _time_ours(row, ours, (boxes, scores), iters)
  if "reference" in peers:
    ref = functools.partial(reference.batched_nms, iou_threshold=thr,
                            max_output_size=m)
    row["same_as_ref"] = _same(got, ref(boxes, scores)[0])
    row["ref_ms"] = 1e3 * harness.time_jax(ref, boxes, scores, iters=iters)
  if "torchvision" in peers:
    try:
      import torch
      import torchvision
      tb = torch.from_numpy(boxes_np.reshape(-1, 4)).cuda()
      ts = torch.from_numpy(scores_np.reshape(-1)).cuda()
      ids = torch.arange(batch, device="cuda").repeat_interleave(n)

      def call():
        keep = torchvision.ops.batched_nms(tb, ts, ids, thr)
        torch.cuda.synchronize()
        return keep

      keep = call().cpu().numpy()
      same = True
      for b in range(batch):
        mine = keep[(keep >= b * n) & (keep < (b + 1) * n)][:m] - b * n
        same &= _same(_valid(got[b]), mine.astype(np.int32))
      row["same_as_tv"] = bool(same)
      row["tv_ms"] = 1e3 * harness.time_host(call, iters=iters)
    except Exception as e:  # noqa: BLE001
      row["tv_error"] = repr(e)[:200]
  _ratios(row, ("tv", "ref"))
  return row


def profile(rng, sizes, iters):
  """Where the time goes: device kernels per stage, wall time, jit floor."""
  rows = []
  floor = jax.jit(lambda x: x + 1)
  x = jnp.ones((16,), jnp.float32)
  rows.append(dict(case="jit floor (x + 1)", wall_ms=1e3 * harness.time_jax(
      floor, x, iters=50)))
  for n in sizes:
    boxes_np, scores_np = writeup_boxes(rng, n)
    boxes, scores = jnp.asarray(boxes_np), jnp.asarray(scores_np)
    stages = {"sort": jax.jit(lambda s: reference.sort_by_score(s))}
    for m in (128, n):
      stages[f"nms m={m}"] = jax.jit(functools.partial(
          pk.nms, iou_threshold=0.5, max_output_size=m, backend="gpu"))
    for name, fn in stages.items():
      args = (scores,) if name == "sort" else (boxes, scores)
      try:
        wall = 1e3 * harness.time_jax(fn, *args, iters=iters)
        kernels = harness.device_kernel_times(fn, *args)
      except Exception as e:  # noqa: BLE001
        rows.append(dict(case=f"{name} n={n}", error=repr(e)[:300]))
        continue
      top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:10]
      rows.append(dict(case=f"{name} n={n}", wall_ms=wall, kernels={
          k: [round(v[0], 1), round(v[1], 1)] for k, v in top}))
      print(rows[-1], flush=True)
  return rows


SCAN_CASES = ((1000, 0.5), (5000, 0.1))  # max_output_size = N
# The first config is the stop-10 default (``--tune-scan`` keeps the
# fastest correct one).
SCAN_CONFIGS = (  # SCAN_DEPTH, RESOLVE, MASK_CHUNK_ROWS_SMALL
    (1, "where", 4096), (1, "skip", 4096), (1, "skip", 8192))


def tune_scan(rng):
  """Device-time A/B of the scan form and chunk length; keeps the fastest.

  These knobs apply below ``block_sizes.SMALL_BOXES``; larger N keep
  (SCAN_DEPTH_LARGE, RESOLVE_LARGE).
  Each config is timed (device time, profiler) and checked against the
  reference on SCAN_CASES (max_output_size = N, the scan-heavy cases);
  only configs with identical indices everywhere compete, scored by the
  sum over cases of device time relative to the first config.
  """
  rows = []
  data = {}
  for n, thr in SCAN_CASES:
    boxes_np, scores_np = writeup_boxes(rng, n)
    boxes, scores = jnp.asarray(boxes_np), jnp.asarray(scores_np)
    want = reference.nms(boxes, scores, iou_threshold=thr, max_output_size=n)
    data[n, thr] = (boxes, scores, np.asarray(want[0]))
  saved = (nms_gpu.SCAN_DEPTH, nms_gpu.RESOLVE,
           block_sizes.MASK_CHUNK_ROWS_SMALL)
  totals = {}
  first = {}
  for config in SCAN_CONFIGS:
    (nms_gpu.SCAN_DEPTH, nms_gpu.RESOLVE,
     block_sizes.MASK_CHUNK_ROWS_SMALL) = config
    total, ok = 0.0, True
    for (n, thr), (boxes, scores, want) in data.items():
      fn = jax.jit(functools.partial(pk.nms, iou_threshold=thr,
                                     max_output_size=n, backend="gpu"))
      try:
        same = _same(fn(boxes, scores)[0], want)
        kernels = harness.device_kernel_times(fn, boxes, scores)
        us = kernels["(device total)"][1]
        scan_us = kernels.get("_scan_kernel", [0, 0])[1]
        wall = 1e3 * harness.time_jax(fn, boxes, scores, iters=10)
      except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        rows.append(dict(config=str(config), n=n, thr=thr,
                         error=repr(e)[:300]))
        ok = False
        continue
      ok &= same
      total += us / first.setdefault((n, thr), us)
      top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:8]
      rows.append(dict(config=str(config), n=n, thr=thr, same_as_ref=same,
                       device_us=us, scan_us=scan_us, wall_ms=wall,
                       kernels={k: [round(v[0], 1), round(v[1], 1)]
                                for k, v in top}))
      print(rows[-1], flush=True)
    if ok:
      totals[config] = total
  best = min(totals, key=totals.get) if totals else saved
  (nms_gpu.SCAN_DEPTH, nms_gpu.RESOLVE,
   block_sizes.MASK_CHUNK_ROWS_SMALL) = best
  print("kept: SCAN_DEPTH, RESOLVE, MASK_CHUNK_ROWS_SMALL =", best,
        flush=True)
  return rows


# Settings that ``--forms`` A/Bs: module, name.
FORM_KNOBS = {"RESOLVE": nms_gpu, "RESOLVE_LARGE": nms_gpu, "JUMP": nms_gpu,
              "FEW_ROWS": nms_gpu, "OVERLAP": nms_gpu,
              "OVERLAP_PROGRAMS": nms_gpu, "RADIX_SORT": nms_gpu,
              "OVERLAP_FROM": nms_gpu,
              "RANK_SORT_MAX": nms_gpu, "RANK_ROWS": nms_gpu,
              "STATIC_CHUNKS_MAX": nms_gpu,
              "MASK_CHUNK_ROWS_SMALL": block_sizes,
              "MASK_CHUNK_ROWS": block_sizes, "SCAN_WARPS": block_sizes,
              "MASK_CHUNK_ROWS_OVERLAP": block_sizes}
SMALL_CASES = ((1000, 0.1), (1000, 0.5), (5000, 0.1), (5000, 0.5))
LARGE_CASES = ((20000, 0.1), (20000, 0.5))
FORM_CASES = SMALL_CASES + LARGE_CASES  # max_output_size = N
FORM_SETS = {
    # The first A/B (bench/results/nms-forms-h100-2026-11-22.json).
    "scan": (
        ("previous", dict(RESOLVE="where", RESOLVE_LARGE="where", JUMP=False,
                          FEW_ROWS=0, MASK_CHUNK_ROWS_SMALL=4096,
                          RANK_SORT_MAX=0),
         FORM_CASES),
        ("band+jump", dict(RESOLVE="band", RESOLVE_LARGE="band", JUMP=True,
                           MASK_CHUNK_ROWS_SMALL=8192), FORM_CASES),
        ("where+jump", dict(RESOLVE="where", RESOLVE_LARGE="where", JUMP=True,
                            MASK_CHUNK_ROWS_SMALL=8192), FORM_CASES),
        ("band+jump/1warp", dict(RESOLVE="band", RESOLVE_LARGE="band",
                                 JUMP=True, MASK_CHUNK_ROWS_SMALL=8192,
                                 SCAN_WARPS=1), FORM_CASES),
        ("band", dict(RESOLVE="band", RESOLVE_LARGE="band", JUMP=False,
                      MASK_CHUNK_ROWS_SMALL=8192), FORM_CASES),
        ("skip+jump", dict(RESOLVE="skip", RESOLVE_LARGE="skip", JUMP=True,
                           MASK_CHUNK_ROWS_SMALL=8192), FORM_CASES)),
    # Second: few kept rows by bit scans, the rank sort's program size,
    # chunk rows and scan warps from 16k boxes on. Only the first three are
    # checked on FORM_CHECKS (the rest change no scan logic; their timed
    # cases are still compared with numpy).
    "sizes": (
        ("default", {}, FORM_CASES),
        ("few4", dict(FEW_ROWS=4), FORM_CASES),
        ("chunk2048", dict(MASK_CHUNK_ROWS=2048, STATIC_CHUNKS_MAX=10),
         LARGE_CASES, False),
        ("few8", dict(FEW_ROWS=8), FORM_CASES),
        ("rank16", dict(RANK_ROWS=16), SMALL_CASES, False),
        ("chunk3072", dict(MASK_CHUNK_ROWS=3072), LARGE_CASES, False),
        ("scan8warps", dict(SCAN_WARPS=8), LARGE_CASES, False),
        ("rank32", dict(RANK_ROWS=32), SMALL_CASES, False),
        ("chunk8192", dict(MASK_CHUNK_ROWS=8192), LARGE_CASES, False),
        ("scan2warps", dict(SCAN_WARPS=2), LARGE_CASES, False)),
    # Third (stop 11, issue 6's 20k row; bench/results/
    # nms-forms-overlap-h100-2026-11-23.json, which ran the first three
    # before the time budget, "default" then being these old settings and
    # the overlap starting at chunk 0): the uint32-key radix sort and the
    # overlapped scan / next mask launches. "large": checked only on the
    # data above RANK_SORT_MAX boxes (the radix sort; from 16k on the
    # overlapped chunks).
    "overlap": (
        ("default", dict(OVERLAP=False, RADIX_SORT=False), LARGE_CASES,
         False),
        ("radix", dict(OVERLAP=False, RADIX_SORT=True), LARGE_CASES, "large"),
        ("overlap+radix", dict(OVERLAP=True, OVERLAP_FROM=0, RADIX_SORT=True),
         LARGE_CASES, "large"),
        ("overlap263+radix", dict(OVERLAP=True, OVERLAP_FROM=0,
                                  OVERLAP_PROGRAMS=263, RADIX_SORT=True),
         LARGE_CASES, "large"),
        ("overlap+radix/chunk2048", dict(
            OVERLAP=True, OVERLAP_FROM=0, RADIX_SORT=True,
            MASK_CHUNK_ROWS=2048, STATIC_CHUNKS_MAX=10), LARGE_CASES, False),
        ("overlap131+radix", dict(OVERLAP=True, OVERLAP_FROM=0,
                                  OVERLAP_PROGRAMS=131, RADIX_SORT=True),
         LARGE_CASES, False),
        ("overlap+radix/chunk3072", dict(
            OVERLAP=True, OVERLAP_FROM=0, RADIX_SORT=True,
            MASK_CHUNK_ROWS=3072),
         LARGE_CASES, False)),
}


def _apply(settings):
  saved = {k: getattr(FORM_KNOBS[k], k) for k in FORM_KNOBS}
  for k, v in settings.items():
    setattr(FORM_KNOBS[k], k, v)
  return saved


def _hard_data(rng, kind, n):
  boxes, scores = writeup_boxes(rng, n)
  if kind in ("nan+inverted", "ties"):
    scores = scores.copy()
    scores[rng.random(n) < 0.2] = np.nan
    flip = rng.random(n) < 0.2
    boxes[flip] = boxes[flip][:, [2, 3, 0, 1]]
  if kind == "ties":
    scores = np.round(scores * 10).astype(np.float32)
  if kind == "clusters":
    centres = rng.random((10, 2)) * 400
    xy = centres[rng.integers(0, 10, n)] + rng.normal(0, 3, (n, 2))
    boxes = np.concatenate([xy, xy + 40 + rng.normal(0, 3, (n, 2))],
                           1).astype(np.float32)
  return boxes, scores


FORM_CHECKS = (  # kind, n, thr, m, class-aware
    ("nan+inverted", 2500, 0.5, 2500, False),
    ("nan+inverted", 2500, 0.1, 2500, False),
    ("ties", 2500, 0.5, 2500, False), ("ties", 2500, 0.5, 64, False),
    ("clusters", 1500, 0.1, 1500, False),
    ("writeup", 2500, 0.3, 2500, True),
    ("nan+inverted", 9000, 0.5, 9000, False))
# From SMALL_BOXES on (the "where" scan, unrolled chunks, overlap): one draw.
FORM_CHECKS_LARGE = (
    ("nan+inverted", 20000, 0.5, 20000, False),
    ("ties", 20000, 0.5, 20000, False),
    ("clusters", 20000, 0.1, 20000, False),
    ("writeup", 20000, 0.3, 20000, True))


def verify_forms(rng, out, configs, seeds=2, budget_s=None, save=None):
  """Scan forms vs numpy's float32 greedy NMS (the truth) and by time.

  For every (name, settings, cases) of ``configs``: the FORM_CHECKS data (``seeds`` draws
  each; the GPU-jitted reference is compared with the truth too), then
  device time per kernel and pipelined wall time on FORM_CASES. Results
  go to ``out`` as they come; stops starting configs after ``budget_s``.
  """
  if budget_s is None:
    budget_s = float(os.environ.get("NMS_FORMS_BUDGET_S", "150"))
  start = time.time()
  data = []
  large = any(c[3:] == ("large",) for c in configs)
  for kind, n, thr, m, classes in FORM_CHECKS + (
      FORM_CHECKS_LARGE if large else ()):
    for _ in range(1 if n >= 16384 else seeds):
      boxes, scores = _hard_data(rng, kind, n)
      cls = rng.integers(0, 7, n).astype(np.int32) if classes else None
      truth = numpy_nms(boxes, scores, thr, m, cls)
      if n >= 16384:  # the reference's GPU check costs too long there
        data.append((kind, n, thr, m, boxes, scores, cls, truth, None))
        continue
      ref = reference.nms(jnp.asarray(boxes), jnp.asarray(scores),
                          iou_threshold=thr, max_output_size=m,
                          class_ids=None if cls is None else jnp.asarray(cls))
      data.append((kind, n, thr, m, boxes, scores, cls, truth,
                   _same(_valid(ref[0]), truth)))
  out["reference_vs_truth"] = [dict(case=d[0], n=d[1], thr=d[2], m=d[3],
                                    ref_ok=d[8]) for d in data]
  timed = {}
  for n, thr in FORM_CASES:
    b, s = writeup_boxes(rng, n)
    timed[n, thr] = (jnp.asarray(b), jnp.asarray(s), numpy_nms(b, s, thr, n))
  out["forms"] = []
  for name, settings, cases, *check_it in configs:
    if time.time() - start > budget_s:
      out["forms"].append(dict(config=name, skipped="time budget"))
      continue
    saved = _apply(settings)
    row = dict(config=name, settings=settings, checks=[], cases=[])
    try:
      fns = {}
      for kind, n, thr, m, boxes, scores, cls, truth, _ in (
          data if check_it in ([], [True]) else
          [d for d in data if d[1] > nms_gpu.RANK_SORT_MAX]
          if check_it == ["large"]
          else ()):
        key = (thr, m, cls is None)
        if key not in fns:  # fresh per config: traced with its settings
          fns[key] = jax.jit(functools.partial(
              pk.nms, iou_threshold=thr, max_output_size=m, backend="gpu"))
        got = fns[key](boxes, scores, class_ids=cls)
        row["checks"].append(dict(
            case=kind, n=n, thr=thr, m=m,
            ok=_same(_valid(got[0]), truth) and int(got[1]) == len(truth)))

      for (n, thr), (boxes, scores, truth) in timed.items():
        if (n, thr) not in cases:
          continue
        fn = jax.jit(functools.partial(pk.nms, iou_threshold=thr,
                                       max_output_size=n, backend="gpu"))
        ok = _same(_valid(fn(boxes, scores)[0]), truth)
        kernels = harness.device_kernel_times(fn, boxes, scores)
        top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:8]
        row["cases"].append(dict(
            n=n, thr=thr, ok=ok, device_us=kernels["(device total)"][1],
            pipelined_ms=1e3 * harness.time_jax(
                fn, boxes, scores, warmup=1, iters=5, reps=PIPELINE_REPS),
            kernels={k: [round(v[0], 1), round(v[1], 1)] for k, v in top}))
        print(name, row["cases"][-1], flush=True)
      row["checks_ok"] = all(c["ok"] for c in row["checks"] + row["cases"])
    except Exception as e:  # noqa: BLE001
      traceback.print_exc()
      row["error"] = repr(e)[:400]
    finally:
      _apply(saved)
    out["forms"].append(row)
    if save:  # after every config: a run cut short keeps the rest
      save()
    print(name, "checks_ok", row.get("checks_ok"),
          f"{time.time() - start:.0f}s", flush=True)
  return out


# Stop 11 (bench/results/nms-20k-h100-2026-11-23.json, where "default"
# still had 4096-row chunks and "chunk2048", the pick, set MASK_CHUNK_ROWS
# = 2048 and STATIC_CHUNKS_MAX = 10): the defaults (radix sort, overlapped
# 2048-row chunks from chunk 1) against 4096-row chunks and no overlap.
PICK_CONFIGS = (("default", {}),
                ("chunk4096", dict(MASK_CHUNK_ROWS_OVERLAP=4096)),
                ("no-overlap", dict(OVERLAP=False)))
PICK_CASES = ((20000, 0.1), (20000, 0.5))  # max_output_size = N
# The settings a failed check falls back to: the previous session's forms.
FALLBACK = dict(FORM_SETS["scan"][0][1], OVERLAP=False, RADIX_SORT=False)


def pick_form(rng):
  """Device-time A/B of PICK_CONFIGS on PICK_CASES; applies the fastest
  (summed time relative to the first) among those equal to numpy's truth."""
  rows, totals, first = [], {}, {}
  data = {}
  for n, thr in PICK_CASES:
    b, s = writeup_boxes(rng, n)
    data[n, thr] = (jnp.asarray(b), jnp.asarray(s), numpy_nms(b, s, thr, n))
  for name, settings in PICK_CONFIGS:
    saved = _apply(settings)
    total, ok = 0.0, True
    try:
      for (n, thr), (boxes, scores, truth) in data.items():
        fn = jax.jit(functools.partial(pk.nms, iou_threshold=thr,
                                       max_output_size=n, backend="gpu"))
        same = _same(_valid(fn(boxes, scores)[0]), truth)
        kernels = harness.device_kernel_times(fn, boxes, scores)
        us = kernels["(device total)"][1]
        ok &= same
        total += us / first.setdefault((n, thr), us)
        top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:6]
        rows.append(dict(config=name, n=n, thr=thr, same_as_numpy=same,
                         device_us=us, kernels={
                             k: [round(v[0], 1), round(v[1], 1)]
                             for k, v in top}))
        print(rows[-1], flush=True)
    except Exception as e:  # noqa: BLE001
      traceback.print_exc()
      rows.append(dict(config=name, error=repr(e)[:300]))
      ok = False
    finally:
      _apply(saved)
    if ok:
      totals[name] = total
  best = min(totals, key=totals.get) if totals else PICK_CONFIGS[0][0]
  _apply(dict(PICK_CONFIGS)[best])
  print("picked", best, totals, flush=True)
  return dict(rows=rows, totals=totals, picked=best)


TUNED = ("MASK_ROWS", "MASK_WORDS", "MASK_WARPS", "SCAN_WARPS",
         "MASK_CHUNK_ROWS")
BITMASK_CONFIGS = (  # rows, words, mask warps, scan warps, chunk rows
    (64, 4, 4, None, 4096), (64, 4, 4, None, 2048), (64, 4, 4, None, 16384),
    (64, 8, 4, None, 4096), (32, 8, 4, None, 4096), (128, 2, 4, None, 4096),
    (64, 4, 2, None, 4096), (64, 4, 8, None, 4096))


def tune(rng, sizes):
  """Block sizes of the GPU bitmask design; leaves the fastest in place."""
  rows = []
  saved = tuple(getattr(block_sizes, k) for k in TUNED)
  totals = {}
  for n in sizes:
    boxes_np, scores_np = writeup_boxes(rng, n)
    boxes, scores = jnp.asarray(boxes_np), jnp.asarray(scores_np)
    for config in BITMASK_CONFIGS:
      for key, value in zip(TUNED, config):
        setattr(block_sizes, key, value)
      for m in (128, n):
        fn = jax.jit(functools.partial(pk.nms, iou_threshold=0.5,
                                       max_output_size=m, backend="gpu"))
        try:
          ms = 1e3 * harness.time_jax(fn, boxes, scores, iters=10)
        except Exception as e:  # noqa: BLE001
          ms = float("inf")
          print("tune failed", config, repr(e)[:300])
        rows.append(dict(n=n, m=m, config=str(config), ms=ms))
        # Relative to the default config, so every size counts alike.
        totals.setdefault(config, []).append(ms)
  base = totals[BITMASK_CONFIGS[0]]
  score = {c: sum(t / b for t, b in zip(v, base)) for c, v in totals.items()}
  best = min(score, key=score.get)
  for key, value in zip(TUNED, best if np.isfinite(score[best]) else saved):
    setattr(block_sizes, key, value)
  print("tuned:", dict(zip(TUNED, best)), flush=True)
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="CPU smoke test (interpret mode, small N)")
  parser.add_argument("--tune", action="store_true")
  parser.add_argument("--tune-scan", action="store_true",
                      help="GPU: device-time A/B of the scan form and chunk "
                           "length (keeps the fastest correct one)")
  parser.add_argument("--small-iters", type=int, default=30,
                      help="iterations at N < 20k (short, noisy calls)")
  parser.add_argument("--no-check", action="store_true")
  parser.add_argument("--sizes", default="1000,5000,20000,100000")
  parser.add_argument("--iters", type=int, default=10)
  parser.add_argument("--big-iters", type=int, default=3,
                      help="iterations at N >= 50k")
  parser.add_argument("--no-batched", action="store_true")
  parser.add_argument("--quick-check", action="store_true",
                      help="a shorter correctness check")
  parser.add_argument("--minimal-check", action="store_true",
                      help="only the classes / NaN / ties checks")
  parser.add_argument("--out", default=None, help="results directory")
  parser.add_argument("--name", default="nms",
                      help="results file name (a partial table: not 'nms')")
  parser.add_argument("--peers", default="reference,torchvision,nxn_mask")
  parser.add_argument("--profile", action="store_true",
                      help="GPU: device time per kernel (jax profiler)")
  parser.add_argument("--pick", action="store_true",
                      help="GPU: A/B PICK_CONFIGS first, keep the fastest")
  parser.add_argument("--no-nxn-from", type=int, default=20000,
                      help="skip the N x N peer from this N on (slow)")
  parser.add_argument("--forms", default=None, choices=sorted(FORM_SETS),
                      help="GPU: only A/B these settings (vs numpy truth, "
                           "by time)")
  parser.add_argument("--compare", default=None,
                      help="GPU IoU test: fma or div (default: module's)")
  args = parser.parse_args(argv)
  rng = np.random.default_rng(0)
  on_gpu = jax.default_backend() == "gpu"
  extra = {}

  if args.quick or not on_gpu:
    with pk.force_interpret("generic"):
      rows = []
      boxes_np, scores_np = writeup_boxes(rng, 300)
      boxes, scores = jnp.asarray(boxes_np), jnp.asarray(scores_np)
      for name, backend in (("ours_interpret", None),
                            ("reference", "reference")):
        fn = jax.jit(functools.partial(pk.nms, iou_threshold=0.5,
                                       max_output_size=300, backend=backend))
        ms = 1e3 * harness.time_jax(fn, boxes, scores, warmup=1, iters=3)
        rows.append(dict(impl=name, n=300, ms=ms,
                         kept=int(fn(boxes, scores)[1])))
    harness.print_table(rows, ["impl", "n", "ms", "kept"])
    print("wrote", harness.write_results("nms-quick", rows,
                                         directory=args.out))
    return 0

  if args.compare:
    nms_gpu.COMPARE = args.compare
  extra["compare"] = nms_gpu.COMPARE
  extra["timing"] = TIMING_NOTE.replace("PIPELINE_REPS", str(PIPELINE_REPS))
  floor = jax.jit(lambda x: x + 1)
  x = jnp.ones((16,), jnp.float32)
  extra["jit_floor"] = dict(
      synced_ms=1e3 * harness.time_jax(floor, x, iters=50),
      pipelined_ms=1e3 * harness.time_jax(floor, x, iters=10,
                                          reps=PIPELINE_REPS))
  print("jit floor", extra["jit_floor"], flush=True)
  if args.forms:
    out = {}
    name = "nms-forms" + ("" if args.forms == "scan" else f"-{args.forms}")
    verify_forms(rng, out, FORM_SETS[args.forms], save=lambda: print(
        "wrote", harness.write_results(name, [], extra=out,
                                       directory=args.out)))
    return 0
  if args.pick:
    extra["pick"] = pick_form(rng)
  if args.tune_scan:
    try:
      extra["tune_scan"] = tune_scan(rng)
    except Exception as e:  # noqa: BLE001
      traceback.print_exc()
      extra["tune_scan"] = [dict(error=repr(e)[:300])]
  if args.profile:
    extra["profile"] = profile(rng, [int(s) for s in args.sizes.split(",")],
                               args.iters)
  if not args.no_check:
    start = time.time()
    checks = check(rng, quick=args.quick_check, minimal=args.minimal_check)
    harness.print_table(checks, ["case", "design", "n", "thr", "m", "kept",
                                 "ok"])
    extra["checks"] = checks
    extra["checks_all_ok"] = all(c["ok"] for c in checks)
    if not extra["checks_all_ok"]:
      # Fall back to the previous session's forms, say so.
      _apply(FALLBACK)
      extra["fallback_settings"] = FALLBACK
      checks = check(rng, quick=args.quick_check, minimal=args.minimal_check)
      harness.print_table(checks, ["case", "design", "n", "thr", "m", "kept",
                                   "ok"])
      extra["checks_fallback_config"] = checks
      extra["checks_all_ok"] = all(c["ok"] for c in checks)
    print(f"checks: {time.time() - start:.1f}s", flush=True)
  if args.tune:
    tuned = tune(rng, (20000,))
    harness.print_table(tuned, ["n", "m", "config", "ms"])
    extra["tune"] = tuned
  extra["block_sizes"] = harness.module_settings(block_sizes, (
      "GPU_TILE", "GPU_NUM_WARPS", "GPU_BITMASK_MAX_BYTES", "SMALL_BOXES",
      "MASK_WORDS_SMALL", "MASK_CHUNK_ROWS_SMALL", "MASK_CHUNK_ROWS_OVERLAP")
      + TUNED)
  extra["scan"] = harness.module_settings(nms_gpu, (
      "SCAN_DEPTH", "RESOLVE", "JUMP", "FEW_ROWS", "RANK_SORT_MAX",
      "RANK_ROWS", "RANK_COLS", "SCAN_DEPTH_LARGE", "RESOLVE_LARGE",
      "STATIC_CHUNKS_FEW", "STATIC_CHUNKS_MAX", "OVERLAP", "OVERLAP_FROM",
      "OVERLAP_PROGRAMS", "RADIX_SORT", "RADIX_SORT_MAX"))

  peers = tuple(p for p in args.peers.split(",") if p)
  rows = []
  columns = ["n", "thr", "m", "design", "kept", "ours_ms", "ours_pipelined_ms",
             "tv_ms", "ref_ms", "nxn_ms", "x_vs_tv", "x_vs_tv_pipelined",
             "x_vs_ref", "x_vs_nxn", "same_as_tv", "same_as_ref",
             "same_as_nxn"]
  batched = [] if args.no_batched else [128, 5000]

  def run_batched_rows():
    while batched:
      m = batched.pop(0)
      start = time.time()
      try:
        rows.append(run_batched(rng, 16, 5000, 0.5, m, peers,
                                args.small_iters))
      except Exception:  # noqa: BLE001
        traceback.print_exc()
        rows.append(dict(n="16x5000", thr=0.5, m=m, error="failed"))
      print(rows[-1], f"{time.time() - start:.1f}s", flush=True)
      harness.write_results(args.name, rows, extra=extra,
                            directory=args.out)

  for n in (int(s) for s in args.sizes.split(",")):
    if n >= 50_000:  # the slow sizes last: a run cut short keeps the rest
      run_batched_rows()
    for thr in (0.1, 0.5):
      for m in (128, n):
        start = time.time()
        try:
          iters = (args.big_iters if n >= 50_000 else args.iters
                   if n >= 20_000 else args.small_iters)
          rows.append(run_case(rng, n, thr, m, peers, iters,
                               nxn_below=args.no_nxn_from))
        except Exception:  # noqa: BLE001
          traceback.print_exc()
          rows.append(dict(n=n, thr=thr, m=m, error="failed"))
        print(rows[-1], f"{time.time() - start:.1f}s", flush=True)
        # Written after every row so a run cut short still leaves results.
        harness.write_results(args.name, rows, extra=extra,
                            directory=args.out)
  run_batched_rows()
  harness.print_table(rows, columns)
  print("wrote", harness.write_results(args.name, rows, extra=extra,
                                       directory=args.out))
  return 0


if __name__ == "__main__":
  sys.exit(main())
