"""IoU family: one suite for every backend (``tests/backends.py``) against the
float64 oracle (``tests/oracles/boxes.py``); then the kernels' own tests,
properties and argument errors.

Tolerances (values are O(1)): float32 3e-6 absolute (float32 formula chains
lose ~10 ulp), plus, for cxcywh inputs, the rounding of the kernel's float32
conversion to corners (``cxcywh_atol``), bfloat16 outputs 1e-2 (8-bit mantissa), float64 (reference)
1e-12; gradients relative to their largest entry: float32 2e-5, bfloat16
1e-2.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import backends
import pallas_kernels as pk
from oracles import boxes as oracle
from pallas_kernels import _backend, _compat, force_interpret
from pallas_kernels.boxes.iou import _math, api, mosaic_tpu, triton

ALL = backends.params()
KINDS = oracle.KINDS
METRICS = {"iou": pk.iou, "giou": pk.giou, "diou": pk.diou, "ciou": pk.ciou}
PAIRWISE = {"iou": pk.pairwise_iou, "giou": pk.pairwise_giou,
            "diou": pk.pairwise_diou, "ciou": pk.pairwise_ciou}
LOSSES = {"iou": pk.iou_loss, "giou": pk.giou_loss, "diou": pk.diou_loss,
          "ciou": pk.ciou_loss}
REDUCTIONS = ("none", "mean", "sum")
ATOL = {"float32": 3e-6, "bfloat16": 1e-2, "float64": 1e-12}
GRAD_RTOL = {"float32": 2e-5, "bfloat16": 1e-2}


def _x64():
  """float64 inside a block, on jax 0.7 (experimental) and newer (config)."""
  if hasattr(jax, "enable_x64"):
    return jax.enable_x64(True)
  from jax.experimental import enable_x64
  return enable_x64()


def random_boxes(rng, shape, degenerate_fraction=0.0):
  xy = rng.uniform(-20.0, 80.0, shape + (2,))
  wh = rng.uniform(0.5, 40.0, shape + (2,))
  if degenerate_fraction:
    wh = np.where(rng.random(shape + (2,)) < degenerate_fraction, 0.0, wh)
  return np.concatenate([xy, xy + wh], axis=-1).astype(np.float32)


def assert_close(got, want, atol):
  """got == want within atol where the oracle is finite; got finite."""
  got = np.asarray(got).astype(np.float64)
  want = np.asarray(want, np.float64)
  assert got.shape == want.shape, (got.shape, want.shape)
  assert np.all(np.isfinite(got)), "NaN/Inf where the oracle's is defined"
  finite = np.isfinite(want)
  atol = np.broadcast_to(atol, want.shape)[finite]
  bad = np.abs(got[finite] - want[finite]) > atol
  assert not bad.any(), (
      f"{bad.sum()} of {bad.size} beyond tolerance: got {got[finite][bad]}, "
      f"want {want[finite][bad]}, atol {atol[bad]}")


def cxcywh_atol(c1, c2, pairwise=False):
  """Extra float32 tolerance per output for cxcywh inputs: the kernel rounds
  each corner ``c -/+ s/2`` to float32 (half an ulp of the largest
  coordinate), and a score moves by at most that over the smallest non-zero
  side of the two boxes, for each of the 4 corners of each box."""
  def parts(c):
    c = np.asarray(c, np.float64)
    corner = np.max(np.abs(c[..., :2]) + np.abs(c[..., 2:]) / 2, axis=-1)
    side = np.min(np.where(c[..., 2:] > 0, c[..., 2:], np.inf), axis=-1)
    return corner, side
  (m1, s1), (m2, s2) = parts(c1), parts(c2)
  if pairwise:
    m1, s1, m2, s2 = m1[..., :, None], s1[..., :, None], m2[..., None, :], \
        s2[..., None, :]
  half_ulp = 2.0 ** -24 * np.maximum(m1, m2)
  return 8 * half_ulp / np.minimum(np.minimum(s1, s2), 1.0)


def assert_grads_close(got, want, rtol):
  for g, w in zip(got, want):
    g = np.asarray(g).astype(np.float64)
    np.testing.assert_allclose(
        g, w, atol=rtol * (np.max(np.abs(w), initial=0.0) + 1e-30))


# ------------------------------------------------------------------ suite
@pytest.mark.parametrize("backend", ALL)
def test_metrics_match_oracle(backend, rng):
  """Odd sizes, identical and zero-area boxes, both box formats, broadcast
  leading dims."""
  b1 = random_boxes(rng, (3, 37), 0.1)
  b2 = random_boxes(rng, (1, 37), 0.1)
  b2[0, :5] = b1[0, :5]
  boxes = {"xyxy": (b1, b2), "cxcywh": (oracle.from_xyxy(b1, "cxcywh"),
                                        oracle.from_xyxy(b2, "cxcywh"))}

  @jax.jit
  def run(boxes):
    return {(k, f): backend.run(METRICS[k], *boxes[f], box_format=f)
            for k in KINDS for f in boxes}

  for (kind, box_format), got in run(boxes).items():
    assert got.shape == (3, 37) and got.dtype == jnp.float32
    want = oracle.score(kind, *boxes[box_format], box_format=box_format)
    atol = ATOL["float32"]
    if box_format == "cxcywh":
      atol = atol + cxcywh_atol(*boxes[box_format])
    assert_close(got, want, atol)


@pytest.mark.parametrize("backend", ALL)
def test_losses_match_oracle(backend, rng):
  pred = random_boxes(rng, (5, 67), 0.05)  # 335 boxes: ragged blocks
  target = random_boxes(rng, (5, 67))

  @jax.jit
  def run(p, t):
    return {(k, r): backend.run(LOSSES[k], p, t, reduction=r)
            for k in KINDS for r in REDUCTIONS}

  for (kind, reduction), got in run(pred, target).items():
    want = oracle.loss(kind, pred, target, reduction=reduction)
    scale = pred.size // 4 if reduction == "sum" else 1
    assert_close(got, want, ATOL["float32"] * scale)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("path", ["fused", "separate"])
def test_loss_gradients_match_oracle(backend, path, rng, monkeypatch):
  """Per-box cotangents (reduction="none") and reduced losses, whose
  gradients come with the value ("fused") or from the backward kernel with
  one shared cotangent ("separate", the path of large reduced losses)."""
  if path == "separate":
    monkeypatch.setattr(api, "FUSED_MAX_BOXES", 0)
  pred, target = random_boxes(rng, (301,)), random_boxes(rng, (301,))
  g = rng.normal(size=301).astype(np.float32)
  cotangents = {"none": g, "mean": np.float32(1.7)}
  reductions = ("none", "mean") if path == "fused" else ("mean",)

  @jax.jit
  def grads(p, t):
    out = {}
    for kind in KINDS:
      for reduction in reductions:
        def total(p, t, kind=kind, reduction=reduction):
          value = backend.run(LOSSES[kind], p, t, reduction=reduction)
          return jnp.sum(value * cotangents[reduction])
        out[kind, reduction] = jax.grad(total, argnums=(0, 1))(p, t)
    return out

  for (kind, reduction), got in grads(pred, target).items():
    want = oracle.loss_grads(kind, pred, target, cotangents[reduction],
                             reduction=reduction)
    assert_grads_close(got, want, GRAD_RTOL["float32"])


@pytest.mark.parametrize("backend", ALL)
def test_metric_gradients_match_oracle(backend, rng):
  b1, b2 = random_boxes(rng, (130,)), random_boxes(rng, (130,))
  g = rng.normal(size=130).astype(np.float32)

  @jax.jit
  def grads(x, y):
    return {k: jax.grad(lambda x, y, k=k: jnp.sum(
        backend.run(METRICS[k], x, y) * g), argnums=(0, 1))(x, y)
            for k in KINDS}

  for kind, got in grads(b1, b2).items():
    assert_grads_close(got, oracle.score_grads(kind, b1, b2, g),
                       GRAD_RTOL["float32"])


@pytest.mark.parametrize("backend", ALL)
def test_pairwise_matches_oracle(backend, rng):
  """Odd N and M, identical and zero-area boxes, cxcywh, batched and
  broadcast leading dims, and the gradient (through the reference formula)."""
  b1 = random_boxes(rng, (37,), 0.1)
  b2 = random_boxes(rng, (129,), 0.1)
  b2[:5] = b1[:5]
  s1, s2 = random_boxes(rng, (2, 1, 9)), random_boxes(rng, (3, 17))
  c1, c2 = oracle.from_xyxy(s1, "cxcywh"), oracle.from_xyxy(s2, "cxcywh")

  @jax.jit
  def run(b1, b2, s1, s2, c1, c2):
    out = {k: backend.run(PAIRWISE[k], b1, b2) for k in KINDS}
    out["box_iou"] = backend.run(pk.box_iou, s1, s2, iou_kind="giou")
    out["cxcywh"] = backend.run(pk.pairwise_diou, c1, c2,
                                box_format="cxcywh")
    out["grad"] = jax.grad(lambda x: jnp.sum(jnp.sin(backend.run(
        pk.pairwise_ciou, x, s2[0]))))(s1[0, 0])
    return out

  out = run(b1, b2, s1, s2, c1, c2)
  for kind in KINDS:
    assert out[kind].dtype == jnp.float32
    assert_close(out[kind], oracle.pairwise(kind, b1, b2), ATOL["float32"])
  assert_close(out["box_iou"], oracle.pairwise("giou", s1, s2),
               ATOL["float32"])
  assert_close(out["cxcywh"], oracle.pairwise("diou", c1, c2,
                                              box_format="cxcywh"),
               ATOL["float32"] + cxcywh_atol(c1, c2, pairwise=True))
  # d/dx sum(sin(P)) = sum over columns of cos(P) * dP/dx, by differences.
  cos = np.cos(oracle.pairwise("ciou", s1[0, 0], s2[0]))
  want = sum(oracle.score_grads("ciou", s1[0, 0], np.broadcast_to(
      s2[0, j], (9, 4)), cos[:, j])[0] for j in range(17))
  assert_grads_close([out["grad"]], [want], GRAD_RTOL["float32"])


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


@pytest.mark.parametrize("backend", ALL)
def test_degenerate_boxes(backend):
  """Values equal torchvision's where it has one, else the documented
  definitions; values and gradients finite everywhere."""
  pred, target = DEGENERATE[:, 0], DEGENERATE[:, 1]
  ones = jnp.ones(len(pred))

  @jax.jit
  def run(p, t):
    out = {}
    for kind in KINDS:
      (loss, metric), pullback = jax.vjp(lambda p, t, kind=kind: (
          backend.run(LOSSES[kind], p, t), backend.run(METRICS[kind], p, t)),
                                         p, t)
      out[kind] = (loss, metric, backend.run(PAIRWISE[kind], p, t),
                   pullback((ones, ones)))
    return out

  for kind, (loss, metric, pair, grads) in run(pred, target).items():
    assert_close(loss, oracle.loss(kind, pred, target), 1e-5)
    assert_close(metric, oracle.score(kind, pred, target), 1e-5)
    assert_close(pair, oracle.pairwise(kind, pred, target), 1e-5)
    np.testing.assert_array_equal(np.diag(pair), metric)
    assert all(np.all(np.isfinite(g)) for g in grads), kind
    # Two identical points: IoU 0 (torchvision: 0 / 0), loss 1; identical
    # proper boxes: score 1, loss 0.
    assert float(metric[0]) == 0.0 and float(loss[0]) == pytest.approx(1.0)
    assert float(metric[4]) == pytest.approx(1.0, abs=1e-6)
    assert float(loss[4]) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("count", [0, 1])
def test_sizes(backend, count, rng):
  pred, target = random_boxes(rng, (count,)), random_boxes(rng, (count,))
  out = backend.run(pk.giou_loss, pred, target)
  mean, grads = jax.value_and_grad(lambda p, t: backend.run(
      pk.giou_loss, p, t, reduction="mean"), argnums=(0, 1))(pred, target)
  assert out.shape == (count,) and grads[0].shape == (count, 4)
  assert_close(out, oracle.loss("giou", pred, target), ATOL["float32"])
  assert_close(mean, oracle.loss("giou", pred, target, reduction="mean"),
               ATOL["float32"])
  assert_grads_close(grads, oracle.loss_grads("giou", pred, target,
                                              reduction="mean"),
                     GRAD_RTOL["float32"])


@pytest.mark.parametrize("backend", ALL)
def test_bfloat16_and_integer_boxes(backend, rng):
  p16 = jnp.asarray(random_boxes(rng, (300,)), jnp.bfloat16)
  t16 = jnp.asarray(random_boxes(rng, (300,)), jnp.bfloat16)
  out = backend.run(pk.giou_loss, p16, t16)
  grads = jax.grad(lambda p, t: backend.run(
      pk.giou_loss, p, t, reduction="sum"), argnums=(0, 1))(p16, t16)
  pw = backend.run(pk.pairwise_giou, p16[:20], t16)
  assert out.dtype == grads[0].dtype == pw.dtype == jnp.bfloat16
  # The same (rounded) boxes in float64: only the output rounding differs.
  p32, t32 = np.asarray(p16, np.float32), np.asarray(t16, np.float32)
  assert_close(out, oracle.loss("giou", p32, t32), ATOL["bfloat16"])
  assert_close(pw, oracle.pairwise("giou", p32[:20], t32), ATOL["bfloat16"])
  assert_grads_close(grads, oracle.loss_grads("giou", p32, t32,
                                              reduction="sum"),
                     GRAD_RTOL["bfloat16"])
  a = np.array([[0, 0, 2, 2]], np.int32)
  b = np.array([[1, 1, 3, 3]], np.int32)
  got = backend.run(pk.giou, a, b)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, [1 / 7 - 2 / 9], atol=1e-7)


def test_nan_coordinates_propagate():
  a = jnp.array([[0.0, 0.0, jnp.nan, 2.0], [0.0, 0.0, 2.0, 2.0]])
  b = jnp.array([[1.0, 1.0, 3.0, 3.0], [1.0, 1.0, 3.0, 3.0]])
  out = pk.giou_loss(a, b)
  assert np.isnan(out[0]) and np.isfinite(out[1])


# --------------------------------------------------- reference and chooser
def test_reference_float64_matches_oracle(rng):
  pred = random_boxes(rng, (200,), 0.05).astype(np.float64)
  target = random_boxes(rng, (200,)).astype(np.float64)
  with _x64():
    for kind in KINDS:
      out = LOSSES[kind](jnp.asarray(pred), jnp.asarray(target),
                         backend="reference")
      assert out.dtype == jnp.float64
      assert_close(out, oracle.loss(kind, pred, target), ATOL["float64"])
      pw = PAIRWISE[kind](jnp.asarray(pred[:20]), jnp.asarray(target),
                          backend="reference")
      assert_close(pw, oracle.pairwise(kind, pred[:20], target),
                   ATOL["float64"])


def test_float64_runs_the_reference():
  with _x64():
    a = jnp.zeros((3, 4), jnp.float64)
    with pytest.raises(ValueError, match="float64"):
      pk.giou_loss(a, a, backend="interpret")
    assert pk.giou_loss(a, a, backend="reference").dtype == jnp.float64
    assert pk.pairwise_giou(a, a).dtype == jnp.float64  # chosen: reference


@pytest.mark.parametrize("kind", KINDS)
def test_reference_has_forward_mode_gradients(kind, rng):
  """backend='reference' (and float64, which only the reference runs) is
  plain JAX: jvp and jacfwd work and agree with reverse mode."""
  pred, target = random_boxes(rng, (9,), 0.1), random_boxes(rng, (9,))
  tangent = rng.standard_normal(pred.shape).astype(np.float32)
  for fn in (lambda p: LOSSES[kind](p, target, reduction="sum",
                                    backend="reference"),
             lambda p: PAIRWISE[kind](p[:4], target, backend="reference")):
    fn = jax.jit(fn)  # one compile, not one per primitive
    _, forward = jax.jvp(fn, (jnp.asarray(pred),), (jnp.asarray(tangent),))
    _, pullback = jax.vjp(fn, jnp.asarray(pred))
    cot = np.ones(np.shape(forward), np.float32)
    (reverse,) = pullback(jnp.asarray(cot))
    np.testing.assert_allclose(float(jnp.sum(forward)),
                               float(jnp.vdot(reverse, tangent)), rtol=1e-4,
                               atol=1e-5)
  with _x64():
    p64 = jnp.asarray(pred, jnp.float64)
    loss = lambda p: LOSSES[kind](p, target, reduction="sum")  # noqa: E731
    jac = jax.jit(jax.jacfwd(loss))(p64)
    want = jax.jit(jax.grad(loss))(p64)
    np.testing.assert_allclose(jac, want, rtol=1e-12, atol=1e-14)


def test_gpu_alias_is_the_triton_kernel(rng):
  b1, b2 = random_boxes(rng, (40,)), random_boxes(rng, (40,))
  with force_interpret("generic"):
    np.testing.assert_array_equal(pk.ciou(b1, b2, backend="gpu"),
                                  pk.ciou(b1, b2, backend="triton"))


@pytest.mark.parametrize("kind", KINDS)
def test_matches_installed_torchvision(kind, rng):
  """Against torchvision itself (where it is installed)."""
  torch = pytest.importorskip("torch")
  ops = pytest.importorskip("torchvision.ops")
  pairwise = {"iou": ops.box_iou, "giou": ops.generalized_box_iou,
              "diou": ops.distance_box_iou, "ciou": ops.complete_box_iou}
  losses = {"giou": ops.generalized_box_iou_loss,
            "diou": ops.distance_box_iou_loss, "ciou": ops.complete_box_iou_loss}
  b1 = random_boxes(rng, (23,), 0.1)
  b2 = random_boxes(rng, (131,), 0.1)
  b2[:3] = b1[:3]
  t1, t2 = torch.from_numpy(b1).double(), torch.from_numpy(b2).double()
  assert_close(PAIRWISE[kind](b1, b2), pairwise[kind](t1, t2).numpy(),
               ATOL["float32"])
  if kind in losses:
    pred = random_boxes(rng, (257,), 0.05)
    target = random_boxes(rng, (257,))
    want = losses[kind](torch.from_numpy(pred).double(),
                        torch.from_numpy(target).double(), reduction="none")
    assert_close(LOSSES[kind](pred, target), want.numpy(), ATOL["float32"])


# ---------------------------------------------------- Mosaic TPU kernels
def test_mosaic_partial_last_grid_block_and_multi_step(rng):
  # 9 rows of 128 boxes with 8-row blocks: 2 grid steps, the last partial.
  count = 9 * 128 - 5
  b1, b2 = random_boxes(rng, (count,)), random_boxes(rng, (count,))
  common = dict(kind="giou", formula="loss", eps=oracle.EPS,
                box_format="xyxy", interpret=True, block_rows=8)
  value = mosaic_tpu.elementwise(b1, b2, as_loss=True, **common)
  total = mosaic_tpu.elementwise(b1, b2, as_loss=True, reduce=True, **common)
  d1, d2 = mosaic_tpu.elementwise_vjp(b1, b2, jnp.ones((1,)),
                                      shared_cotangent=True, **common)
  expected = oracle.loss("giou", b1, b2)
  assert_close(value, expected, ATOL["float32"])
  np.testing.assert_allclose(total, expected.sum(), rtol=1e-5)
  assert_grads_close((d1, d2), oracle.loss_grads("giou", b1, b2, -1.0,
                                                 reduction="sum"),
                     GRAD_RTOL["float32"])


def test_mosaic_pairwise_partial_edge_tiles_without_races(rng):
  # 2 x 3 tiles of 128 x 128, the last row and column of tiles partial.
  b1 = random_boxes(rng, (2, 200), 0.1)
  b2 = random_boxes(rng, (2, 259), 0.1)
  out, log = _backend.find_races(
      lambda a, b: mosaic_tpu.pairwise(
          a, b, kind="giou", eps=0.0, out_dtype=jnp.float32, tile=(128, 128),
          interpret=_backend.interpret_value()),
      b1, b2)
  assert log.launches == 1 and not log.found, log
  for i in range(2):
    assert_close(out[i], oracle.pairwise("giou", b1[i], b2[i]),
                 ATOL["float32"])


def test_mosaic_backward_has_no_races(rng):
  pred, target = random_boxes(rng, (200,)), random_boxes(rng, (200,))
  _, log = _backend.find_races(jax.jit(jax.grad(lambda p, t: pk.ciou_loss(
      p, t, reduction="mean", backend="interpret"), argnums=(0, 1))),
                               pred, target)
  assert log.launches >= 2 and not log.found, log   # forward and backward


# -------------------------------------------------------- Triton kernels
def test_triton_kernels_lower_for_cuda(rng):
  """The Triton lowering runs on this CPU host: every GPU kernel lowers."""
  b = jnp.asarray(random_boxes(rng, (3000,)))
  fns = [
      (lambda x, y: pk.ciou_loss(x, y, backend="triton"), (b, b),
       "ciou_loss_gpu"),
      (jax.grad(lambda x, y: pk.giou_loss(x, y, reduction="mean",
                                          backend="triton")), (b, b),
       "giou_loss_value_and_grad_gpu"),
      (jax.grad(lambda x, y: jnp.sum(pk.diou(x, y, backend="triton"))),
       (b, b), "diou_grad_gpu"),
  ] + [(lambda x, y, k=k: pk.box_iou(x, y, iou_kind=k, backend="triton"),
        (b[:100], b), f"pairwise_{k}_gpu") for k in KINDS]
  for fn, args, kernel_name in fns:
    text = _compat.lower_for_cuda(fn, *args).as_text()
    assert "triton" in text.lower() or "__gpu" in text
    assert f'"{kernel_name}"' in text, kernel_name   # the launch's name


def _kernel_primitives(fn, *args):
  names = []
  for eqn in jax.make_jaxpr(fn)(*args).jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      names += [e.primitive.name for e in eqn.params["jaxpr"].eqns]
  return names


def test_triton_masks_every_ragged_store():
  """Triton's Pallas lowering adds no bounds check: a plain ``ref[...] = x``
  (primitive "swap") in a partial last block writes past the array. Kernels
  whose outputs have ragged blocks store through a mask; whole tiles of an
  aligned matrix use plain stores."""
  b = jnp.ones((3000, 4), jnp.float32)
  common = dict(kind="giou", formula="loss", eps=oracle.EPS,
                box_format="xyxy")
  tile_n, tile_m = triton.PAIRWISE_TILE
  for fn, masked in (
      (lambda x, y: triton.elementwise(x, y, **common), True),
      (lambda x, y: triton.elementwise_vjp(x, y, jnp.ones(3000), **common),
       True),
      (lambda x, y: triton.pairwise(x[None, :100], y[None], kind="giou",
                                    eps=0.0, out_dtype=jnp.float32), True),
      (lambda x, y: triton.pairwise(x[None, :2 * tile_n], y[None, :tile_m],
                                    kind="giou", eps=0.0,
                                    out_dtype=jnp.float32), False)):
    names = _kernel_primitives(fn, b, b)
    assert ("masked_swap" in names) == masked, names
    assert ("swap" in names) != masked, names


def test_triton_pairwise_tiles_interpreted(rng):
  """Every tile of ragged and aligned matrices; tiles taller than N."""
  b1, b2 = random_boxes(rng, (77,), 0.05), random_boxes(rng, (160,))
  for n, m, tile in ((37, 160, (8, 64)), (32, 128, (16, 64)),
                     (77, 100, (32, 64)), (5, 70, (128, 64))):
    pw = triton.pairwise(jnp.asarray(b1[None, :n]), jnp.asarray(b2[None, :m]),
                         kind="giou", eps=0.0, out_dtype=jnp.float32,
                         interpret=True, tile=tile)
    assert_close(pw[0], oracle.pairwise("giou", b1[:n], b2[:m]),
                 ATOL["float32"])


@pytest.mark.parametrize("kind", ["iou", "giou", "diou", "ciou"])
@pytest.mark.parametrize("eps", [0.0, 1e-7])
def test_lean_pairwise_formula(kind, eps, rng):
  """The pairwise kernels' lean formula equals the shared one on random,
  far-apart, nested, identical, zero-area and inverted (x2 < x1) boxes, at
  large coordinates too: IoU/GIoU bit for bit (one select per quotient),
  DIoU/CIoU (CIoU's two penalties over one division) to float32 rounding."""
  special = np.array([[0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 4, 0], [3, 3, 1, 1],
                      [0, 0, 2, 2], [0.5, 0.5, 1.5, 1.5],
                      [1e4, 1e4, 1e4 + 3, 1e4 + 1], [-50, -50, -49, -49]],
                     np.float32)
  b1 = np.concatenate([special, random_boxes(rng, (53,), 0.1)])
  b2 = np.concatenate([special[::-1], random_boxes(rng, (70,), 0.1)])
  a = tuple(jnp.asarray(b1[:, c])[:, None] for c in range(4))
  b = tuple(jnp.asarray(b2[:, c])[None, :] for c in range(4))
  for run in (lambda f: f, jax.jit):  # eager and fused: XLA may contract
    lean = run(functools.partial(_math.pairwise_score_lean, kind, eps=eps))(
        a, b)
    shared = run(functools.partial(_math.score, kind, "pairwise", eps))(a, b)
    if kind in ("iou", "giou"):
      np.testing.assert_array_equal(lean, shared)
    else:
      assert np.all(np.isfinite(lean))
      np.testing.assert_allclose(lean, shared, rtol=1e-5, atol=1e-6)
  if kind in ("diou", "ciou"):  # random boxes against the float64 oracle
    k = len(special)
    exact = oracle.pairwise(kind, b1[k:].astype(np.float64),
                            b2[k:].astype(np.float64), eps=eps)
    assert_close(lean[k:, k:], exact, ATOL["float32"])


# ------------------------------------------------------------ properties
_box = st.tuples(st.floats(-50, 50), st.floats(-50, 50),
                 st.floats(0.01, 60), st.floats(0.01, 60))


def _to_array(boxes):
  return np.array([[x, y, x + w, y + h] for x, y, w, h in boxes], np.float32)


@jax.jit
def _properties(a, b):
  # backend=None: on this CPU host, the TPU kernels in the interpreter.
  return (pk.giou(a, b), pk.giou(b, a), pk.giou(a, a), pk.giou_loss(a, b),
          pk.pairwise_giou(a[:8], b[8:]), pk.pairwise_giou(b[8:], a[:8]),
          pk.box_iou(a[:8], b[8:]))


# Fixed sizes: one compilation serves every example.
@given(st.lists(st.tuples(_box, _box), min_size=16, max_size=16))
def test_properties_symmetry_range_identity(pairs):
  a = _to_array([p[0] for p in pairs])
  b = _to_array([p[1] for p in pairs])
  ab, ba, aa, loss, pab, pba, piou = (np.asarray(x) for x in _properties(a, b))
  np.testing.assert_allclose(ab, ba, atol=1e-6)
  assert np.all(ab >= -1.0 - 1e-6) and np.all(ab <= 1.0 + 1e-6)
  np.testing.assert_allclose(aa, 1.0, atol=1e-5)
  assert np.all(loss >= -1e-6) and np.all(loss <= 2 + 1e-6)
  np.testing.assert_allclose(pab, pba.T, atol=1e-6)
  assert np.all(piou >= 0) and np.all(piou <= 1 + 1e-6)
  assert np.all(pab <= piou + 1e-6)


# ----------------------------------------------------------------- errors
@pytest.mark.parametrize("call, error, match", [
    (lambda: pk.giou(np.zeros((3, 3)), np.zeros((3, 4))), ValueError, "boxes1 must have shape"),
    (lambda: pk.giou(np.zeros((3, 4)), np.zeros(4, bool)), TypeError, "boxes2"),
    (lambda: pk.giou("boxes", np.zeros((3, 4))), TypeError, "boxes1"),
    (lambda: pk.giou(np.zeros((3, 4)), np.zeros((2, 4))), ValueError, "broadcast"),
    (lambda: pk.giou_loss(np.zeros((3, 4)), np.zeros((3, 4)), reduction="avg"), ValueError, "reduction"),
    *[(functools.partial(loss, np.zeros((3, 4)), np.zeros((3, 4)),
                         reduction=None), ValueError,
       r"reduction=None is not one of \('none', 'mean', 'sum'\)")
      for loss in LOSSES.values()],
    (lambda: pk.diou(np.zeros((3, 4)), np.zeros((3, 4)), eps=None), TypeError, "diou: eps"),
    (lambda: pk.giou_loss(np.zeros((3, 4)), np.zeros((3, 4)), eps=-1.0), ValueError, "eps"),
    (lambda: pk.giou_loss(np.zeros((3, 4)), np.zeros((3, 4)), eps=float("nan")), ValueError, "eps"),
    (lambda: pk.ciou(np.zeros((3, 4)), np.zeros((3, 4)), eps="1e-7"), TypeError, "eps"),
    (lambda: pk.diou_loss(np.zeros((3, 4)), np.zeros((3, 4)), box_format="xywh"), ValueError, "box_format"),
    (lambda: pk.giou(np.zeros((3, 4)), np.zeros((3, 4)), backend="cuda"), ValueError, "backend"),
    (lambda: pk.giou(np.zeros((3, 4)), np.zeros((3, 4)), backend="mosaic_gpu"), ValueError, "no mosaic_gpu kernel"),
    (lambda: pk.pairwise_giou(np.zeros(4), np.zeros((3, 4))), ValueError, r"\[\.\.\., N, 4\]"),
    (lambda: pk.pairwise_iou(np.zeros((2, 3, 4)), np.zeros((3, 5, 4))), ValueError, "broadcast"),
    (lambda: pk.box_iou(np.zeros((3, 4)), np.zeros((3, 4)), iou_kind="miou"), ValueError, "iou_kind"),
    (lambda: pk.giou(np.zeros((3, 4), np.complex64), np.zeros((3, 4))), TypeError, "dtype"),
])
def test_bad_arguments_raise(call, error, match):
  with pytest.raises(error, match=match):
    call()
