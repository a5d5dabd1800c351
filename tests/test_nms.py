"""NMS: one suite for every backend (``tests/backends.py``) against the exact
greedy NMS oracle (``tests/oracles/boxes.py``); then the kernels' own tests,
soft-NMS, properties and argument errors.

Kept indices must equal the oracle's exactly. The oracle computes IoUs in
float32 in the documented order; where a decision had a float64 IoU within
1e-6 of the threshold (a fused multiply-add could round it the other way),
the backend must still equal the JAX reference exactly.
"""
from __future__ import annotations

import ast
import functools
import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import backends
import pallas_kernels as pk
from oracles import boxes as oracle
from pallas_kernels import _backend, _compat, force_interpret
from pallas_kernels.boxes.iou import reference as iou_reference
from pallas_kernels.boxes.nms import (api, block_sizes, mosaic_tpu,
                                      reference, triton)
from pallas_kernels.boxes.nms.cases import writeup_boxes

ALL = backends.params()
SLOW = pytest.mark.slow


# ------------------------------------------------------------------ data
def clustered_boxes(rng, n, clusters=6):
  centres = rng.random((clusters, 2)) * 300
  xy = centres[rng.integers(0, clusters, n)] + rng.normal(0, 2, (n, 2))
  wh = 30 + rng.normal(0, 2, (n, 2))
  boxes = np.concatenate([xy, xy + wh], 1).astype(np.float32)
  return boxes, rng.random(n).astype(np.float32)


def disjoint_boxes(rng, n):
  x = np.arange(n, dtype=np.float32) * 10
  boxes = np.stack([x, np.zeros(n), x + 5, np.full(n, 5)], 1).astype(np.float32)
  return boxes[rng.permutation(n)], rng.random(n).astype(np.float32)


def float_boxes(rng, n):
  xy = rng.random((n, 2)) * 200
  wh = rng.random((n, 2)) * 50 + 0.5
  return (np.concatenate([xy, xy + wh], 1).astype(np.float32),
          rng.random(n).astype(np.float32))


GENERATORS = dict(writeup=writeup_boxes, clustered=clustered_boxes,
                  disjoint=disjoint_boxes, floats=float_boxes)


def image_batch(rng, n):
  """One image per generator: boxes [4, n, 4], scores [4, n]."""
  data = [GENERATORS[k](rng, n) for k in sorted(GENERATORS)]
  return np.stack([b for b, _ in data]), np.stack([s for _, s in data])


def assert_matches_oracle(got, boxes, scores, thr, m, *, reference_out,
                          class_ids=None, score_threshold=None):
  """Per image: indices and count equal the oracle's (or, where a decision
  was within rounding of the threshold, the JAX reference's)."""
  idx, count = (np.asarray(x) for x in got)
  for b in range(len(scores)):
    want, want_count, close = oracle.nms(
        boxes[b], scores[b], thr, m, score_threshold=score_threshold,
        class_ids=None if class_ids is None else class_ids[b])
    if close:
      want, want_count = (np.asarray(x)[b] for x in reference_out)
    np.testing.assert_array_equal(idx[b], want, err_msg=f"image {b}")
    assert count[b] == want_count, b


@pytest.fixture
def small_tiles(monkeypatch):
  """Several tiles for small N, so the cross-tile paths run."""
  monkeypatch.setattr(block_sizes, "tpu_tile", lambda n: 128)
  monkeypatch.setattr(block_sizes, "GPU_TILE", 32)


# ------------------------------------------------------------------ suite
@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("case", ["plain", "classes"])
def test_matches_oracle(backend, case, rng, small_tiles):
  """Four kinds of data, 203 boxes (partial last tile / word); m = N at
  threshold 0.5, or with classes, a score threshold, NaN scores and
  inverted boxes, m = 7 at threshold 0.1 (the early exit)."""
  n = 203
  boxes, scores = image_batch(rng, n)
  kw = {}
  thr, m = 0.5, n
  if case == "classes":
    thr, m = 0.1, 7
    scores[rng.random(scores.shape) < 0.1] = np.nan
    flip = rng.random(scores.shape) < 0.1
    boxes[flip] = boxes[flip][:, [2, 3, 0, 1]]
    kw = dict(class_ids=rng.integers(0, 3, scores.shape).astype(np.int32),
              score_threshold=0.2)
  got = backend.run(pk.batched_nms, boxes, scores, iou_threshold=thr,
                    max_output_size=m, **kw)
  ref = pk.batched_nms(boxes, scores, iou_threshold=thr, max_output_size=m,
                       backend="reference", **kw)
  assert_matches_oracle(got, boxes, scores, thr, m, reference_out=ref, **kw)


