"""NMS: kernels vs a float64 numpy greedy NMS, the JAX reference and properties."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import pallas_kernels as pk
from pallas_kernels import force_interpret
from pallas_kernels.boxes.nms import api, block_sizes, reference
from pallas_kernels.boxes.nms.cases import writeup_boxes

SLOW = pytest.mark.slow


# ------------------------------------------------------------------ oracle

def np_iou(box, others):
  """float64 IoU of one box with many; empty boxes give 0."""
  def area(b):
    return (np.maximum(b[..., 2] - b[..., 0], 0)
            * np.maximum(b[..., 3] - b[..., 1], 0))
  iw = np.maximum(np.minimum(box[2], others[:, 2])
                  - np.maximum(box[0], others[:, 0]), 0)
  ih = np.maximum(np.minimum(box[3], others[:, 3])
                  - np.maximum(box[1], others[:, 1]), 0)
  inter = iw * ih
  union = area(box) + area(others) - inter
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)


def np_nms(boxes, scores, thr, m, score_threshold=None, classes=None):
  """Greedy NMS in float64; also says whether a decision was within 1e-5
  of the threshold (where float32 rounding may legitimately decide)."""
  boxes = np.asarray(boxes, np.float64)
  scores = np.asarray(scores, np.float64)
  n = len(scores)
  classes = np.zeros(n, np.int64) if classes is None else np.asarray(classes)
  valid = ~np.isnan(scores)
  if score_threshold is not None:
    valid &= scores > score_threshold
  key = np.where(valid, -np.nan_to_num(scores), np.inf)
  order = np.argsort(key, kind="stable")
  alive = valid.copy()
  kept, near = [], False
  for i in order:
    if not alive[i]:
      continue
    kept.append(int(i))
    alive[i] = False
    iou = np_iou(boxes[i], boxes)
    rivals = alive & (classes == classes[i])
    near |= bool(np.any(rivals & (np.abs(iou - thr) <= 1e-5)))
    alive &= ~(rivals & (iou > thr))
  out = np.full(m, -1, np.int32)
  kept = kept[:m]
  out[:len(kept)] = kept
  return out, len(kept), near


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


# ------------------------------------------------------------------ runners

@pytest.fixture
def small_tiles(monkeypatch):
  """Several tiles even for small N so the cross-tile paths run."""
  monkeypatch.setattr(block_sizes, "tpu_tile", lambda n: 128)
  monkeypatch.setattr(block_sizes, "GPU_TILE", 32)


def run_tpu_kernel(boxes, scores, thr, m, flavour="generic", **kw):
  with force_interpret(flavour):
    out = pk.nms(boxes, scores, iou_threshold=thr, max_output_size=m,
                 backend="interpret", **kw)
  return np.asarray(out[0]), int(out[1])


def run_gpu_kernel(boxes, scores, thr, m, class_ids=None, score_threshold=None,
                   design="bitmask"):
  """A GPU design in Pallas interpret mode (semantics check on CPU)."""
  budget = 0 if design == "blocked" else 1 << 40
  chunk = 64 if design == "chunked" else None
  saved = (block_sizes.GPU_BITMASK_MAX_BYTES, block_sizes.MASK_CHUNK_ROWS,
           block_sizes.MASK_CHUNK_ROWS_SMALL)
  block_sizes.GPU_BITMASK_MAX_BYTES = budget
  if chunk is not None:
    block_sizes.MASK_CHUNK_ROWS = block_sizes.MASK_CHUNK_ROWS_SMALL = chunk
  try:
    return _run_gpu_kernel(boxes, scores, thr, m, class_ids, score_threshold)
  finally:
    (block_sizes.GPU_BITMASK_MAX_BYTES, block_sizes.MASK_CHUNK_ROWS,
     block_sizes.MASK_CHUNK_ROWS_SMALL) = saved


def _run_gpu_kernel(boxes, scores, thr, m, class_ids, score_threshold):
  boxes = jnp.asarray(boxes, jnp.float32)[None]
  scores = jnp.asarray(scores, jnp.float32)[None]
  if class_ids is not None:
    class_ids = jnp.asarray(class_ids, jnp.int32)[None]
  idx, count = api._gpu_batched(
      boxes, scores, class_ids, iou_threshold=thr, max_output_size=m,
      score_threshold=score_threshold, interpret=True)
  return np.asarray(idx[0]), int(count[0])


def run_reference(boxes, scores, thr, m, **kw):
  out = pk.nms(boxes, scores, iou_threshold=thr, max_output_size=m,
               backend="reference", **kw)
  return np.asarray(out[0]), int(out[1])


def assert_matches_oracle(got, boxes, scores, thr, m, reference_out=None, **kw):
  want, count, near = np_nms(boxes, scores, thr, m,
                             score_threshold=kw.get("score_threshold"),
                             classes=kw.get("class_ids"))
  if reference_out is not None:
    # The float32 twin must agree exactly, always.
    np.testing.assert_array_equal(got[0], reference_out[0])
    assert got[1] == reference_out[1]
  if not near:
    np.testing.assert_array_equal(got[0], want)
    assert got[1] == count


# ------------------------------------------------------------ reference

@pytest.mark.parametrize("thr", [0.1, 0.5, 0.7])
def test_reference_matches_float64_oracle(rng, thr):
  n = 301  # one shape for every data kind: one compilation per (thr, m)
  for kind in sorted(GENERATORS):
    boxes, scores = GENERATORS[kind](rng, n)
    for m in (7, n):
      got = run_reference(boxes, scores, thr, m)
      assert_matches_oracle(got, boxes, scores, thr, m)


def test_reference_writeup_1024(rng):
  boxes, scores = writeup_boxes(rng, 1024)
  got = run_reference(boxes, scores, 0.5, 1024)
  assert_matches_oracle(got, boxes, scores, 0.5, 1024)


def test_reference_agrees_with_torchvision(rng):
  torch = pytest.importorskip("torch")
  torchvision = pytest.importorskip("torchvision")
  boxes, scores = writeup_boxes(rng, 1024)
  scores = (rng.permutation(1024) / 1024).astype(np.float32)  # no ties
  for thr in (0.1, 0.5, 0.7):
    want = torchvision.ops.nms(torch.from_numpy(boxes),
                               torch.from_numpy(scores), thr).numpy()
    got, count = run_reference(boxes, scores, thr, 1024)
    np.testing.assert_array_equal(got[:count], want)


# ------------------------------------------------------------ TPU kernel

@pytest.mark.parametrize("thr,m", [(0.5, 300), (0.1, 9),
                                   pytest.param(0.7, 300, marks=SLOW)])
def test_tpu_kernel_tpu_interpreter(rng, small_tiles, thr, m):
  """TPU-semantics interpreter (DMAs, SMEM state), three 128-box tiles."""
  boxes, scores = writeup_boxes(rng, 300)
  got = run_tpu_kernel(boxes, scores, thr, m, flavour="tpu")
  assert_matches_oracle(got, boxes, scores, thr, m,
                        reference_out=run_reference(boxes, scores, thr, m))


@pytest.mark.parametrize("thr", [0.1, 0.5, pytest.param(0.7, marks=SLOW)])
def test_tpu_kernel_matches_oracle(rng, small_tiles, thr):
  n = 259  # three 128-box tiles, the last one partial
  m = n if thr != 0.5 else 11
  for kind in sorted(GENERATORS):
    boxes, scores = GENERATORS[kind](rng, n)
    got = run_tpu_kernel(boxes, scores, thr, m)
    assert_matches_oracle(got, boxes, scores, thr, m,
                          reference_out=run_reference(boxes, scores, thr, m))


def test_tpu_kernel_default_tile_1024_boxes(rng):
  """The write-up's case (1024 boxes) with the real 512-box tiles."""
  boxes, scores = writeup_boxes(rng, 1024)
  got = run_tpu_kernel(boxes, scores, 0.5, 128)
  assert_matches_oracle(got, boxes, scores, 0.5, 128,
                        reference_out=run_reference(boxes, scores, 0.5, 128))


