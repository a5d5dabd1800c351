"""Ring attention (``shard_flash_attention(..., sequence_axis=...)``) on 4 and
8 CPU devices against the float64 oracle (``tests/oracles/attention.py``) and
the unsharded ``flash_attention``: forward, lse and the gradients of q, k, v,
bias and sinks (with cotangents for both out and lse), causal and not, GQA,
segment ids, soft cap, bias (full and broadcast), sinks, q_len != kv_len
(both ways), v's head dim != q's (MLA), sliding windows and static masks (each kind, combined, per
head, with segment ids; the oracle's mask is built here with NumPy from the
definitions, not from ``masks``), both sequence layouts, with the sequence
axis alone and beside batch/head axes.

Tolerances, max abs error against float64 on N(0, 1) inputs (lse and
gradients scaled by max(1, max |expected|)), as in tests/test_attention.py:
  float32:  out 2e-5, lse 2e-5, gradients 1e-4;
  bfloat16: out 2e-2, lse 1e-3, gradients 5e-2 (the per-step partial
  results are rounded to bfloat16 before the float32 merge, as every
  kernel's output is).
Against the unsharded kernel the same tolerances hold.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, PartitionSpec as P

import pallas_kernels as pk
from oracles import attention as oracle
from pallas_kernels import _compat
from pallas_kernels.attention import masks, ring

pytestmark = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs 8 devices (tests/conftest.py sets "
    "--xla_force_host_platform_device_count=8 before jax starts)")

TOLERANCES = {"float32": (2e-5, 2e-5, 1e-4), "bfloat16": (2e-2, 1e-3, 5e-2)}


def _mesh(shape, names=("data", "seq")):
  devices = np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape)
  return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(shape))


@dataclasses.dataclass(frozen=True)
class Case:
  mesh: tuple            # mesh shape over ("data", "seq") or MESH_NAMES
  causal: bool
  length: int
  heads: int = 4
  kv_heads: int = 2
  segments: bool = False
  soft_cap: float | None = None
  batch_axis: str | None = None
  head_axis: str | None = None
  names: tuple = ("data", "seq")
  layout: str = "contiguous"
  dtype: str = "float32"
  window: int | tuple | None = None
  mask: str | None = None   # a key of MASKS
  kv_length: int | None = None   # None: length
  bias: tuple | None = None   # (batch or 1, heads or 1) of a bias
  sinks: bool = False
  v_dim: int = 16   # v's head dim (MLA when not q's 16)

  @property
  def kv_len(self):
    return self.length if self.kv_length is None else self.kv_length


def _chunked(size):
  return lambda p, j: (j <= p) & (p // size == j // size)


# name: (the mask given the Dense array, the same rule on positions p, j
# written out with NumPy, or None for the Dense array itself).
MASKS = {
    "chunked": (lambda d: masks.ChunkedCausal(12), _chunked(12)),
    "prefix": (lambda d: masks.PrefixLM(9), lambda p, j: (j < 9) | (j <= p)),
    "dense": (masks.Dense, None),
    "combined": (lambda d: masks.Local(9) & masks.PrefixLM(4)
                 | masks.ChunkedCausal(5) & masks.Dense(d), None),
    "per_head": (lambda d: [masks.ChunkedCausal(8), masks.Local(5, 2),
                            masks.Dense(d), masks.Causal() & masks.Local(3)],
                 None),
}


def _mask_of(case, dense):
  """(mask argument, oracle's bool [heads or 1, Lq, Lk] or None); query i
  sits at position p = i + Lk - Lq (ends aligned)."""
  if case.mask is None:
    return None, None
  make, rule = MASKS[case.mask]
  p = np.arange(case.length)[:, None] + case.kv_len - case.length
  j = np.arange(case.kv_len)[None, :]
  if case.mask == "per_head":
    allowed = np.stack([_chunked(8)(p, j), (j >= p - 5) & (j <= p + 2), dense,
                        (j <= p) & (j >= p - 3)])
  elif case.mask == "combined":
    allowed = ((j >= p - 9) & (j <= p) & ((j < 4) | (j <= p))
               | _chunked(5)(p, j) & dense)[None]
  elif rule is None:
    allowed = dense[None]
  else:
    allowed = rule(p, j)[None]
  return make(dense), allowed


CASES = {
    # 4 devices on the sequence; 2N = 8 chunks of 5.
    "causal_gqa_segments_4": Case((1, 4), True, 40, segments=True),
    # 8 devices on the sequence, non-causal, soft cap.
    "full_softcap_8": Case((1, 8), False, 40, soft_cap=3.0, kv_heads=4),
    # The sequence beside a batch axis and beside a head axis.
    "causal_batch_x_seq": Case((2, 4), True, 48, segments=True,
                               batch_axis="data"),
    "full_heads_x_seq": Case((2, 4), False, 24, head_axis="model",
                             names=("model", "seq"), segments=True),
    "causal_mqa_heads_x_seq": Case((2, 4), True, 24, heads=2, kv_heads=2,
                                   head_axis="model", names=("model", "seq")),
    # Inputs already in zig-zag order.
    "causal_zigzag_8": Case((1, 8), True, 32, layout="zigzag"),
    "causal_bf16_4": Case((1, 4), True, 40, dtype="bfloat16"),
    # Windows and static masks at global positions.
    # v's head dim 24 != q's 16 (MLA): the pairs the window empties give
    # zeros of v's width
    "window_causal_segments_4": Case((1, 4), True, 40, window=7,
                                     segments=True, v_dim=24),
    "window_bidirectional_zigzag_8": Case((1, 8), False, 32, window=(3, 6),
                                          layout="zigzag", kv_heads=4),
    "window_wide_batch_x_seq": Case((2, 4), True, 48, window=30,
                                    batch_axis="data"),
    "chunked_gqa_zigzag_4": Case((1, 4), False, 48, mask="chunked",
                                 layout="zigzag"),
    "chunked_heads_x_seq": Case((2, 4), False, 48, mask="chunked",
                                head_axis="model", names=("model", "seq")),
    "prefix_lm_8": Case((1, 8), False, 32, mask="prefix"),
    "dense_segments_4": Case((1, 4), False, 40, mask="dense", segments=True),
    "combined_causal_zigzag_8": Case((1, 8), True, 32, mask="combined",
                                     layout="zigzag", segments=True),
    "per_head_segments_4": Case((1, 4), False, 40, mask="per_head",
                                segments=True),
    "per_head_window_bf16_4": Case((1, 4), True, 40, mask="per_head",
                                   window=11, dtype="bfloat16"),
    # Bias: rows split with the queries, full or broadcast over batch/heads
    # (a size-1 batch beside a batch axis: its gradient sums over devices).
    "bias_full_softcap_8": Case((1, 8), False, 40, bias=(2, 4),
                                soft_cap=3.0),
    "bias_causal_segments_4": Case((1, 4), True, 40, bias=(1, 4),
                                   segments=True),
    "bias_causal_zigzag_sinks_4": Case((1, 4), True, 32, bias=(2, 1),
                                       layout="zigzag", sinks=True),
    "bias_heads_x_seq": Case((2, 4), True, 24, bias=(1, 4), head_axis="model",
                             names=("model", "seq")),
    "bias_bf16_4": Case((1, 4), True, 32, bias=(1, 1), dtype="bfloat16"),
    # Sinks join the merged softmax once (d sinks too).
    "sinks_causal_segments_8": Case((1, 8), True, 32, sinks=True,
                                    segments=True),
    "sinks_mask_bias_batch_x_seq": Case((2, 4), False, 48, mask="chunked",
                                        window=(5, 3), sinks=True,
                                        bias=(1, 4), batch_axis="data"),
    # q_len != kv_len (ends aligned): chunked prefill against a longer
    # cache, and more queries than keys (early queries see no key).
    "prefill_causal_bias_4": Case((1, 4), True, 16, kv_length=64,
                                  bias=(1, 4), segments=True),
    "prefill_causal_4": Case((1, 4), True, 8, kv_length=16),
    "prefill_full_8": Case((1, 8), False, 16, kv_length=40, kv_heads=4),
    "prefill_window_zigzag_8": Case((1, 8), True, 32, kv_length=64,
                                    window=20, layout="zigzag"),
    "prefill_chunked_sinks_4": Case((1, 4), False, 24, kv_length=48,
                                    mask="chunked", sinks=True),
    "prefill_per_head_4": Case((1, 4), False, 16, kv_length=48,
                               mask="per_head", segments=True),
    "prefill_dense_heads_x_seq": Case((2, 4), False, 24, kv_length=48,
                                      mask="dense", bias=(2, 4),
                                      head_axis="model",
                                      names=("model", "seq")),
    "prefill_combined_zigzag_4": Case((1, 4), True, 32, kv_length=64,
                                      mask="combined", layout="zigzag"),
    "more_queries_causal_8": Case((1, 8), True, 64, kv_length=32,
                                  segments=True),
    "mla_prefill_wide_v_bias_8": Case((1, 8), False, 16, kv_length=48,
                                      bias=(2, 4), v_dim=40),
    "prefill_bf16_4": Case((1, 4), True, 16, kv_length=48, bias=(2, 4),
                           sinks=True, dtype="bfloat16"),
}
# The default suite's share (the rest run with --runslow).
FAST = {"causal_gqa_segments_4", "full_softcap_8", "causal_zigzag_8",
        "window_causal_segments_4", "chunked_gqa_zigzag_4",
        "combined_causal_zigzag_8", "per_head_segments_4",
        "bias_causal_segments_4", "bias_causal_zigzag_sinks_4",
        "sinks_mask_bias_batch_x_seq", "prefill_causal_bias_4",
        "prefill_combined_zigzag_4", "more_queries_causal_8"}


def _inputs(case, rng):
  """q, k, v, segment ids, bias, sinks (None where the case has none) and
  the cotangents of out and lse."""
  dtype = jnp.dtype(case.dtype)
  b, length, kv_len, d = 2, case.length, case.kv_len, 16
  f = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
  q = f(b, case.heads, length, d)
  k, v = f(b, case.kv_heads, kv_len, d), f(b, case.kv_heads, kv_len,
                                          case.v_dim)
  segs = None
  if case.segments:
    q_seg = np.sort(rng.integers(0, 3, (b, length)), axis=1)
    q_seg[:, 5:9] = 7  # rows that no key matches: out 0, lse -inf
    kv_seg = np.sort(rng.integers(0, 3, (b, kv_len)), axis=1)
    segs = (jnp.asarray(q_seg, jnp.int32), jnp.asarray(kv_seg, jnp.int32))
  bias = None if case.bias is None else f(*case.bias, length, kv_len)
  sinks = f(case.heads) if case.sinks else None
  d_out = rng.standard_normal(q.shape[:3] + v.shape[3:])
  d_lse = rng.standard_normal(q.shape[:3])
  return q, k, v, segs, bias, sinks, d_out, d_lse


def _kwargs(case, backend, mask=None):
  kwargs = dict(causal=case.causal, logit_soft_cap=case.soft_cap,
                sliding_window=case.window, return_lse=True, backend=backend)
  if mask is not None:
    kwargs["mask"] = mask
  return kwargs


def _loss(attention, d_out, d_lse):
  """<out, d_out> + <lse, d_lse> over rows with finite lse, and (out,
  lse)."""
  def loss(q, k, v, bias, sinks):
    out, lse = attention(q, k, v, bias, sinks)
    finite = jnp.isfinite(lse)
    total = (jnp.sum(out.astype(jnp.float32) * d_out)
             + jnp.sum(jnp.where(finite, lse, 0.0) * d_lse))
    return total, (out, lse)
  return loss


def _ring_fn(case, backend, segs, mask=None):
  mesh = _mesh(case.mesh, case.names)
  return lambda q, k, v, bias, sinks: pk.shard_flash_attention(
      mesh, q, k, v, batch_axis=case.batch_axis, head_axis=case.head_axis,
      sequence_axis="seq", sequence_layout=case.layout, segment_ids=segs,
      bias=bias, sinks=sinks, **_kwargs(case, backend, mask))


def _run(fn, q, k, v, bias, sinks, d_out, d_lse):
  """((dq, dk, dv, d bias, d sinks), (out, lse)); None for absent ones."""
  grad = jax.jit(jax.grad(_loss(fn, jnp.asarray(d_out, jnp.float32),
                                jnp.asarray(d_lse, jnp.float32)),
                          argnums=(0, 1, 2, 3, 4), has_aux=True))
  return jax.block_until_ready(grad(q, k, v, bias, sinks))


def _assert_close(actual, expected, tol, what):
  actual = np.asarray(actual).astype(np.float64)
  expected = np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
  inf = np.isinf(expected)
  np.testing.assert_array_equal(actual[inf], expected[inf], err_msg=what)
  err = np.max(np.abs(actual[~inf] - expected[~inf]), initial=0)
  assert err <= tol, f"{what}: max abs error {err} > {tol}"


def _scale(x):
  x = np.asarray(x, np.float64)
  return max(1.0, float(np.max(np.abs(x[np.isfinite(x)]), initial=0)))


def _check(case, backend, rng):
  q, k, v, segs, bias, sinks, d_out, d_lse = _inputs(case, rng)
  mask, allowed = _mask_of(case, rng.random((case.length, case.kv_len)) < 0.4)
  n = case.mesh[case.names.index("seq")]
  ring_q, ring_k, ring_v, ring_segs, ring_bias = q, k, v, segs, bias
  ring_d_out, ring_d_lse = d_out, d_lse
  if case.layout == "zigzag":  # the user's tokens, permuted once
    q_order = ring.zigzag_order(case.length, n)
    kv_order = ring.zigzag_order(case.kv_len, n)
    ring_q = q[:, :, q_order]
    ring_k, ring_v = k[:, :, kv_order], v[:, :, kv_order]
    ring_d_out, ring_d_lse = d_out[:, :, q_order], d_lse[:, :, q_order]
    if segs is not None:
      ring_segs = (segs[0][:, q_order], segs[1][:, kv_order])
    if bias is not None:   # both axes follow their tokens
      ring_bias = bias[:, :, q_order][:, :, :, kv_order]
  (dq, dk, dv, d_bias, d_sinks), (out, lse) = _run(
      _ring_fn(case, backend, ring_segs, mask), ring_q, ring_k, ring_v,
      ring_bias, sinks, ring_d_out, ring_d_lse)
  if case.layout == "zigzag":
    # Causal and masks in the original order: the oracle sees that order.
    q_undo, kv_undo = np.argsort(q_order), np.argsort(kv_order)
    out, lse, dq = (x[:, :, q_undo] for x in (out, lse, dq))
    dk, dv = dk[:, :, kv_undo], dv[:, :, kv_undo]
    if d_bias is not None:
      d_bias = d_bias[:, :, q_undo][:, :, :, kv_undo]
  unsharded = lambda q, k, v, bias, sinks: pk.flash_attention(  # noqa: E731
      q, k, v, segment_ids=segs, bias=bias, sinks=sinks,
      **_kwargs(case, backend, mask))
  u_grads, (u_out, u_lse) = _run(unsharded, q, k, v, bias, sinks, d_out,
                                 d_lse)
  ref_out, ref_lse, ref_grads = oracle.attention(
      q, k, v, causal=case.causal, segment_ids=segs,
      sliding_window=case.window, logit_soft_cap=case.soft_cap, bias=bias,
      allowed=allowed, sinks=sinks, d_out=d_out, d_lse=d_lse)
  out_tol, lse_tol, grad_tol = TOLERANCES[case.dtype]
  assert out.dtype == q.dtype and lse.dtype == jnp.float32
  for got, name in ((out, "out"), (u_out, "unsharded out")):
    _assert_close(got, ref_out, out_tol, name)
  _assert_close(out, u_out, out_tol, "out vs unsharded")
  for got in (lse, u_lse):
    _assert_close(got, ref_lse, lse_tol * _scale(ref_lse), "lse")
  grads = (dq, dk, dv, d_bias, d_sinks)
  for name, got, want, ref, x in zip(("q", "k", "v", "bias", "sinks"), grads,
                                     u_grads, ref_grads + (None,) * (
                                         5 - len(ref_grads)),
                                     (q, k, v, bias, sinks)):
    if x is None:
      assert got is None and ref is None, name
      continue
    assert got.dtype == x.dtype
    tol = grad_tol * _scale(ref)
    _assert_close(got, ref, tol, f"d{name}")
    _assert_close(got, want, tol, f"d{name} vs unsharded")


def _reference_params():
  return [pytest.param(n, marks=[] if n in FAST else [pytest.mark.slow])
          for n in sorted(CASES)]


@pytest.mark.parametrize("name", _reference_params())
def test_ring_matches_oracle_reference(name, rng):
  _check(CASES[name], "reference", rng)


# By default one case runs the kernels (zig-zag, bias, sinks); the reference
# backend runs the ring's schedule for every FAST case above.
@pytest.mark.parametrize("name", ["bias_causal_zigzag_sinks_4"] + [
    pytest.param(n, marks=pytest.mark.slow)
    for n in ("causal_gqa_segments_4", "prefill_causal_4",
              "causal_batch_x_seq", "causal_bf16_4", "full_softcap_8",
              "window_causal_segments_4", "combined_causal_zigzag_8",
              "per_head_segments_4", "prefill_causal_bias_4",
              "sinks_mask_bias_batch_x_seq", "prefill_window_zigzag_8",
              "prefill_dense_heads_x_seq", "more_queries_causal_8",
              "prefill_bf16_4", "mla_prefill_wide_v_bias_8")])
def test_ring_matches_oracle_generic_interpreter(name, rng):
  """backend=None on a CPU: the TPU kernel in Pallas' generic interpreter."""
  _check(CASES[name], None, rng)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["causal_gqa_segments_4", "full_heads_x_seq",
                                  "window_causal_segments_4",
                                  "bias_causal_segments_4",
                                  "prefill_causal_bias_4"])
