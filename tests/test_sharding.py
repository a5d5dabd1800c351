"""Every public op under every way of sharding, on 8 CPU devices.

Forms: inside a user's ``jax.shard_map`` (check_vma on and off, Auto and
Explicit meshes, 1-D and 2-D), plain ``jax.jit`` on ``NamedSharding`` inputs
over Auto axes (custom_partitioning: no all-gather of operands), and
Explicit axes. Each result (and gradient) equals the unsharded reference;
sharded non-splittable dimensions raise errors that name the helper.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import pallas_kernels as pk
import sharding_cases as sc  # noqa: E402

pytestmark = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs 8 devices (tests/conftest.py sets "
    "--xla_force_host_platform_device_count=8 before jax starts)")


def _mesh(axis_type, shape=(2, 4)):
  return jax.make_mesh(shape, sc.MESH_AXES[:len(shape)],
                       axis_types=(axis_type,) * len(shape))


def _use_mesh(mesh):
  return (jax.set_mesh(mesh) if hasattr(jax, "set_mesh")
          else jax.sharding.use_mesh(mesh))


def _close(case, got, want):
  for g, w in zip(jax.tree_util.tree_leaves(got),
                  jax.tree_util.tree_leaves(want)):
    assert g.shape == w.shape and g.dtype == w.dtype
    np.testing.assert_allclose(np.asarray(g, np.float64),
                               np.asarray(w, np.float64), atol=case.atol,
                               rtol=case.atol)


def _expected(case, args):
  ref = case.fn("reference")
  out = jax.jit(ref)(*args)
  grads = (jax.jit(sc.scalar_loss(ref, case.grad))(*args)
           if case.grad else None)
  return out, grads


def _put(mesh, args, specs):
  return [jax.device_put(a, NamedSharding(mesh, s)) for a, s in
          zip(args, specs)]


def _local_cases():
  # Reduced losses are global sums: inside shard_map they are per shard.
  return [c for c in sc.CASE_NAMES if not c.endswith(("_sum", "_mean"))]


# Unchecked shard_map by default for these (the rest with --runslow).
UNCHECKED_BY_DEFAULT = {"flash_attention", "decode_attention", "int8_matmul",
                        "quantize_int8", "grouped_matmul", "pairwise_giou"}


def _shard_map_params():
  # Checked mode for every case (the oldest jax: only that).
  out = []
  for name in _local_cases():
    out.append(pytest.param(name, True, marks=pytest.mark.compat,
                            id=f"{name}-True"))
    out.append(pytest.param(
        name, False, id=f"{name}-False",
        marks=[] if name in UNCHECKED_BY_DEFAULT else [pytest.mark.slow]))
  return out


@pytest.mark.parametrize("name,check_vma", _shard_map_params())
def test_inside_user_shard_map(name, check_vma, rng):
  case = sc.case(name)
  args = case.make(rng)
  want, want_grads = _expected(case, args)
  mesh = _mesh(AxisType.Auto)
  fn = case.fn(None)
  mapped = jax.shard_map(fn, mesh=mesh, in_specs=case.specs,
                         out_specs=case.out_specs, check_vma=check_vma)
  _close(case, jax.jit(mapped)(*args), want)
  if case.grad:
    grad_specs = tuple(case.specs[i] for i in case.grad)
    # Gradients of a replicated (broadcast) input are summed over shards.
    def local_grads(*a):
      grads = sc.scalar_loss(fn, case.grad)(*a)
      return tuple(
          # check_vma=True types the VJP, which then sums them itself.
          g if check_vma or not _absent_axes(spec)
          else jax.lax.psum(g, _absent_axes(spec))
          for g, spec in zip(grads, grad_specs))
    grads = jax.jit(jax.shard_map(
        local_grads, mesh=mesh, in_specs=case.specs, out_specs=grad_specs,
        check_vma=check_vma))(*args)
    _close(case, grads, want_grads)


def _absent_axes(spec):
  used = {a for e in spec if e is not None
          for a in (e if isinstance(e, tuple) else (e,))}
  return tuple(a for a in sc.MESH_AXES if a not in used)


def _setup(name, rng, axis_type):
  """The case, fresh inputs, the reference's results and a 2x4 mesh."""
  case = sc.case(name)
  args = case.make(rng)
  want, want_grads = _expected(case, args)
  return case, args, want, want_grads, _mesh(axis_type)