def test_tpu_kernel_long_suppression_chain(small_tiles):
  """A chain where each box overlaps only the next: the within-tile fixed
  point needs many rounds and keeps every other box."""
  n = 200
  x = np.arange(n, dtype=np.float32) * 6
  boxes = np.stack([x, np.zeros(n), x + 10, np.full(n, 10)], 1)
  scores = np.linspace(1, 0.5, n).astype(np.float32)
  got = run_tpu_kernel(boxes, scores, 0.1, n)
  want, count, near = np_nms(boxes, scores, 0.1, n)
  assert not near and count == n // 2
  np.testing.assert_array_equal(got[0], want)


# ------------------------------------------------------------ GPU kernel

@pytest.mark.parametrize("design,thr,m", [
    ("bitmask", 0.5, 203), ("bitmask", 0.1, 5), ("chunked", 0.5, 203),
    ("blocked", 0.1, 203), pytest.param("bitmask", 0.7, 203, marks=SLOW),
    pytest.param("chunked", 0.1, 5, marks=SLOW),
    pytest.param("blocked", 0.5, 5, marks=SLOW)])
def test_gpu_kernel_interpret_matches_oracle(rng, small_tiles, design, thr, m):
  n = 203  # seven 32-box words / blocked tiles, the last one partial
  # Chunks of 64 rows: four mask + scan launches, slow to interpret.
  kinds = ["clustered", "writeup"] if design == "chunked" else GENERATORS
  for kind in sorted(kinds):
    boxes, scores = GENERATORS[kind](rng, n)
    got = run_gpu_kernel(boxes, scores, thr, m, design=design)
    assert_matches_oracle(got, boxes, scores, thr, m,
                          reference_out=run_reference(boxes, scores, thr, m))