def _edge_images():
  """Small images padded to 8 boxes with inert NaN-score boxes, and what
  each keeps at threshold 0.5, score threshold 0.05."""
  nan = np.nan
  images = [
      ([[0, 0, 10, 10],    # 0: tie with 1, lower index wins
        [0, 0, 10, 10],    # 1: suppressed by 0
        [20, 20, 30, 30],  # 2: NaN score, never kept
        [20, 20, 30, 30],  # 3: kept (2 does not suppress)
        [50, 50, 40, 40],  # 4: inverted: kept, suppresses none
        [40, 40, 50, 50],  # 5: kept despite overlapping 4's span
        [60, 60, 70, 70],  # 6: score == score_threshold: dropped
        [60, 60, 70, 70]],  # 7: kept
       [0.5, 0.5, nan, 0.2, 0.9, 0.1, 0.05, 0.06], [4, 0, 3, 5, 7]),
      # IoU exactly 0.5 (inter 50, union 100): "strictly greater" keeps both.
      ([[0, 0, 10, 10], [0, 5, 10, 10], [0, 0, 10, 5]], [0.9, 0.8, 0.7],
       [0, 1, 2]),
      ([[0, 0, 1, 1]], [0.3], [0]),                            # one box
      ([[0, 0, 10, 10], [1, 1, 10, 10]], [0.1, 0.9], [1]),     # IoU 0.81
      ([[0, 0, 10, 10], [0, 0, 10, 10]], [nan, nan], []),      # nothing
      # Class ids equal as floats (+0.0 / -0.0 bits), not as ints: both kept.
      ([[0, 0, 10, 10], [0, 0, 10, 10]], [0.9, 0.8], [0, 1]),
  ]
  boxes = np.zeros((len(images), 8, 4), np.float32)
  scores = np.full((len(images), 8), np.nan, np.float32)
  classes = np.zeros((len(images), 8), np.int32)
  classes[-1, 1] = np.iinfo(np.int32).min
  for i, (b, s, _) in enumerate(images):
    boxes[i, :len(b)], scores[i, :len(s)] = b, s
  return boxes, scores, classes, [want for _, _, want in images]


@pytest.mark.parametrize("backend", ALL)
def test_edge_cases(backend):
  boxes, scores, classes, wanted = _edge_images()
  idx, count = backend.run(pk.batched_nms, boxes, scores, iou_threshold=0.5,
                           max_output_size=8, score_threshold=0.05,
                           class_ids=classes)
  for i, want in enumerate(wanted):
    assert int(count[i]) == len(want), i
    np.testing.assert_array_equal(idx[i], want + [-1] * (8 - len(want)))
  # One image (nms), and fewer slots than kept boxes.
  idx, count = backend.run(pk.nms, boxes[0], scores[0], iou_threshold=0.5,
                           max_output_size=2, score_threshold=0.05)
  np.testing.assert_array_equal(idx, [4, 0])
  assert int(count) == 2


def test_empty_inputs_and_no_outputs(rng):
  idx, count = pk.nms(np.zeros((0, 4), np.float32), np.zeros(0, np.float32),
                      iou_threshold=0.5, max_output_size=3)
  np.testing.assert_array_equal(idx, [-1, -1, -1])
  assert int(count) == 0
  boxes, scores = writeup_boxes(rng, 20)
  idx, count = pk.nms(boxes, scores, iou_threshold=0.5, max_output_size=0)
  assert idx.shape == (0,) and int(count) == 0


# ------------------------------------------------------------ reference
def test_reference_agrees_with_torchvision(rng):
  torch = pytest.importorskip("torch")
  torchvision = pytest.importorskip("torchvision")
  boxes, _ = writeup_boxes(rng, 1024)
  scores = (rng.permutation(1024) / 1024).astype(np.float32)  # no ties
  for thr in (0.1, 0.5, 0.7):
    want = torchvision.ops.nms(torch.from_numpy(boxes),
                               torch.from_numpy(scores), thr).numpy()
    got, count = pk.nms(boxes, scores, iou_threshold=thr,
                        max_output_size=1024, backend="reference")
    np.testing.assert_array_equal(np.asarray(got)[:int(count)], want)