@pytest.mark.compat
@pytest.mark.parametrize("name", sc.CASE_NAMES)
def test_jit_on_auto_sharded_inputs(name, rng):
  case, args, want, want_grads, mesh = _setup(name, rng, AxisType.Auto)
  sharded = _put(mesh, args, case.specs)
  fn = jax.jit(case.fn(None))
  _close(case, fn(*sharded), want)
  hlo = fn.lower(*sharded).compile().as_text()
  assert "all-gather" not in hlo, "operands were gathered"
  for out, spec in zip(jax.tree_util.tree_leaves(fn(*sharded)),
                       case.out_specs):
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, spec), out.ndim)
  if case.grad:
    _close(case, jax.jit(sc.scalar_loss(case.fn(None), case.grad))(*sharded),
           want_grads)


@pytest.mark.compat
@pytest.mark.parametrize("name", sc.CASE_NAMES)
def test_jit_on_explicit_axes(name, rng):
  case, args, want, want_grads, mesh = _setup(name, rng, AxisType.Explicit)
  with _use_mesh(mesh):
    sharded = _put(mesh, args, case.specs)
    fn = jax.jit(case.fn(None))
    got = fn(*sharded)
    _close(case, got, want)
    for out, spec in zip(jax.tree_util.tree_leaves(got), case.out_specs):
      assert out.sharding.is_equivalent_to(NamedSharding(mesh, spec),
                                           out.ndim)
    if case.grad:
      _close(case, jax.jit(sc.scalar_loss(case.fn(None), case.grad))(
          *sharded), want_grads)


@pytest.mark.compat
def test_one_dimensional_mesh_and_interpret_backend(rng):
  case = sc.case("flash_attention")
  args = case.make(rng)
  want, _ = _expected(case, args)
  mesh = _mesh(AxisType.Explicit, shape=(4,))
  specs = (P(None, "data"), P(None, "data"), P(None, "data"),
           P(None, "data"), P())
  with _use_mesh(mesh):
    sharded = _put(mesh, args, specs)
    _close(case, jax.jit(case.fn("interpret"))(*sharded), want)


@pytest.mark.compat
def test_sequence_sharding_names_the_helper(rng):
  q, k, v, _, _ = sc.case("flash_attention").make(rng)
  mesh = _mesh(AxisType.Explicit)
  with _use_mesh(mesh):
    q, k, v = _put(mesh, (q, k, v), [P("data", None, "model")] * 3)
    with pytest.raises(ValueError, match=r"q dimension 2 \(q_len\).*"
                       r"shard_flash_attention"):
      jax.jit(pk.flash_attention)(q, k, v)
  auto = _mesh(AxisType.Auto)
  q, k, v = _put(auto, (q, k, v), [P("data", None, "model")] * 3)
  with pytest.raises(Exception, match=r"q_len"):
    jax.jit(pk.flash_attention)(q, k, v)


@pytest.mark.compat
def test_matmul_contracted_dimension_names_the_helper(rng):
  x, w, *_ = sc.case("int8_matmul").make(rng)
  mesh = _mesh(AxisType.Explicit)
  with _use_mesh(mesh):
    x, w = _put(mesh, (x, w), [P(None, "model"), P("model")])
    with pytest.raises(ValueError, match="K \\(contracted\\).*"
                       "shard_int8_matmul"):
      jax.jit(pk.int8_matmul)(x, w)


@pytest.mark.compat
def test_nms_of_one_image_cannot_split_its_boxes(rng):
  boxes = sc._boxes(rng, 32)
  scores = jnp.asarray(rng.uniform(size=32), jnp.float32)
  mesh = _mesh(AxisType.Explicit)
  with _use_mesh(mesh):
    boxes, scores = _put(mesh, (boxes, scores), [P("data"), P("data")])
    with pytest.raises(ValueError, match="boxes.*sequential"):
      pk.nms(boxes, scores, iou_threshold=0.5, max_output_size=4)


