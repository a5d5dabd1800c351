"""Every backend is the same function: for each op and a random draw of
every option value, each CPU backend (tests/backends.py) gives the
reference's result on the same fresh inputs, within rounding.

Tolerances: float32 results 2e-5 relative to their largest entry (float32
formula chains and accumulation order), bfloat16 1e-2 (8-bit mantissa); the
int32 product, NMS indices and counts exactly; attention gradients 1e-4
(chains of float32 matmuls), 5e-2 from bfloat16 inputs. Attention's options
are also drawn against a float64 oracle in tests/test_attention.py
(``test_random_shapes_and_masks``).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import backends
import pallas_kernels as pk
from conftest import COMPAT_RUN

KERNEL_BACKENDS = [p for p in backends.params(every_flavour=True)
                   if p.id != "reference"]
REFERENCE = backends.Backend("reference", "reference", None)
# One draw per op and backend in the oldest-jax tier (conftest.COMPAT_RUN).
EXAMPLES = [1 if COMPAT_RUN else 3, pytest.param(30, marks=pytest.mark.slow)]


def _run_or_skip(backend, op, *args, **kwargs):
  """The op on ``backend``, or None where that kernel cannot run the call
  (the chooser's ValueError: a refusal is allowed, a different answer not)."""
  with backend.context():
    try:
      return op(*args, backend=backend.backend, **kwargs)
    except ValueError as error:
      if "cannot" in str(error) or "kernel exists" in str(error):
        return None
      raise


def _assert_same(got, want, dtype):
  got = np.asarray(got, np.float64)
  want = np.asarray(want, np.float64)
  assert got.shape == want.shape
  if np.issubdtype(np.asarray(want).dtype, np.integer) or dtype == "int":
    np.testing.assert_array_equal(got, want)
    return
  # Gradients chain several float32 matmuls: 1e-4; from bfloat16 inputs the
  # kernels round probabilities to bfloat16 before the dS matmuls: 5e-2 (as
  # test_attention.py's bfloat16 gradient tolerance).
  rtol = {jnp.bfloat16: 1e-2, "grad": 1e-4, "bf16 grad": 5e-2}.get(dtype,
                                                                   2e-5)
  scale = np.max(np.abs(want[np.isfinite(want)]), initial=0.0) + 1e-30
  np.testing.assert_allclose(got, want, atol=rtol * scale, rtol=0)


def _boxes(rng, shape):
  xy = rng.uniform(-10.0, 60.0, shape + (2,))
  wh = rng.uniform(0.0, 25.0, shape + (2,))
  return np.concatenate([xy, xy + wh], axis=-1).astype(np.float32)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("examples", EXAMPLES)
def test_iou_family(backend, examples):
  @settings(max_examples=examples)
  @given(kind=st.sampled_from(["iou", "giou", "diou", "ciou"]),
         form=st.sampled_from(["metric", "loss", "pairwise"]),
         reduction=st.sampled_from(["none", "mean", "sum"]),
         box_format=st.sampled_from(["xyxy", "cxcywh"]),
         eps=st.sampled_from([1e-7, 0.5]),
         dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
         n=st.integers(1, 300), seed=st.integers(0, 2**31 - 1))
  def run(kind, form, reduction, box_format, eps, dtype, n, seed):
    rng = np.random.default_rng(seed)
    a = jnp.asarray(_boxes(rng, (n,)), dtype)
    b = jnp.asarray(_boxes(rng, (n,)), dtype)
    options = {"box_format": box_format}
    if form == "loss":
      op = getattr(pk, f"{kind}_loss")
      options.update(reduction=reduction, eps=eps)
    elif form == "pairwise":
      op = getattr(pk, f"pairwise_{kind}")
      b = b[: max(1, n // 3)]
    else:
      op = getattr(pk, kind)
    if kind in ("diou", "ciou") and form != "loss":
      options["eps"] = eps
    got = _run_or_skip(backend, op, a, b, **options)
    if got is not None:
      _assert_same(got, REFERENCE.run(op, a, b, **options), dtype)
  run()


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("examples", EXAMPLES)
def test_int8_matmul(backend, examples):
  @settings(max_examples=examples)
  @given(mode=st.sampled_from(["raw", "fused", "dynamic", "weight_only"]),
         layout=st.sampled_from(["kn", "nk"]), bias=st.booleans(),
         out_dtype=st.sampled_from([None, jnp.float32]),
         m=st.integers(1, 70), k=st.integers(1, 300), n=st.integers(1, 200),
         seed=st.integers(0, 2**31 - 1))
  def run(mode, layout, bias, out_dtype, m, k, n, seed):
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.integers(-127, 128, (k, n)), jnp.int8)
    options = {"weight_layout": layout}
    if layout == "nk":
      w = w.T
    if mode == "raw":
      x = jnp.asarray(rng.integers(-127, 128, (m, k)), jnp.int8)
      options["out_dtype"] = jnp.int32
    else:
      options["w_scale"] = jnp.asarray(rng.uniform(1e-3, 2e-3, (n,)),
                                       jnp.float32)
      if bias:
        options["bias"] = jnp.asarray(rng.standard_normal(n), jnp.float32)
      if out_dtype is not None:
        options["out_dtype"] = out_dtype
      if mode == "fused":
        x = jnp.asarray(rng.integers(-127, 128, (m, k)), jnp.int8)
        options["x_scale"] = jnp.asarray(rng.uniform(1e-3, 2e-3, (m, 1)),
                                         jnp.float32)
      else:
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        options["weight_only"] = mode == "weight_only"
    got = _run_or_skip(backend, pk.int8_matmul, x, w, **options)
    if got is not None:
      want = REFERENCE.run(pk.int8_matmul, x, w, **options)
      assert got.dtype == want.dtype
      _assert_same(got, want, "int" if mode == "raw" else
                   (want.dtype if want.dtype == jnp.bfloat16 else None))
  run()


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("examples", EXAMPLES)
def test_nms(backend, examples):
  @settings(max_examples=examples)
  @given(iou_threshold=st.sampled_from([0.0, 0.1, 0.5, 0.9]),
         score_threshold=st.sampled_from([None, 0.3]),
         classes=st.sampled_from([0, 1, 4]), batch=st.integers(0, 2),
         n=st.integers(1, 400), max_output_size=st.integers(0, 500),
         seed=st.integers(0, 2**31 - 1))
  def run(iou_threshold, score_threshold, classes, batch, n, max_output_size,
          seed):
    rng = np.random.default_rng(seed)
    shape = (batch, n) if batch else (n,)
    boxes = jnp.asarray(_boxes(rng, shape))
    scores = jnp.asarray(rng.random(shape), jnp.float32)
    options = dict(iou_threshold=iou_threshold,
                   max_output_size=max_output_size,
                   score_threshold=score_threshold)
    if classes:
      options["class_ids"] = jnp.asarray(rng.integers(0, classes, shape),
                                         jnp.int32)
    op = pk.batched_nms if batch else pk.nms
    got = _run_or_skip(backend, op, boxes, scores, **options)
    if got is not None:
      want = REFERENCE.run(op, boxes, scores, **options)
      for g, w in zip(got, want):
        _assert_same(g, w, "int")
  run()


def _attention_mask(kind, lq, lk, heads, rng):
  from pallas_kernels.attention import masks
  if kind == "chunked":
    return masks.ChunkedCausal(int(rng.integers(1, 80)))
  if kind == "prefix":
    return masks.PrefixLM(int(rng.integers(0, lk + 1)))
  if kind == "dense":
    return masks.Dense(rng.random((lq, lk)) < 0.3)
  if kind == "per_head":
    return [masks.ChunkedCausal(int(rng.integers(1, 80))) | masks.Local(5, 5)
            for _ in range(heads)]
  return None


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("examples", EXAMPLES)
def test_flash_attention(backend, examples):
  """Output, lse and the gradients of q, k, v and sinks (through a random
  linear function of out and lse) agree with the reference's."""
  import jax

  @settings(max_examples=examples, deadline=None)
  @given(causal=st.booleans(),
         window=st.sampled_from([None, 17, (40, 3), (None, 0)]),
         cap=st.sampled_from([None, 5.0]),
         segments=st.booleans(), bias=st.booleans(), sinks=st.booleans(),
         mask=st.sampled_from([None, "chunked", "prefix", "dense",
                               "per_head"]),
         group=st.sampled_from([1, 2]),
         dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
         lq=st.integers(1, 200), lk=st.integers(1, 200),
         seed=st.integers(0, 2**31 - 1))
  def run(causal, window, cap, segments, bias, sinks, mask, group, dtype, lq,
          lk, seed):
    rng = np.random.default_rng(seed)
    heads, d = 2, 32
    make = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
    q, k, v = make(1, heads, lq, d), make(1, heads // group, lk, d), make(
        1, heads // group, lk, d)
    weights = jnp.asarray(rng.standard_normal((1, heads, lq, d)), jnp.float32)
    kw = dict(causal=causal, sliding_window=window, logit_soft_cap=cap,
              mask=_attention_mask(mask, lq, lk, heads, rng))
    if segments:
      ids = lambda n: jnp.asarray(np.sort(rng.integers(0, 3, (1, n))))  # noqa: E731
      kw["segment_ids"] = (ids(lq), ids(lk))
    if bias:
      kw["bias"] = jnp.asarray(rng.standard_normal((1, 1, lq, lk)),
                               jnp.float32)
    sink = (jnp.asarray(rng.standard_normal(heads), jnp.float32)
            if sinks else None)

    def call(backend_name, q, k, v, sink):
      out, lse = pk.flash_attention(q, k, v, sinks=sink, return_lse=True,
                                    backend=backend_name, **kw)
      score = jnp.sum(out.astype(jnp.float32) * weights) + jnp.sum(
          jnp.where(jnp.isfinite(lse), lse, 0.0))
      return score, (out, lse)

    def run_on(name):
      argnums = (0, 1, 2, 3) if sinks else (0, 1, 2)
      return jax.grad(lambda *a: call(name, *a), argnums, has_aux=True)(
          q, k, v, sink)

    with backend.context():
      try:
        grads, (out, lse) = run_on(backend.backend)
      except ValueError as error:
        if "cannot" in str(error):
          return
        raise
    want_grads, (want_out, want_lse) = run_on("reference")
    _assert_same(out, want_out, dtype)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(want_lse))
    finite = np.isfinite(np.asarray(want_lse))
    _assert_same(np.asarray(lse)[finite], np.asarray(want_lse)[finite],
                 jnp.float32 if dtype == jnp.float32 else dtype)
    for got, want in zip(grads, want_grads):
      _assert_same(got, want, "bf16 grad" if dtype == jnp.bfloat16
                   else "grad")

  run()


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("examples", EXAMPLES)
def test_decode_attention(backend, examples):
  @settings(max_examples=examples, deadline=None)
  @given(t=st.integers(1, 16), s=st.integers(1, 700), group=st.sampled_from(
      [1, 4]), window=st.sampled_from([None, 50]),
         cap=st.sampled_from([None, 20.0]), sinks=st.booleans(),
         paged=st.booleans(), dtype=st.sampled_from([jnp.float32,
                                                     jnp.bfloat16]),
         seed=st.integers(0, 2**31 - 1))
  def run(t, s, group, window, cap, sinks, paged, dtype, seed):
    rng = np.random.default_rng(seed)
    batch, kv_heads, d = 2, 2, 64
    make = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)  # noqa: E731
    q = make(batch, kv_heads * group, t, d)
    lengths = jnp.asarray(rng.integers(0, s + 1, batch), jnp.int32)
    kw = dict(sliding_window=window, logit_soft_cap=cap)
    if sinks:
      kw["sinks"] = jnp.asarray(rng.standard_normal(kv_heads * group),
                                jnp.float32)
    if paged:
      page = 16
      pages = -(-s // page)
      k, v = (make(batch * pages, kv_heads, page, d) for _ in range(2))
      kw["page_table"] = jnp.asarray(
          rng.permutation(batch * pages).reshape(batch, pages), jnp.int32)
    else:
      k, v = make(batch, kv_heads, s, d), make(batch, kv_heads, s, d)
    got = _run_or_skip(backend, pk.decode_attention, q, k, v, lengths, **kw)
    if got is None:
      return
    want = pk.decode_attention(q, k, v, lengths, backend="reference", **kw)
    _assert_same(got, want, dtype)

  run()


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("examples", EXAMPLES)
def test_quantized_matmul(backend, examples):
  @settings(max_examples=examples, deadline=None)
  @given(fmt=st.sampled_from(["int8", "int4", "float8_e4m3fn",
                              "float8_e5m2"]),
         group=st.sampled_from([None, 32, 64]), asymmetric=st.booleans(),
         layout=st.sampled_from(["kn", "nk"]), m=st.integers(1, 40),
         k_groups=st.integers(1, 6), n=st.integers(1, 150),
         seed=st.integers(0, 2**31 - 1))
  def run(fmt, group, asymmetric, layout, m, k_groups, n, seed):
    rng = np.random.default_rng(seed)
    k = k_groups * (group or 32)
    dtype = jnp.int4 if fmt == "int4" else jnp.dtype(fmt)
    symmetric = not (asymmetric and fmt in ("int8", "int4") and group)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
    quantized = pk.quantize(w, dtype, axis=0, group_size=group,
                            symmetric=symmetric)
    wq, scale = quantized[0], quantized[1]
    zero = quantized[2] if len(quantized) > 2 else None
    shape = (-1, n) if group else (n,)
    scale = scale.reshape(shape)
    zero = None if zero is None else zero.reshape(shape)
    if layout == "nk":
      wq = wq.T
      scale = scale.T if group else scale
      zero = None if zero is None else zero.T
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    _quantized_matmul_agrees(
        backend, x, wq, jnp.bfloat16, w_scale=scale, w_zero=zero,
        group_size=group, weight_only=True, weight_layout=layout)

  run()


def _quantized_matmul_agrees(backend, x, w, dtype, **kw):
  """``backend``'s quantized_matmul equals the reference's (skips what the
  backend declines)."""
  got = _run_or_skip(backend, pk.quantized_matmul, x, w, **kw)
  if got is not None:
    _assert_same(got, pk.quantized_matmul(x, w, backend="reference", **kw),
                 dtype)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("examples", EXAMPLES)
def test_quantized_matmul_group_products(backend, examples):
  """Quantized x times quantized w, both with group scales from
  ``quantize(..., group_size=g)``."""
  @settings(max_examples=examples, deadline=None)
  @given(fmt=st.sampled_from(["int8", "float8_e4m3fn", "float8_e5m2"]),
         group=st.sampled_from([32, 64]), layout=st.sampled_from(["kn", "nk"]),
         m=st.integers(1, 40), k_groups=st.integers(1, 6),
         n=st.integers(1, 150), seed=st.integers(0, 2**31 - 1))
  def run(fmt, group, layout, m, k_groups, n, seed):
    rng = np.random.default_rng(seed)
    k = k_groups * group
    dtype = jnp.dtype(fmt)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
    xq, x_scale = pk.quantize(x, dtype, group_size=group)
    wq, w_scale = pk.quantize(w, dtype, axis=0, group_size=group)
    if layout == "nk":
      wq, w_scale = wq.T, w_scale.T
    _quantized_matmul_agrees(
        backend, xq, wq, jnp.float32, x_scale=x_scale, w_scale=w_scale,
        group_size=group, weight_layout=layout, out_dtype=jnp.float32)

  run()