def test_reference_under_jit_with_int_boxes(rng):
  boxes, scores = writeup_boxes(rng, 50)
  fn = jax.jit(functools.partial(pk.nms, iou_threshold=0.5,
                                 max_output_size=50, backend="reference"))
  idx, count = fn(boxes.astype(np.int32), scores)
  want, want_count, _ = oracle.nms(boxes, scores, 0.5, 50)
  np.testing.assert_array_equal(idx, want)
  assert int(count) == want_count


# ---------------------------------------------------- Mosaic TPU kernel
def test_mosaic_long_suppression_chain(small_tiles):
  """Each box overlaps only the next: the within-tile fixed point needs many
  rounds and keeps every other box."""
  n = 200
  x = np.arange(n, dtype=np.float32) * 6
  boxes = np.stack([x, np.zeros(n), x + 10, np.full(n, 10)], 1)
  scores = np.linspace(1, 0.5, n).astype(np.float32)
  with force_interpret("generic"):
    idx, count = pk.nms(boxes, scores, iou_threshold=0.1, max_output_size=n,
                        backend="interpret")
  want, want_count, _ = oracle.nms(boxes, scores, 0.1, n)
  assert want_count == n // 2 and int(count) == want_count
  np.testing.assert_array_equal(idx, want)


def test_mosaic_has_no_races(rng, small_tiles):
  """Four 128-box tiles that all keep boxes in the race-detecting
  interpreter: the last tile prefetches slab s + 1 while testing slab s."""
  boxes, scores = float_boxes(rng, 450)
  (idx, count), log = _backend.find_races(
      lambda b, s: pk.nms(b, s, iou_threshold=0.5, max_output_size=450,
                          backend="interpret"), boxes, scores)
  assert log.launches >= 2 and not log.found, log  # the sort and NMS kernels
  want, want_count, _ = oracle.nms(boxes, scores, 0.5, 450)
  assert int(count) == want_count
  np.testing.assert_array_equal(idx, want)


def sort_oracle(scores, score_threshold):
  """Keepable boxes by descending score (ties: lower index), then the rest
  by index; and which are keepable."""
  valid = ~np.isnan(scores)
  if score_threshold is not None:
    valid &= scores > score_threshold
  primary = np.where(valid, -scores.astype(np.float64), 0.0)
  order = np.lexsort((np.arange(len(scores)), primary, ~valid))
  return order, valid[order]


@pytest.mark.parametrize("n,score_threshold", [
    (1023, 0.3), (9000, None), pytest.param(3001, 0.0, marks=SLOW)])
def test_mosaic_sort_is_the_score_order(rng, n, score_threshold):
  """The bitonic sort kernel (TPU interpreter) at odd N with tied, -0.0,
  -inf, +inf and NaN scores orders boxes as the stable score sort."""
  scores = (rng.integers(-20, 20, (2, n)) / 8).astype(np.float32)
  scores[0, ::7] = -np.inf
  scores[0, 3::11] = np.nan
  scores[1, ::13] = -0.0
  scores[1, 5::17] = np.inf
  with force_interpret("tpu"):
    order, valid = api._tpu_order(jnp.asarray(scores), score_threshold,
                                  interpret=_backend.interpret_value("tpu"))
  for b in range(2):
    want_order, want_valid = sort_oracle(scores[b], score_threshold)
    np.testing.assert_array_equal(order[b], want_order, err_msg=f"image {b}")
    np.testing.assert_array_equal(valid[b], want_valid, err_msg=f"image {b}")


def test_mosaic_sort_has_no_races(rng):
  """Four chunks: both merge levels (chunk swaps, in-chunk finish) run."""
  keys = jnp.asarray(rng.integers(-50, 50, (1, 4000)), jnp.int32)
  (sorted_keys, order), log = _backend.find_races(
      lambda k: mosaic_tpu.sort_keys(k, interpret=_backend.interpret_value()),
      keys)
  assert log.launches >= 1 and not log.found, log
  want = np.lexsort((np.arange(4000), np.asarray(keys[0])))
  np.testing.assert_array_equal(order[0, :4000], want)
  np.testing.assert_array_equal(sorted_keys[0, :4000], np.asarray(keys[0])[want])


