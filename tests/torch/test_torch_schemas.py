"""The public typed ops ``torch.ops.pallas_kernels.<name>`` (``schemas.py``).

For every op: its schema has typed arguments (the Python function's
parameters, pairs split, Python-only ones left out), the op gives the
Python function's results, and ``torch.library.opcheck`` passes on small
CPU inputs (schema, autograd registration, fake tensors; AOT dispatch for
one op of each family). Per family, ``torch.compile(fullgraph=True)`` with
the aot_eager backend traces the op without graph breaks and matches eager;
one op also compiles with inductor on CPU, and with openxla on XLA tensors
(with gradients). The torch functions take every
parameter of the JAX op of the same name (``test_signature_is_the_jax_ops``).
"""
from __future__ import annotations

import inspect
import math

import numpy as np
import pytest

pytest.importorskip("torch_xla")
pytestmark = pytest.mark.torch

import torch  # noqa: E402
from torch.testing._internal import optests  # noqa: E402

import torch_bridge as tb  # noqa: E402
from torch_bridge import _core, ops, schemas  # noqa: E402

PUBLIC = [n for n in ops.__all__ if n != "UnshardedWarning"]


def _boxes(gen, *shape):
  xy = torch.rand(*shape, 2, generator=gen) * 10
  return torch.cat([xy, xy + torch.rand(*shape, 2, generator=gen) * 5 + 0.1],
                   -1)


def _two_boxes(gen, pairwise=False, grad=True):
  shapes = ((2, 5), (2, 3)) if pairwise else ((3, 7), (1, 7))
  return tuple(_boxes(gen, *s).requires_grad_(grad) for s in shapes)


def _sample(name, gen):
  """``(args, kwargs)`` of a small call of the public op ``name``: the
  reference implementation (fast to compile; these tests are about the
  schema, not the kernels) but for flash attention, which runs its kernel
  (the interpreter on CPU)."""
  args, kwargs = _sample_arguments(name, gen)
  if name != "flash_attention":
    kwargs["backend"] = "reference"
  return args, kwargs


def _sample_arguments(name, gen):
  randn = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
  int8 = lambda *s: torch.randint(-127, 128, s, generator=gen,  # noqa: E731
                                  dtype=torch.int8)
  if name in ("iou", "giou", "diou", "ciou"):
    return _two_boxes(gen), dict(box_format="cxcywh") if name == "giou" else {}
  if name.startswith("pairwise_"):
    return _two_boxes(gen, pairwise=True), {}
  if name == "box_iou":
    return _two_boxes(gen, pairwise=True), dict(iou_kind="ciou", eps=1e-6)
  if name.endswith("_loss"):
    return _two_boxes(gen), dict(reduction="mean")
  if name in ("nms", "batched_nms", "soft_nms"):
    shape = (2, 9) if name == "batched_nms" else (9,)
    args = (_boxes(gen, *shape), torch.rand(*shape, generator=gen))
    if name == "soft_nms":
      return args, dict(max_output_size=5, method="linear")
    return args, dict(iou_threshold=0.3, max_output_size=4,
                      class_ids=torch.arange(9).expand(*shape) % 2)
  if name == "flash_attention":
    q = randn(1, 2, 9, 8).requires_grad_()
    return (q, randn(1, 2, 9, 8), randn(1, 2, 9, 8)), dict(
        causal=True, sliding_window=[4, 0],
        sinks=randn(2).requires_grad_(),
        q_segment_ids=torch.tensor([[0] * 5 + [1] * 4]),
        kv_segment_ids=torch.tensor([[0] * 5 + [1] * 4]))
  if name == "decode_attention":
    return (randn(2, 4, 1, 8).requires_grad_(), randn(2, 2, 11, 8),
            randn(2, 2, 11, 8), torch.tensor([3, 11])), dict(
                sinks=randn(4).requires_grad_(), sliding_window=5)
  if name == "quantize_int8":
    return (randn(5, 7),), dict(axis=0)
  if name == "int8_matmul":
    return (randn(5, 7), int8(3, 7)), dict(
        w_scale=torch.rand(3, generator=gen), weight_layout="nk",
        out_dtype=torch.float32)
  if name == "int8_dense":
    return (randn(5, 7).requires_grad_(), randn(3, 7),
            randn(3).requires_grad_()), {}
  if name == "quantize":  # (float8 outputs: opcheck cannot compare them)
    return (randn(5, 16), torch.int8), dict(group_size=8, symmetric=False)
  if name == "quantized_matmul":
    return (randn(5, 16), int8(3, 16)), dict(
        w_scale=torch.rand(3, 2, generator=gen), group_size=8,
        weight_only=True, weight_layout="nk")
  if name == "quantized_dense":
    return (randn(5, 16).requires_grad_(), int8(16, 3),
            torch.rand(3, generator=gen)), dict(
                lora_a=randn(16, 2).requires_grad_(),
                lora_b=randn(2, 3).requires_grad_(), lora_scale=0.5)
  if name == "grouped_matmul":
    return (randn(11, 6).requires_grad_(), randn(3, 6, 5).requires_grad_(),
            torch.tensor([4, 0, 5])), dict(
                preferred_element_type=torch.float32)
  if name == "ragged_paged_attention":
    return (randn(5, 4, 8), randn(6, 4, 4, 8), torch.tensor([3, 7]),
            torch.randperm(6, generator=gen).reshape(2, 3),
            torch.tensor([0, 1, 5]), torch.tensor([2])), dict(
                sliding_window=5, soft_cap=20.0, k_scale=0.5)
  if name == "mla_ragged_paged_attention":
    return (randn(5, 4, 12), randn(6, 4, 12), torch.tensor([3, 7]),
            torch.randperm(6, generator=gen).reshape(2, 3),
            torch.tensor([0, 1, 5]), torch.tensor([2])), dict(
                latent_dim=8, sliding_window=5, v_scale=0.5)
  raise AssertionError(f"no sample for {name}")