def test_ring_matches_oracle_tpu_interpreter(name, rng):
  """backend="interpret": the TPU-semantics interpreter, whose kernel
  launches wait for every device (4 devices: jax 0.7's interpreter hangs
  with 8 on a 2-core host, ring or not). The window leaves most pairs
  empty: their devices still launch a kernel (dropped) at every step."""
  case = dataclasses.replace(CASES[name], mesh=(2, 2)) if name.startswith(
      "full") else dataclasses.replace(CASES[name], mesh=(1, 4))
  _check(case, "interpret", rng)


@pytest.mark.parametrize("name", ["full_softcap_8", "bias_full_softcap_8"])
def test_backward_saves_no_visiting_blocks(name, rng):
  """The custom VJP keeps the local slices, not the N visiting K/V blocks
  (nor per-step bias blocks)."""
  from jax._src.ad_checkpoint import saved_residuals
  case = CASES[name]
  q, k, v, _, bias, *_ = _inputs(case, rng)
  fn = _ring_fn(case, "reference", None)
  saved = saved_residuals(lambda q, k, v, bias: fn(q, k, v, bias, None)[0]
                          .sum(), q, k, v, bias)
  total = sum(np.prod(aval.shape) * aval.dtype.itemsize for aval, _ in saved)
  # q, k, v, bias, out (float32) and lse: the whole inputs once, globally.
  bound = (2 * q.nbytes + k.nbytes + v.nbytes + 4 * np.prod(q.shape[:3])
           + (0 if bias is None else bias.nbytes))
  assert total <= bound, (total, bound, [a for a, _ in saved])


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_zigzag_moves_match_zigzag_order(n):
  length = 4 * n
  mesh = _mesh((n,), ("seq",))
  x = jnp.arange(2 * 3 * length, dtype=jnp.float32).reshape(2, 3, length)

  def moves(x):
    zig = ring.to_zigzag(x, "seq", n, 2)
    return zig, ring.from_zigzag(zig, "seq", n, 2)

  spec = P(None, None, "seq")
  zig, back = jax.jit(_compat.shard_map(moves, mesh=mesh, in_specs=spec,
                                        out_specs=(spec, spec)))(x)
  np.testing.assert_array_equal(zig, np.asarray(x)[:, :, ring.zigzag_order(
      length, n)])
  np.testing.assert_array_equal(back, x)