def test_mosaic_sort_rejects_too_many_keys():
  keys = jax.ShapeDtypeStruct((1, mosaic_tpu.SORT_MAX + 1), jnp.int32)
  with pytest.raises(ValueError, match="SORT_MAX"):
    jax.eval_shape(mosaic_tpu.sort_keys, keys)


def test_kept_indices_without_scatter(rng):
  """Kept sorted positions -> original indices as the reference's scatter
  does, across several levels of the prefix-count recursion."""
  keep = jnp.asarray(rng.random((2, 20000)) < 0.3)
  order = jnp.asarray(np.stack([rng.permutation(20000)] * 2), jnp.int32)
  for m in (1, 100, 20000):
    got = api._kept_indices(keep, order, m)
    want = jax.vmap(functools.partial(reference.keep_to_indices,
                                      max_output_size=m))(keep, order)
    for g, w in zip(got, want):
      np.testing.assert_array_equal(g, w)


def test_mosaic_default_tiles_1024_boxes(rng):
  """The write-up's case: 1024 boxes in two 512-box tiles."""
  boxes, scores = writeup_boxes(rng, 1024)
  with force_interpret("generic"):
    got = pk.batched_nms(boxes[None], scores[None], iou_threshold=0.5,
                         max_output_size=128, backend="interpret")
  assert_matches_oracle(got, boxes[None], scores[None], 0.5, 128,
                        reference_out=pk.batched_nms(
                            boxes[None], scores[None], iou_threshold=0.5,
                            max_output_size=128, backend="reference"))


# -------------------------------------------------------- Triton kernels
def _bitmask_matches_oracle(boxes, scores, thr=0.5, m=None, **options):
  """The bitmask kernels (interpreted, 32 x 2-word mask tiles) keep exactly
  the oracle's boxes (max_output_size ``m``, default N); returns how many."""
  n = len(scores)
  m = n if m is None else m
  want, want_count, _ = oracle.nms(boxes, scores, thr, m)
  order, planes, classes, flags = api._sorted_inputs(
      jnp.asarray(boxes, jnp.float32)[None],
      jnp.asarray(scores, jnp.float32)[None], None, None, n)
  keep, base, count = triton.keep_words_bitmask(
      planes, classes, flags, iou_threshold=thr, max_output_size=m,
      rows=32, words=2, use_classes=False, interpret=True, **options)
  idx, count = triton.words_to_indices(keep, base, count, order, m)
  np.testing.assert_array_equal(np.asarray(idx[0]), want)
  assert int(count[0]) == want_count
  return want_count


@pytest.mark.parametrize("band,n,m", [
    (False, 160, 160), (True, 200, 20), (False, 200, 20),
    pytest.param(True, 160, 160, marks=SLOW)])
