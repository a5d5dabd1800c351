"""Public NMS ops: validation, the score sort, backend dispatch. Every sort
(Mosaic, Triton rank/radix, XLA) gives ``reference.sort_by_score``'s order.
Thresholds and ``max_output_size`` are static, so the output shape
``[max_output_size]`` works under jit.
"""
from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _backend, _sharding
from . import block_sizes, mosaic_tpu, reference, triton


# ----------------------------------------------------------------- validation

def _static_number(op, name, value, *, allow_none=False, minimum=None):
  if value is None and allow_none:
    return None
  if isinstance(value, (bool, np.bool_)) or not isinstance(
      value, (numbers.Real, np.floating, np.integer)):
    raise TypeError(f"{op}: {name} must be a Python float (static), got "
                    f"{type(value).__name__}")
  value = float(value)
  if not np.isfinite(value):
    raise ValueError(f"{op}: {name} must be finite, got {value}")
  if minimum is not None and value < minimum:
    raise ValueError(f"{op}: {name} must be >= {minimum}, got {value}")
  return value


def _static_size(op, name, value):
  if isinstance(value, (bool, np.bool_)) or not isinstance(
      value, (numbers.Integral, np.integer)):
    raise TypeError(f"{op}: {name} must be a Python int (static), got "
                    f"{type(value).__name__}")
  if value < 0:
    raise ValueError(f"{op}: {name} must be >= 0, got {value}")
  return int(value)


def _array(op, name, value, ndim, kind):
  try:
    value = jnp.asarray(value)
  except TypeError as e:
    raise TypeError(f"{op}: {name} must be an array, got "
                    f"{type(value).__name__}") from e
  if value.ndim != len(ndim):
    raise ValueError(f"{op}: {name} must have shape {ndim}, got "
                     f"{tuple(value.shape)}")
  if kind == "real" and not (jnp.issubdtype(value.dtype, jnp.floating)
                             or jnp.issubdtype(value.dtype, jnp.integer)):
    raise TypeError(f"{op}: {name} must be real (float or int), got "
                    f"{value.dtype}")
  if kind == "int" and not jnp.issubdtype(value.dtype, jnp.integer):
    raise TypeError(f"{op}: {name} must have an integer dtype, got "
                    f"{value.dtype}")
  return value


def _validate(op, boxes, scores, class_ids, iou_threshold, max_output_size,
              score_threshold, batched):
  lead = ("B", "N") if batched else ("N",)
  boxes = _array(op, "boxes", boxes, lead + ("4",), "real")
  scores = _array(op, "scores", scores, lead, "real")
  if boxes.shape[-1] != 4:
    raise ValueError(f"{op}: boxes must have shape [{', '.join(lead)}, 4] "
                     f"(x1, y1, x2, y2), got {tuple(boxes.shape)}")
  if scores.shape != boxes.shape[:-1]:
    raise ValueError(f"{op}: scores must have shape {tuple(boxes.shape[:-1])} "
                     f"to match boxes, got {tuple(scores.shape)}")
  if class_ids is not None:
    class_ids = _array(op, "class_ids", class_ids, lead, "int")
    if class_ids.shape != scores.shape:
      raise ValueError(f"{op}: class_ids must have shape "
                       f"{tuple(scores.shape)}, got {tuple(class_ids.shape)}")
    class_ids = class_ids.astype(jnp.int32)
  iou_threshold = _static_number(op, "iou_threshold", iou_threshold, minimum=0.0)
  max_output_size = _static_size(op, "max_output_size", max_output_size)
  score_threshold = _static_number(op, "score_threshold", score_threshold,
                                   allow_none=True)
  return (boxes.astype(jnp.float32), scores.astype(jnp.float32), class_ids,
          iou_threshold, max_output_size, score_threshold)


# ------------------------------------------------------------ implementations

def _sorted_inputs(boxes, scores, class_ids, score_threshold, padded,
                   sort=None, gather_planes=False):
  """Per image: score order, planes [B, 5, Np], classes and flags [B, Np].
  ``sort(scores, score_threshold) -> (order, valid)`` replaces the stable
  argsort (same result). ``gather_planes``: gather each coordinate plane
  along its lanes (on TPU far fewer bundles than XLA's gather of 4-float
  rows); same values."""
  batch, n = scores.shape
  if sort is None:
    order, valid = jax.vmap(
        lambda s: reference.sort_by_score(s, score_threshold))(scores)
  else:
    order, valid = sort(scores, score_threshold)
  if gather_planes:
    coords = jnp.take_along_axis(jnp.swapaxes(boxes, 1, 2), order[:, None],
                                 axis=2)
    planes = jnp.concatenate(
        [coords, reference.box_areas(jnp.swapaxes(coords, 1, 2))[:, None]],
        axis=1)
  else:
    planes = jax.vmap(reference.sorted_planes)(boxes, order)
  classes = (jnp.zeros((batch, n), jnp.int32) if class_ids is None
             else jnp.take_along_axis(class_ids, order, axis=1))
  pad = padded - n
  planes = jnp.pad(planes, ((0, 0), (0, 0), (0, pad)))
  classes = jnp.pad(classes, ((0, 0), (0, pad)))
  flags = jnp.pad(valid.astype(jnp.int32), ((0, 0), (0, pad)))
  return order, planes, classes, flags


