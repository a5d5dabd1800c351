"""Writes the guide's backend-support tables from the kernels' own rules.

    python docs/support_table.py          # rewrite docs/backends.md's tables
    python docs/support_table.py --check  # exit 1 if the page is stale

Each cell asks the op itself: the call is traced (``jax.eval_shape``, no
compilation) with ``backend=`` naming one kernel, for a Hopper GPU target
and the default TPU generation, so the answer is the kernel row's
``supports`` and ``hardware`` rules. A refusal shows the kernel's reason.
"""
from __future__ import annotations

import contextlib
import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from pallas_kernels import _backend  # noqa: E402

PAGE = pathlib.Path(__file__).with_name("backends.md")
BEGIN, END = "<!-- support-table:begin -->", "<!-- support-table:end -->"
COLUMNS = ("mosaic_tpu", "triton", "mosaic_gpu", "reference")


def _x64(enabled):
  """float64 inside the block (jax < 0.8: jax.experimental.enable_x64)."""
  if not enabled:
    return contextlib.nullcontext()
  if hasattr(jax, "enable_x64"):
    return jax.enable_x64(True)
  from jax.experimental import enable_x64
  return enable_x64()


def _spec(shape, dtype=jnp.bfloat16):
  return jax.ShapeDtypeStruct(shape, dtype)


def _masks():
  from pallas_kernels.attention import masks
  return masks


def _attention_cases():
  def call(d=128, dtype=jnp.bfloat16, kv_heads=4, grad=False, dv=None,
           **kw):
    q = _spec((2, 4, 256, d), dtype)
    kv = _spec((2, kv_heads, 256, d), dtype)
    v = kv if dv is None else _spec((2, kv_heads, 256, dv), dtype)

    def run(backend):
      def f(q, k, v, *extra):
        options = dict(kw)
        if "segment_ids" in options:
          options["segment_ids"] = (extra[0], extra[0])
        if "bias" in options:
          options["bias"] = extra[-1]
        if "sinks" in options:
          options["sinks"] = extra[-1]
        return pk.flash_attention(q, k, v, backend=backend, **options)
      extra = []
      if "segment_ids" in kw:
        extra.append(_spec((2, 256), jnp.int32))
      if "bias" in kw:
        extra.append(_spec((2, 4, 256, 256), jnp.float32))
      if "sinks" in kw:
        extra.append(_spec((4,), jnp.float32))
      if grad:
        loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32))  # noqa: E731
        return jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), q, kv, v,
                              *extra)
      return jax.eval_shape(f, q, kv, v, *extra)
    return run

  return [
      ("bf16, head_dim 128", call()),
      ("head_dim 64", call(d=64)),
      ("head_dim 96", call(d=96)),
      ("head_dim 256", call(d=256)),
      ("float32", call(dtype=jnp.float32)),
      ("causal", call(causal=True)),
      ("sliding_window", call(sliding_window=(64, 0))),
      ("segment_ids", call(segment_ids=True)),
      ("bias", call(bias=True)),
      ("logit_soft_cap", call(logit_soft_cap=30.0)),
      ("mask=ChunkedCausal(64)", call(mask=_masks().ChunkedCausal(64))),
      ("sinks", call(sinks=True)),
      ("GQA (4 q heads, 2 kv heads)", call(kv_heads=2)),
      ("MLA (q/k head_dim 192, v 128)", call(d=192, dv=128)),
      ("backward, head_dim 128", call(grad=True)),
      ("backward, head_dim 256", call(d=256, grad=True)),
      ("backward, causal", call(causal=True, grad=True)),
      ("backward, MLA (192, v 128)", call(d=192, dv=128, grad=True)),
  ]


