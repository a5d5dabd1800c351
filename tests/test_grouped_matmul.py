"""grouped_matmul against a float64 oracle written here (per-group numpy
products), on every CPU backend; gradients; group-size properties; bad
inputs; one compile for every routing; AOT compiles for v5e and v6e.

Tolerances: float32 inputs 2e-5 of the largest |value| of the expected
result (float32 sums over K); bfloat16 inputs 2e-2 (8-bit mantissa of the
output and of the rounded gradients).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import backends
import sharding_cases
import pallas_kernels as pk

BACKENDS = backends.params(["interpret", "interpret_generic", "triton",
                            "reference"])
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
SMALL_TILES = (32, 128, 128)  # several row tiles, groups straddling them


def _local_rows(sizes, m, offset, num_local):
  """(local group, row range) of rhs[0 .. num_local - 1] = groups offset..."""
  start = 0
  for g, size in enumerate(np.asarray(sizes)):
    end = min(start + max(int(size), 0), m)
    if offset <= g < offset + num_local:
      yield g - offset, slice(start, end)
    start = end


def _oracle(lhs, rhs, sizes, transpose_rhs=False, offset=0):
  lhs = np.asarray(lhs, np.float64)
  rhs = np.asarray(rhs, np.float64)
  if transpose_rhs:
    rhs = np.swapaxes(rhs, 1, 2)
  out = np.zeros((lhs.shape[0], rhs.shape[2]))
  for g, rows in _local_rows(sizes, lhs.shape[0], offset, rhs.shape[0]):
    out[rows] = lhs[rows] @ rhs[g]
  return out


def _oracle_grads(lhs, rhs, sizes, dout, transpose_rhs=False, offset=0):
  lhs = np.asarray(lhs, np.float64)
  rhs = np.asarray(rhs, np.float64)
  dout = np.asarray(dout, np.float64)
  r = np.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
  dlhs, drhs = np.zeros_like(lhs), np.zeros_like(r)
  for g, rows in _local_rows(sizes, lhs.shape[0], offset, r.shape[0]):
    dlhs[rows] = dout[rows] @ r[g].T
    drhs[g] = lhs[rows].T @ dout[rows]
  return dlhs, (np.swapaxes(drhs, 1, 2) if transpose_rhs else drhs)


def _close(got, want, dtype):
  got = np.asarray(got, np.float64)
  scale = max(1.0, float(np.abs(want).max()))
  np.testing.assert_allclose(got, want, rtol=0, atol=TOL[dtype] * scale)


def _inputs(rng, m, k, n, g, dtype, transpose_rhs=False):
  lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
  shape = (g, n, k) if transpose_rhs else (g, k, n)
  rhs = jnp.asarray(rng.standard_normal(shape) / np.sqrt(k), dtype)
  return lhs, rhs


def _sizes(rng, m, g, kind):
  if kind == "one_group":
    sizes = np.zeros(g, np.int32)
    sizes[rng.integers(g)] = m
  elif kind == "short":  # rows past the groups, an empty group
    sizes = rng.multinomial(m - m // 3, np.ones(g) / g).astype(np.int32)
    sizes[rng.integers(g)] = 0
  else:
    sizes = rng.multinomial(m, np.ones(g) / g).astype(np.int32)
  return jnp.asarray(sizes)


CASES = [  # m, k, n, g, transpose_rhs, dtype, sizes
    (77, 48, 40, 5, False, jnp.float32, "short"),
    (131, 200, 136, 4, True, jnp.float32, "balanced"),
    (96, 64, 130, 3, False, jnp.bfloat16, "one_group"),
    (45, 256, 64, 7, True, jnp.bfloat16, "short"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:5]
                                                                    + c[6:])))
def test_matches_float64_oracle(backend, case, rng):
  m, k, n, g, transpose_rhs, dtype, kind = case
  lhs, rhs = _inputs(rng, m, k, n, g, dtype, transpose_rhs)
  sizes = _sizes(rng, m, g, kind)
  out = backend.run(pk.grouped_matmul, lhs, rhs, sizes,
                    transpose_rhs=transpose_rhs, block_sizes=SMALL_TILES)
  assert out.shape == (m, n) and out.dtype == dtype
  _close(out, _oracle(lhs, rhs, sizes, transpose_rhs), dtype)


@pytest.mark.compat  # forward and backward on every backend, once
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gradients_match_float64_oracle(backend, transpose_rhs, rng):
  m, k, n, g = 70, 136, 48, 4
  lhs, rhs = _inputs(rng, m, k, n, g, jnp.float32, transpose_rhs)
  sizes = _sizes(rng, m, g, "short")
  dout = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)

  def loss(lhs, rhs):
    out = pk.grouped_matmul(lhs, rhs, sizes, transpose_rhs=transpose_rhs,
                            block_sizes=SMALL_TILES, backend=backend.backend)
    return (out * dout).sum()

  with backend.context():
    dlhs, drhs = jax.grad(loss, (0, 1))(lhs, rhs)
  want_lhs, want_rhs = _oracle_grads(lhs, rhs, sizes, dout, transpose_rhs)
  _close(dlhs, want_lhs, jnp.float32)
  _close(drhs, want_rhs, jnp.float32)
  empty = np.asarray(sizes) == 0
  assert not np.asarray(drhs)[empty].any()  # empty groups: zero gradient


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("offset", [0, 2, 5])
def test_group_offset_matches_float64_oracle(backend, offset, rng):
  """rhs holds 3 of 8 groups: the local groups' rows, zeros elsewhere
  (rows before and after them, including whole row tiles), and gradients."""
  m, k, n, total, local = 150, 72, 40, 8, 3
  lhs, rhs = _inputs(rng, m, k, n, local, jnp.float32)
  sizes = _sizes(rng, m, total, "short")
  dout = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)

  def loss(lhs, rhs, offset):
    out = pk.grouped_matmul(lhs, rhs, sizes, group_offset=offset,
                            block_sizes=SMALL_TILES, backend=backend.backend)
    return (out * dout).sum(), out

  with backend.context():  # the offset traced, as a device's would be
    (_, out), (dlhs, drhs) = jax.jit(jax.value_and_grad(
        loss, (0, 1), has_aux=True))(lhs, rhs, jnp.int32(offset))
  _close(out, _oracle(lhs, rhs, sizes, offset=offset), jnp.float32)
  want_lhs, want_rhs = _oracle_grads(lhs, rhs, sizes, dout, offset=offset)
  _close(dlhs, want_lhs, jnp.float32)
  _close(drhs, want_rhs, jnp.float32)


@pytest.mark.compat
@pytest.mark.parametrize("axes", [
    {"expert_axis": "x"}, {"n_axis": "x"}, {"k_axis": "x"},
    {"expert_axis": "x", "n_axis": "y"}])
def test_shard_grouped_matmul_matches_oracle(axes, rng):
  """Experts, N or K split over the mesh (psum of the partial products),
  forward and gradients, against the unsplit oracle."""
  m, k, n, total = 96, 256, 256, 8
  lhs, rhs = _inputs(rng, m, k, n, total, jnp.float32)
  sizes = _sizes(rng, m, total, "short")
  dout = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
  mesh = jax.make_mesh((4, 2), ("x", "y"))

  def loss(lhs, rhs):
    out = pk.shard_grouped_matmul(mesh, lhs, rhs, sizes,
                                  block_sizes=SMALL_TILES, **axes)
    return (out * dout).sum(), out

  with pk.force_interpret("generic"), sharding_cases.use_mesh(mesh):
    (_, out), (dlhs, drhs) = jax.jit(jax.value_and_grad(
        loss, (0, 1), has_aux=True))(lhs, rhs)
  _close(out, _oracle(lhs, rhs, sizes), jnp.float32)
  want_lhs, want_rhs = _oracle_grads(lhs, rhs, sizes, dout)
  _close(dlhs, want_lhs, jnp.float32)
  _close(drhs, want_rhs, jnp.float32)


def test_shard_grouped_matmul_bad_axes():
  mesh = jax.make_mesh((8,), ("x",))
  lhs, rhs = jnp.ones((8, 16)), jnp.ones((3, 16, 8))
  sizes = jnp.array([2, 3, 3], jnp.int32)
  with pytest.raises(ValueError, match="expert_axis='z' is not a mesh axis"):
    pk.shard_grouped_matmul(mesh, lhs, rhs, sizes, expert_axis="z")
  with pytest.raises(ValueError, match="3 groups must divide evenly"):
    pk.shard_grouped_matmul(mesh, lhs, rhs, sizes, expert_axis="x")


@pytest.mark.parametrize("transpose_rhs, scale_shape, want", [
    (False, (3, 2, 8), (None, None, "x")), (False, (3, 1, 8), (None, None, "x")),
    (True, (3, 8, 2), (None, "x", None)), (True, (3, 8, 1), (None, "x", None))])
def test_rule_splits_the_scale_as_rhs(transpose_rhs, scale_shape, want):
  """Under an N split, rhs_scale ([G, S, N], [G, N, S] transposed) is split
  on its N dimension, whatever rhs's layout."""
  from jax.sharding import PartitionSpec as P

  from pallas_kernels import _sharding
  from pallas_kernels.gmm import api
  arrays = (jnp.ones((8, 16)), jnp.ones((3, 8, 16) if transpose_rhs else
                                        (3, 16, 8), jnp.int8),
            jnp.ones((3,), jnp.int32), jnp.ones(scale_shape),
            jnp.zeros((), jnp.int32))
  rule = api._rule("gmm", arrays, {"transpose_rhs": transpose_rhs})
  ins, _ = _sharding._specs_for(rule, {"n": ("x",)})
  assert ins[3] == P(*want)


