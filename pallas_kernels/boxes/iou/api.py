"""Public IoU-family ops (torchvision semantics): metrics ``[..., 4] x [..., 4]
-> [...]``, pairwise ``[..., N, 4] x [..., M, 4] -> [..., N, M]`` and losses.
Shared arguments: boxes real float or integer; ``box_format`` "xyxy" or
"cxcywh"; ``eps`` a float >= 0; ``reduction`` "none", "mean" (0 for no boxes)
or "sum"; ``backend`` None, "mosaic_tpu", "triton", "gpu", "interpret" or
"reference". Results in the inputs' float dtype (float32 for integers).
"""
from __future__ import annotations

import contextlib
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _backend, _sharding
from . import _math, mosaic_tpu, reference, triton

DEFAULT_EPS = reference.DEFAULT_EPS
REDUCTIONS = ("none", "mean", "sum")


# ----------------------------------------------------------------- validation
def _check_boxes(op, name, boxes, min_ndim=1):
  if isinstance(boxes, (list, tuple)):
    boxes = np.asarray(boxes)
  if not hasattr(boxes, "shape") or not hasattr(boxes, "dtype"):
    raise TypeError(f"{op}: {name} must be an array of boxes [..., 4], got "
                    f"{type(boxes).__name__}")
  dtype = jnp.dtype(boxes.dtype)
  if not (jnp.issubdtype(dtype, jnp.floating)
          or jnp.issubdtype(dtype, jnp.integer)) or dtype == jnp.bool_:
    raise TypeError(f"{op}: {name} must have a real floating or integer "
                    f"dtype, got {dtype}")
  if len(boxes.shape) < min_ndim or boxes.shape[-1] != 4:
    want = "[..., 4]" if min_ndim == 1 else "[..., N, 4]"
    raise ValueError(f"{op}: {name} must have shape {want} (4 coordinates "
                     f"last), got shape {tuple(boxes.shape)}")
  return boxes


def _check_options(op, backend, box_format, eps):
  _backend.check_backend(op, backend)
  if box_format not in _math.BOX_FORMATS:
    raise ValueError(f"{op}: box_format={box_format!r} is not one of "
                     f"{_math.BOX_FORMATS}")
  if isinstance(eps, bool) or not isinstance(eps, (int, float, np.floating)):
    raise TypeError(f"{op}: eps must be a Python float, got {eps!r}")
  if not (math.isfinite(eps) and eps >= 0):
    raise ValueError(f"{op}: eps must be finite and >= 0, got {eps}")


def _check_reduction(op, reduction):
  if not isinstance(reduction, str) or reduction not in REDUCTIONS:
    raise ValueError(f"{op}: reduction={reduction!r} is not one of "
                     f"{REDUCTIONS}")


def _kernel_dtype(dtype):
  return dtype if jnp.issubdtype(dtype, jnp.floating) else jnp.dtype(jnp.float32)


def _kernels(dtype, tpu, gpu, ref):
  """The op's Kernel rows, best first; ``ref`` is the plain-JAX formula."""
  why = None
  if dtype == jnp.float64:
    why = ("float64 boxes: the kernels compute in float32 (cast the boxes to "
           "float32, or use backend='reference')")
  return [_backend.Kernel("mosaic_tpu", tpu, supports=lambda: why),
          _backend.Kernel("triton", gpu, supports=lambda: why),
          _backend.Kernel("reference", ref)]


def _check_choice(op, backend, kernels):
  """Raises where ``backend`` names a kernel that cannot run the call."""
  if backend is not None:
    _backend.choose(op, backend, kernels)


# ----------------------------------------------------------- elementwise ops
# Small reduced losses compute both gradients in the forward pass (one
# kernel on GPUs; launches, not bytes, set the time there).
FUSED_MAX_BOXES = 1 << 20