def _tpu_order(scores, score_threshold, interpret=None):
  """``reference.sort_by_score`` per image by the Mosaic sort kernel."""
  n = scores.shape[1]
  keys, order = mosaic_tpu.sort_keys(
      mosaic_tpu.score_keys(scores, score_threshold), interpret=interpret)
  return order[:, :n], keys[:, :n] != mosaic_tpu.INVALID_KEY


def _tpu_batched(boxes, scores, class_ids, *, iou_threshold, max_output_size,
                 score_threshold, interpret=None):
  n = scores.shape[1]
  tile = block_sizes.tpu_tile(n)
  padded = block_sizes.padded_size(n, tile)
  sort = (functools.partial(_tpu_order, interpret=interpret)
          if mosaic_tpu.sort_size(n) <= mosaic_tpu.SORT_MAX else None)
  order, planes, classes, flags = _sorted_inputs(
      boxes, scores, class_ids, score_threshold, padded, sort=sort,
      gather_planes=True)
  rows = jnp.concatenate([
      planes,
      jax.lax.bitcast_convert_type(classes, jnp.float32)[:, None],
      flags.astype(jnp.float32)[:, None],
      jnp.zeros_like(planes[:, :1]),
  ], axis=1)
  keep = mosaic_tpu.keep_mask(rows, iou_threshold=iou_threshold,
                              max_output_size=max_output_size, tile=tile,
                              use_classes=class_ids is not None,
                              interpret=interpret)
  return _kept_indices(keep[:, :n], order, max_output_size)


