"""The ``shard_*`` helpers on every kind of mesh, with plain or placed inputs.

Each helper must place (or reshard) its inputs as its specs say, on meshes
with Explicit axes (``jax.make_mesh``'s default on new jax), Auto axes, and
under ``jax.set_mesh``, eagerly and under ``jax.jit``; results equal the
unsharded op. Most rows run the reference kernel (placement is what is
tested); the docstring examples also run the default kernels.
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import pallas_kernels as pk
import sharding_cases as sc

pytestmark = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs 8 devices (tests/conftest.py)")

MESHES = ("explicit", "auto", "set_mesh")
INPUTS = ("plain", "as_specs", "elsewhere")


def _mesh(kind):
  axis_type = AxisType.Auto if kind == "auto" else AxisType.Explicit
  return jax.make_mesh((2, 4), sc.MESH_AXES, axis_types=(axis_type,) * 2)


def _attention(rng):
  f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  return f(2, 4, 24, 16), f(2, 4, 24, 16), f(2, 4, 24, 16)


def _nms(rng):
  return (sc._boxes(rng, 4, 12),
          jnp.asarray(rng.uniform(size=(4, 12)), jnp.float32))


def _flash(backend):
  def run(mesh, q, k, v):
    return pk.shard_flash_attention(mesh, q, k, v, causal=True,
                                    backend=backend)
  return run


def _ring(backend):
  def run(mesh, q, k, v):
    return pk.shard_flash_attention(mesh, q, k, v, causal=True,
                                    head_axis=None, sequence_axis="model",
                                    backend=backend)
  return run


def _batched_nms(backend):
  def run(mesh, boxes, scores):
    return pk.shard_batched_nms(mesh, boxes, scores, iou_threshold=0.5,
                                max_output_size=6, backend=backend)
  return run


def _matmul(backend, **axes):
  def run(mesh, x, w, xs, ws, bias):
    return pk.shard_int8_matmul(mesh, x, w, x_scale=xs, w_scale=ws, bias=bias,
                                out_dtype=jnp.float32, backend=backend,
                                **axes)
  return run


def _raw_matmul(backend, **axes):
  def run(mesh, x, w, *_):
    return pk.shard_int8_matmul(mesh, x, w, backend=backend, **axes)
  return run


# name: (inputs, helper(backend), the specs the helper gives its inputs,
#        the unsharded op, tolerance)
HELPERS = {
    "flash_attention": (
        _attention, _flash, [P("data", "model")] * 3,
        lambda q, k, v: pk.flash_attention(q, k, v, causal=True,
                                           backend="reference"), 2e-5),
    "ring_attention": (
        _attention, _ring, [P("data", None, "model")] * 3,
        lambda q, k, v: pk.flash_attention(q, k, v, causal=True,
                                           backend="reference"), 2e-5),
    "batched_nms": (
        _nms, _batched_nms, [P("data")] * 2,
        lambda b, s: pk.batched_nms(b, s, iou_threshold=0.5,
                                    max_output_size=6, backend="reference"),
        0),
    "int8_matmul_n": (
        sc._int8_inputs,
        lambda b: _matmul(b, row_axis="data", n_axis="model"),
        [P("data"), P(None, "model"), P("data"), P("model"), P("model")],
        lambda x, w, xs, ws, bias: pk.int8_matmul(
            x, w, x_scale=xs, w_scale=ws, bias=bias, out_dtype=jnp.float32,
            backend="reference"), 1e-4),
    "int8_matmul_k": (
        sc._int8_inputs,
        lambda b: _matmul(b, row_axis="data", k_axis="model"),
        [P("data", "model"), P("model"), P("data"), P(), P()],
        lambda x, w, xs, ws, bias: pk.int8_matmul(
            x, w, x_scale=xs, w_scale=ws, bias=bias, out_dtype=jnp.float32,
            backend="reference"), 1e-4),
    "int8_matmul_k_raw": (
        sc._int8_inputs,
        lambda b: _raw_matmul(b, row_axis="data", k_axis="model"),
        [P("data", "model"), P("model"), P(), P(), P()],
        lambda x, w, *_: pk.int8_matmul(x, w, backend="reference"), 0),
}


def _elsewhere(spec, shape, mesh):
  """A placement other than ``spec``: its mesh axes on the other dimensions
  where they divide them, else replicated."""
  axes = [e for e in spec if e is not None]
  moved = [None] * len(shape)
  for i, axis in enumerate(axes):
    dim = (len(shape) - 1 - i) % len(shape)
    if shape[dim] % mesh.shape[axis] == 0:
      moved[dim] = axis
  moved = P(*moved)
  same = tuple(moved) == tuple(spec) + (None,) * (len(shape) - len(spec))
  return P() if same else moved


def _inputs(args, specs, mesh, how):
  if how == "plain":
    return list(args)
  specs = specs if how == "as_specs" else [
      _elsewhere(s, a.shape, mesh) for s, a in zip(specs, args)]
  return [jax.device_put(a, NamedSharding(mesh, s))
          for a, s in zip(args, specs)]


def _check(name, mesh_kind, how, jit, backend, rng):
  make, helper, specs, unsharded, tol = HELPERS[name]
  args = make(rng)
  want = unsharded(*args)
  mesh = _mesh(mesh_kind)
  run = helper(backend)
  call = lambda *a: run(mesh, *a)
  call = jax.jit(call) if jit else call
  inputs = _inputs(args, specs, mesh, how)
  if mesh_kind == "set_mesh":
    with sc.use_mesh(mesh):
      got = call(*inputs)
  else:
    got = call(*inputs)
  for g, w in zip(jax.tree_util.tree_leaves(got),
                  jax.tree_util.tree_leaves(want)):
    assert g.shape == w.shape and g.dtype == w.dtype
    np.testing.assert_allclose(np.asarray(g, np.float64),
                               np.asarray(w, np.float64), atol=tol, rtol=tol)


# Every (mesh, inputs) pair once; each mesh and each inputs value both
# eagerly and under jit. The full product is the slow test below.
COVERING = [("explicit", "plain", False), ("explicit", "as_specs", True),
            ("explicit", "elsewhere", False), ("auto", "plain", True),
            ("auto", "as_specs", False), ("auto", "elsewhere", True),
            ("set_mesh", "plain", False), ("set_mesh", "as_specs", True),
            ("set_mesh", "elsewhere", True)]


@pytest.mark.parametrize("name,mesh_kind,how,jit", [
    (name, *row) for i, name in enumerate(sorted(HELPERS))
    for j, row in enumerate(COVERING) if (i + j) % 3 == 0])
def test_helper_places_its_inputs(name, mesh_kind, how, jit, rng):
  # Each helper on three rows of COVERING, each row for two helpers.
  _check(name, mesh_kind, how, jit, "reference", rng)


@pytest.mark.slow
@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("how", INPUTS)
@pytest.mark.parametrize("mesh_kind", MESHES)
@pytest.mark.parametrize("name", sorted(HELPERS))
def test_helper_places_its_inputs_all(name, mesh_kind, how, jit, rng):
  _check(name, mesh_kind, how, jit, "reference", rng)


def _docstring_example(name, rng):
  # jax.make_mesh's own axis types, plain inputs, eager: the docstrings.
  make, helper, _, unsharded, tol = HELPERS[name]
  args = make(rng)
  got = helper(None)(jax.make_mesh((2, 4), sc.MESH_AXES), *args)
  for g, w in zip(jax.tree_util.tree_leaves(got),
                  jax.tree_util.tree_leaves(unsharded(*args))):
    np.testing.assert_allclose(np.asarray(g, np.float64),
                               np.asarray(w, np.float64), atol=tol, rtol=tol)


@pytest.mark.parametrize("name", ["flash_attention", "int8_matmul_n",
                                  "int8_matmul_k"])
def test_docstring_example_with_default_kernels(name, rng):
  _docstring_example(name, rng)


@pytest.mark.slow   # their default (interpreted) kernels compile slowly
@pytest.mark.parametrize("name", ["ring_attention", "batched_nms"])
def test_docstring_example_with_default_kernels_slow(name, rng):
  _docstring_example(name, rng)