@pytest.mark.compat
def test_uneven_auto_split_is_replicated_not_padded(rng):
  # 6 boxes over 8 devices: a padded split would add padding to the sum.
  p, t = sc._boxes(rng, 6), sc._boxes(rng, 6)
  want = pk.giou_loss(p, t, reduction="sum", backend="reference")
  mesh = _mesh(AxisType.Auto, shape=(8,))
  spec = NamedSharding(mesh, P())
  fn = jax.jit(lambda p, t: pk.giou_loss(
      jax.lax.with_sharding_constraint(p, NamedSharding(mesh, P("data"))),
      t, reduction="sum"))
  got = fn(jax.device_put(p, spec), jax.device_put(t, spec))
  np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.compat
def test_vmap_of_auto_partitioned_call(rng):
  q, k, v = (jnp.stack([x, -x]) for x in sc.case("flash_attention").make(
      rng)[:3])
  fn = jax.vmap(lambda q, k, v: pk.flash_attention(q, k, v, causal=True))
  want = jax.vmap(lambda q, k, v: pk.flash_attention(
      q, k, v, causal=True, backend="reference"))(q, k, v)
  np.testing.assert_allclose(jax.jit(fn)(q, k, v), want, atol=2e-5)


@pytest.mark.compat
def test_int8_in_checked_shard_map_with_tpu_interpreter(rng):
  case = sc.case("int8_matmul")
  args = case.make(rng)
  want, _ = _expected(case, args)
  mapped = jax.shard_map(case.fn("interpret"), mesh=_mesh(AxisType.Auto),
                         in_specs=case.specs, out_specs=case.out_specs)
  _close(case, jax.jit(mapped)(*args), want)


@pytest.mark.compat
@pytest.mark.parametrize("name", ["decode_attention",
                                  "decode_attention_paged"])
def test_decode_in_checked_shard_map_with_tpu_interpreter(name, rng):
  case = sc.case(name)
  args = case.make(rng)
  want, _ = _expected(case, args)
  mapped = jax.shard_map(case.fn("interpret"), mesh=_mesh(AxisType.Auto),
                         in_specs=case.specs, out_specs=case.out_specs)
  _close(case, jax.jit(mapped)(*args), want)


@pytest.mark.compat
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("axes", [dict(row_axis="data", n_axis="model"),
                                  dict(row_axis="data", k_axis="model")])
def test_shard_int8_matmul_helper(axes, layout, rng):
  x, w, xs, ws, bias = sc.case("int8_matmul").make(rng)
  w = w if layout == "kn" else w.T
  kwargs = dict(x_scale=xs, w_scale=ws, bias=bias, out_dtype=jnp.float32,
                weight_layout=layout)
  want = pk.int8_matmul(x, w, backend="reference", **kwargs)
  got = pk.shard_int8_matmul(_mesh(AxisType.Auto), x, w, **axes, **kwargs)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
  raw = pk.shard_int8_matmul(_mesh(AxisType.Auto), x, w, weight_layout=layout,
                             **axes)
  assert raw.dtype == jnp.int32
  np.testing.assert_array_equal(raw, pk.int8_matmul(
      x, w, weight_layout=layout, backend="reference"))


@pytest.mark.compat
def test_shard_batched_nms_helper(rng):
  boxes, scores = sc.case("batched_nms").make(rng)
  kwargs = dict(iou_threshold=0.5, max_output_size=12)
  want = pk.batched_nms(boxes, scores, backend="reference", **kwargs)
  got = pk.shard_batched_nms(_mesh(AxisType.Auto, shape=(4,)), boxes, scores,
                             **kwargs)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)
  with pytest.raises(ValueError, match="not divisible by mesh axis"):
    pk.shard_batched_nms(_mesh(AxisType.Auto, shape=(8,)), boxes, scores,
                         **kwargs)