QUANTIZED = [  # format, group size (None: per channel), lhs dtype, transpose
    (jnp.int8, None, jnp.bfloat16, False),
    (jnp.int8, 64, jnp.float32, True),
    (jnp.int4, 128, jnp.bfloat16, False),
    (jnp.float8_e4m3fn, None, jnp.bfloat16, True),
    (jnp.float8_e5m2, 64, jnp.bfloat16, False),
]


def _quantized_rhs(rng, g, k, n, fmt, group_size, transpose_rhs):
  """(codes, scale) from ``pk.quantize`` along K, and the weight they mean
  in float64, [G, K, N] (or [G, N, K])."""
  shape = (g, n, k) if transpose_rhs else (g, k, n)
  w = jnp.asarray(rng.standard_normal(shape) / np.sqrt(k), jnp.float32)
  axis = 2 if transpose_rhs else 1
  codes, scale = pk.quantize(w, fmt, axis=axis, group_size=group_size,
                             backend="reference")
  per = k // scale.shape[axis]
  weight = (np.asarray(codes.astype(jnp.float32), np.float64)
            * np.repeat(np.asarray(scale, np.float64), per, axis=axis))
  return codes, scale, weight


def _rotated(cases, backends_):
  """Each case once on a rotating backend; the full product under
  --runslow."""
  out = []
  for i, case in enumerate(cases):
    for j, b in enumerate(backends_):
      marks = list(b.marks) + ([] if j == i % len(backends_)
                               else [pytest.mark.slow])
      out.append(pytest.param(case, b.values[0], marks=marks,
                              id="-".join(str(getattr(x, "__name__", x))
                                          for x in case) + f"-{b.id}"))
  return out