@pytest.mark.parametrize("design", ["bitmask", "blocked"])
def test_gpu_kernel_classes_nan_inverted(rng, small_tiles, design):
  boxes, scores = writeup_boxes(rng, 150)
  scores[rng.random(150) < 0.2] = np.nan
  flip = rng.random(150) < 0.2
  boxes[flip] = boxes[flip][:, [2, 3, 0, 1]]
  classes = rng.integers(0, 3, 150).astype(np.int32)
  got = run_gpu_kernel(boxes, scores, 0.3, 150, class_ids=classes,
                       score_threshold=0.1, design=design)
  ref = run_reference(boxes, scores, 0.3, 150, class_ids=classes,
                      score_threshold=0.1)
  assert_matches_oracle(got, boxes, scores, 0.3, 150, reference_out=ref,
                        class_ids=classes, score_threshold=0.1)


def _assert_bitmask_words_match_reference(boxes, scores, thr=0.5, m=None,
                                          **options):
  """The GPU bitmask kernels (interpreted, 32 x 2-word mask tiles) keep
  exactly the reference's boxes (max_output_size ``m``, default N); returns
  how many."""
  from pallas_kernels.boxes.nms import triton
  n = len(scores)
  m = n if m is None else m
  want = run_reference(boxes, scores, thr, m)
  order, planes, classes, flags = api._sorted_inputs(
      jnp.asarray(boxes, jnp.float32)[None],
      jnp.asarray(scores, jnp.float32)[None], None, None, n)
  keep, base, count = triton.keep_words_bitmask(
      planes, classes, flags, iou_threshold=thr, max_output_size=m,
      rows=32, words=2, use_classes=False, interpret=True, **options)
  idx, count = triton.words_to_indices(keep, base, count, order, m)
  np.testing.assert_array_equal(np.asarray(idx[0]), want[0])
  assert int(count[0]) == want[1]
  return want[1]


@pytest.mark.parametrize("thr,m,band", [
    (0.5, 200, False), (0.1, 200, True), (0.3, 20, True),
    pytest.param(0.3, 20, False, marks=SLOW),
    pytest.param(0.1, 200, False, marks=SLOW)])