def _python_kwargs(kwargs):
  """The Python function's keywords for the op's: pairs joined, a
  ``sliding_window`` list as a tuple."""
  kwargs = dict(kwargs)
  for python_name, (first, second) in schemas._PAIRS.items():
    if first in kwargs:
      kwargs[python_name] = (kwargs.pop(first), kwargs.pop(second))
  if isinstance(kwargs.get("sliding_window"), list):
    kwargs["sliding_window"] = tuple(kwargs["sliding_window"])
  return kwargs


def _flat(out):
  return list(out) if isinstance(out, (tuple, list)) else [out]


def _public(name):
  return getattr(torch.ops.pallas_kernels, name)


def test_every_op_is_public():
  for name in PUBLIC:
    assert "str static" not in str(_public(name).default._schema)


@pytest.mark.parametrize("name, want", [
    ("giou", "pallas_kernels::giou(Tensor boxes1, Tensor boxes2, *, "
     'str box_format="xyxy", str? backend=None) -> Tensor'),
    ("nms", "pallas_kernels::nms(Tensor boxes, Tensor scores, *, "
     "float iou_threshold, int max_output_size, float? score_threshold=None, "
     "Tensor? class_ids=None, str? backend=None) -> (Tensor, Tensor)"),
    ("quantized_dense", "pallas_kernels::quantized_dense(Tensor x, "
     "Tensor w_q, Tensor w_scale, Tensor? bias=None, *, Tensor? w_zero=None, "
     "int? group_size=None, Tensor? lora_a=None, Tensor? lora_b=None, "
     'float lora_scale=1., str weight_layout="kn", str? backend=None) '
     "-> Tensor"),
    ("grouped_matmul", "pallas_kernels::grouped_matmul(Tensor lhs, "
     "Tensor rhs, Tensor group_sizes, *, bool transpose_rhs=False, "
     "ScalarType? preferred_element_type=None, Tensor? group_offset=None, "
     "Tensor? rhs_scale=None, str? backend=None) -> Tensor"),
    ("ragged_paged_attention", "pallas_kernels::ragged_paged_attention("
     "Tensor q, Tensor kv_pages, Tensor kv_lens, Tensor page_indices, "
     "Tensor cu_q_lens, Tensor num_seqs, *, float sm_scale=1., "
     "int? sliding_window=None, float? soft_cap=None, "
     "float mask_value=-2.381976426469702e+38, float? k_scale=None, "
     "float? v_scale=None, int? num_kv_pages_per_block=None, "
     "int? num_queries_per_block=None, int? vmem_limit_bytes=None, "
     "Tensor? sinks=None, str? backend=None) -> Tensor"),
])
def test_schema_examples(name, want):
  assert str(_public(name).default._schema) == want