def _inclusive_counts(x):
  """Inclusive prefix sums of int32 [B, N] small counts (< 2^24 in all). Rows of
  128 are prefix-summed by a matmul with an upper-triangular ones matrix (exact:
  integers in float32) and offset by the prefix sums of the row totals,
  recursively: XLA's TPU cumsum of 100k compiles for seconds."""
  batch, n = x.shape
  if n <= 128:
    return jnp.cumsum(x, axis=1)
  rows = -(-n // 128)
  tiles = jnp.pad(x, ((0, 0), (0, rows * 128 - n))).reshape(batch, rows, 128)
  lane = jnp.arange(128)
  upper = (lane[:, None] <= lane[None, :]).astype(jnp.float32)
  within = jnp.einsum("brl,lm->brm", tiles.astype(jnp.float32), upper,
                      precision=jax.lax.Precision.HIGHEST).astype(jnp.int32)
  totals = within[:, :, -1]
  before = _inclusive_counts(totals) - totals
  return (within + before[:, :, None]).reshape(batch, rows * 128)[:, :n]


def _kept_indices(keep, order, max_output_size):
  """Keep mask [B, N] over sorted positions -> (original indices [B, M]
  padded with -1, count [B]); ``reference.keep_to_indices`` without its
  scatter (the k-th kept position is found by binary search)."""
  counts = _inclusive_counts(keep.astype(jnp.int32))
  slots = jnp.arange(max_output_size, dtype=jnp.int32)
  count = jnp.minimum(counts[:, -1], max_output_size)
  position = jax.vmap(lambda c: jnp.searchsorted(
      c, slots + 1, side="left", method="scan"))(counts)
  indices = jnp.take_along_axis(
      order, jnp.minimum(position, keep.shape[1] - 1), axis=1)
  return (jnp.where(slots[None, :] < count[:, None], indices, -1),
          count.astype(jnp.int32))


def _bitmask_sizes(num_boxes, max_output_size):
  chunk_rows = block_sizes.mask_chunk_rows(num_boxes)
  if num_boxes >= block_sizes.SMALL_BOXES:  # else no cap: fewer launches
    chunk_rows = triton.chunk_rows_for(max_output_size, chunk_rows)
    overlap_rows = block_sizes.MASK_CHUNK_ROWS_OVERLAP
    if (max_output_size >= num_boxes
        and -(-num_boxes // overlap_rows) <= triton.STATIC_CHUNKS_MAX):
      chunk_rows = overlap_rows
  return dict(rows=block_sizes.MASK_ROWS,
              words=block_sizes.mask_words(num_boxes),
              chunk_rows=chunk_rows,
              max_bytes=block_sizes.GPU_BITMASK_MAX_BYTES)


def _gpu_batched(boxes, scores, class_ids, *, iou_threshold, max_output_size,
                 score_threshold, interpret=None):
  batch, n = scores.shape
  sizes = _bitmask_sizes(n, max_output_size)
  if triton.bitmask_layout(batch, n, **sizes) is not None:
    sort = (functools.partial(triton.rank_order, interpret=interpret)
            if n <= triton.RANK_SORT_MAX else
            triton.radix_order if n <= triton.RADIX_SORT_MAX
            else None)
    order, planes, classes, flags = _sorted_inputs(
        boxes, scores, class_ids, score_threshold, n, sort=sort)
    keep, base, count = triton.keep_words_bitmask(
        planes, classes, flags, iou_threshold=iou_threshold,
        max_output_size=max_output_size, mask_warps=block_sizes.MASK_WARPS,
        scan_warps=block_sizes.SCAN_WARPS, use_classes=class_ids is not None,
        interpret=interpret, **sizes)
    return triton.words_to_indices(keep, base, count, order, max_output_size)
  tile = block_sizes.GPU_TILE
  padded = block_sizes.padded_size(n, tile)
  order, planes, classes, flags = _sorted_inputs(
      boxes, scores, class_ids, score_threshold, padded)
  pos, count = triton.kept_positions(
      *(planes[:, r] for r in range(5)), classes, flags,
      iou_threshold=iou_threshold, max_output_size=max_output_size,
      tile=tile, num_warps=block_sizes.GPU_NUM_WARPS, interpret=interpret)
  count = jnp.minimum(count, max_output_size)
  slots = jnp.arange(max_output_size, dtype=jnp.int32)
  live = slots[None, :] < count[:, None]
  indices = jnp.take_along_axis(order, jnp.clip(pos, 0, n - 1), axis=1)
  return jnp.where(live, indices, -1), count.astype(jnp.int32)


def _reference_batched(boxes, scores, class_ids, *, iou_threshold,
                       max_output_size, score_threshold):
  return reference.batched_nms(
      boxes, scores, iou_threshold=iou_threshold,
      max_output_size=max_output_size, score_threshold=score_threshold,
      class_ids=class_ids)


def _run(op, backend, boxes, scores, class_ids, iou_threshold,
         max_output_size, score_threshold):
  _backend.check_backend(op, backend)
  static = dict(iou_threshold=iou_threshold, max_output_size=max_output_size,
                score_threshold=score_threshold)
  kernels = [
      _backend.Kernel("mosaic_tpu", functools.partial(_tpu_batched, **static)),
      _backend.Kernel("triton", functools.partial(_gpu_batched, **static)),
      _backend.Kernel("reference",
                      functools.partial(_reference_batched, **static)),
  ]
  batch, n = scores.shape
  if n == 0 or max_output_size == 0 or batch == 0:  # nothing to compute
    if backend is not None:  # still, a kernel named must exist
      _backend.choose(op, backend, kernels)
    return (jnp.full((batch, max_output_size), -1, jnp.int32),
            jnp.zeros((batch,), jnp.int32))
  return _backend.dispatch(op, backend, kernels, boxes, scores, class_ids,
                           rule=sharding_rule(op, class_ids))


def sharding_rule(op, class_ids, *, batched=True, indexed=1):
  """Images (b) split; never an image's boxes (greedy NMS is sequential
  over them). Results: ``indexed`` arrays over the kept boxes (indices,
  soft-NMS scores), then the count; without ``batched``, one image."""
  b = "b " if batched else ""
  return _sharding.make_rule(
      op, [("boxes", b + "n c"), ("scores", b + "n"),
           ("class_ids", None if class_ids is None else b + "n")],
      [b + "k"] * indexed + [b.strip()], split=b,
      helper="batched_nms with the image batch sharded (NMS of one image "
      "is sequential over its boxes)",
      names={"b": "image batch", "n": "boxes", "c": "coordinates",
             "k": "kept boxes"})


# -------------------------------------------------------------------- public

def nms(boxes, scores, *, iou_threshold, max_output_size, score_threshold=None,
        class_ids=None, backend=None):
  """Greedy non-maximum suppression of one image (torchvision.ops.nms semantics).

  Args:
    boxes: [N, 4] (x1, y1, x2, y2), float (ints are converted to float32).
    scores: [N] real.
    iou_threshold: Python float >= 0; a box is dropped when its IoU with a
      kept box is strictly greater.
    max_output_size: Python int >= 0, the static output length.
    score_threshold: optional Python float; scores <= it are never kept.
    class_ids: optional [N] integer classes; different classes never
      suppress each other (torchvision's ``batched_nms``).
    backend: None (chosen by platform), "mosaic_tpu", "triton", "gpu"
      (the best GPU kernel), "interpret" or "reference".

  Returns:
    (indices int32 [max_output_size]: kept box indices by decreasing score
    (equal scores: lower index first), padded with -1; num_valid int32).
  NaN scores are never kept; inverted boxes are empty (IoU 0 with all).
  """
  args = _validate("nms", boxes, scores, class_ids, iou_threshold,
                   max_output_size, score_threshold, batched=False)
  boxes, scores, class_ids = args[:3]
  indices, count = _run(
      "nms", backend, boxes[None], scores[None],
      None if class_ids is None else class_ids[None], *args[3:])
  return indices[0], count[0]


def batched_nms(boxes, scores, *, iou_threshold, max_output_size,
                score_threshold=None, class_ids=None, backend=None):
  """:func:`nms` of B independent images at once.

  Args: ``boxes`` [B, N, 4], ``scores`` [B, N], optional ``class_ids``
  [B, N]; the other arguments as for :func:`nms`. Images run in parallel
  (across cores / thread blocks).

  Returns:
    (indices int32 [B, max_output_size] padded with -1, num_valid int32 [B]).
  """
  args = _validate("batched_nms", boxes, scores, class_ids, iou_threshold,
                   max_output_size, score_threshold, batched=True)
  return _run("batched_nms", backend, *args)


def soft_nms(boxes, scores, *, max_output_size, method="gaussian", sigma=0.5,
             iou_threshold=0.3, score_threshold=0.001, class_ids=None,
             backend=None):
  """Soft-NMS of one image: decays overlapping scores instead of dropping boxes.

  Repeatedly picks the remaining box with the highest current score (ties:
  lower index) and multiplies every other remaining box's score (same class,
  with ``class_ids`` [N]) by exp(-iou^2 / sigma) (``method="gaussian"``) or
  by 1 - iou where iou > ``iou_threshold`` (``"linear"``). Stops after
  ``max_output_size`` picks or when no remaining score exceeds
  ``score_threshold``.

  Args: ``boxes`` [N, 4] xyxy, ``scores`` [N]; ``sigma`` > 0; ``backend``
  None or "reference" (only the reference exists: each step rescores every
  remaining box, so a tiled kernel cannot skip work as greedy NMS does).
  Returns: (indices int32 [max_output_size] padded with -1, decayed scores
  float32 [max_output_size] padded with 0, count int32).
  """
  op = "soft_nms"
  _backend.check_backend(op, backend)
  if method not in ("gaussian", "linear"):
    raise ValueError(f"{op}: method must be 'gaussian' or 'linear', got "
                     f"{method!r}")
  boxes, scores, class_ids, iou_threshold, max_output_size, score_threshold = (
      _validate(op, boxes, scores, class_ids, iou_threshold, max_output_size,
                score_threshold, batched=False))
  sigma = _static_number(op, "sigma", sigma)
  if sigma <= 0:
    raise ValueError(f"{op}: sigma must be > 0, got {sigma}")
  if score_threshold is None:
    score_threshold = -np.inf

  def run(boxes, scores, class_ids):
    return reference.soft_nms(
        boxes, scores, max_output_size=max_output_size, method=method,
        sigma=sigma, iou_threshold=iou_threshold,
        score_threshold=score_threshold, class_ids=class_ids)

  return _backend.dispatch(op, backend, [_backend.Kernel("reference", run)],
                           boxes, scores, class_ids)


def shard_batched_nms(mesh, boxes, scores, *, batch_axis="data",
                      class_ids=None, **kwargs):
  """:func:`batched_nms` with the images split over mesh axis ``batch_axis``.

  Each device runs NMS on its images (``shard_map``); indices and counts
  come back split the same way. Other keyword arguments go to
  ``batched_nms``.

  Example::

      mesh = jax.make_mesh((8,), ("data",))
      keep, count = shard_batched_nms(mesh, boxes, scores, iou_threshold=0.5,
                                      max_output_size=100)
  """
  from jax.sharding import PartitionSpec as P
  if batch_axis not in mesh.shape:
    raise ValueError(f"shard_batched_nms: batch_axis={batch_axis!r} is not a "
                     f"mesh axis ({tuple(mesh.shape)})")
  if jnp.shape(scores)[0] % mesh.shape[batch_axis]:
    raise ValueError(f"shard_batched_nms: batch {jnp.shape(scores)[0]} is not "
                     f"divisible by mesh axis {batch_axis!r} "
                     f"({mesh.shape[batch_axis]})")
  spec = P(batch_axis)
  args = [boxes, scores] + ([] if class_ids is None else [class_ids])

  def local(boxes, scores, class_ids=None):
    return batched_nms(boxes, scores, class_ids=class_ids, **kwargs)

  return _sharding.shard_map(local, mesh=mesh, in_specs=(spec,) * len(args),
                             out_specs=(spec, spec))(*args)