def test_zigzag_order():
  order = ring.zigzag_order(8, 2)
  np.testing.assert_array_equal(order, [0, 1, 6, 7, 2, 3, 4, 5])
  with pytest.raises(ValueError, match="not divisible by 2 \\* num_shards"):
    ring.zigzag_order(6, 2)


def _shard(q, k=None, v=None, **kwargs):
  """shard_flash_attention on a ("data", "seq") mesh of 2 x 4."""
  args = dict(sequence_axis="seq", batch_axis=None, head_axis=None)
  args.update(kwargs)
  k = q if k is None else k
  return pk.shard_flash_attention(_mesh((2, 4)), q, k, k if v is None else v,
                                  **args)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(bias=jnp.zeros((1, 1, 16, 8))), ValueError, "bias must have shape"),
    (dict(bias=jnp.zeros((1, 1, 16, 16), jnp.int32)), TypeError,
     "bias must be bfloat16, float16 or float32"),
    (dict(mask=[masks.Causal()] * 3 + [masks.Local(2)], head_axis="data"),
     ValueError, "per-head mask list cannot be split"),
    (dict(mask=masks.Dense(np.ones((8, 8), bool))), ValueError,
     "Dense mask has shape"),
    (dict(batch_axis="seq"), ValueError, "must differ from batch_axis"),
    (dict(sequence_axis="rows"), ValueError, "no axis 'rows'"),
    (dict(sequence_layout="striped"), ValueError, "sequence_layout must be"),
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(dropout=0.1), TypeError, "unexpected keyword argument 'dropout'"),
    (dict(sinks=jnp.zeros(3)), ValueError, r"sinks must have shape \[heads\]"),
])
def test_ring_rejects(kwargs, error, match):
  with pytest.raises(error, match=match):
    _shard(jnp.zeros((4, 4, 16, 8)), **kwargs)


