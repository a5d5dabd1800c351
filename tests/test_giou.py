"""IoU-family ops vs torchvision's formulas (float64 numpy), gradients,
degenerate boxes, odd sizes, properties and argument errors."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import pallas_kernels as pk
from pallas_kernels import _compat, force_interpret
from pallas_kernels.boxes.iou import _math, api, mosaic_tpu, triton

KINDS = ("iou", "giou", "diou", "ciou")


def _x64():
  """float64 inside a block, on jax 0.7 (experimental) and newer (config)."""
  if hasattr(jax, "enable_x64"):
    return jax.enable_x64(True)
  from jax.experimental import enable_x64
  return enable_x64()

METRICS = {"iou": pk.iou, "giou": pk.giou, "diou": pk.diou, "ciou": pk.ciou}
PAIRWISE = {"iou": pk.pairwise_iou, "giou": pk.pairwise_giou,
            "diou": pk.pairwise_diou, "ciou": pk.pairwise_ciou}
LOSSES = {"iou": pk.iou_loss, "giou": pk.giou_loss, "diou": pk.diou_loss,
          "ciou": pk.ciou_loss}
EPS = 1e-7
F32_ATOL = 3e-6     # values are O(1); float32 formula chains lose ~10 ulp
BF16_ATOL = 0.06    # inputs rounded to 8 mantissa bits


# --------------------------------------------- torchvision formulas, float64
# Transcribed from torchvision.ops.boxes / *_loss.py, independent of the
# package's shared formula module. NaN/Inf wherever torchvision gives them.
def _area(b):
  return (b[..., 2] - b[..., 0]) * (b[..., 3] - b[..., 1])


def tv_pairwise(kind, b1, b2, eps=EPS):
  b1, b2 = np.asarray(b1, np.float64), np.asarray(b2, np.float64)
  with np.errstate(divide="ignore", invalid="ignore"):
    lt = np.maximum(b1[:, None, :2], b2[None, :, :2])
    rb = np.minimum(b1[:, None, 2:], b2[None, :, 2:])
    wh = np.clip(rb - lt, 0, None)
    inter = wh[..., 0] * wh[..., 1]
    union = _area(b1)[:, None] + _area(b2)[None, :] - inter
    iou = inter / union
    if kind == "iou":
      return iou
    lti = np.minimum(b1[:, None, :2], b2[None, :, :2])
    rbi = np.maximum(b1[:, None, 2:], b2[None, :, 2:])
    whi = np.clip(rbi - lti, 0, None)
    if kind == "giou":
      areai = whi[..., 0] * whi[..., 1]
      return iou - (areai - union) / areai
    diag = whi[..., 0] ** 2 + whi[..., 1] ** 2 + eps
    cx1, cy1 = (b1[:, 0] + b1[:, 2]) / 2, (b1[:, 1] + b1[:, 3]) / 2
    cx2, cy2 = (b2[:, 0] + b2[:, 2]) / 2, (b2[:, 1] + b2[:, 3]) / 2
    dist = (cx1[:, None] - cx2[None, :]) ** 2 + (cy1[:, None] - cy2[None, :]) ** 2
    diou = iou - dist / diag
    if kind == "diou":
      return diou
    w1, h1 = b1[:, None, 2] - b1[:, None, 0], b1[:, None, 3] - b1[:, None, 1]
    w2, h2 = b2[:, 2] - b2[:, 0], b2[:, 3] - b2[:, 1]
    v = 4 / math.pi ** 2 * (np.arctan(w1 / h1) - np.arctan(w2 / h2)) ** 2
    alpha = v / (1 - iou + v + eps)
    return diou - alpha * v


def tv_loss(kind, b1, b2, eps=EPS):
  b1, b2 = np.asarray(b1, np.float64), np.asarray(b2, np.float64)
  x1, y1, x2, y2 = np.moveaxis(b1, -1, 0)
  u1, v1, u2, v2 = np.moveaxis(b2, -1, 0)
  with np.errstate(divide="ignore", invalid="ignore"):
    xk1, yk1 = np.maximum(x1, u1), np.maximum(y1, v1)
    xk2, yk2 = np.minimum(x2, u2), np.minimum(y2, v2)
    mask = (yk2 > yk1) & (xk2 > xk1)
    inter = np.where(mask, (xk2 - xk1) * (yk2 - yk1), 0.0)
    union = (x2 - x1) * (y2 - y1) + (u2 - u1) * (v2 - v1) - inter
    iou = inter / (union + eps)
    if kind == "iou":
      return 1 - iou
    xc1, yc1 = np.minimum(x1, u1), np.minimum(y1, v1)
    xc2, yc2 = np.maximum(x2, u2), np.maximum(y2, v2)
    if kind == "giou":
      area_c = (xc2 - xc1) * (yc2 - yc1)
      return 1 - (iou - (area_c - union) / (area_c + eps))
    diag = (xc2 - xc1) ** 2 + (yc2 - yc1) ** 2 + eps
    dist = ((x1 + x2) / 2 - (u1 + u2) / 2) ** 2 + ((y1 + y2) / 2 - (v1 + v2) / 2) ** 2
    loss = 1 - iou + dist / diag
    if kind == "diou":
      return loss
    v = 4 / math.pi ** 2 * (np.arctan((u2 - u1) / (v2 - v1))
                            - np.arctan((x2 - x1) / (y2 - y1))) ** 2
    alpha = v / (1 - iou + v + eps)
    return loss + alpha * v


def tv_reduce(loss, reduction):
  if reduction == "sum":
    return loss.sum()
  if reduction == "mean":
    return loss.mean() if loss.size else 0.0
  return loss


def random_boxes(rng, shape, degenerate_fraction=0.0):
  xy = rng.uniform(-20.0, 80.0, shape + (2,))
  wh = rng.uniform(0.5, 40.0, shape + (2,))
  if degenerate_fraction:
    flat = rng.random(shape + (2,)) < degenerate_fraction
    wh = np.where(flat, 0.0, wh)
  return np.concatenate([xy, xy + wh], axis=-1).astype(np.float32)


def assert_matches_where_defined(out, expected, atol):
  out = np.asarray(out, np.float64)
  finite = np.isfinite(expected)
  assert np.all(np.isfinite(out)), "kernel produced NaN/Inf"
  np.testing.assert_allclose(out[finite], expected[finite], atol=atol, rtol=0)


# ------------------------------------------------------------ exact numbers
def test_known_values_by_hand():
  a = jnp.array([[0.0, 0.0, 2.0, 2.0]])
  b = jnp.array([[1.0, 1.0, 3.0, 3.0]])
  iou = 1 / 7                       # inter 1, union 7
  giou = iou - (9 - 7) / 9          # hull 3 x 3
  diou = iou - 2 / (18 + EPS)       # centres (1,1),(2,2); hull diagonal^2 18
  with force_interpret("generic"):
    np.testing.assert_allclose(pk.iou(a, b, backend="interpret"), [iou], atol=1e-7)
    np.testing.assert_allclose(pk.giou(a, b, backend="interpret"), [giou], atol=1e-7)
    np.testing.assert_allclose(pk.diou(a, b, backend="interpret"), [diou], atol=1e-7)
    # Same aspect ratio: CIoU adds nothing.
    np.testing.assert_allclose(pk.ciou(a, b, backend="interpret"), [diou], atol=1e-7)
    np.testing.assert_allclose(
        pk.giou_loss(a, b, backend="interpret"),
        [1 - (1 / (7 + EPS) - 2 / (9 + EPS))], atol=1e-7)
    # Far apart boxes: IoU 0, GIoU -> -1 as the hull grows.
    far = jnp.array([[1000.0, 1000.0, 1002.0, 1002.0]])
    assert float(pk.iou(a, far, backend="interpret")[0]) == 0.0
    assert -1.0 <= float(pk.giou(a, far, backend="interpret")[0]) < -0.99


# ------------------------------------------------- vs torchvision, float32
@pytest.mark.parametrize("kind", KINDS)
def test_pairwise_matches_torchvision(kind, rng):
  b1 = random_boxes(rng, (37,), degenerate_fraction=0.1)
  b2 = random_boxes(rng, (129,), degenerate_fraction=0.1)
  b2[:5] = b1[:5]                                   # identical boxes
  with force_interpret():
    out = PAIRWISE[kind](b1, b2, backend="interpret")
  assert out.shape == (37, 129) and out.dtype == jnp.float32
  assert_matches_where_defined(out, tv_pairwise(kind, b1, b2), F32_ATOL)


@pytest.mark.parametrize("kind", KINDS)
def test_elementwise_is_torchvision_diagonal(kind, rng):
  b1 = random_boxes(rng, (3, 129), degenerate_fraction=0.1)
  b2 = random_boxes(rng, (3, 129), degenerate_fraction=0.1)
  b2[0, :7] = b1[0, :7]
  with force_interpret():
    out = METRICS[kind](b1, b2, backend="interpret")
  assert out.shape == (3, 129)
  expected = np.stack([np.diag(tv_pairwise(kind, x, y)) for x, y in zip(b1, b2)])
  assert_matches_where_defined(out, expected, F32_ATOL)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_losses_match_torchvision(kind, reduction, rng):
  pred = random_boxes(rng, (2, 333), degenerate_fraction=0.05)
  target = random_boxes(rng, (2, 333))
  flavour = "tpu" if reduction == "none" else "generic"
  with force_interpret(flavour):
    out = LOSSES[kind](pred, target, reduction=reduction, backend="interpret")
  expected = tv_reduce(tv_loss(kind, pred, target), reduction)
  scale = 666 if reduction == "sum" else 1
  assert_matches_where_defined(out, np.asarray(expected), F32_ATOL * scale)


@pytest.mark.parametrize("kind", KINDS)
def test_matches_installed_torchvision(kind, rng):
  """Against torchvision itself (installed in the torch_xla environment)."""
  torch = pytest.importorskip("torch")
  ops = pytest.importorskip("torchvision.ops")
  pairwise = {"iou": ops.box_iou, "giou": ops.generalized_box_iou,
              "diou": ops.distance_box_iou, "ciou": ops.complete_box_iou}
  losses = {"giou": ops.generalized_box_iou_loss,
            "diou": ops.distance_box_iou_loss, "ciou": ops.complete_box_iou_loss}
  b1 = random_boxes(rng, (23,), degenerate_fraction=0.1)
  b2 = random_boxes(rng, (131,), degenerate_fraction=0.1)
  b2[:3] = b1[:3]
  t1, t2 = torch.from_numpy(b1).double(), torch.from_numpy(b2).double()
  with force_interpret("generic"):
    out = PAIRWISE[kind](b1, b2, backend="interpret")
  assert_matches_where_defined(out, pairwise[kind](t1, t2).numpy(), F32_ATOL)
  if kind in losses:
    pred = random_boxes(rng, (257,), degenerate_fraction=0.05)
    target = random_boxes(rng, (257,))
    want = losses[kind](torch.from_numpy(pred).double(),
                        torch.from_numpy(target).double(), reduction="none")
    with force_interpret("generic"):
      got = LOSSES[kind](pred, target, backend="interpret")
    assert_matches_where_defined(got, want.numpy(), F32_ATOL)


def test_reference_backend_matches_torchvision_float64(rng):
  pred = random_boxes(rng, (200,), 0.05).astype(np.float64)
  target = random_boxes(rng, (200,)).astype(np.float64)
  with _x64():
    for kind in KINDS:
      out = LOSSES[kind](jnp.asarray(pred), jnp.asarray(target),
                         backend="reference")
      assert out.dtype == jnp.float64
      assert_matches_where_defined(out, tv_loss(kind, pred, target), 1e-12)
      pw = PAIRWISE[kind](jnp.asarray(pred[:20]), jnp.asarray(target),
                          backend="reference")
      assert_matches_where_defined(pw, tv_pairwise(kind, pred[:20], target),
                                   1e-12)


# ------------------------------------------------------------- gradients
def _float64_grads(kind, reduction, pred, target, g):
  with _x64():
    def loss(p, t):
      out = LOSSES[kind](p, t, reduction=reduction, backend="reference")
      return jnp.sum(out * g) if reduction == "none" else out * g
    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(
        jnp.asarray(pred, jnp.float64), jnp.asarray(target, jnp.float64))
    return [np.asarray(x) for x in grads]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_loss_gradients_match_float64(kind, reduction, rng):
  pred = random_boxes(rng, (129,))
  target = random_boxes(rng, (129,))
  g = (rng.normal(size=129) if reduction == "none" else np.array(1.7))
  flavour = "tpu" if reduction == "none" else "generic"

  def loss(p, t):
    out = LOSSES[kind](p, t, reduction=reduction, backend="interpret")
    return jnp.sum(out * jnp.asarray(g, jnp.float32))

  with force_interpret(flavour):
    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(pred, target)
  expected = _float64_grads(kind, reduction, pred, target, g)
  for got, want in zip(grads, expected):
    scale = np.max(np.abs(want)) + 1e-30
    np.testing.assert_allclose(np.asarray(got) / scale, want / scale,
                               atol=2e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_metric_gradients_use_kernel_and_match_reference(kind, rng):
  b1 = random_boxes(rng, (50,))
  b2 = random_boxes(rng, (50,))
  fn = METRICS[kind]

  def total(be):
    return lambda x, y: jnp.sum(fn(x, y, backend=be) ** 2)

  with force_interpret("generic"):
    got = jax.jit(jax.grad(total("interpret"), argnums=(0, 1)))(b1, b2)
  want = jax.jit(jax.grad(total("reference"), argnums=(0, 1)))(b1, b2)
  for x, y in zip(got, want):
    np.testing.assert_allclose(x, y, atol=2e-6, rtol=1e-5)


def test_pairwise_gradient_matches_reference(rng):
  b1, b2 = random_boxes(rng, (8,)), random_boxes(rng, (128,))

  def total(be):
    return lambda x, y: jnp.sum(jnp.sin(pk.pairwise_ciou(x, y, backend=be)))

  with force_interpret("generic"):
    got = jax.jit(jax.grad(total("interpret"), argnums=(0, 1)))(b1, b2)
  want = jax.jit(jax.grad(total("reference"), argnums=(0, 1)))(b1, b2)
  for x, y in zip(got, want):
    np.testing.assert_allclose(x, y, atol=2e-6, rtol=1e-5)


# -------------------------------------------------------- degenerate boxes
DEGENERATE = np.array([
    # pred                    target
    [[0, 0, 0, 0], [0, 0, 0, 0]],          # two identical points
    [[1, 1, 1, 1], [5, 5, 5, 5]],          # two distinct points
    [[0, 0, 4, 0], [0, 0, 4, 0]],          # identical zero-height boxes
    [[0, 0, 0, 4], [1, 0, 1, 4]],          # parallel zero-width boxes
    [[0, 0, 2, 2], [0, 0, 2, 2]],          # identical boxes
    [[0, 0, 2, 2], [1e6, 1e6, 1e6 + 2, 1e6 + 2]],   # far apart
    [[3, 3, 1, 1], [0, 0, 2, 2]],          # x2 < x1 and y2 < y1
    [[3, 0, 1, 2], [0, 0, 2, 2]],          # x2 < x1 only (negative area)
    [[0, 0, 2, 2], [0, 0, 0, 0]],          # box vs point inside it
    [[0, 0, 2, 2], [1, 1, 1, 1]],          # box vs point in its centre
], np.float32)


@pytest.mark.parametrize("kind", KINDS)
def test_degenerate_boxes_finite_values_and_gradients(kind):
  pred, target = DEGENERATE[:, 0], DEGENERATE[:, 1]

  def everything(p, t, backend):
    # (The reduced losses' shared-cotangent path is covered by other tests.)
    return (jnp.sum(LOSSES[kind](p, t, backend=backend) * weights)
            + jnp.sum(METRICS[kind](p, t, backend=backend)))

  weights = jnp.arange(1.0, len(pred) + 1.0)
  with force_interpret("generic"):
    loss = LOSSES[kind](pred, target, backend="interpret")
    metric = METRICS[kind](pred, target, backend="interpret")
    pairwise = PAIRWISE[kind](pred, target, backend="interpret")
    grads = jax.jit(jax.grad(everything, argnums=(0, 1)),
                    static_argnums=2)(pred, target, "interpret")
  ref_grads = jax.jit(jax.grad(everything, argnums=(0, 1)),
                      static_argnums=2)(pred, target, "reference")
  assert_matches_where_defined(loss, tv_loss(kind, pred, target), 1e-5)
  expected_pairwise = tv_pairwise(kind, pred, target)
  assert_matches_where_defined(metric, np.diag(expected_pairwise), 1e-5)
  assert_matches_where_defined(pairwise, expected_pairwise, 1e-5)
  np.testing.assert_array_equal(np.diag(pairwise), metric)
  for got, want in zip(grads, ref_grads):
    assert np.all(np.isfinite(got)) and np.all(np.isfinite(want))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  # Where torchvision divides 0 by 0 the value is defined, not NaN: two
  # identical points have IoU 0 (hence GIoU 0 too) and loss 1.
  assert float(metric[0]) == 0.0 and float(loss[0]) == pytest.approx(1.0)
  # Identical proper boxes: score 1, loss 0 for every kind.
  assert float(metric[4]) == pytest.approx(1.0, abs=1e-6)
  assert float(loss[4]) == pytest.approx(0.0, abs=1e-6)


def test_nan_coordinates_propagate():
  a = jnp.array([[0.0, 0.0, jnp.nan, 2.0], [0.0, 0.0, 2.0, 2.0]])
  b = jnp.array([[1.0, 1.0, 3.0, 3.0], [1.0, 1.0, 3.0, 3.0]])
  with force_interpret("generic"):
    out = pk.giou_loss(a, b, backend="interpret")
  assert np.isnan(out[0]) and np.isfinite(out[1])


# ------------------------------------------------------- shapes and dtypes
@pytest.mark.parametrize("count", [0, 1, 129, 1000])
def test_odd_sizes_forward_and_backward(count, rng):
  pred, target = random_boxes(rng, (count,)), random_boxes(rng, (count,))
  with force_interpret("generic"):
    out = pk.giou_loss(pred, target, backend="interpret")
    mean, grads = jax.jit(jax.value_and_grad(
        lambda p, t: pk.giou_loss(p, t, reduction="mean", backend="interpret"),
        argnums=(0, 1)))(pred, target)
  assert out.shape == (count,)
  np.testing.assert_allclose(out, tv_loss("giou", pred, target), atol=F32_ATOL)
  np.testing.assert_allclose(mean, tv_reduce(tv_loss("giou", pred, target), "mean"),
                             atol=F32_ATOL)
  expected = _float64_grads("giou", "mean", pred, target, 1.0)
  for got, want in zip(grads, expected):
    assert got.shape == (count, 4)
    np.testing.assert_allclose(got, want, atol=1e-7)


def test_cxcywh_equals_converted_xyxy(rng):
  xyxy = random_boxes(rng, (2, 140))
  cxcywh = np.concatenate([(xyxy[..., :2] + xyxy[..., 2:]) / 2,
                           xyxy[..., 2:] - xyxy[..., :2]], -1)
  other = random_boxes(rng, (2, 140))
  other_c = np.concatenate([(other[..., :2] + other[..., 2:]) / 2,
                            other[..., 2:] - other[..., :2]], -1)
  @jax.jit
  def both(c1, c2, x1, x2):
    with force_interpret("generic"):
      return [(LOSSES[k](c1, c2, box_format="cxcywh", backend="interpret"),
               LOSSES[k](x1, x2, backend="interpret")) for k in KINDS]

  for got, want in both(cxcywh, other_c, xyxy, other):
    np.testing.assert_allclose(got, want, atol=1e-5)
  with force_interpret("generic"):
    got = pk.pairwise_giou(cxcywh[0], other_c[1], box_format="cxcywh")
    want = pk.pairwise_giou(xyxy[0], other[1])
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_bfloat16_inputs(rng):
  pred = random_boxes(rng, (300,))
  target = random_boxes(rng, (300,))
  p16, t16 = jnp.asarray(pred, jnp.bfloat16), jnp.asarray(target, jnp.bfloat16)
  with force_interpret():
    out = pk.giou_loss(p16, t16, backend="interpret")
  with force_interpret("generic"):
    grads = jax.jit(jax.grad(lambda p, t: pk.giou_loss(
        p, t, reduction="sum", backend="interpret"), argnums=(0, 1)))(p16, t16)
    pw = pk.pairwise_giou(p16[:20], t16, backend="interpret")
  assert out.dtype == jnp.bfloat16 and grads[0].dtype == jnp.bfloat16
  assert pw.dtype == jnp.bfloat16
  # Same boxes after rounding to bf16, computed in float64: only the output
  # rounding (8 bits) differs.
  exact = tv_loss("giou", np.asarray(p16, np.float32), np.asarray(t16, np.float32))
  np.testing.assert_allclose(np.asarray(out, np.float32), exact, atol=1e-2)
  want = _float64_grads("giou", "sum", np.asarray(p16, np.float32),
                        np.asarray(t16, np.float32), 1.0)
  for got, w in zip(grads, want):
    np.testing.assert_allclose(np.asarray(got, np.float32), w,
                               atol=np.max(np.abs(w)) * 1e-2)


def test_integer_boxes_give_float32():
  a = np.array([[0, 0, 2, 2]], np.int32)
  b = np.array([[1, 1, 3, 3]], np.int32)
  with force_interpret("generic"):
    out = pk.giou(a, b, backend="interpret")
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(out, [1 / 7 - 2 / 9], atol=1e-7)


def test_broadcasting_and_batched_pairwise(rng):
  a = random_boxes(rng, (3, 1, 10))
  b = random_boxes(rng, (1, 4, 10))
  s1, s2 = random_boxes(rng, (2, 1, 9)), random_boxes(rng, (3, 17))
  with force_interpret("generic"):
    out = pk.diou(a, b, backend="interpret")
    pw = pk.box_iou(s1, s2, iou_kind="giou", backend="interpret")
  assert out.shape == (3, 4, 10)
  np.testing.assert_allclose(out, np.asarray(pk.diou(a, b, backend="reference")),
                             atol=F32_ATOL)
  assert pw.shape == (2, 3, 9, 17)
  for i in range(2):
    for j in range(3):
      np.testing.assert_allclose(pw[i, j], tv_pairwise("giou", s1[i, 0], s2[j]),
                                 atol=F32_ATOL)


def test_backend_none_jitted_runs_interpreter_on_cpu(rng):
  pred, target = random_boxes(rng, (77,)), random_boxes(rng, (77,))
  out = jax.jit(lambda p, t: pk.giou_loss(p, t, reduction="sum"))(pred, target)
  np.testing.assert_allclose(out, tv_loss("giou", pred, target).sum(), rtol=1e-5)


def test_no_races_in_backward_kernel(rng):
  pred, target = random_boxes(rng, (200,)), random_boxes(rng, (200,))
  with force_interpret("races"):
    grads = jax.jit(jax.grad(lambda p, t: pk.ciou_loss(
        p, t, reduction="mean", backend="interpret"), argnums=(0, 1)))(pred, target)
    jax.block_until_ready(grads)
  assert not _compat.races_found()


def test_partial_last_grid_block_and_multi_step(rng):
  # 9 rows of 128 boxes with 8-row blocks: 2 grid steps, the last partial.
  count = 9 * 128 - 5
  b1, b2 = random_boxes(rng, (count,)), random_boxes(rng, (count,))
  interp = True
  value = mosaic_tpu.elementwise(b1, b2, kind="giou", formula="loss", eps=EPS,
                                 box_format="xyxy", as_loss=True,
                                 interpret=interp, block_rows=8)
  total = mosaic_tpu.elementwise(b1, b2, kind="giou", formula="loss", eps=EPS,
                                 box_format="xyxy", as_loss=True, reduce=True,
                                 interpret=interp, block_rows=8)
  d1, _ = mosaic_tpu.elementwise_vjp(
      b1, b2, jnp.ones((1,)), kind="giou", formula="loss", eps=EPS,
      box_format="xyxy", shared_cotangent=True, interpret=interp, block_rows=8)
  expected = tv_loss("giou", b1, b2)
  np.testing.assert_allclose(value, expected, atol=F32_ATOL)
  np.testing.assert_allclose(total, expected.sum(), rtol=1e-5)
  want = -_float64_grads("giou", "sum", b1, b2, 1.0)[0]
  np.testing.assert_allclose(d1, want, atol=1e-5)


# ----------------------------------------------------------- properties
_box = st.tuples(st.floats(-50, 50), st.floats(-50, 50),
                 st.floats(0.01, 60), st.floats(0.01, 60))


def _to_array(boxes):
  return np.array([[x, y, x + w, y + h] for x, y, w, h in boxes], np.float32)


@jax.jit
def _giou_properties(a, b):
  with force_interpret("generic"):
    return (pk.giou(a, b, backend="interpret"), pk.giou(b, a, backend="interpret"),
            pk.giou(a, a, backend="interpret"),
            pk.giou_loss(a, b, backend="interpret"))


@jax.jit
def _pairwise_properties(a, b):
  with force_interpret("generic"):
    return (pk.pairwise_giou(a, b, backend="interpret"),
            pk.pairwise_giou(b, a, backend="interpret"),
            pk.box_iou(a, b, backend="interpret"))


# Fixed sizes: one compilation serves every example.
@given(st.lists(st.tuples(_box, _box), min_size=16, max_size=16))
def test_properties_symmetry_range_identity(pairs):
  a = _to_array([p[0] for p in pairs])
  b = _to_array([p[1] for p in pairs])
  ab, ba, aa, loss_ab = (np.asarray(x) for x in _giou_properties(a, b))
  np.testing.assert_allclose(ab, ba, atol=1e-6)
  assert np.all(ab >= -1.0 - 1e-6) and np.all(ab <= 1.0 + 1e-6)
  np.testing.assert_allclose(aa, 1.0, atol=1e-5)
  assert np.all(loss_ab >= -1e-6) and np.all(loss_ab <= 2 + 1e-6)


@given(st.lists(_box, min_size=8, max_size=8), st.lists(_box, min_size=8, max_size=8))
def test_pairwise_properties(set1, set2):
  a, b = _to_array(set1), _to_array(set2)
  ab, ba, iou = (np.asarray(x) for x in _pairwise_properties(a, b))
  np.testing.assert_allclose(ab, ba.T, atol=1e-6)
  assert np.all(iou >= 0) and np.all(iou <= 1 + 1e-6)
  assert np.all(ab <= iou + 1e-6)


# ----------------------------------------------------------------- errors
@pytest.mark.parametrize("call, error, match", [
    (lambda: pk.giou(np.zeros((3, 3)), np.zeros((3, 4))), ValueError, "boxes1 must have shape"),
    (lambda: pk.giou(np.zeros((3, 4)), np.zeros(4, bool)), TypeError, "boxes2"),
    (lambda: pk.giou("boxes", np.zeros((3, 4))), TypeError, "boxes1"),
    (lambda: pk.giou(np.zeros((3, 4)), np.zeros((2, 4))), ValueError, "broadcast"),
    (lambda: pk.giou_loss(np.zeros((3, 4)), np.zeros((3, 4)), reduction="avg"), ValueError, "reduction"),
    (lambda: pk.giou_loss(np.zeros((3, 4)), np.zeros((3, 4)), eps=-1.0), ValueError, "eps"),
    (lambda: pk.giou_loss(np.zeros((3, 4)), np.zeros((3, 4)), eps=float("nan")), ValueError, "eps"),
    (lambda: pk.ciou(np.zeros((3, 4)), np.zeros((3, 4)), eps="1e-7"), TypeError, "eps"),
    (lambda: pk.diou_loss(np.zeros((3, 4)), np.zeros((3, 4)), box_format="xywh"), ValueError, "box_format"),
    (lambda: pk.giou(np.zeros((3, 4)), np.zeros((3, 4)), backend="cuda"), ValueError, "backend"),
    (lambda: pk.pairwise_giou(np.zeros(4), np.zeros((3, 4))), ValueError, r"\[\.\.\., N, 4\]"),
    (lambda: pk.pairwise_iou(np.zeros((2, 3, 4)), np.zeros((3, 5, 4))), ValueError, "broadcast"),
    (lambda: pk.box_iou(np.zeros((3, 4)), np.zeros((3, 4)), iou_kind="miou"), ValueError, "iou_kind"),
    (lambda: pk.giou(np.zeros((3, 4), np.complex64), np.zeros((3, 4))), TypeError, "dtype"),
])
def test_bad_arguments_raise(call, error, match):
  with pytest.raises(error, match=match):
    call()


def test_float64_runs_the_reference():
  with _x64():
    a = jnp.zeros((3, 4), jnp.float64)
    with pytest.raises(ValueError, match="float64"):
      pk.giou_loss(a, a, backend="interpret")
    assert pk.giou_loss(a, a, backend="reference").dtype == jnp.float64
    assert pk.pairwise_giou(a, a).dtype == jnp.float64  # chosen: reference


# --------------------------------------------- GPU kernels (interpreted)
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_kernels_interpreted(kind, rng):
  n, block = 300, 128  # 3 programs, the last one ragged
  b1, b2 = random_boxes(rng, (n,), 0.05), random_boxes(rng, (n,))
  g = rng.normal(size=n).astype(np.float32)
  value = triton.elementwise(b1, b2, kind=kind, formula="loss", eps=EPS,
                          box_format="xyxy", as_loss=True, interpret=True,
                          block=block)
  total = triton.elementwise(b1, b2, kind=kind, formula="loss", eps=EPS,
                          box_format="xyxy", as_loss=True, reduce=True,
                          interpret=True, block=block)
  expected = tv_loss(kind, b1, b2)
  assert_matches_where_defined(value, expected, F32_ATOL)
  np.testing.assert_allclose(total, np.sum(np.asarray(value, np.float64)),
                             rtol=1e-5)
  b1 = random_boxes(rng, (n,))  # torchvision's gradient is NaN at h == 0
  d1, d2 = triton.elementwise_vjp(b1, b2, -g, kind=kind, formula="loss", eps=EPS,
                               box_format="xyxy", interpret=True, block=block)
  want = _float64_grads(kind, "none", b1, b2, g)
  for got, w in zip((d1, d2), want):
    np.testing.assert_allclose(got, w, atol=np.max(np.abs(w)) * 2e-5)
  s1, _ = triton.elementwise_vjp(b1, b2, jnp.full((1,), -1.0), kind=kind,
                              formula="loss", eps=EPS, box_format="xyxy",
                              shared_cotangent=True, interpret=True,
                              block=block)
  want = _float64_grads(kind, "sum", b1, b2, 1.0)[0]
  np.testing.assert_allclose(s1, want, atol=np.max(np.abs(want)) * 2e-5)
  pw = triton.pairwise(jnp.asarray(b1[None, :70]), jnp.asarray(b2[None, :130]),
                    kind=kind, eps=EPS, out_dtype=jnp.float32, interpret=True)
  assert_matches_where_defined(pw[0], tv_pairwise(kind, b1[:70], b2[:130]),
                               F32_ATOL)


def test_gpu_backend_through_public_api(rng):
  b1, b2 = random_boxes(rng, (300,)), random_boxes(rng, (300,))
  with force_interpret("generic"):
    got = jax.jit(jax.grad(lambda p, t: pk.giou_loss(
        p, t, reduction="mean", backend="gpu"), argnums=(0, 1)))(b1, b2)
    pw = pk.pairwise_diou(b1[:10], b2, backend="gpu")
  want = _float64_grads("giou", "mean", b1, b2, 1.0)
  for x, w in zip(got, want):
    np.testing.assert_allclose(x, w, atol=1e-7)
  assert_matches_where_defined(pw, tv_pairwise("diou", b1[:10], b2), F32_ATOL)


def test_gpu_kernels_lower_for_cuda(rng):
  """The Triton lowering runs on this CPU host: every GPU kernel lowers."""
  b = jnp.asarray(random_boxes(rng, (3000,)))
  fns = [
      (lambda x, y: pk.ciou_loss(x, y, backend="gpu"), (b, b)),
      (jax.grad(lambda x, y: pk.giou_loss(x, y, reduction="mean", backend="gpu")), (b, b)),
      (jax.grad(lambda x, y: jnp.sum(pk.diou(x, y, backend="gpu"))), (b, b)),
      (lambda x, y: pk.pairwise_giou(x, y, backend="gpu"), (b[:100], b)),
  ]
  for fn, args in fns:
    lowered = _compat.lower_for_cuda(fn, *args)
    assert "triton" in lowered.as_text().lower() or "__gpu" in lowered.as_text()


def test_gpu_direct_vjp_call_at_ragged_size(rng):
  """The call that disagreed on the H100: elementwise_vjp jitted, 3000 boxes.

  Default block (1024), so the third program is partial; random cotangent.
  """
  b1, b2 = random_boxes(rng, (3000,)), random_boxes(rng, (3000,))
  g = rng.normal(size=3000).astype(np.float32)
  d1, d2 = jax.jit(lambda x, y, c: triton.elementwise_vjp(
      x, y, c, kind="giou", formula="loss", eps=EPS, box_format="xyxy",
      interpret=True))(b1, b2, g)
  want = _float64_grads("giou", "none", b1, b2, -g)
  for got, w in zip((d1, d2), want):
    np.testing.assert_allclose(got, w, atol=np.max(np.abs(w)) * 2e-5)


def _kernel_primitives(fn, *args):
  names = []
  for eqn in jax.make_jaxpr(fn)(*args).jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      names += [e.primitive.name for e in eqn.params["jaxpr"].eqns]
  return names


def test_gpu_kernels_mask_every_ragged_store():
  """Triton's Pallas lowering adds no bounds check: a plain ``ref[...] = x``
  (primitive "swap") in a partial last block writes past the array. The
  kernels whose outputs have ragged blocks must store through a mask."""
  b = jnp.ones((3000, 4), jnp.float32)
  common = dict(kind="giou", formula="loss", eps=EPS, box_format="xyxy")
  for fn in (lambda x, y: triton.elementwise(x, y, **common),
             lambda x, y: triton.elementwise_vjp(x, y, jnp.ones(3000), **common),
             lambda x, y: triton.pairwise(x[None, :100], y[None], kind="giou",
                                       eps=0.0, out_dtype=jnp.float32)):
    names = _kernel_primitives(fn, b, b)
    assert "masked_swap" in names and "swap" not in names, names


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gpu_fused_value_and_grad_interpreted(rng, reduction):
  """Small reduced losses: loss sum and both gradients from one kernel."""
  n, block = 300, 128  # 3 programs, the last one ragged
  b1, b2 = random_boxes(rng, (n,)), random_boxes(rng, (n,))
  scale = -1.0 / n if reduction == "mean" else -1.0
  total, d1, d2 = triton.elementwise_value_and_grad(
      b1, b2, kind="giou", formula="loss", eps=EPS, box_format="xyxy",
      as_loss=True, grad_scale=scale, interpret=True, block=block)
  np.testing.assert_allclose(total, np.sum(tv_loss("giou", b1, b2)),
                             rtol=1e-5)
  want = _float64_grads("giou", reduction, b1, b2, 1.0)
  for got, w in zip((d1, d2), want):
    np.testing.assert_allclose(got, w, atol=np.max(np.abs(w)) * 2e-5)
  # The public API takes this path for small reduced losses, any backend.
  assert api._fused_value_and_grad(
      api._Config("giou_loss", "giou", "loss", EPS, "xyxy", True, reduction,
                  "gpu", jnp.dtype(jnp.float32)), n)


def test_gpu_pairwise_tiles_interpreted(rng):
  """Every tile of ragged and aligned matrices, tiles taller than N."""
  b1, b2 = random_boxes(rng, (77,), 0.05), random_boxes(rng, (160,))
  for n, m, tile in ((37, 160, (8, 64)), (32, 128, (16, 64)),
                     (77, 100, (32, 64)), (5, 70, (128, 64))):
    pw = triton.pairwise(jnp.asarray(b1[None, :n]), jnp.asarray(b2[None, :m]),
                         kind="giou", eps=0.0, out_dtype=jnp.float32,
                         interpret=True, tile=tile)
    assert pw.shape == (1, n, m)
    assert_matches_where_defined(pw[0], tv_pairwise("giou", b1[:n], b2[:m]),
                                 F32_ATOL)


def test_gpu_pairwise_plain_store_only_for_whole_tiles():
  """Aligned matrices store tiles unmasked; a ragged edge still masks."""
  b = jnp.ones((256, 4), jnp.float32)
  tile_n, tile_m = triton.PAIRWISE_TILE

  def names(n, m):
    return _kernel_primitives(lambda x, y: triton.pairwise(
        x[None, :n], y[None, :m], kind="giou", eps=0.0,
        out_dtype=jnp.float32), b, b)

  aligned = names(tile_n * 2, tile_m)
  assert "swap" in aligned and "masked_swap" not in aligned, aligned
  ragged = names(tile_n * 2, tile_m - 1)
  assert "masked_swap" in ragged and "swap" not in ragged, ragged


@pytest.mark.parametrize("kind", ["iou", "giou"])
def test_pairwise_lean_formula_interpreted(kind, rng):
  """The pairwise kernels' lean IoU/GIoU (one select per quotient) against
  torchvision in float64 and bit for bit against the shared formula, on
  random, far-apart, nested, identical, zero-area and inverted (x2 < x1)
  boxes, at large coordinates too; the kernels against torchvision."""
  special = np.array([[0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 4, 0], [3, 3, 1, 1],
                      [0, 0, 2, 2], [0.5, 0.5, 1.5, 1.5], [1e4, 1e4, 1e4 + 3,
                      1e4 + 1], [-50, -50, -49, -49]], np.float32)
  b1 = np.concatenate([special, random_boxes(rng, (53,), 0.1)])
  b2 = np.concatenate([special[::-1], random_boxes(rng, (70,), 0.1)])
  expected = tv_pairwise(kind, b1, b2)
  a = tuple(jnp.asarray(b1[:, c])[:, None] for c in range(4))
  b = tuple(jnp.asarray(b2[:, c])[None, :] for c in range(4))
  for run in (lambda f: f, jax.jit):  # eager and fused: XLA may contract
    lean = run(functools.partial(_math.pairwise_score_lean, kind))(a, b)
    shared = run(functools.partial(_math.score, kind, "pairwise", 0.0))(a, b)
    np.testing.assert_array_equal(lean, shared)
  for got in (triton.pairwise(jnp.asarray(b1[None]), jnp.asarray(b2[None]),
                              kind=kind, eps=0.0, out_dtype=jnp.float32,
                              interpret=True, tile=(8, 64)),
              mosaic_tpu.pairwise(jnp.asarray(b1[None]), jnp.asarray(b2[None]),
                                  kind=kind, eps=0.0, out_dtype=jnp.float32,
                                  interpret=True)):
    assert_matches_where_defined(got[0], expected, F32_ATOL)
  with pytest.raises(ValueError, match="diou"):
    _math.pairwise_score_lean("diou", a, b)