@pytest.mark.parametrize("name", PUBLIC)
def test_schema_is_the_function_signature(name):
  """Arguments: the Python parameters in order (pairs split, Python-only
  ones left out), keyword-only where they are, with their defaults."""
  params = inspect.signature(getattr(ops, name)).parameters.values()
  want = []
  for p in params:
    if p.name in schemas.PYTHON_ONLY:
      continue
    for arg in schemas._PAIRS.get(p.name, (p.name,)):
      want.append((arg, p.kind is p.KEYWORD_ONLY,
                   p.default is not inspect.Parameter.empty, p.default))
  got = [(a.name, a.kwarg_only, a.has_default_value(), a.default_value
          if a.has_default_value() else inspect.Parameter.empty)
         for a in _public(name).default._schema.arguments]
  assert [g[:3] for g in got] == [w[:3] for w in want]
  for (arg, *_, value), (_, *_, default) in zip(got, want):
    if default is not inspect.Parameter.empty:
      assert value == default, arg
  for a in _public(name).default._schema.arguments:
    assert str(a.type) != "str" or a.name in schemas._TYPES


@pytest.mark.parametrize("name", PUBLIC)
def test_op_is_the_function(torch_gen, name):
  """Positional and keyword calls of the op give the function's values
  (and, for inputs that require grad, its gradients)."""
  args, kwargs = _sample(name, torch_gen)
  got = _flat(_public(name)(*args, **kwargs))
  want = _flat(getattr(tb, name)(*args, **_python_kwargs(kwargs)))
  assert len(got) == len(want)
  for g, w in zip(got, want):
    assert g.dtype == w.dtype
    torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
  leaves = [t for t in list(args) + list(kwargs.values())
            if isinstance(t, torch.Tensor) and t.requires_grad]
  if leaves:
    grads = torch.autograd.grad(got[0].float().sum(), leaves)
    want_grads = torch.autograd.grad(want[0].float().sum(), leaves)
    for g, w in zip(grads, want_grads):
      torch.testing.assert_close(g, w, rtol=0, atol=0)


# One op of each family gets every opcheck utility by default; the others
# under --runslow (the AOT dispatch checks trace the op's JAX functions
# again: seconds per op on CPU).
AOT_DEFAULT = ("giou_loss", "nms", "int8_dense", "flash_attention")
FAST = ("test_schema", "test_autograd_registration", "test_faketensor")
# opcheck's defaults (test_schema, test_autograd_registration,
# test_faketensor, test_aot_dispatch_dynamic) and test_aot_dispatch_static.
ALL_UTILS = tuple(optests.generate_tests.DEFAULT_TEST_UTILS) + (
    "test_aot_dispatch_static",)


def _opcheck_params():
  for name in PUBLIC:
    if name not in AOT_DEFAULT:  # (the others' "all" includes these)
      yield pytest.param(name, "fast", id=f"{name}-fast")
    yield pytest.param(name, "all", id=f"{name}-all", marks=() if name in
                       AOT_DEFAULT else pytest.mark.slow)


@pytest.mark.parametrize("name, utils", _opcheck_params())
def test_opcheck(torch_gen, name, utils):
  """Every public op passes every opcheck utility, test_aot_dispatch_dynamic
  (symbolic sizes) included: its fake tensors specialize the sizes, which
  jax.eval_shape needs (one graph does not serve several sizes)."""
  args, kwargs = _sample(name, torch_gen)
  if utils == "fast":
    torch.library.opcheck(_public(name).default, args, kwargs,
                          test_utils=FAST)
    return
  result = torch.library.opcheck(_public(name).default, args, kwargs,
                                 test_utils=ALL_UTILS)
  assert result == dict.fromkeys(ALL_UTILS, "SUCCESS")


def test_opcheck_can_fail(torch_gen, monkeypatch):
  """Fake results that disagree with the real ones fail (the public op's
  fake tensors come from the internal op's fake implementation)."""
  args, kwargs = _sample("iou", torch_gen)
  args = [a.detach() for a in args]  # the forward op (no residuals)
  monkeypatch.setattr(_core.registered_ops()["iou"], "jax_forward",
                      lambda text: lambda *a: (a[0][..., :2],))
  with pytest.raises(Exception, match="test_faketensor"):
    torch.library.opcheck(_public("iou").default, args, kwargs,
                          test_utils=("test_faketensor",))