def test_ring_rejects_lengths():
  q = jnp.zeros((2, 4, 16, 8))
  with pytest.raises(ValueError, match="kv_len 10 must be divisible by the 4 "
                     "devices"):
    _shard(q, jnp.zeros((2, 4, 10, 8)), causal=True)
  with pytest.raises(ValueError, match="q_len 12 must be divisible by 2 x "
                     "the 4 devices"):
    _shard(jnp.zeros((2, 4, 12, 8)), causal=True)
  with pytest.raises(ValueError, match="q_len 10 must be divisible by the 4 "
                     "devices"):
    _shard(jnp.zeros((2, 4, 10, 8)))
  with pytest.raises(ValueError, match="kv_len 12 must be divisible by 2 x "
                     "the 4 devices .*zig-zag masked"):
    _shard(q, jnp.zeros((2, 4, 12, 8)), causal=True,
           sequence_layout="zigzag")
  with pytest.raises(ValueError, match="2 x the 4 devices .*zig-zag masked"):
    _shard(jnp.zeros((2, 4, 12, 8)), sliding_window=3,
           sequence_layout="zigzag")
  with pytest.raises(ValueError, match="sequence_layout needs sequence_axis"):
    _shard(q, sequence_axis=None, sequence_layout="zigzag")


def test_ring_of_empty_batch():
  q = jnp.zeros((0, 2, 16, 8))
  out, lse = _shard(q, causal=True, return_lse=True)
  assert out.shape == q.shape and lse.shape == (0, 2, 16)