class _Config(NamedTuple):
  op: str
  kind: str
  formula: str
  eps: float
  box_format: str
  as_loss: bool
  reduction: str
  backend: str | None
  out_dtype: object
  flavour: str | None  # the interpreter forced when the op was called

  @property
  def acc_dtype(self):
    """Accumulation dtype: float32, float64 for float64 boxes."""
    return jnp.promote_types(self.out_dtype, jnp.float32)

  @property
  def formula_args(self):
    return dict(kind=self.kind, formula=self.formula, eps=self.eps,
                box_format=self.box_format)

  def kernels(self, tpu, gpu, ref):
    return _kernels(self.out_dtype, tpu, gpu, ref)


def _score(cfg, b1, b2):
  """The reference formula's score of matching boxes (accumulation dtype)."""
  return reference.elementwise_score(cfg.kind, cfg.formula, cfg.eps,
                                     cfg.box_format, b1, b2).astype(
                                         cfg.acc_dtype)


def _forward_kernels(cfg):
  reduce = cfg.reduction != "none"
  common = dict(cfg.formula_args, as_loss=cfg.as_loss, reduce=reduce)
  if not reduce:
    common["out_dtype"] = cfg.out_dtype

  def ref(b1, b2):
    value = _score(cfg, b1, b2)
    if cfg.as_loss:
      value = 1.0 - value
    return jnp.sum(value) if reduce else value.astype(cfg.out_dtype)

  return cfg.kernels(functools.partial(mosaic_tpu.elementwise, **common),
                     functools.partial(triton.elementwise, **common), ref)


def _backward_kernels(cfg, shared):
  common = dict(cfg.formula_args, shared_cotangent=shared)

  def ref(b1, b2, cot):
    _, pullback = jax.vjp(lambda x, y: _score(cfg, x, y), b1, b2)
    cot = jnp.broadcast_to(cot, (b1.shape[0],)) if shared else cot
    return pullback(cot.astype(cfg.acc_dtype))

  return cfg.kernels(
      functools.partial(mosaic_tpu.elementwise_vjp, **common),
      functools.partial(triton.elementwise_vjp, **common), ref)


def _value_and_grad_kernels(cfg, grad_scale, value_scale):
  common = cfg.formula_args

  def tpu(b1, b2, interpret=None):
    total = value_scale * mosaic_tpu.elementwise(
        b1, b2, as_loss=cfg.as_loss, reduce=True, interpret=interpret,
        **common)
    d1, d2 = mosaic_tpu.elementwise_vjp(
        b1, b2, jnp.full((1,), grad_scale, jnp.float32),
        shared_cotangent=True, interpret=interpret, **common)
    return total, d1, d2

  def ref(b1, b2):
    def total(x, y):
      value = _score(cfg, x, y)
      return jnp.sum(1.0 - value if cfg.as_loss else value)
    value, (d1, d2) = jax.value_and_grad(total, argnums=(0, 1))(b1, b2)
    scale = grad_scale * (-1.0 if cfg.as_loss else 1.0)  # d total = -d score
    return (value * value_scale, (d1 * scale).astype(b1.dtype),
            (d2 * scale).astype(b2.dtype))

  gpu = functools.partial(triton.elementwise_value_and_grad,
                          as_loss=cfg.as_loss, grad_scale=grad_scale,
                          value_scale=value_scale, **common)
  return cfg.kernels(tpu, gpu, ref)


_BOX_NAMES = {"n": "boxes", "c": "coordinates", "b": "batch",
              "m": "boxes2"}


def _boxes_rule(op, results, sums=None, cotangent=None):
  """Matching boxes [n, 4] split by box; a sum over boxes is psum-ed."""
  operands = [("boxes1", "n c"), ("boxes2", "n c")]
  if cotangent is not None:
    operands.append(("cotangent", cotangent))
  return _sharding.make_rule(op, operands, results, split="n", sums=sums,
                             helper="jax.shard_map", names=_BOX_NAMES)