def _decode_cases():
  def call(d=128, dtype=jnp.bfloat16, t=1, page_size=None, cache_dtype=None,
           **kw):
    q = _spec((2, 8, t, d), dtype)
    lengths = _spec((2,), jnp.int32)
    cache_dtype = cache_dtype or dtype
    if page_size is None:
      cache = _spec((2, 2, 1024, d), cache_dtype)
      extra = []
    else:
      cache = _spec((64, 2, page_size, d), cache_dtype)
      extra = [_spec((2, 1024 // page_size), jnp.int32)]
    if "sinks" in kw:
      extra.append(_spec((8,), jnp.float32))
    if cache_dtype != dtype:   # 8-bit: per-head scales
      kw.update(k_scale=jnp.ones((2,)), v_scale=jnp.ones((2,)))

    def run(backend):
      def f(q, k, v, n, *rest):
        options = dict(kw)
        rest = list(rest)
        if page_size is not None:
          options["page_table"] = rest.pop(0)
        if "sinks" in options:
          options["sinks"] = rest.pop(0)
        return pk.decode_attention(q, k, v, n, backend=backend, **options)
      return jax.eval_shape(f, q, cache, cache, lengths, *extra)
    return run

  return [
      ("bf16, head_dim 128, GQA 8/2", call()),
      ("head_dim 64", call(d=64)),
      ("head_dim 96", call(d=96)),
      ("head_dim 256", call(d=256)),
      ("float32", call(dtype=jnp.float32)),
      ("float16", call(dtype=jnp.float16)),
      ("16 new tokens", call(t=16)),
      ("sliding_window", call(sliding_window=256)),
      ("logit_soft_cap", call(logit_soft_cap=30.0)),
      ("sinks", call(sinks=True)),
      ("paged, page_size 16", call(page_size=16)),
      ("paged, page_size 128", call(page_size=128)),
      ("paged, page_size 24", call(page_size=24)),
      ("int8 cache (k_scale/v_scale)", call(cache_dtype=jnp.int8)),
      ("float8_e4m3fn cache, paged",
       call(cache_dtype=jnp.float8_e4m3fn, page_size=64)),
      ("float8_e5m2 cache", call(cache_dtype=jnp.float8_e5m2)),
      ("int8 cache, float16 q", call(dtype=jnp.float16,
                                     cache_dtype=jnp.int8)),
  ]


def _int8_cases():
  def call(m=256, k=512, n=384, weight_only=False, layout="kn",
           scales=True):
    x = _spec((m, k), jnp.bfloat16 if weight_only else jnp.int8)
    w = _spec((k, n) if layout == "kn" else (n, k), jnp.int8)
    operands = [x, w]
    if scales:
      operands.append(_spec((n,), jnp.float32))
      if not weight_only:
        operands.append(_spec((m, 1), jnp.float32))

    def run(backend):
      def f(x, w, *scale):
        return pk.int8_matmul(x, w, w_scale=scale[0] if scale else None,
                              x_scale=scale[1] if len(scale) > 1 else None,
                              weight_only=weight_only, weight_layout=layout,
                              backend=backend)
      return jax.eval_shape(f, *operands)
    return run

  return [
      ("int8 x int8, fused dequant", call()),
      ("int8 x int8, int32 out (no scales)", call(scales=False)),
      ("weight-only, M = 16, w [N, K]", call(m=16, weight_only=True,
                                             layout="nk")),
      ("weight-only, M = 128, w [N, K]", call(m=128, weight_only=True,
                                              layout="nk")),
      ("weight-only, M = 128, w [K, N]", call(m=128, weight_only=True)),
      ("weight-only, M = 512", call(m=512, weight_only=True, layout="nk")),
  ]


def _quantized_cases():
  def call(w_dtype=jnp.int4, x_dtype=jnp.bfloat16, m=16, k=512, n=384,
           group_size=None, layout="kn", zero=False):
    weight_only = x_dtype in (jnp.bfloat16, jnp.float32)
    w = _spec((k, n) if layout == "kn" else (n, k), w_dtype)
    if group_size:
      table = (k // group_size, n) if layout == "kn" else (n, k // group_size)
    else:
      table = (n,)
    operands = [_spec((m, k), x_dtype), w, _spec(table, jnp.float32)]
    if zero:
      operands.append(_spec(table, w_dtype))

    def run(backend):
      def f(x, w, scale, *zero_):
        return pk.quantized_matmul(
            x, w, w_scale=scale, w_zero=zero_[0] if zero_ else None,
            group_size=group_size, weight_only=weight_only,
            weight_layout=layout, backend=backend)
      return jax.eval_shape(f, *operands)
    return run

  return [
      ("int4 weight-only, per channel", call()),
      ("int4 weight-only, group 128 + zero, w [K, N]",
       call(group_size=128, zero=True)),
      ("int4 weight-only, group 128, w [N, K]",
       call(group_size=128, layout="nk")),
      ("int4 weight-only, w [N, K], odd K", call(k=511, layout="nk")),
      ("fp8 e4m3 weight-only, per channel", call(w_dtype=jnp.float8_e4m3fn)),
      ("fp8 e5m2 weight-only, group 64", call(w_dtype=jnp.float8_e5m2,
                                              group_size=64)),
      ("fp8 x fp8 (e4m3)", call(w_dtype=jnp.float8_e4m3fn,
                                x_dtype=jnp.float8_e4m3fn, m=256)),
      ("int8 weight-only, group 128", call(w_dtype=jnp.int8,
                                           group_size=128)),
      ("int8 x int8, group 128 (group products)",
       call(w_dtype=jnp.int8, x_dtype=jnp.int8, group_size=128)),
      ("fp8 x fp8 (e4m3), group 64, w [N, K]",
       call(w_dtype=jnp.float8_e4m3fn, x_dtype=jnp.float8_e4m3fn, m=256,
            group_size=64, layout="nk")),
  ]


def _box_cases():
  def loss(dtype=jnp.float32, reduction="mean"):
    def run(backend):
      with _x64(dtype == jnp.float64):
        b = _spec((1000, 4), dtype)
        return jax.eval_shape(
            lambda p, t: pk.giou_loss(p, t, reduction=reduction,
                                      backend=backend), b, b)
    return run

  def pairwise(backend):
    return jax.eval_shape(lambda a, b: pk.pairwise_giou(a, b, backend=backend),
                          _spec((300, 4), jnp.float32),
                          _spec((200, 4), jnp.float32))

  def nms(n, batched=False):
    def run(backend):
      shape = (3, n) if batched else (n,)
      op = pk.batched_nms if batched else pk.nms
      return jax.eval_shape(
          lambda b, s: op(b, s, iou_threshold=0.5, max_output_size=100,
                          backend=backend),
          _spec(shape + (4,), jnp.float32), _spec(shape, jnp.float32))
    return run

  def soft_nms(backend):
    return jax.eval_shape(
        lambda b, s: pk.soft_nms(b, s, max_output_size=50, backend=backend),
        _spec((500, 4), jnp.float32), _spec((500,), jnp.float32))

  return [
      ("IoU-family losses, float32 (iou/giou/diou/ciou)", loss()),
      ("losses, bfloat16", loss(dtype=jnp.bfloat16)),
      ("losses, float64", loss(dtype=jnp.float64)),
      ("pairwise (iou/giou/diou/ciou)", pairwise),
      ("nms, N = 5000", nms(5000)),
      ("batched_nms, 3 x 5000", nms(5000, batched=True)),
      ("soft_nms", soft_nms),
  ]


def _gmm_cases():
  def call(fmt=None, group=None, transpose=False, offset=None, grad=False):
    m, k, n, g = 1000, 512, 384, 8
    rhs = _spec((g, n, k) if transpose else (g, k, n), fmt or jnp.bfloat16)
    operands = [_spec((m, k)), rhs, _spec((g,), jnp.int32)]
    if fmt is not None:
      s = k // group if group else 1
      operands.append(_spec((g, n, s) if transpose else (g, s, n),
                            jnp.float32))

    def run(backend):
      def f(lhs, rhs, sizes, *scale):
        out = pk.grouped_matmul(lhs, rhs, sizes, transpose_rhs=transpose,
                                group_offset=offset,
                                rhs_scale=scale[0] if scale else None,
                                backend=backend)
        return out.astype(jnp.float32).sum()
      if grad:
        return jax.eval_shape(jax.grad(f, (0, 1)), *operands)
      return jax.eval_shape(f, *operands)
    return run

  return [
      ("bf16 experts", call()),
      ("bf16 experts, rhs [G, N, K]", call(transpose=True)),
      ("forward and backward (tgmm)", call(grad=True)),
      ("expert-parallel shard (group_offset)", call(offset=0)),
      ("int8 experts, per channel", call(jnp.int8)),
      ("int4 experts, group 128", call(jnp.int4, 128)),
      ("fp8 e4m3 experts, per channel, rhs [G, N, K]",
       call(jnp.float8_e4m3fn, transpose=True)),
  ]


def _ragged_cases():
  def call(dtype=jnp.bfloat16, d=128, kv_heads=2):
    q = _spec((64, 8, d), dtype)
    pages = _spec((32, 16, 2 * kv_heads, d), dtype)
    ints = [_spec((4,), jnp.int32), _spec((4, 8), jnp.int32),
            _spec((5,), jnp.int32), _spec((1,), jnp.int32)]

    def run(backend):
      return jax.eval_shape(
          lambda *a: pk.ragged_paged_attention(*a, backend=backend), q,
          pages, *ints)
    return run

  return [
      ("bf16 cache, head_dim 128, GQA 4", call()),
      ("float32 cache, head_dim 64", call(jnp.float32, 64)),
  ]


def _mla_cases():
  def call(dtype=jnp.bfloat16, d=576, latent=512):
    q = _spec((64, 16, d))
    pages = _spec((32, 16, d), dtype)
    ints = [_spec((4,), jnp.int32), _spec((4, 8), jnp.int32),
            _spec((5,), jnp.int32), _spec((1,), jnp.int32)]

    def run(backend):
      return jax.eval_shape(
          lambda *a: pk.mla_ragged_paged_attention(
              *a, latent_dim=latent, backend=backend), q, pages, *ints)
    return run

  return [
      ("bf16 cache, D 576 (latent 512 + rope 64), 16 heads", call()),
      ("fp8 e4m3 cache, D 576", call(jnp.float8_e4m3fn)),
  ]


FAMILIES = (("flash_attention", _attention_cases),
            ("decode_attention", _decode_cases),
            ("int8_matmul", _int8_cases),
            ("quantized_matmul", _quantized_cases),
            ("grouped_matmul", _gmm_cases),
            ("ragged_paged_attention", _ragged_cases),
            ("mla_ragged_paged_attention", _mla_cases),
            ("IoU family and NMS", _box_cases))


def _cell(run, backend):
  try:
    run(backend)
  except ValueError as error:
    message = " ".join(str(error).split())
    if "kernel exists for this op" in message:
      return "–"
    if "cannot run this call: " in message:
      message = message.split("cannot run this call: ", 1)[1]
    elif "has no GPU kernel for this call (" in message:
      message = message.split("for this call (", 1)[1][:-1]
    return "no: " + message.replace("|", "/")
  return "yes"


def tables() -> str:
  out = []
  with _backend.target_override(gpu_capability="9.0"):
    for title, cases in FAMILIES:
      out.append(f"### {title}\n")
      out.append("| call | " + " | ".join(f"`{c}`" for c in COLUMNS) + " |")
      out.append("| --- |" + " --- |" * len(COLUMNS))
      for name, run in cases():
        cells = [_cell(run, c) for c in COLUMNS]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
      out.append("")
  return "\n".join(out).rstrip() + "\n"


def render(page: str) -> str:
  start, end = page.index(BEGIN) + len(BEGIN), page.index(END)
  return page[:start] + "\n" + tables() + page[end:]


def main(argv) -> int:
  page = PAGE.read_text()
  new = render(page)
  if "--check" in argv:
    if new != page:
      print(f"{PAGE} is stale: run python docs/support_table.py")
      return 1
    return 0
  PAGE.write_text(new)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