def test_triton_scan_forms_and_chunks(rng, band, n, m):
  """Both scan forms over 64-row chunks; m = N: unrolled chunks (the scalar
  form overlaps chunk c's scan with chunk c + 1's mask from chunk 1 on),
  m < N: the early-exit while loop. Interpret mode fills every mask word the
  compiled kernel leaves unwritten (below the diagonal, padding, removed
  rows and columns) with all ones, so a scan that read one with effect, or
  a wrong skip, keeps too few boxes."""
  boxes, scores = GENERATORS["clustered"](rng, n)
  scores[rng.random(n) < 0.35] = np.nan
  chunks = -(-n // 64)
  assert triton.static_chunks(chunks, n, m) == (m >= n) and chunks >= 3
  _bitmask_matches_oracle(boxes, scores, 0.3, m, chunk_rows=64, band=band)


@pytest.mark.parametrize("band", [False, True])
def test_triton_scan_kept_rows(rng, band):
  """Word 0 keeps boxes 0-2 (the rest copy box 0), word 1 boxes 32-35; words
  2 and 3 hold one box on each of them, suppressed by that row alone, so a
  row left out of the OR keeps a box too many; words 4-7 keep more boxes
  than FEW_ROWS (all 32 rows ORed)."""
  n = 256
  corner = np.stack([np.arange(n) % 16, np.arange(n) // 16], 1) * 100.0
  boxes = np.concatenate([corner, corner + 10], 1).astype(np.float32)
  boxes[3:32] = boxes[0]
  boxes[64:67] = boxes[0:3] + 1
  boxes[36:64] = boxes[32]
  boxes[96:100] = boxes[32:36] + 1
  scores = np.linspace(1, 0, n, dtype=np.float32)
  kept = _bitmask_matches_oracle(boxes, scores, chunk_rows=256, band=band)
  assert kept == n - 29 - 3 - 28 - 4


@pytest.mark.parametrize("thr,m", [(0.1, 203), (0.5, 5)])
def test_triton_blocked_design(rng, small_tiles, monkeypatch, thr, m):
  """The fallback past the mask budget: classes, NaN, inverted boxes."""
  monkeypatch.setattr(block_sizes, "GPU_BITMASK_MAX_BYTES", 0)
  boxes, scores = image_batch(rng, 203)
  scores[rng.random(scores.shape) < 0.1] = np.nan
  flip = rng.random(scores.shape) < 0.1
  boxes[flip] = boxes[flip][:, [2, 3, 0, 1]]
  classes = rng.integers(0, 3, scores.shape).astype(np.int32)
  kw = dict(iou_threshold=thr, max_output_size=m, class_ids=classes)
  with force_interpret("generic"):
    got = pk.batched_nms(boxes, scores, backend="triton", **kw)
  assert_matches_oracle(got, boxes, scores, thr, m, class_ids=classes,
                        reference_out=pk.batched_nms(
                            boxes, scores, backend="reference", **kw))


def test_triton_kernels_lower_for_cuda(monkeypatch):
  """The Triton lowering runs on this CPU host: the band scan (one chunk),
  the scalar scan with overlapped chunks and with the while loop, and the
  blocked design all lower."""
  boxes, scores = jnp.zeros((1100, 4)), jnp.zeros((1100,))

  def lowers(n, m):
    fn = functools.partial(pk.nms, iou_threshold=0.5, max_output_size=m,
                           backend="triton")
    text = _compat.lower_for_cuda(fn, boxes[:n], scores[:n]).as_text()
    assert "triton" in text.lower() or "__gpu" in text
    assert re.search(r'"nms_\w+_gpu"', text)   # launches carry their names

  lowers(1000, 1000)
  monkeypatch.setattr(block_sizes, "SMALL_BOXES", 512)
  monkeypatch.setattr(block_sizes, "MASK_CHUNK_ROWS_OVERLAP", 512)
  monkeypatch.setattr(block_sizes, "MASK_CHUNK_ROWS", 256)
  lowers(1100, 1100)   # 3 chunks of 512 rows, overlapped
  lowers(1100, 8)      # 5 chunks of 256 rows, the while loop
  monkeypatch.setattr(block_sizes, "GPU_BITMASK_MAX_BYTES", 0)
  lowers(300, 100)


@pytest.mark.parametrize("batch,n,score_threshold", [
    (1, 1, None), (1, 1030, 2.0), (2, 127, None), (3, 300, 4.0)])
def test_triton_radix_order_is_the_stable_sort(rng, batch, n,
                                                score_threshold):
  """The uint32-key sort (padded for one image): ties (-0.0 against 0.0) by
  index, NaN / thresholded scores last, negative scores after positive."""
  scores = rng.integers(-4, 7, (batch, n)).astype(np.float32)
  scores[rng.random((batch, n)) < 0.2] = np.nan
  scores[0, :n:2] = -0.0
  scores[:, 1::5] = np.float32(1e-40)  # subnormal
  order, valid = triton.radix_order(jnp.asarray(scores), score_threshold)
  for b in range(batch):
    want, want_valid = oracle.score_order(scores[b], score_threshold)
    np.testing.assert_array_equal(np.asarray(order[b]), want)
    np.testing.assert_array_equal(np.asarray(valid[b]), want_valid[want])


@pytest.mark.parametrize("n,score_threshold", [(1, None), (127, None),
                                               (1030, 2.0)])
def test_triton_rank_order_is_the_stable_sort(rng, n, score_threshold):
  """The rank-count sort: ties (also -0.0 against 0.0) by index, NaN and
  thresholded scores last by index."""
  scores = rng.integers(0, 7, (2, n)).astype(np.float32)
  scores[rng.random((2, n)) < 0.2] = np.nan
  scores[0, :n:2] = -0.0
  scores[1, :n:3] = 0.0
  order, valid = triton.rank_order(jnp.asarray(scores), score_threshold,
                                   interpret=True)
  for b in range(2):
    want, want_valid = oracle.score_order(scores[b], score_threshold)
    np.testing.assert_array_equal(np.asarray(order[b]), want)
    np.testing.assert_array_equal(np.asarray(valid[b]), want_valid[want])


def test_triton_bitmask_scratch_stays_within_budget():
  """Mask chunks shrink as N grows: scratch bounded, rows per chunk > 0."""
  budget = 256 << 20
  for n in (1, 31, 1000, 20_000, 100_000, 1_000_000, 10_000_000):
    words, chunk, chunks, nbytes = triton.bitmask_layout(
        1, n, rows=64, words=4, chunk_rows=4096, max_bytes=budget)
    assert nbytes <= budget and chunk % 64 == 0 and chunk >= 64
    assert words * 32 >= n and chunk * chunks >= n
  assert triton.bitmask_layout(1, 10**9, max_bytes=budget) is None


def test_backend_none_traces_every_platform(rng):
  """backend=None traces every platform's branch, the kernels included."""
  boxes, scores = writeup_boxes(rng, 40)
  jaxpr = jax.make_jaxpr(functools.partial(
      pk.nms, iou_threshold=0.5, max_output_size=8))(boxes, scores)
  assert str(jaxpr).count("pallas_call") >= 2


# ------------------------------------------------------------ soft-NMS
@pytest.mark.parametrize("method", ["gaussian", "linear"])
def test_soft_nms_matches_oracle(rng, method):
  boxes, scores = clustered_boxes(rng, 60, clusters=4)
  idx, out_scores, count = pk.soft_nms(
      boxes, scores, max_output_size=60, method=method, sigma=0.5,
      iou_threshold=0.3, score_threshold=0.05)
  want_idx, want_scores = oracle.soft_nms(
      boxes, scores, 60, method=method, sigma=0.5, iou_threshold=0.3,
      score_threshold=0.05)
  count = int(count)
  assert count == len(want_idx)
  np.testing.assert_array_equal(np.asarray(idx)[:count], want_idx)
  np.testing.assert_allclose(np.asarray(out_scores)[:count], want_scores,
                             rtol=1e-5)
  with pytest.raises(ValueError, match="no mosaic_tpu kernel"):
    pk.soft_nms(boxes, scores, max_output_size=60, backend="mosaic_tpu")
  if method == "linear":  # backend=None under forced interpret: the reference
    with force_interpret():
      again = pk.soft_nms(boxes, scores, max_output_size=60, method=method,
                          sigma=0.5, iou_threshold=0.3, score_threshold=0.05)
    np.testing.assert_array_equal(again[0], idx)


# ------------------------------------------------------------ properties
PROPERTY_N = 64  # one shape (and so one compilation) for every example


@st.composite
def box_sets(draw):
  """Up to PROPERTY_N real boxes; the rest have NaN scores (inert)."""
  n = draw(st.integers(1, PROPERTY_N))
  seed = draw(st.integers(0, 2**31 - 1))
  kind = draw(st.sampled_from(sorted(GENERATORS)))
  boxes, scores = GENERATORS[kind](np.random.default_rng(seed), PROPERTY_N)
  scores[n:] = np.nan
  return boxes, scores, n


@functools.cache
def _jitted_nms(thr):
  # Every example has PROPERTY_N boxes: one trace serves them all (an eager
  # call traces and compiles the interpreted kernel again each time).
  return jax.jit(functools.partial(pk.nms, iou_threshold=thr,
                                   max_output_size=PROPERTY_N))


@pytest.mark.parametrize("thr", [0.0, 0.45])
@settings(max_examples=5)
@given(case=box_sets())
def test_greedy_properties(thr, case):
  """backend=None (on this host, the TPU kernel in the interpreter): kept
  boxes are distinct, by decreasing score, pairwise at most thr apart; each
  dropped box overlaps an earlier kept one."""
  boxes, scores, n = case
  idx, count = _jitted_nms(thr)(boxes, scores)
  idx, count = np.asarray(idx), int(count)
  kept = idx[:count]
  assert (idx[count:] == -1).all() and len(set(kept)) == count
  assert (kept < n).all()                             # NaN never kept
  assert (np.diff(scores[kept]) <= 0).all()          # decreasing score
  tol = 1e-5
  for a in range(count):                              # kept: pairwise <= thr
    assert (oracle.iou64(boxes[kept[a]], boxes[kept[a + 1:]])
            <= thr + tol).all()
  for j in set(range(n)) - set(kept.tolist()):        # dropped: covered
    earlier = [i for i in kept if (scores[i], -i) > (scores[j], -j)]
    iou = oracle.iou64(boxes[j], boxes[earlier]) if earlier else np.zeros(0)
    assert (iou > thr - tol).any(), j


# ------------------------------------------------------------ validation
@pytest.mark.parametrize("call,match,error", [
    (lambda: pk.nms(np.zeros((3, 3)), np.zeros(3), iou_threshold=0.5,
                    max_output_size=2), "boxes must have shape", ValueError),
    (lambda: pk.nms(np.zeros((3, 4)), np.zeros(4), iou_threshold=0.5,
                    max_output_size=2), "scores must have shape", ValueError),
    (lambda: pk.nms(np.zeros((3, 4)), np.zeros(3), iou_threshold=-0.1,
                    max_output_size=2), "iou_threshold must be >= 0",
     ValueError),
    (lambda: pk.nms(np.zeros((3, 4)), np.zeros(3), iou_threshold=np.nan,
                    max_output_size=2), "iou_threshold must be finite",
     ValueError),
    (lambda: pk.nms(np.zeros((3, 4)), np.zeros(3), iou_threshold=jnp.ones(()),
                    max_output_size=2), "iou_threshold must be a Python float",
     TypeError),
    (lambda: pk.nms(np.zeros((3, 4)), np.zeros(3), iou_threshold=0.5,
                    max_output_size=2.0), "max_output_size must be a Python int",
     TypeError),
    (lambda: pk.nms(np.zeros((3, 4)), np.zeros(3), iou_threshold=0.5,
                    max_output_size=-1), "max_output_size must be >= 0",
     ValueError),
    (lambda: pk.nms(np.zeros((3, 4)), np.zeros(3), iou_threshold=0.5,
                    max_output_size=2, class_ids=np.zeros(3, np.float32)),
     "class_ids must have an integer dtype", TypeError),
    (lambda: pk.nms(np.zeros((3, 4)), np.zeros(3), iou_threshold=0.5,
                    max_output_size=2, class_ids=np.zeros(2, np.int32)),
     "class_ids must have shape", ValueError),
    (lambda: pk.nms(np.zeros((3, 4)), np.zeros(3, bool), iou_threshold=0.5,
                    max_output_size=2), "scores must be real", TypeError),
    (lambda: pk.nms(np.zeros((3, 4)), np.zeros(3), iou_threshold=0.5,
                    max_output_size=2, score_threshold="x"),
     "score_threshold must be a Python float", TypeError),
    (lambda: pk.nms(np.zeros((3, 4)), np.zeros(3), iou_threshold=0.5,
                    max_output_size=2, backend="cuda"), "backend='cuda'",
     ValueError),
    (lambda: pk.nms(np.zeros((3, 4)), np.zeros(3), iou_threshold=0.5,
                    max_output_size=2, backend="mosaic_gpu"),
     "no mosaic_gpu kernel", ValueError),
    (lambda: pk.batched_nms(np.zeros((3, 4)), np.zeros(3), iou_threshold=0.5,
                            max_output_size=2), "boxes must have shape",
     ValueError),
    (lambda: pk.batched_nms(np.zeros((2, 3, 4)), np.zeros((3, 2)),
                            iou_threshold=0.5, max_output_size=2),
     "scores must have shape", ValueError),
    (lambda: pk.soft_nms(np.zeros((3, 4)), np.zeros(3), max_output_size=2,
                         method="hard"), "method must be", ValueError),
    (lambda: pk.soft_nms(np.zeros((3, 4)), np.zeros(3), max_output_size=2,
                         sigma=0.0), "sigma must be > 0", ValueError),
])
def test_bad_inputs_raise_naming_the_argument(call, match, error):
  with pytest.raises(error, match=match):
    call()


# ------------------------------------------------------------ the package
def test_public_names():
  from pallas_kernels import reference as ref_mod
  assert ref_mod.nms is reference.nms
  assert ref_mod.batched_nms is reference.batched_nms
  assert callable(pk.nms) and callable(pk.batched_nms)
  assert callable(pk.soft_nms)


def test_box_references_import_no_family_api():
  """The references are the semantics the kernels are checked against:
  they import the shared formulas, never the ops built on them."""
  for module in (reference, iou_reference):
    for node in ast.walk(ast.parse(inspect.getsource(module))):
      if isinstance(node, ast.ImportFrom):
        names = [node.module or ""] + [a.name for a in node.names]
        assert not any(n == "api" or n.endswith(".api") for n in names), (
            module.__name__, names)