def _plan(mask, n, length, zigzag_inputs=False, kv_length=None, causal=False):
  kv_length = length if kv_length is None else kv_length
  q, k = jnp.zeros((1, 4, length, 8)), jnp.zeros((1, 4, kv_length, 8))
  config, _, _ = pk.attention.api._validate(
      q, k, k, causal, None, None, None, None, None, False, None, None, mask)
  return ring._mask_plan(config, ring._band_mask(config, length, kv_length),
                         n, length, kv_length, zigzag_inputs)


def test_mask_plans_skip_dead_steps_and_balance():
  """A window no wider than a slice needs only the previous device's slice
  (the ring stops after step 1); chunks within slices need no visiting
  slice; causal-like masks with a long reach move to zig-zag order, whose
  blocks dedupe to a few kernels (as plain causal ones)."""
  window = _plan(masks.Local(100, 0), 8, 2048)
  assert (window.last_step, window.zigzag) == (1, False)
  assert _plan(masks.ChunkedCausal(256), 8, 2048).last_step == 0
  long = _plan(masks.Causal() & masks.Local(4000, 0), 8, 2048)
  assert long.zigzag and long.last_step == 7 and len(long.branches) <= 5
  assert _plan(masks.PrefixLM(300), 8, 2048).zigzag


@pytest.mark.parametrize("n, q_len, kv_len", [(8, 2048, 8192), (8, 3072, 8192),
                                              (16, 4096, 65536)])
