"""``jax.vmap`` of every public op, on every CPU backend, equals the op
applied to each mapped slice; a mapped axis folds into the kernel's own
batch-like axis (one kernel call, no loop) where the op's sharding rule has
one (``pallas_kernels._batching``).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import backends
import pallas_kernels as pk
from pallas_kernels import _batching, _sharding, nn

# The batching rule is the chooser's, the same for every kernel: by default
# the TPU-semantics interpreter (whose kernels Pallas cannot batch) runs;
# --runslow runs every backend.
ALL = [p if p.id == "interpret" else
       pytest.param(*p.values, id=p.id, marks=[*p.marks, pytest.mark.slow])
       for p in backends.params()]
MAPPED = 2


def boxes(rng, *shape):
  xy = rng.uniform(0.0, 10.0, shape + (2,))
  wh = rng.uniform(0.5, 6.0, shape + (2,))
  return jnp.asarray(np.concatenate([xy, xy + wh], -1), jnp.float32)


def per_slice(fn, args, in_axes):
  """fn on each mapped slice, results stacked: what vmap must equal."""
  outs = [fn(*(a if ax is None else jnp.take(a, i, axis=ax)
               for a, ax in zip(args, in_axes))) for i in range(MAPPED)]
  return jax.tree.map(lambda *o: jnp.stack(o), *outs)


def check(backend, op, args, in_axes=0, rtol=1e-5, slices_by=None, **kwargs):
  """vmap of ``op`` on ``backend`` equals ``op`` per slice on ``slices_by``
  (default: the same backend)."""
  in_axes = (in_axes,) * len(args) if isinstance(in_axes, int) else in_axes
  fn = lambda *a: backend.run(op, *a, **kwargs)
  got = jax.vmap(fn, in_axes=in_axes)(*args)
  slice_fn = fn if slices_by is None else (
      lambda *a: slices_by.run(op, *a, **kwargs))
  want = per_slice(slice_fn, args, in_axes)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert (g.shape, g.dtype) == (w.shape, w.dtype)
    np.testing.assert_allclose(np.asarray(g, np.float64),
                               np.asarray(w, np.float64), rtol=rtol,
                               atol=rtol)


@pytest.mark.parametrize("backend", ALL)
def test_boxes(backend, rng):
  a, b = boxes(rng, MAPPED, 5), boxes(rng, MAPPED, 5)
  check(backend, pk.ciou, (a, b[0]), in_axes=(0, None))
  loss = functools.partial(pk.diou_loss, reduction="mean")
  grad = lambda x, y, backend=None: jax.grad(  # noqa: E731
      lambda x: loss(x, y, backend=backend))(x)
  check(backend, grad, (a, b))  # no fold: one call per slice
  check(backend, pk.box_iou, (boxes(rng, MAPPED, 2, 4),
                              boxes(rng, MAPPED, 1, 3)), iou_kind="diou")


@pytest.mark.parametrize("backend", ALL)
def test_attention(backend, rng):
  if backend.name == "mosaic_gpu":
    pytest.skip("the Mosaic GPU kernels take bf16 without bias or segments")
  q = jnp.asarray(rng.standard_normal((MAPPED, 2, 4, 5, 8)), jnp.float32)
  kv = jnp.asarray(rng.standard_normal((MAPPED, 2, 2, 7, 8)), jnp.float32)
  bias = jnp.asarray(rng.standard_normal((1, 4, 5, 7)), jnp.float32)
  seg = (jnp.asarray(rng.integers(0, 2, (MAPPED, 2, 5)), jnp.int32),
         jnp.asarray(rng.integers(0, 2, (MAPPED, 2, 7)), jnp.int32))

  def attention(q, k, v, bias, q_seg, kv_seg, backend=None):
    return pk.flash_attention(q, k, v, bias=bias, segment_ids=(q_seg, kv_seg),
                              sliding_window=3, return_lse=True,
                              backend=backend)

  def grads(q, k, bias, q_seg, kv_seg, backend=None):
    """The output and the gradients: the forward and the backward kernel."""
    return jax.value_and_grad(lambda q, k, bias: jnp.sum(attention(
        q, k, k, bias, q_seg, kv_seg, backend)[0]), argnums=(0, 1, 2))(
            q, k, bias)

  # the bias, broadcast over the batch, is the same for every mapped slice:
  # its gradient is a sum over rows of each slice
  check(backend, grads, (q, kv, bias, *seg), in_axes=(0, 0, None, 0, 0),
        rtol=1e-4)


@pytest.mark.parametrize("backend", ALL)
def test_int8(backend, rng):
  if backend.name == "mosaic_gpu":
    pytest.skip("the Mosaic GPU int8 kernel runs weight-only [N, K] only")
  x8 = jnp.asarray(rng.integers(-127, 128, (MAPPED, 4, 16)), jnp.int8)
  w8 = jnp.asarray(rng.integers(-127, 128, (MAPPED, 16, 8)), jnp.int8)
  xf = jnp.asarray(rng.standard_normal((MAPPED, 4, 16)), jnp.float32)
  check(backend, pk.int8_matmul, (x8, w8[0]), in_axes=(0, None))
  check(backend, pk.int8_matmul, (x8, w8))   # mapped weights
  # Float x: the folded call may tile (and so round) differently.
  check(backend, functools.partial(pk.int8_matmul, weight_only=True),
        (xf, w8[0]), in_axes=(0, None), rtol=1e-4)
  check(backend, pk.int8_matmul, (xf, w8[0]), in_axes=(0, None), rtol=1e-4)
  dense = lambda x, w, backend=None: nn.int8_dense(  # noqa: E731
      x, w, backend=backend)
  check(backend, dense, (xf, xf[0].T), in_axes=(0, None), rtol=1e-4)
  check(backend, pk.quantize_int8, (xf,))


@pytest.mark.parametrize("backend", ALL)
def test_quantized_matmul(backend, rng):
  if backend.name == "mosaic_gpu":
    pytest.skip("the Mosaic GPU kernel takes bf16 x with 33 <= M <= 256 "
                "only (tests/test_quant_mosaic_gpu.py)")
  xf = jnp.asarray(rng.standard_normal((MAPPED, 4, 64)), jnp.float32)
  w4 = jnp.asarray(rng.integers(-8, 8, (MAPPED, 64, 8)), jnp.int4)
  scale = jnp.asarray(rng.uniform(0.5, 2, (MAPPED, 2, 8)), jnp.float32)
  grouped = functools.partial(pk.quantized_matmul, group_size=32,
                              weight_only=True)
  check(backend, lambda x, w, s, backend=None: grouped(
      x, w, w_scale=s, backend=backend), (xf, w4[0], scale[0]),
        in_axes=(0, None, None), rtol=1e-4)
  check(backend, lambda x, w, s, backend=None: grouped(  # mapped weights
      x, w, w_scale=s, backend=backend), (xf, w4, scale), rtol=1e-4)
  check(backend, pk.quantize, (xf,), dtype=jnp.int8)  # the kernel's call


@pytest.mark.parametrize("backend", ALL)
def test_grouped_matmul(backend, rng):
  """Mapped tokens and routing (each slice its own group sizes), and mapped
  experts too."""
  lhs = jnp.asarray(rng.standard_normal((MAPPED, 40, 32)), jnp.float32)
  rhs = jnp.asarray(rng.standard_normal((MAPPED, 3, 32, 16)), jnp.float32)
  sizes = jnp.asarray([[10, 0, 25], [5, 30, 5]], jnp.int32)
  check(backend, pk.grouped_matmul, (lhs, rhs[0], sizes),
        in_axes=(0, None, 0), rtol=1e-4)
  check(backend, pk.grouped_matmul, (lhs, rhs, sizes), rtol=1e-4)
  grads = lambda x, w, g, backend=None: jax.grad(  # noqa: E731
      lambda x, w: jnp.sum(pk.grouped_matmul(x, w, g, backend=backend)),
      (0, 1))(x, w)
  check(backend, grads, (lhs, rhs[0], sizes), in_axes=(0, None, 0),
        rtol=1e-4)


@pytest.mark.parametrize("backend", ALL)
def test_nms(backend, rng):
  # Kept indices are exact, so the reference gives the per-slice answer (the
  # kernel per slice in the TPU interpreter would triple the test's time).
  ref = backends.REFERENCE
  b = boxes(rng, MAPPED, 2, 9)
  s = jnp.asarray(rng.random((MAPPED, 2, 9)), jnp.float32)
  c = jnp.asarray(rng.integers(0, 2, (MAPPED, 2, 9)), jnp.int32)
  with_classes = lambda b, s, c, backend=None: pk.batched_nms(  # noqa: E731
      b, s, class_ids=c, iou_threshold=0.3, max_output_size=5,
      backend=backend)
  check(backend, with_classes, (b, s, c), slices_by=ref)
  check(backend, pk.nms, (b[:, 0], s[:, 0]), iou_threshold=0.3,
        max_output_size=5, slices_by=ref)


@pytest.mark.parametrize("backend", backends.params(["reference"]))
def test_soft_nms(backend, rng):
  """(soft_nms has only the reference)"""
  b = boxes(rng, MAPPED, 9)
  s = jnp.asarray(rng.random((MAPPED, 9)), jnp.float32)
  check(backend, pk.soft_nms, (b, s), max_output_size=5,
        slices_by=backends.REFERENCE)


def test_mapped_axis_folds_into_one_kernel_call(rng):
  """vmap of a kernel call traces the same kernel calls as one slice does
  (on the folded batch): no loop over the mapped axis."""
  def calls(fn, *args):
    text = str(jax.make_jaxpr(fn)(*args))
    return text.count("pallas_call["), text.count("scan[")

  def same_as_one_slice(fn, *args):
    return calls(jax.vmap(fn), *args) == calls(fn, *(a[0] for a in args))

  q = jnp.ones((MAPPED, 2, 4, 5, 8))
  a = boxes(rng, MAPPED, 5)
  with pk.force_interpret("tpu"):
    assert same_as_one_slice(
        lambda q: pk.flash_attention(q, q, q, backend="interpret"), q)
    assert same_as_one_slice(
        lambda a: pk.pairwise_giou(a, a, backend="interpret"), a)
  # a reduced loss has no batch axis to fold into: one call per slice
  loss = lambda a: pk.giou_loss(a, a, reduction="sum", backend="interpret")
  with pk.force_interpret("generic"):
    (kernels, loops), one = calls(jax.vmap(loss), a), calls(loss, a[0])
  assert kernels == one[0] and loops == one[1] + 1


def test_fold_factor_reads_the_rule():
  rule = _sharding.make_rule("op", [("x", "m k"), ("w", "k n")], ["m n"],
                             split="m n")
  assert _batching.fold_factor(rule) == "m"
  summed = _sharding.make_rule("op", [("x", "n c")], [""], split="n",
                               sums=["n"])
  assert _batching.fold_factor(summed) is None


def test_vmap_of_a_jitted_call_in_the_tpu_interpreter():
  """jax < 0.12 batched a traced TPU-interpreted pallas_call into a grid
  longer than its dimension semantics (safe_zip error)."""
  q = jnp.asarray(np.random.default_rng(0).standard_normal((3, 1, 2, 128, 32)),
                  jnp.float32)
  f = jax.jit(lambda q: pk.flash_attention(q, q, q, causal=True))
  with pk.force_interpret("tpu"):
    got = jax.vmap(f)(q)
  want = jax.vmap(lambda q: pk.flash_attention(q, q, q, causal=True,
                                               backend="reference"))(q)
  np.testing.assert_allclose(got, want, atol=2e-5)


@pytest.mark.parametrize("backend", ALL)
def test_decode_attention(backend, rng):
  """Mapped batches of decode steps, each with its own cache lengths."""
  if backend.name == "mosaic_gpu":
    pytest.skip("no Mosaic GPU decode kernel")
  q = jnp.asarray(rng.standard_normal((MAPPED, 3, 4, 1, 16)), jnp.float32)
  cache = jnp.asarray(rng.standard_normal((MAPPED, 3, 2, 24, 16)),
                      jnp.float32)
  lengths = jnp.asarray([[5, 24, 1], [20, 3, 9]], jnp.int32)
  check(backend, lambda q, c, n, backend=None: pk.decode_attention(
      q, c, c, n, backend=backend), (q, cache, lengths), rtol=1e-4)


@pytest.mark.parametrize("backend", ALL)
def test_ragged_paged_attention(backend, rng):
  """Mapped serving steps: each slice its own pages, lengths and batch."""
  if backend.name in ("mosaic_gpu", "triton"):
    pytest.skip("no GPU ragged kernel")
  pages = jnp.asarray(rng.standard_normal((MAPPED, 12, 8, 4, 16)),
                      jnp.float32)
  q = jnp.asarray(rng.standard_normal((MAPPED, 6, 4, 16)), jnp.float32)
  lens = jnp.asarray([[10, 20, 0], [5, 30, 7]], jnp.int32)
  table = jnp.asarray(np.stack([rng.permutation(12).reshape(3, 4)
                                for _ in range(MAPPED)]), jnp.int32)
  cu = jnp.asarray([[0, 4, 6, 6], [0, 1, 2, 6]], jnp.int32)
  live = jnp.asarray([[2], [3]], jnp.int32)
  check(backend, pk.ragged_paged_attention, (q, pages, lens, table, cu, live),
        rtol=1e-4)
  latent_pages = pages.reshape(MAPPED, 12, 8, 64)[..., :48]  # D 48
  q_latent = jnp.asarray(rng.standard_normal((MAPPED, 6, 4, 48)),
                         jnp.float32)
  check(backend, pk.mla_ragged_paged_attention,
        (q_latent, latent_pages, lens, table, cu, live), rtol=1e-4,
        latent_dim=32)