@pytest.mark.parametrize("case, backend", _rotated(QUANTIZED, BACKENDS))
def test_quantized_rhs_matches_float64_oracle(backend, case, rng):
  """Codes times scales, per channel or per K group, both layouts, against
  the float64 product with the dequantized weight; gradients in lhs and the
  scales."""
  fmt, group_size, dtype, transpose_rhs = case
  m, k, n, g = 83, 256, 136, 4
  lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
  codes, scale, weight = _quantized_rhs(rng, g, k, n, fmt, group_size,
                                        transpose_rhs)
  sizes = _sizes(rng, m, g, "short")
  dout = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)

  def loss(lhs, scale):
    out = pk.grouped_matmul(lhs, codes, sizes, rhs_scale=scale,
                            transpose_rhs=transpose_rhs,
                            block_sizes=(32, 128, 128),
                            backend=backend.backend)
    return (out.astype(jnp.float32) * dout).sum(), out

  with backend.context():
    (_, out), (dlhs, dscale) = jax.jit(jax.value_and_grad(
        loss, (0, 1), has_aux=True))(lhs, scale)
  assert out.shape == (m, n) and out.dtype == dtype
  _close(out, _oracle(lhs, weight, sizes, transpose_rhs), dtype)
  want_lhs, want_w = _oracle_grads(lhs, weight, sizes, dout, transpose_rhs)
  _close(dlhs, want_lhs, dtype)
  # d scale = sum over each scale's K group of codes * d weight.
  axis = 2 if transpose_rhs else 1
  per = k // scale.shape[axis]
  prod = np.asarray(codes.astype(jnp.float32), np.float64) * want_w
  prod = np.moveaxis(prod, axis, -1)
  want_scale = np.moveaxis(
      prod.reshape(prod.shape[:-1] + (k // per, per)).sum(-1), -1, axis)
  _close(dscale, want_scale, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_groups_with_no_rows_give_zero_gradients(backend, rng):
  """Every group empty, or rows only in the last: the weight gradient of an
  empty group is written as zeros by the kernel (no stale memory)."""
  m, k, n, g = 40, 24, 136, 3
  lhs, rhs = _inputs(rng, m, k, n, g, jnp.float32)
  for sizes in ([0, 0, 0], [0, 0, m - 7]):
    sizes = jnp.asarray(sizes, jnp.int32)
    with backend.context():
      dlhs, drhs = jax.grad(lambda l, r: pk.grouped_matmul(
          l, r, sizes, block_sizes=SMALL_TILES,
          backend=backend.backend).sum(), (0, 1))(lhs, rhs)
    want_lhs, want_rhs = _oracle_grads(lhs, rhs, sizes, np.ones((m, n)))
    _close(dlhs, want_lhs, jnp.float32)
    _close(drhs, want_rhs, jnp.float32)


@given(data=st.data())
def test_group_sizes_property(data):
  """Any sizes, including negative and sums past M (clamped, documented),
  on the kernel (generic interpreter) and the reference alike."""
  g = data.draw(st.integers(1, 6), label="groups")
  m = data.draw(st.integers(1, 90), label="m")
  sizes = np.array(data.draw(st.lists(st.integers(-3, m), min_size=g,
                                      max_size=g), label="sizes"), np.int32)
  rng = np.random.default_rng(data.draw(st.integers(0, 2**31), label="seed"))
  lhs, rhs = _inputs(rng, m, 40, 24, g, jnp.float32)
  want = _oracle(lhs, rhs, sizes)
  with pk.force_interpret("generic"):
    got = pk.grouped_matmul(lhs, rhs, jnp.asarray(sizes),
                            block_sizes=SMALL_TILES)
  _close(got, want, jnp.float32)
  _close(pk.grouped_matmul(lhs, rhs, jnp.asarray(sizes), backend="reference"),
         want, jnp.float32)


def test_one_compile_for_every_routing(rng):
  lhs, rhs = _inputs(rng, 64, 32, 16, 4, jnp.float32)
  traces = []

  @jax.jit
  def step(sizes):
    traces.append(1)
    return pk.grouped_matmul(lhs, rhs, sizes, block_sizes=SMALL_TILES)

  with pk.force_interpret("generic"):
    for kind in ("balanced", "short", "one_group"):
      sizes = _sizes(rng, 64, 4, kind)
      _close(step(sizes), _oracle(lhs, rhs, sizes), jnp.float32)
  assert len(traces) == 1


@pytest.mark.parametrize("call, match", [
    (lambda l, r, s: pk.grouped_matmul(l[0], r, s), "lhs must be"),
    (lambda l, r, s: pk.grouped_matmul(l, r[0], s), "rhs must be"),
    (lambda l, r, s: pk.grouped_matmul(l[:, :5], r, s), "must equal lhs's K"),
    (lambda l, r, s: pk.grouped_matmul(l, r, s[:2]), "group_sizes must be"),
    (lambda l, r, s: pk.grouped_matmul(l, r, s.astype(jnp.float32)),
     "integers"),
    (lambda l, r, s: pk.grouped_matmul(l.astype(jnp.int8), r, s), "lhs must"),
    (lambda l, r, s: pk.grouped_matmul(l, r, s, block_sizes=(30, 128, 128)),
     "block_sizes"),
    (lambda l, r, s: pk.grouped_matmul(l, r, s, backend="cuda"), "backend"),
    (lambda l, r, s: pk.grouped_matmul(l, r.astype(jnp.int8), s),
     "quantized codes need rhs_scale"),
    (lambda l, r, s: pk.grouped_matmul(l, r, s, rhs_scale=jnp.ones((3, 1, 8))),
     "with rhs_scale, rhs must hold int8"),
    (lambda l, r, s: pk.grouped_matmul(l, r.astype(jnp.int8), s,
                                       rhs_scale=jnp.ones((3, 3, 8))),
     r"rhs_scale must be \[G, S, N\] = \(3, None, 8\) with S dividing K=16"),
    (lambda l, r, s: pk.grouped_matmul(l, r[:2], s, group_offset=2),
     r"group_offset=2 must be in \[0, 1\]"),
    (lambda l, r, s: pk.grouped_matmul(l, r, s[:2], group_offset=0),
     "G_total >= rhs's group count 3"),
    (lambda l, r, s: pk.grouped_matmul(l, r, s, group_offset=jnp.ones(2,
                                                                    int)),
     "group_offset must be an integer scalar"),
    (lambda l, r, s: pk.grouped_matmul(l, r, s, backend="mosaic_gpu"),
     "no mosaic_gpu kernel"),
])
def test_bad_inputs_raise(call, match):
  lhs, rhs = jnp.ones((8, 16)), jnp.ones((3, 16, 8))
  with pytest.raises(ValueError, match=match):
    call(lhs, rhs, jnp.array([2, 3, 3], jnp.int32))


@pytest.mark.compat
def test_empty_dimensions():
  for m, k, n in ((0, 16, 8), (8, 0, 8), (8, 16, 0)):
    out = pk.grouped_matmul(jnp.ones((m, k)), jnp.ones((2, k, n)),
                            jnp.array([m, 0], jnp.int32))
    assert out.shape == (m, n) and not np.asarray(out).any()


@pytest.mark.compat
@pytest.mark.tpu_aot
@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
def test_compiles_for_tpu_forward_and_backward(topology, tpu_topologies):
  from pallas_kernels import tpu_aot

  def train(lhs, rhs, sizes):
    return jax.grad(lambda l, r: pk.grouped_matmul(l, r, sizes).astype(
        jnp.float32).sum(), (0, 1))(lhs, rhs)

  # Mixtral-like: 8 experts, K 4096, N 14336 (top-2 of 2048 tokens).
  args = (jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16),
          jax.ShapeDtypeStruct((8, 4096, 14336), jnp.bfloat16),
          jax.ShapeDtypeStruct((8,), jnp.int32))
  tpu_aot.compile_for_tpu(train, *args, topology=topology)


@pytest.mark.tpu_aot
@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
@pytest.mark.parametrize("fmt, groups, transpose_rhs", [
    (jnp.int8, 1, False), (jnp.int4, 32, False),
    (jnp.float8_e4m3fn, 1, True), (jnp.int8, 32, True)])
def test_quantized_compiles_for_tpu(topology, fmt, groups, transpose_rhs,
                                    tpu_topologies):
  """Quantized experts (per channel and 128-wide K groups, both layouts)."""
  from pallas_kernels import tpu_aot
  g, k, n = 8, 4096, 2048
  args = (jax.ShapeDtypeStruct((4096, k), jnp.bfloat16),
          jax.ShapeDtypeStruct((g, n, k) if transpose_rhs else (g, k, n), fmt),
          jax.ShapeDtypeStruct((g,), jnp.int32),
          jax.ShapeDtypeStruct((g, n, groups) if transpose_rhs
                               else (g, groups, n), jnp.float32))
  tpu_aot.compile_for_tpu(
      lambda lhs, rhs, sizes, scale: pk.grouped_matmul(
          lhs, rhs, sizes, rhs_scale=scale, transpose_rhs=transpose_rhs),
      *args, topology=topology)