def test_unequal_causal_plans_balance(n, q_len, kv_len):
  """Causal attention of q_len != kv_len (e.g. chunked prefill against a
  longer cache) moves to zig-zag order, where every device computes the
  same number of live blocks. Distinct kernels: one per distinct place of
  the diagonal in a pair, O(N)."""
  plan = _plan(None, n, q_len, kv_length=kv_len, causal=True)
  mask = ring._band_mask(_validated(q_len, kv_len), q_len, kv_len)
  assert plan.zigzag and len(plan.branches) <= 3 * n + 2
  work = [sum(np.mean(ring._classes(
      ring._placed(mask, r, src, n, q_len, kv_len, True), q_len // n,
      kv_len // n, q_len // n // 16, kv_len // n // 16) > 0)
              for src in range(n)) for r in range(n)]
  assert max(work) - min(work) < 1e-9, work
  contiguous = [sum(np.mean(ring._classes(
      ring._placed(mask, r, src, n, q_len, kv_len, False), q_len // n,
      kv_len // n, q_len // n // 16, kv_len // n // 16) > 0)
                    for src in range(n)) for r in range(n)]
  assert max(work) < max(contiguous)


def _validated(q_len, kv_len):
  q, k = jnp.zeros((1, 4, q_len, 8)), jnp.zeros((1, 4, kv_len, 8))
  return pk.attention.api._validate(q, k, k, True, None, None, None, None,
                                    None, False, None, None)[0]


@pytest.mark.parametrize("zigzag", [False, True])
@pytest.mark.parametrize("q_len, kv_len", [(48, 48), (24, 72), (72, 40)])
def test_placed_masks_are_slices_of_the_global_mask(zigzag, q_len, kv_len,
                                                    rng):
  """Every pair's placed mask equals its block of the global mask (NumPy
  rule here, ends aligned: query i at position i + kv_len - q_len), and its
  block classes never call a block with an allowed entry empty nor one with
  a masked entry full."""
  n = 4
  dense = rng.random((q_len, kv_len)) < 0.5
  p = np.arange(q_len)[:, None] + kv_len - q_len
  j = np.arange(kv_len)[None, :]
  cases = [(masks.ChunkedCausal(7), (j <= p) & (p // 7 == j // 7)),
           (masks.Causal(), j <= p),
           (masks.Local(6, 0), (j <= p) & (j >= p - 6)),
           (masks.PrefixLM(10) & masks.Local(None, 3), ((j < 10) | (j <= p))
            & (j <= p + 3)),
           (masks.Local(5, 9) | masks.Dense(dense), ((j >= p - 5)
                                                   & (j <= p + 9)) | dense)]
  q_order, kv_order = ((ring.zigzag_order(q_len, n),
                        ring.zigzag_order(kv_len, n)) if zigzag else
                       (np.arange(q_len), np.arange(kv_len)))
  q_local, kv_local = q_len // n, kv_len // n
  for mask, want in cases:
    for r in range(n):
      for src in range(n):
        placed = ring._placed(mask, r, src, n, q_len, kv_len, zigzag)
        block = want[np.ix_(q_order[r * q_local:(r + 1) * q_local],
                            kv_order[src * kv_local:(src + 1) * kv_local])]
        np.testing.assert_array_equal(
            masks.dense(placed, q_local, kv_local), block,
            err_msg=f"{mask} {r} {src}")
        classes = masks.block_classes(placed, q_local, kv_local, 5, 4)
        rows, cols = -(-q_local // 5) * 5, -(-kv_local // 4) * 4
        tiles = np.zeros((rows, cols), bool)
        tiles[:q_local, :kv_local] = block
        live = tiles.reshape(rows // 5, 5, cols // 4, 4).any(axis=(1, 3))
        assert not np.any((classes == 0) & live)
        tiles[q_local:] = True   # padded queries are dropped, not masked
        tiles = tiles.reshape(rows // 5, 5, cols // 4, 4)
        assert not np.any((classes == 2) & ~tiles.all(axis=(1, 3)))
