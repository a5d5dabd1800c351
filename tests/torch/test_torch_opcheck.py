"""``torch.library.opcheck`` on the internal ops ``torch_bridge.ops`` runs.

Each ``JaxOp`` registers four internal custom ops (namespace
``pallas_kernels_impl``; the public typed ops are checked in
``test_torch_schemas.py``), all with the generic schema
``(str static, Tensor[] arrays, ...) -> Tensor[]``: ``<name>`` (forward),
``<name>_save`` (forward plus the VJP's residuals: what autograd calls when
an input requires grad), ``<name>_vjp`` and ``<name>_restore`` (the two
backwards). Their arguments here are the ones the public function builds
(recorded from a real call at odd shapes, CPU tensors), so the static
strings are the real ones.

opcheck utilities (each checked for every op and stage; by default only
for one op of each kind, ``DEFAULT`` and ``AOT_DEFAULT``, the rest under
--runslow: every stage compiles the op's JAX functions, about a second each
on CPU and several for the box ops' backward):
  test_schema, test_autograd_registration, test_faketensor. The schema
      declares no aliasing or mutation, which test_schema verifies; the
      static string is an ordinary ``str`` argument, so none of the
      utilities is inapplicable to the generic schema.
  test_aot_dispatch_static, test_aot_dispatch_dynamic: the op traced by
      AOTAutograd (forward and, where inputs require grad, backward through
      the registered autograd formula) against eager. "dynamic" marks sizes
      symbolic, but the fake implementations need concrete shapes
      (``jax.eval_shape``), so they specialize them: it checks that the ops
      trace under dynamic shapes, not that one graph serves several sizes.
  The backward ops (``_vjp``, ``_restore``) have no autograd formula of
  their own (no double backward), so they are checked on inputs that do not
  require grad. Ops with no gradient (NMS family, ``quantize_int8``,
  ``int8_matmul``, ``grouped_matmul_tgmm``: ``custom_kernel.tgmm``,
  ``ragged_paged_attention``, ``mla_ragged_paged_attention``) never
  call their save/vjp/restore ops; only the forward is checked.
"""
from __future__ import annotations

import pytest

pytest.importorskip("torch_xla")
pytestmark = pytest.mark.torch

import torch  # noqa: E402

import torch_bridge as tb  # noqa: E402
from torch_bridge import _core, _eager, custom_kernel, ops  # noqa: E402

FAST = ("test_schema", "test_autograd_registration", "test_faketensor")
AOT = ("test_aot_dispatch_static", "test_aot_dispatch_dynamic")


def _boxes(gen, *shape):
  xy = torch.rand(*shape, 2, generator=gen) * 10
  return torch.cat([xy, xy + torch.rand(*shape, 2, generator=gen) * 5 + 0.1],
                   -1)


def _pair(gen):
  return _boxes(gen, 3, 7).requires_grad_(), _boxes(gen, 1, 7).requires_grad_()


def _pairwise(gen):
  return _boxes(gen, 2, 5).requires_grad_(), _boxes(gen, 2, 3).requires_grad_()


def _scored(gen, *shape):
  return _boxes(gen, *shape), torch.rand(*shape, generator=gen)