# torch.compile, per family: (op, whether to differentiate).
COMPILED = [("flash_attention", True), ("decode_attention", False),
            ("int8_dense", True), ("quantized_matmul", False),
            ("grouped_matmul", True), ("ragged_paged_attention", False),
            ("mla_ragged_paged_attention", False),
            ("giou_loss", True), ("pairwise_diou", False), ("nms", False),
            ("soft_nms", False)]


@pytest.mark.parametrize("name, grad", COMPILED)
def test_compile_aot_eager_fullgraph(torch_gen, name, grad):
  args, kwargs = _sample(name, torch_gen)
  leaves = [t for t in list(args) + list(kwargs.values())
            if isinstance(t, torch.Tensor) and t.requires_grad]
  op = _public(name)

  def run(*args):
    out = _flat(op(*args, **kwargs))
    return out, out[0].float().sum()

  def with_grads(fn):
    out, total = fn(*args)
    return out + (list(torch.autograd.grad(total, leaves)) if grad else [])

  torch._dynamo.reset()
  compiled = torch.compile(run, fullgraph=True, backend="aot_eager")
  got, want = with_grads(compiled), with_grads(run)
  assert len(got) == len(want)
  for g, w in zip(got, want):
    torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


# Static masks (a Python-only argument of torch_bridge.flash_attention)
# under torch.compile: name -> (mask from the masks module, the same rule
# written out here on query position p = i + kv_len - q_len and key j (one
# matrix, or one per head), q_len (kv_len is 16), backend). Mask parameters
# are used by no other test, so the compiled call is the first this process
# sees of each mask (the eager call comes after it).
COMPILED_MASKS = {
    # the kernel (Pallas' interpreter), which skips the blocks a mask empties
    "prefix_and_local": (
        lambda m: m.PrefixLM(5) & m.Local(3, None),
        lambda p, j: ((j < 5) | (j <= p)) & (j >= p - 3), 16, None),
    "chunked_short_q": (  # ends aligned: query 0 sits at position 6
        lambda m: m.ChunkedCausal(6),
        lambda p, j: (j <= p) & (p // 6 == j // 6), 10, "reference"),
    "per_head_list": (
        lambda m: [m.ChunkedCausal(8) | m.Local(2, 1),
                   m.Causal() & m.Local(2, None)],
        lambda p, j: torch.stack([
            ((j <= p) & (p // 8 == j // 8)) | ((j >= p - 2) & (j <= p + 1)),
            (j <= p) & (j >= p - 2)]), 16,
        "reference"),
}


@pytest.mark.parametrize("name", sorted(COMPILED_MASKS))
def test_compile_aot_eager_fullgraph_mask(torch_gen, name):
  """A mask= inside torch.compile(fullgraph=True): values and q/k/v
  gradients equal eager's and a float64 attention masked by the rule."""
  from pallas_kernels.attention import masks
  build, rule, q_len, backend = COMPILED_MASKS[name]
  mask, kv_len, dim = build(masks), 16, 8
  q = torch.randn(2, 2, q_len, dim, generator=torch_gen, dtype=torch.float64)
  k, v = (torch.randn(2, 2, kv_len, dim, generator=torch_gen,
                      dtype=torch.float64) for _ in range(2))
  ct = torch.randn(2, 2, q_len, dim, generator=torch_gen, dtype=torch.float64)

  def run(q, k, v):
    return tb.flash_attention(q, k, v, mask=mask, backend=backend)

  def with_grads(fn, dtype):
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    return [out] + list(torch.autograd.grad(out, leaves, ct.to(dtype)))

  def oracle(q, k, v, masked=True):
    p = torch.arange(q_len)[:, None] + (kv_len - q_len)
    allowed = rule(p, torch.arange(kv_len)[None, :]) | (not masked)
    assert allowed.any(-1).all()  # every row sees a key: no 0/0 rows
    logits = (q @ k.transpose(-1, -2) / math.sqrt(dim)).masked_fill(
        ~allowed, float("-inf"))
    return torch.softmax(logits, -1) @ v

  torch._dynamo.reset()
  # Compiled first: the mask is new to the bridge while Dynamo traces it.
  got = with_grads(torch.compile(run, fullgraph=True, backend="aot_eager"),
                   torch.float32)
  eager = with_grads(run, torch.float32)
  want = with_grads(oracle, torch.float64)
  for g, e, w in zip(got, eager, want):
    torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-4)
  # (the mask matters: unmasked attention is far from the oracle)
  assert not torch.allclose(oracle(q, k, v, masked=False), want[0].detach(),
                            atol=1e-2)


def test_compile_mask_argument_recompiles(torch_gen):
  """A mask passed to the compiled function: another mask gives its own
  values, not the first mask's graph (Dynamo guards on the mask)."""
  from pallas_kernels.attention import masks
  q, k, v = (torch.randn(1, 2, 16, 8, generator=torch_gen) for _ in range(3))

  def run(q, k, v, mask):
    return tb.flash_attention(q, k, v, mask=mask, backend="reference")

  torch._dynamo.reset()
  compiled = torch.compile(run, fullgraph=True, backend="aot_eager")
  # Masks of different types: a changed int field of the same type would
  # be made a symbolic int on recompile, which no static parameter takes.
  results = []
  for mask in (masks.PrefixLM(9), masks.Local(1, 2) | masks.ChunkedCausal(3)):
    results.append(compiled(q, k, v, mask))
    torch.testing.assert_close(results[-1], run(q, k, v, mask), rtol=1e-6,
                               atol=1e-6)
  assert not torch.allclose(*results, atol=1e-2)


def test_compile_inductor_cpu(torch_gen):
  boxes1, boxes2 = _two_boxes(torch_gen, grad=False)

  def run(a, b):
    return torch.ops.pallas_kernels.giou(a * 2, b, backend="reference") + 1

  torch._dynamo.reset()
  compiled = torch.compile(run, fullgraph=True, backend="inductor")
  torch.testing.assert_close(compiled(boxes1, boxes2), run(boxes1, boxes2))


@pytest.mark.parametrize("name", PUBLIC)
def test_signature_is_the_jax_ops(name):
  """The JAX op's parameters (names, kinds, defaults, order), then
  partition_spec and mesh (except ``quantize`` and the paged attention
  ops, which take no spec).
  ``int8_dense`` takes nn.Linear's ``weight [out, in]`` where the JAX op
  takes ``w [in, out]``."""
  import pallas_kernels
  from pallas_kernels import nn
  jax_op = getattr(pallas_kernels, name, None) or getattr(nn, name)
  ours = list(inspect.signature(getattr(tb, name)).parameters.values())
  theirs = inspect.signature(jax_op).parameters.values()
  if name not in ("quantize", "ragged_paged_attention",
                  "mla_ragged_paged_attention"):
    assert [p.name for p in ours[-2:]] == ["partition_spec", "mesh"]
    ours = ours[:-2]
  renamed = {"weight": "w"} if name == "int8_dense" else {}
  assert [(renamed.get(p.name, p.name), p.kind, p.default) for p in ours] == [
      (p.name, p.kind, p.default) for p in theirs]


# ------------------------------------------------ the added JAX arguments --

def _np(t):
  return t.detach().float().numpy()


def test_flash_attention_sinks_and_mask_are_the_jax_ops(torch_gen):
  """Forwarded as given: the same values and gradients as the JAX op (both
  on its reference implementation, fast to compile)."""
  import jax
  import jax.numpy as jnp

  import pallas_kernels
  from pallas_kernels.attention import masks
  q, k, v = (torch.randn(1, 2, 16, 8, generator=torch_gen) for _ in range(3))
  sinks = torch.randn(2, generator=torch_gen)
  mask = masks.ChunkedCausal(4) | masks.PrefixLM(3)
  q.requires_grad_()
  sinks.requires_grad_()
  out = tb.flash_attention(q, k, v, sinks=sinks, mask=mask,
                           backend="reference")
  dq, dsinks = torch.autograd.grad(out.sum(), [q, sinks])

  def jax_loss(q, sinks):
    return pallas_kernels.flash_attention(
        q, jnp.asarray(_np(k)), jnp.asarray(_np(v)), sinks=sinks,
        mask=mask, backend="reference").sum()
  want, (want_dq, want_dsinks) = jax.value_and_grad(jax_loss, (0, 1))(
      jnp.asarray(_np(q)), jnp.asarray(_np(sinks)))
  np.testing.assert_allclose(_np(out).sum(), want, rtol=1e-5)
  np.testing.assert_allclose(_np(dq), want_dq, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(_np(dsinks), want_dsinks, rtol=1e-5, atol=1e-5)
  assert dsinks.abs().sum() > 0
  # The same mask as a per-head list gives the same bits.
  again = tb.flash_attention(q.detach(), k, v, sinks=sinks.detach(),
                             mask=[mask, mask], backend="reference")
  torch.testing.assert_close(again, out, rtol=0, atol=0)


def test_flash_attention_mask_must_be_a_mask():
  q = torch.zeros(1, 1, 4, 8)
  with pytest.raises(TypeError, match="flash_attention: mask must be"):
    tb.flash_attention(q, q, q, mask=torch.ones(4, 4, dtype=torch.bool))


def test_weight_layout_and_block_sizes(torch_gen):
  from pallas_kernels.int8 import BlockSizes
  x = torch.randn(16, 128, generator=torch_gen)
  w = torch.randint(-127, 128, (128, 128), generator=torch_gen,
                    dtype=torch.int8)
  w_scale = torch.rand(128, generator=torch_gen)
  want = tb.int8_matmul(x, w, w_scale=w_scale, weight_only=True)
  nk = tb.int8_matmul(x, w.T.contiguous(), w_scale=w_scale, weight_only=True,
                      weight_layout="nk", block_sizes=BlockSizes(16, 128, 128))
  torch.testing.assert_close(nk, want)
  blocked = tb.quantized_matmul(x, w, w_scale=w_scale, weight_only=True,
                                block_sizes=(16, 128, 128))
  torch.testing.assert_close(blocked, want)
  dequantized = (x @ (w.float() * w_scale))
  torch.testing.assert_close(want.float(), dequantized, rtol=1e-4, atol=1e-3)


def test_compile_openxla(torch_gen, xla_device):
  """A public op on XLA tensors under the openxla backend, with gradients,
  against the Python function on CPU tensors."""
  pred, target = (t.detach() for t in _two_boxes(torch_gen))

  def run(pred, target):
    return torch.ops.pallas_kernels.giou_loss(pred, target, reduction="sum",
                                              backend="reference")

  torch._dynamo.reset()
  compiled = torch.compile(run, fullgraph=True, backend="openxla")
  on_xla = pred.to(xla_device).requires_grad_()
  loss = compiled(on_xla, target.to(xla_device))
  loss.backward()
  on_cpu = pred.clone().requires_grad_()
  want = tb.giou_loss(on_cpu, target, reduction="sum", backend="reference")
  want.backward()
  torch.testing.assert_close(loss.detach().cpu(), want.detach(), rtol=1e-5,
                             atol=1e-5)
  torch.testing.assert_close(on_xla.grad.cpu(), on_cpu.grad, rtol=1e-5,
                             atol=1e-5)


@pytest.mark.slow  # a process's first dynamic-shape compile: ~25 s here
def test_compile_dynamic_symbolic_statics(torch_gen):
  """torch.compile(dynamic=True) makes int and float arguments symbolic from
  the first call: a static parameter given one (group_size here) is
  specialized to its value (a constant of the JAX function: another value
  recompiles) and the result equals eager."""
  def quantize(x, group_size):
    return tb.quantize(x, torch.int8, group_size=group_size,
                       backend="reference")

  torch._dynamo.reset()
  compiled = torch.compile(quantize, fullgraph=True, backend="aot_eager",
                           dynamic=True)
  for group_size in (8, 5):
    args = (torch.randn(3, 20, generator=torch_gen), group_size)
    for g, w in zip(compiled(*args), quantize(*args)):
      torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.slow
def test_compile_dynamic_shapes_with_gradients(torch_gen):
  """torch.compile(dynamic=True) on the gradient path (which needs the save
  op's output count, whatever the symbolic sizes) with a symbolic float
  static (lora_scale): values and gradients equal eager."""
  def dense(x, w_q, w_scale, a, b, lora_scale):
    return tb.quantized_dense(x, w_q, w_scale, lora=(a, b),
                              lora_scale=lora_scale, backend="reference")

  torch._dynamo.reset()
  compiled = torch.compile(dense, fullgraph=True, backend="aot_eager",
                           dynamic=True)
  randn = lambda *s: torch.randn(*s, generator=torch_gen)  # noqa: E731
  x, a, b = randn(5, 16), randn(16, 2), randn(2, 3)
  leaves = [t.requires_grad_() for t in (x, a, b)]
  w_q = torch.randint(-127, 128, (16, 3), generator=torch_gen,
                      dtype=torch.int8)
  args = (x, w_q, torch.rand(3, generator=torch_gen), a, b, 0.5)
  got, want = compiled(*args), dense(*args)
  torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
  for g, w in zip(torch.autograd.grad(got.sum(), leaves),
                  torch.autograd.grad(want.sum(), leaves)):
    torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