def call_rule(op, shape1, shape2, *, pairwise=False,
              names=("boxes1", "boxes2")):
  """The rule over a box op's public operands (``[..., 4]``, or ``[..., N,
  4]`` and ``[..., M, 4]`` pairwise; the kernels see them flattened): every
  dimension of the broadcast leading shape split (never a broadcast, size-1
  one), pairwise N and M too; the coordinates never."""
  keep = 2 if pairwise else 1
  lead = max(len(shape1), len(shape2)) - keep
  batch = [f"a{i}" for i in range(lead)]
  own = (" n c", " m c") if pairwise else (" c", " c")
  operands = [
      (name, " ".join(_sharding.trailing_factors(
          shape[:len(shape) - keep], " ".join(batch), f"{name}_").split()
          + tail.split()))
      for name, shape, tail in zip(names, (shape1, shape2), own)]
  result = " ".join(batch + (["n", "m"] if pairwise else []))
  return _sharding.make_rule(
      op, operands, [result], split=result, helper="jax.shard_map",
      names={**_BOX_NAMES, **{a: "batch" for a in batch}})


def _elementwise_forward(cfg, b1, b2):
  reduced = cfg.reduction != "none"
  rule = _boxes_rule(cfg.op, ["" if reduced else "n"],
                     sums=["n" if reduced else ""])
  out = _backend.dispatch(cfg.op, cfg.backend, _forward_kernels(cfg), b1, b2,
                          rule=rule)
  if cfg.reduction == "mean":
    out = out / b1.shape[0]
  return out.astype(cfg.out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _elementwise_kernel_op(cfg, b1, b2):
  return _elementwise_forward(cfg, b1, b2)


def _fused_value_and_grad(cfg, num_boxes):
  return cfg.reduction != "none" and num_boxes <= FUSED_MAX_BOXES


def _elementwise_fwd(cfg, b1, b2):
  n = b1.shape[0]
  if not _fused_value_and_grad(cfg, n):
    return _elementwise_forward(cfg, b1, b2), (b1, b2)
  # Gradients of the reduced output for a unit cotangent, in the forward
  # pass; the backward only scales them (x * 1 folds away under grad).
  mean_scale = 1.0 / n if cfg.reduction == "mean" else 1.0
  grad_scale = (-1.0 if cfg.as_loss else 1.0) * mean_scale
  total, d1, d2 = _backend.dispatch(
      cfg.op + "_value_and_grad", cfg.backend,
      _value_and_grad_kernels(cfg, grad_scale, mean_scale), b1, b2,
      rule=_boxes_rule(cfg.op, ["", "n c", "n c"], sums=["n", "", ""]))
  return total.astype(cfg.out_dtype), (d1, d2)


def _elementwise_bwd(cfg, residuals, g):
  g = g.astype(cfg.acc_dtype)
  if _fused_value_and_grad(cfg, residuals[0].shape[0]):
    d1, d2 = residuals
    return (d1 * g).astype(d1.dtype), (d2 * g).astype(d2.dtype)
  b1, b2 = residuals
  g = g * (-1.0 if cfg.as_loss else 1.0)
  shared = cfg.reduction != "none"
  if cfg.reduction == "mean":
    g = g / b1.shape[0]
  cot = g.reshape(1) if shared else g
  rule = _boxes_rule(cfg.op, ["n c", "n c"],
                     cotangent="one" if shared else "n")
  # Traced when the gradient is transposed, maybe after a force_interpret
  # block around the op has ended: the forward's interpreter still holds.
  with (_backend.force_interpret(cfg.flavour) if cfg.flavour
        else contextlib.nullcontext()):
    return _backend.dispatch(cfg.op + "_backward", cfg.backend,
                             _backward_kernels(cfg, shared), b1, b2, cot,
                             rule=rule)


_elementwise_kernel_op.defvjp(_elementwise_fwd, _elementwise_bwd)


def _elementwise(op, kind, formula, eps, box_format, as_loss, reduction,
                 backend, boxes1, boxes2):
  shape = jnp.broadcast_shapes(tuple(boxes1.shape), tuple(boxes2.shape))
  out_dtype = jnp.dtype(reference.result_dtype(boxes1, boxes2))
  cfg = _Config(op, kind, formula, float(eps), box_format, as_loss,
                reduction, backend, out_dtype,
                _backend.forced_interpret_flavour())
  if math.prod(shape) == 0:  # no boxes: nothing to compute
    _check_choice(op, backend, _forward_kernels(cfg))
    return jnp.zeros(() if reduction != "none" else shape[:-1], out_dtype)
  dtype = _kernel_dtype(out_dtype)
  b1 = jnp.broadcast_to(jnp.asarray(boxes1).astype(dtype), shape).reshape(-1, 4)
  b2 = jnp.broadcast_to(jnp.asarray(boxes2).astype(dtype), shape).reshape(-1, 4)
  if _backend.only_reference(backend, _forward_kernels(cfg)):
    out = _elementwise_forward(cfg, b1, b2)  # JAX differentiates it
  else:
    out = _elementwise_kernel_op(cfg, b1, b2)
  return out if reduction != "none" else out.reshape(shape[:-1])


def _metric(op, kind, boxes1, boxes2, eps, box_format, backend):
  boxes1 = _check_boxes(op, "boxes1", boxes1)
  boxes2 = _check_boxes(op, "boxes2", boxes2)
  _check_options(op, backend, box_format, eps=eps)
  _check_broadcast(op, boxes1, boxes2, "boxes1", "boxes2")
  return _elementwise(op, kind, "pairwise", eps, box_format, False, "none",
                      backend, boxes1, boxes2)


def _loss(op, kind, pred, target, reduction, eps, box_format, backend):
  pred = _check_boxes(op, "pred", pred)
  target = _check_boxes(op, "target", target)
  _check_options(op, backend, box_format, eps=eps)
  _check_reduction(op, reduction)
  _check_broadcast(op, pred, target, "pred", "target")
  return _elementwise(op, kind, "loss", eps, box_format, True, reduction,
                      backend, pred, target)


def _check_broadcast(op, a, b, name_a, name_b, skip_last=1):
  try:
    jnp.broadcast_shapes(tuple(a.shape[:len(a.shape) - skip_last]),
                         tuple(b.shape[:len(b.shape) - skip_last]))
  except ValueError:
    raise ValueError(f"{op}: shapes of {name_a} {tuple(a.shape)} and {name_b} "
                     f"{tuple(b.shape)} do not broadcast") from None


def iou(boxes1, boxes2, *, box_format="xyxy", backend=None):
  """IoU of matching boxes: the diagonal of torchvision's ``box_iou``.

  Args: ``boxes1``, ``boxes2`` [..., 4]; ``box_format``; ``backend``.
  Returns: [...] in [0, 1] (0 where the union is 0).
  """
  return _metric("iou", "iou", boxes1, boxes2, 0.0, box_format, backend)


def giou(boxes1, boxes2, *, box_format="xyxy", backend=None):
  """Generalized IoU of matching boxes (``generalized_box_iou``'s diagonal).

  Args: ``boxes1``, ``boxes2`` [..., 4]; ``box_format``; ``backend``.
  Returns: [...] in [-1, 1]: IoU - (hull - union) / hull.
  """
  return _metric("giou", "giou", boxes1, boxes2, 0.0, box_format, backend)


def diou(boxes1, boxes2, *, eps=DEFAULT_EPS, box_format="xyxy", backend=None):
  """Distance IoU of matching boxes (``distance_box_iou``'s diagonal).

  Args: ``boxes1``, ``boxes2`` [..., 4]; ``eps`` (added to the hull's
  squared diagonal); ``box_format``; ``backend``.
  Returns: [...]: IoU - squared centre distance / squared hull diagonal.
  """
  return _metric("diou", "diou", boxes1, boxes2, eps, box_format, backend)


def ciou(boxes1, boxes2, *, eps=DEFAULT_EPS, box_format="xyxy", backend=None):
  """Complete IoU of matching boxes (``complete_box_iou``'s diagonal).

  Args: ``boxes1``, ``boxes2`` [..., 4]; ``eps``; ``box_format``; ``backend``.
  Returns: [...]: DIoU - alpha * v, v the aspect-ratio term.
  """
  return _metric("ciou", "ciou", boxes1, boxes2, eps, box_format, backend)


def iou_loss(pred, target, *, reduction="none", eps=DEFAULT_EPS,
             box_format="xyxy", backend=None):
  """1 - inter / (union + eps) of matching boxes, reduced.

  Args: ``pred``, ``target`` [..., 4]; ``reduction``; ``eps``;
  ``box_format``; ``backend``.
  Returns: [...] for reduction="none", else a scalar.
  """
  return _loss("iou_loss", "iou", pred, target, reduction, eps, box_format,
               backend)


def giou_loss(pred, target, *, reduction="none", eps=DEFAULT_EPS,
              box_format="xyxy", backend=None):
  """torchvision's ``generalized_box_iou_loss``.

  Args: ``pred``, ``target`` [..., 4]; ``reduction``; ``eps`` (added to
  the union and the hull area); ``box_format``; ``backend``.
  Returns: 1 - GIoU, [...] for reduction="none", else a scalar.
  """
  return _loss("giou_loss", "giou", pred, target, reduction, eps, box_format,
               backend)


def diou_loss(pred, target, *, reduction="none", eps=DEFAULT_EPS,
              box_format="xyxy", backend=None):
  """torchvision's ``distance_box_iou_loss``.

  Args: ``pred``, ``target`` [..., 4]; ``reduction``; ``eps``;
  ``box_format``; ``backend``.
  Returns: 1 - DIoU, [...] for reduction="none", else a scalar.
  """
  return _loss("diou_loss", "diou", pred, target, reduction, eps, box_format,
               backend)


def ciou_loss(pred, target, *, reduction="none", eps=DEFAULT_EPS,
              box_format="xyxy", backend=None):
  """torchvision's ``complete_box_iou_loss``.

  Args: ``pred``, ``target`` [..., 4]; ``reduction``; ``eps``;
  ``box_format``; ``backend``.
  Returns: 1 - CIoU, [...] for reduction="none", else a scalar.
  """
  return _loss("ciou_loss", "ciou", pred, target, reduction, eps, box_format,
               backend)


# -------------------------------------------------------------- pairwise ops
class _PairConfig(NamedTuple):
  op: str
  kind: str
  eps: float
  backend: str | None
  out_dtype: object


def _pairwise_kernels(cfg):
  common = dict(kind=cfg.kind, eps=cfg.eps, out_dtype=cfg.out_dtype)
  return _kernels(
      cfg.out_dtype, functools.partial(mosaic_tpu.pairwise, **common),
      functools.partial(triton.pairwise, **common),
      lambda a, b: reference.pairwise_score(cfg.kind, cfg.eps, "xyxy", a,
                                            b).astype(cfg.out_dtype))


def _pairwise_forward(cfg, a, b):
  kernels = _pairwise_kernels(cfg)
  rule = _sharding.make_rule(
      cfg.op, [("boxes1", "b n c"), ("boxes2", "b m c")], ["b n m"],
      split="b n m", helper="jax.shard_map", names=_BOX_NAMES)
  return _backend.dispatch(cfg.op, cfg.backend, kernels, a, b, rule=rule)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _pairwise_kernel_op(cfg, a, b):
  return _pairwise_forward(cfg, a, b)


def _pairwise_fwd(cfg, a, b):
  return _pairwise_forward(cfg, a, b), (a, b)


def _pairwise_bwd(cfg, residuals, g):
  a, b = residuals
  _, pullback = jax.vjp(
      lambda x, y: reference.pairwise_score(cfg.kind, cfg.eps, "xyxy", x, y),
      a, b)
  return pullback(g.astype(a.dtype))


_pairwise_kernel_op.defvjp(_pairwise_fwd, _pairwise_bwd)


def _pairwise(op, kind, boxes1, boxes2, eps, box_format, backend):
  boxes1 = _check_boxes(op, "boxes1", boxes1, min_ndim=2)
  boxes2 = _check_boxes(op, "boxes2", boxes2, min_ndim=2)
  _check_options(op, backend, box_format, eps=eps)
  _check_broadcast(op, boxes1, boxes2, "boxes1", "boxes2", skip_last=2)
  out_dtype = jnp.dtype(reference.result_dtype(boxes1, boxes2))
  batch = jnp.broadcast_shapes(tuple(boxes1.shape[:-2]),
                               tuple(boxes2.shape[:-2]))
  n, m = boxes1.shape[-2], boxes2.shape[-2]
  cfg = _PairConfig(op, kind, float(eps), backend, out_dtype)
  if math.prod(batch) * n * m == 0:  # an empty matrix: nothing to compute
    _check_choice(op, backend, _pairwise_kernels(cfg))
    return jnp.zeros(batch + (n, m), out_dtype)
  dtype = jnp.promote_types(out_dtype, jnp.float32)

  def prepare(boxes, count):
    boxes = jnp.asarray(boxes).astype(dtype)
    if box_format != "xyxy":  # xyxy boxes go to the kernel as they are
      planes = _math.to_xyxy(box_format, *(boxes[..., c] for c in range(4)))
      boxes = jnp.stack(planes, axis=-1)
    return jnp.broadcast_to(boxes, batch + (count, 4)).reshape(-1, count, 4)

  a, b = prepare(boxes1, n), prepare(boxes2, m)
  if _backend.only_reference(backend, _pairwise_kernels(cfg)):
    out = _pairwise_forward(cfg, a, b)  # JAX differentiates it
  else:
    out = _pairwise_kernel_op(cfg, a, b)
  return out.reshape(batch + (n, m))


def pairwise_iou(boxes1, boxes2, *, box_format="xyxy", backend=None):
  """torchvision's ``box_iou``: IoU of every pair of boxes.

  Args: ``boxes1`` [..., N, 4], ``boxes2`` [..., M, 4]; ``box_format``;
  ``backend``.
  Returns: [..., N, M] in [0, 1].
  """
  return _pairwise("pairwise_iou", "iou", boxes1, boxes2, 0.0, box_format,
                   backend)


def pairwise_giou(boxes1, boxes2, *, box_format="xyxy", backend=None):
  """torchvision's ``generalized_box_iou`` (DETR's matching cost).

  Args: ``boxes1`` [..., N, 4], ``boxes2`` [..., M, 4]; ``box_format``;
  ``backend``.
  Returns: [..., N, M] in [-1, 1].
  """
  return _pairwise("pairwise_giou", "giou", boxes1, boxes2, 0.0, box_format,
                   backend)


def pairwise_diou(boxes1, boxes2, *, eps=DEFAULT_EPS, box_format="xyxy",
                  backend=None):
  """torchvision's ``distance_box_iou`` of every pair of boxes.

  Args: ``boxes1`` [..., N, 4], ``boxes2`` [..., M, 4]; ``eps``;
  ``box_format``; ``backend``.
  Returns: [..., N, M].
  """
  return _pairwise("pairwise_diou", "diou", boxes1, boxes2, eps, box_format,
                   backend)


def pairwise_ciou(boxes1, boxes2, *, eps=DEFAULT_EPS, box_format="xyxy",
                  backend=None):
  """torchvision's ``complete_box_iou`` of every pair of boxes.

  Args: ``boxes1`` [..., N, 4], ``boxes2`` [..., M, 4]; ``eps``;
  ``box_format``; ``backend``.
  Returns: [..., N, M].
  """
  return _pairwise("pairwise_ciou", "ciou", boxes1, boxes2, eps, box_format,
                   backend)


def box_iou(boxes1, boxes2, *, iou_kind="iou", eps=DEFAULT_EPS,
            box_format="xyxy", backend=None):
  """Pairwise IoU-family matrix; with the default ``iou_kind="iou"``
  torchvision's ``box_iou``.

  Args: ``boxes1`` [..., N, 4], ``boxes2`` [..., M, 4]; ``iou_kind`` in
  ("iou", "giou", "diou", "ciou"); ``eps`` (used by "diou" and "ciou");
  ``box_format``; ``backend``.
  Returns: [..., N, M].
  """
  if iou_kind not in _math.KINDS:
    raise ValueError(f"box_iou: iou_kind={iou_kind!r} is not one of "
                     f"{_math.KINDS}")
  if iou_kind in ("iou", "giou"):
    _check_options("box_iou", backend, box_format, eps=eps)
    eps = 0.0
  return _pairwise("box_iou", iou_kind, boxes1, boxes2, eps, box_format,
                   backend)