# op name -> a call of its public function (the recorded call's arguments
# are the sample).
CALLS = {
    "iou": lambda g: tb.iou(*_pair(g)),
    "giou": lambda g: tb.giou(*_pair(g), box_format="cxcywh"),
    "diou": lambda g: tb.diou(*_pair(g)),
    "ciou": lambda g: tb.ciou(*_pair(g)),
    "pairwise_iou": lambda g: tb.pairwise_iou(*_pairwise(g)),
    "pairwise_giou": lambda g: tb.pairwise_giou(*_pairwise(g)),
    "pairwise_diou": lambda g: tb.pairwise_diou(*_pairwise(g)),
    "pairwise_ciou": lambda g: tb.pairwise_ciou(*_pairwise(g)),
    "box_iou": lambda g: tb.box_iou(*_pairwise(g), iou_kind="ciou"),
    "iou_loss": lambda g: tb.iou_loss(*_pair(g), reduction="mean"),
    "giou_loss": lambda g: tb.giou_loss(*_pair(g)),
    "diou_loss": lambda g: tb.diou_loss(*_pair(g), eps=1e-6),
    "ciou_loss": lambda g: tb.ciou_loss(_boxes(g, 4, 9).requires_grad_(),
                                        _boxes(g, 4, 9).requires_grad_(),
                                        reduction="sum"),
    "nms": lambda g: tb.nms(*_scored(g, 9), iou_threshold=0.3,
                            max_output_size=4,
                            class_ids=torch.arange(9) % 2),
    "batched_nms": lambda g: tb.batched_nms(*_scored(g, 2, 9),
                                            iou_threshold=0.3,
                                            max_output_size=4),
    "soft_nms": lambda g: tb.soft_nms(*_scored(g, 9), max_output_size=5,
                                      method="linear"),
    "flash_attention": lambda g: tb.flash_attention(
        torch.randn(1, 2, 9, 8, generator=g).requires_grad_(),
        torch.randn(1, 2, 9, 8, generator=g),
        torch.randn(1, 2, 9, 8, generator=g), causal=True),
    "quantize_int8": lambda g: tb.quantize_int8(
        torch.randn(5, 7, generator=g)),
    "int8_matmul": lambda g: tb.int8_matmul(
        torch.randn(5, 7, generator=g),
        torch.randint(-127, 128, (7, 3), generator=g, dtype=torch.int8),
        w_scale=torch.rand(1, 3, generator=g)),
    "int8_dense": lambda g: tb.int8_dense(
        torch.randn(5, 7, generator=g).requires_grad_(),
        torch.randn(3, 7, generator=g), torch.randn(3, generator=g)),
    "decode_attention": lambda g: tb.decode_attention(
        torch.randn(2, 4, 1, 8, generator=g).requires_grad_(),
        torch.randn(2, 2, 11, 8, generator=g),
        torch.randn(2, 2, 11, 8, generator=g), torch.tensor([3, 11]),
        sinks=torch.randn(4, generator=g).requires_grad_()),
    "quantize": lambda g: tb.quantize(torch.randn(5, 16, generator=g),
                                      torch.float8_e4m3fn, group_size=8),
    "quantized_matmul": lambda g: tb.quantized_matmul(
        torch.randn(5, 16, generator=g).requires_grad_(),
        torch.randint(-127, 128, (3, 16), generator=g, dtype=torch.int8),
        w_scale=torch.rand(3, 2, generator=g), group_size=8,
        weight_only=True, weight_layout="nk"),
    "quantized_dense": lambda g: tb.quantized_dense(
        torch.randn(5, 16, generator=g).requires_grad_(),
        torch.randn(16, 3, generator=g).to(torch.float8_e5m2),
        torch.rand(3, generator=g),
        lora=(torch.randn(16, 2, generator=g).requires_grad_(),
              torch.randn(2, 3, generator=g).requires_grad_())),
    "grouped_matmul": lambda g: tb.grouped_matmul(
        torch.randn(11, 6, generator=g).requires_grad_(),
        torch.randn(3, 5, 6, generator=g).requires_grad_(),
        torch.tensor([4, 0, 5]), transpose_rhs=True),
    "ragged_paged_attention": lambda g: tb.ragged_paged_attention(
        *_ragged_sample(g), sliding_window=5, soft_cap=20.0),
    "mla_ragged_paged_attention": lambda g: tb.mla_ragged_paged_attention(
        torch.randn(5, 4, 12, generator=g),
        torch.randn(6, 4, 12, generator=g), *_ragged_sample(g)[2:],
        latent_dim=8, soft_cap=20.0),
    "grouped_matmul_tgmm": lambda g: custom_kernel.tgmm(
        torch.randn(6, 11, generator=g), torch.randn(11, 5, generator=g),
        torch.tensor([4, 0, 5], dtype=torch.int32)),
}
def _ragged_sample(g):
  """q [5, 4, 8], kv_pages [6, 4, 4, 8] (Hkv 2), 2 sequences (1 and 4 new
  tokens, 3 and 7 cached) on shuffled pages."""
  return (torch.randn(5, 4, 8, generator=g),
          torch.randn(6, 4, 4, 8, generator=g), torch.tensor([3, 7]),
          torch.randperm(6, generator=g).reshape(2, 3),
          torch.tensor([0, 1, 5]), torch.tensor([2]))