def test_gpu_scan_forms_and_skipped_words_interpret(rng, thr, m, band):
  """Both scan forms in interpret mode.

  Interpret mode fills every mask word the compiled kernel would leave
  unwritten (below the diagonal, padding, removed rows and columns) with
  all ones, so a scan that read one with effect would keep too few boxes.
  """
  from pallas_kernels.boxes.nms import triton
  n = 200
  boxes, scores = GENERATORS["clustered"](rng, n)
  scores[rng.random(n) < 0.35] = np.nan
  # m < N: 4 chunks, the early-exit while loop; else 2 unrolled chunks.
  chunk_rows = 64 if m < n else 128
  assert triton.static_chunks(-(-n // chunk_rows), n, m) == (m >= n)
  _assert_bitmask_words_match_reference(
      boxes, scores, thr, m, chunk_rows=chunk_rows, band=band)


@pytest.mark.parametrize("band", [False, True])
def test_gpu_scan_runs_of_removed_words_interpret(rng, band):
  """Words 1-2 are removed by word 0's kept box, word 3 onwards are spread
  boxes."""
  n = 256
  jitter = rng.random((n, 4)).astype(np.float32)
  boxes = np.tile(np.float32([0, 0, 50, 50]), (n, 1)) + jitter
  spread, _ = GENERATORS["writeup"](rng, n - 96)
  boxes[96:] = spread
  scores = np.linspace(1, 0, n, dtype=np.float32)
  scores[200] = np.nan
  _assert_bitmask_words_match_reference(boxes, scores, chunk_rows=256,
                                        band=band)


@pytest.mark.parametrize("band", [False, True])
def test_gpu_scan_few_kept_rows_interpret(band):
  """Word 0 keeps boxes 0-2 (the rest copy box 0), word 1 boxes 32-35; words
  2 and 3 hold one box on each of them, suppressed by that row alone, so a
  row left out of the OR keeps a box too many. The rest stand apart."""
  n = 128
  corner = np.stack([np.arange(n) % 16, np.arange(n) // 16], 1) * 100.0
  boxes = np.concatenate([corner, corner + 10], 1).astype(np.float32)
  boxes[3:32] = boxes[0]
  boxes[64:67] = boxes[0:3] + 1
  boxes[36:64] = boxes[32]
  boxes[96:100] = boxes[32:36] + 1
  scores = np.linspace(1, 0, n, dtype=np.float32)
  kept = _assert_bitmask_words_match_reference(
      boxes, scores, chunk_rows=128, band=band)
  assert kept == n - 29 - 3 - 28 - 4


@pytest.mark.parametrize("thr,m,chunk_rows", [
    (0.5, 160, 64), pytest.param(0.3, 60, 64, marks=SLOW)])
def test_gpu_overlapped_chunks_interpret(rng, thr, m, chunk_rows):
  """Chunk c's scan beside chunk c + 1's mask in one launch (the mask then
  skips by the removed words from before that scan); with m < N, the count
  reached within the (unrolled) chunks. Skipped words are all ones in
  interpret mode, so a wrong skip keeps too few boxes."""
  from pallas_kernels.boxes.nms import triton
  n = 160  # 3 chunks of 64 rows
  boxes, scores = GENERATORS["writeup"](rng, n)
  scores[rng.random(n) < 0.1] = np.nan
  assert triton.static_chunks(-(-n // chunk_rows), n, m)
  kept = _assert_bitmask_words_match_reference(
      boxes, scores, thr, m, chunk_rows=chunk_rows, band=False)
  assert kept > 20  # many kept boxes: several rows ORed per chunk


@pytest.mark.parametrize("batch,n,score_threshold", [
    (1, 1, None), (1, 1030, 2.0), (2, 127, None), (3, 300, 4.0)])
def test_gpu_radix_order_equals_stable_sort(rng, batch, n, score_threshold):
  """The uint32-key sort (padded for one image) = the stable argsort of
  -score: ties (-0.0 against 0.0) by index, NaN / thresholded scores last,
  negative scores after positive ones."""
  from pallas_kernels.boxes.nms import triton
  scores = rng.integers(-4, 7, (batch, n)).astype(np.float32)
  scores[rng.random((batch, n)) < 0.2] = np.nan
  scores[0, :n:2] = -0.0
  scores[:, 1::5] = np.float32(1e-40)  # subnormal
  order, valid = triton.radix_order(jnp.asarray(scores), score_threshold)
  for b in range(batch):
    want, want_valid = reference.sort_by_score(jnp.asarray(scores[b]),
                                               score_threshold)
    np.testing.assert_array_equal(np.asarray(order[b]), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(valid[b]),
                                  np.asarray(want_valid))


@pytest.mark.parametrize("n,score_threshold", [(1, None), (127, None),
                                               (1030, 2.0)])
def test_gpu_rank_order_equals_stable_sort(rng, n, score_threshold):
  """The GPU's rank-count sort = the stable argsort of -score: ties (also
  -0.0 against 0.0) by index, NaN and thresholded scores last by index."""
  from pallas_kernels.boxes.nms import triton
  scores = rng.integers(0, 7, (2, n)).astype(np.float32)
  scores[rng.random((2, n)) < 0.2] = np.nan
  scores[0, :n:2] = -0.0
  scores[1, :n:3] = 0.0
  order, valid = triton.rank_order(jnp.asarray(scores), score_threshold,
                                interpret=True)
  for b in range(2):
    want, want_valid = reference.sort_by_score(jnp.asarray(scores[b]),
                                               score_threshold)
    np.testing.assert_array_equal(np.asarray(order[b]), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(valid[b]),
                                  np.asarray(want_valid))


def test_gpu_bitmask_scratch_stays_within_budget():
  """Mask chunks shrink as N grows: scratch bounded, rows per chunk > 0."""
  from pallas_kernels.boxes.nms import triton
  budget = 256 << 20
  for n in (1, 31, 1000, 20_000, 100_000, 1_000_000, 10_000_000):
    words, chunk, chunks, nbytes = triton.bitmask_layout(
        1, n, rows=64, words=4, chunk_rows=4096, max_bytes=budget)
    assert nbytes <= budget and chunk % 64 == 0 and chunk >= 64
    assert words * 32 >= n and chunk * chunks >= n
  assert triton.bitmask_layout(1, 10**9, max_bytes=budget) is None  # -> blocked


def test_gpu_branch_traces_on_cpu(rng):
  """backend=None traces every platform's branch, the GPU kernel included."""
  boxes, scores = writeup_boxes(rng, 40)
  jaxpr = jax.make_jaxpr(functools.partial(
      pk.nms, iou_threshold=0.5, max_output_size=8))(boxes, scores)
  assert "pallas_call" in str(jaxpr)


# ------------------------------------------------------------ edge cases

ALL_BACKENDS = ["reference", "tpu", "gpu"]


def run_backend(which, boxes, scores, thr, m, **kw):
  if which == "reference":
    return run_reference(boxes, scores, thr, m, **kw)
  if which == "tpu":
    return run_tpu_kernel(boxes, scores, thr, m, **kw)
  design = "blocked" if which == "gpu_blocked" else "bitmask"
  return run_gpu_kernel(boxes, scores, thr, m, design=design, **kw)


@pytest.mark.parametrize("which", ALL_BACKENDS)
def test_empty_and_tiny_inputs(which):
  none = np.zeros((0, 4), np.float32), np.zeros((0,), np.float32)
  if which == "reference":
    idx, count = run_reference(*none, 0.5, 3)
    np.testing.assert_array_equal(idx, [-1, -1, -1])
    assert count == 0
  one = np.array([[0, 0, 1, 1]], np.float32), np.array([0.3], np.float32)
  idx, count = run_backend(which, *one, 0.5, 3)
  np.testing.assert_array_equal(idx, [0, -1, -1])
  assert count == 1
  two = (np.array([[0, 0, 10, 10], [1, 1, 10, 10]], np.float32),
         np.array([0.1, 0.9], np.float32))
  idx, count = run_backend(which, *two, 0.5, 2)   # IoU 0.81: one kept
  np.testing.assert_array_equal(idx, [1, -1])
  idx, count = run_backend(which, *two, 0.9, 4)   # below threshold: both
  np.testing.assert_array_equal(idx, [1, 0, -1, -1])
  assert count == 2


@pytest.mark.parametrize("which", ALL_BACKENDS + ["gpu_blocked"])
def test_ties_nan_inverted_threshold(which):
  boxes = np.array([[0, 0, 10, 10],    # 0: tie with 1, lower index wins
                    [0, 0, 10, 10],    # 1: suppressed by 0
                    [20, 20, 30, 30],  # 2: NaN score, never kept
                    [20, 20, 30, 30],  # 3: kept (2 does not suppress)
                    [50, 50, 40, 40],  # 4: inverted: kept, suppresses none
                    [40, 40, 50, 50],  # 5: kept despite overlapping 4's span
                    [60, 60, 70, 70],  # 6: score == score_threshold: dropped
                    [60, 60, 70, 70.]], np.float32)  # 7: kept
  scores = np.array([0.5, 0.5, np.nan, 0.2, 0.9, 0.1, 0.05, 0.06], np.float32)
  idx, count = run_backend(which, boxes, scores, 0.5, 8, score_threshold=0.05)
  np.testing.assert_array_equal(idx[:count], [4, 0, 3, 5, 7])
  assert count == 5


@pytest.mark.parametrize("which", ALL_BACKENDS)
def test_exact_threshold_is_not_suppressed(which):
  # IoU exactly 0.5 (inter 50, union 100): "strictly greater" keeps both.
  boxes = np.array([[0, 0, 10, 10], [0, 5, 10, 10], [0, 0, 10, 5]],
                   np.float32)
  scores = np.array([0.9, 0.8, 0.7], np.float32)
  idx, count = run_backend(which, boxes, scores, 0.5, 3)
  np.testing.assert_array_equal(idx, [0, 1, 2])


def test_all_scores_invalid_and_max_output_zero(rng):
  boxes, _ = writeup_boxes(rng, 20)
  scores = np.full(20, np.nan, np.float32)
  for which in ALL_BACKENDS:
    idx, count = run_backend(which, boxes, scores, 0.5, 4)
    np.testing.assert_array_equal(idx, [-1] * 4)
    assert count == 0
  idx, count = pk.nms(boxes, rng.random(20), iou_threshold=0.5,
                      max_output_size=0)
  assert idx.shape == (0,) and int(count) == 0


# ------------------------------------------------------------ batched, classes

def test_batched_matches_per_image(rng, small_tiles):
  batch, n = 3, 150
  data = [writeup_boxes(rng, n) for _ in range(batch)]
  boxes = np.stack([d[0] for d in data])
  scores = np.stack([d[1] for d in data])
  scores[1, :] = np.nan  # an image with nothing to keep
  with force_interpret("generic"):
    idx, count = pk.batched_nms(boxes, scores, iou_threshold=0.4,
                                max_output_size=60)
  ref_idx, ref_count = pk.batched_nms(boxes, scores, iou_threshold=0.4,
                                      max_output_size=60, backend="reference")
  np.testing.assert_array_equal(idx, ref_idx)
  np.testing.assert_array_equal(count, ref_count)
  for b in range(batch):
    want, c, near = np_nms(boxes[b], scores[b], 0.4, 60)
    if not near:
      np.testing.assert_array_equal(idx[b], want)
    assert int(count[b]) == c
  assert int(count[1]) == 0


@pytest.mark.parametrize("which", ALL_BACKENDS + ["gpu_blocked"])
def test_class_aware_equals_per_class_runs(rng, small_tiles, which):
  n = 160
  boxes, scores = clustered_boxes(rng, n, clusters=3)
  classes = rng.integers(0, 4, n).astype(np.int32)
  idx, count = run_backend(which, boxes, scores, 0.3, n, class_ids=classes)
  merged = []
  for c in np.unique(classes):
    # Only class c's scores are live: same shape, so one compilation.
    alone = np.where(classes == c, scores, np.nan).astype(np.float32)
    sub, k = run_reference(boxes, alone, 0.3, n)
    merged.extend(sub[:k])
  merged = sorted(merged, key=lambda i: (-scores[i], i))
  np.testing.assert_array_equal(idx[:count], merged)
  assert count == len(merged)


def test_class_ids_do_not_collide(rng):
  """Class ids that are equal as floats but not as ints stay apart."""
  boxes = np.array([[0, 0, 10, 10], [0, 0, 10, 10]], np.float32)
  scores = np.array([0.9, 0.8], np.float32)
  classes = np.array([0, np.iinfo(np.int32).min], np.int32)  # +0.0 / -0.0 bits
  for which in ALL_BACKENDS:
    idx, count = run_backend(which, boxes, scores, 0.5, 2, class_ids=classes)
    assert count == 2, which


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


@pytest.mark.parametrize("thr", [0.0, 0.45])
@given(case=box_sets())
def test_greedy_properties(thr, case):
  boxes, scores, n = case
  with force_interpret("generic"):
    idx, count = pk.nms(boxes, scores, iou_threshold=thr,
                        max_output_size=PROPERTY_N)
  idx, count = np.asarray(idx), int(count)
  kept = idx[:count]
  assert (idx[count:] == -1).all() and len(set(kept)) == count
  assert (kept < n).all()                             # NaN never kept
  assert (np.diff(scores[kept]) <= 0).all()          # decreasing score
  boxes64 = boxes.astype(np.float64)
  tol = 1e-5
  for a in range(count):                              # kept: pairwise <= thr
    iou = np_iou(boxes64[kept[a]], boxes64[kept[a + 1:]])
    assert (iou <= thr + tol).all()
  rank = {int(i): r for r, i in enumerate(kept)}
  for j in set(range(n)) - set(rank):                 # dropped: covered
    earlier = [i for i in kept if (scores[i], -i) > (scores[j], -j)]
    iou = np_iou(boxes64[j], boxes64[earlier]) if earlier else np.zeros(0)
    assert (iou > thr - tol).any(), j


# ------------------------------------------------------------ soft-NMS

@pytest.mark.parametrize("method", ["gaussian", "linear"])
def test_soft_nms_matches_numpy(rng, method):
  boxes, scores = clustered_boxes(rng, 60, clusters=4)
  idx, out_scores, count = pk.soft_nms(boxes, scores, max_output_size=60,
                                       method=method, sigma=0.5,
                                       iou_threshold=0.3, score_threshold=0.05)
  current = scores.astype(np.float64)
  remaining = current > 0.05
  want_idx, want_scores = [], []
  while remaining.any() and len(want_idx) < 60:
    i = int(np.argmax(np.where(remaining, current, -np.inf)))
    want_idx.append(i)
    want_scores.append(current[i])
    iou = np_iou(boxes[i].astype(np.float64), boxes.astype(np.float64))
    if method == "linear":
      decay = np.where(iou > 0.3, 1 - iou, 1)
    else:
      decay = np.exp(-iou ** 2 / 0.5)
    current = current * decay
    remaining[i] = False
    remaining &= current > 0.05
  count = int(count)
  assert count == len(want_idx)
  np.testing.assert_array_equal(np.asarray(idx)[:count], want_idx)
  np.testing.assert_allclose(np.asarray(out_scores)[:count], want_scores,
                             rtol=1e-5)


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


def test_works_under_jit_with_int_boxes(rng):
  boxes, scores = writeup_boxes(rng, 50)
  fn = jax.jit(functools.partial(pk.nms, iou_threshold=0.5, max_output_size=50,
                                 backend="reference"))
  idx, count = fn(boxes.astype(np.int32), scores)
  want, c, _ = np_nms(boxes, scores, 0.5, 50)
  np.testing.assert_array_equal(idx, want)


def test_public_names():
  from pallas_kernels import reference as ref_mod
  assert ref_mod.nms is reference.nms
  assert ref_mod.batched_nms is reference.batched_nms
  assert callable(pk.nms) and callable(pk.batched_nms)
  assert callable(pk.soft_nms)


def test_box_references_import_no_family_api():
  """The references are the semantics the kernels are checked against:
  they import the shared formulas, never the ops built on them."""
  import ast
  import inspect
  from pallas_kernels.boxes.iou import reference as iou_reference
  for module in (reference, iou_reference):
    for node in ast.walk(ast.parse(inspect.getsource(module))):
      if isinstance(node, ast.ImportFrom):
        names = [node.module or ""] + [a.name for a in node.names]
        assert not any(n == "api" or n.endswith(".api") for n in names), (
            module.__name__, names)