# Checked by default (the others under --runslow): one op of each kind.
DEFAULT = ("diou", "pairwise_iou", "ciou_loss", "soft_nms", "int8_dense",
           "quantize_int8", "decode_attention", "quantized_matmul",
           "grouped_matmul")
AOT_DEFAULT = ("diou", "soft_nms")


def test_every_registered_op_has_a_sample():
  registered = {n for n in _core.registered_ops() if not n.startswith("_")}
  assert registered == set(CALLS)


def _recorded(monkeypatch, name, gen):
  """``(which, static, arrays)`` of the custom op that the public function
  calls with the eager fast path off, as under torch.compile (``which``:
  "forward_op" or "save_op")."""
  op, seen = _core.registered_ops()[name], []
  monkeypatch.setattr(_eager, "plain_device", lambda tensors: None)
  for which in ("forward_op", "save_op"):
    def record(static, arrays, _which=which, _real=getattr(op, which)):
      seen.append((_which, static, list(arrays)))
      return _real(static, arrays)
    monkeypatch.setattr(op, which, record)
  CALLS[name](gen)
  monkeypatch.undo()
  assert len(seen) == 1, seen
  return seen[0]


def _cases(monkeypatch, name, gen, stage):
  """``(custom op, args)`` for the op's custom ops that a call reaches:
  stage "forward": ``<name>`` and ``<name>_save``; "backward": ``_vjp``
  and ``_restore``."""
  which, static, arrays = _recorded(monkeypatch, name, gen)
  lib = torch.ops.pallas_kernels_impl
  if which == "forward_op":  # no gradient asked: save/vjp/restore unused
    assert not any(a is not None and a.requires_grad for a in arrays)
    return [(getattr(lib, name).default, (static, arrays))]
  if stage == "forward":
    return [(getattr(lib, name).default, (static, arrays)),
            (getattr(lib, f"{name}_save").default, (static, arrays))]
  saved = getattr(lib, f"{name}_save")(static, arrays)
  float_outs = _core._float_outputs(_core.registered_ops()[name], static,
                                    arrays)
  cotangents = [torch.randn(o.shape, generator=gen, dtype=o.dtype)
                for o, f in zip(saved, float_outs) if f]
  plain = [a.detach() for a in arrays]
  return [(getattr(lib, f"{name}_vjp").default, (static, plain, cotangents)),
          (getattr(lib, f"{name}_restore").default,
           (static, plain, [s.detach() for s in saved], cotangents))]


def _params(default):
  """(name, stage) for every op and stage; slow unless ``name`` is in
  ``default`` (each stage compiles the op's JAX functions: about a second
  each on CPU, several for the backward of the box ops)."""
  return [pytest.param(n, stage, marks=() if n in default else
                       pytest.mark.slow)
          for n in sorted(CALLS) for stage in ("forward", "backward")
          if stage == "forward" or _core.registered_ops()[n].differentiable
          != ()]


@pytest.mark.parametrize("name, stage", _params(DEFAULT))
def test_opcheck(monkeypatch, torch_gen, name, stage):
  for custom, args in _cases(monkeypatch, name, torch_gen, stage):
    torch.library.opcheck(custom, args, test_utils=FAST)


@pytest.mark.parametrize("name, stage", _params(AOT_DEFAULT))
def test_opcheck_aot_dispatch(monkeypatch, torch_gen, name, stage):
  for custom, args in _cases(monkeypatch, name, torch_gen, stage):
    torch.library.opcheck(custom, args, test_utils=AOT)


def test_opcheck_can_fail(monkeypatch, torch_gen):
  """A fake implementation that disagrees with the real op fails
  test_faketensor (so the checks above are not vacuous)."""
  static, arrays = _recorded(monkeypatch, "iou", torch_gen)[1:]
  op = _core.registered_ops()["iou"]
  monkeypatch.setattr(op, "jax_forward",
                      lambda text: lambda *a: (a[0][..., :2],))
  with pytest.raises(Exception, match="test_faketensor"):
    torch.library.opcheck(torch.ops.pallas_kernels_impl.iou.default,
                          (static, arrays), test_utils=("test_faketensor",))
