"""Dispatch, the interpret switch and bad backend values."""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _backend, _compat
from pallas_kernels._compat import pl


def _double_kernel(x_ref, o_ref):
  o_ref[...] = x_ref[...] * 2


def _double_tpu(x, *, interpret=False):
  return pl.pallas_call(
      _double_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      interpret=interpret)(x)


CALLS = []


def _recording(name, fn):
  def wrapped(*args, **kwargs):
    CALLS.append(name)
    return fn(*args, **kwargs)
  return wrapped


def toy_op(x, backend=None, gpu_supported=True):
  impls = {
      "mosaic_tpu": _recording("mosaic_tpu", _double_tpu),
      "reference": _recording("reference", lambda x: x * 2),
  }
  impls["gpu"] = (_recording("gpu", lambda x: x * 2) if gpu_supported
                  else "toy has no GPU kernel")
  return _backend.dispatch("toy_op", backend, impls, x)


@pytest.fixture(autouse=True)
def _clear_calls(monkeypatch):
  monkeypatch.delenv(_backend.INTERPRET_ENV_VAR, raising=False)
  CALLS.clear()


def test_auto_on_cpu_runs_interpret_branch():
  x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
  out = jax.jit(toy_op)(x)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(x) * 2)
  # Every platform's branch is traced, but the CPU executes the interpreter.
  assert "mosaic_tpu" in CALLS and "gpu" in CALLS


@pytest.mark.parametrize("backend", ["interpret", "reference"])
def test_explicit_backends_run(backend):
  x = jnp.ones((8, 128), jnp.float32)
  out = toy_op(x, backend=backend)
  np.testing.assert_array_equal(np.asarray(out), 2 * np.ones((8, 128)))
  assert CALLS == ["reference" if backend == "reference" else "mosaic_tpu"]


def test_bad_backend_value_names_op_and_choices():
  with pytest.raises(ValueError, match=r"toy_op: backend='tpu' is not one of"):
    toy_op(jnp.ones(3), backend="tpu")


def test_unsupported_backend_says_why():
  with pytest.raises(ValueError, match="toy_op: backend='gpu' is not supported: "
                     "toy has no GPU kernel"):
    toy_op(jnp.ones(3), backend="gpu", gpu_supported=False)


def test_force_interpret_context_and_env(monkeypatch):
  x = jnp.ones((8, 128), jnp.float32)
  with _backend.force_interpret("generic"):
    assert _backend.forced_interpret_flavour() == "generic"
    assert _backend.interpret_value() is True
    toy_op(x)
  assert CALLS == ["mosaic_tpu"]  # forced: no platform branches traced
  assert _backend.forced_interpret_flavour() is None
  monkeypatch.setenv(_backend.INTERPRET_ENV_VAR, "1")
  assert _backend.forced_interpret_flavour() == "tpu"
  assert _backend.resolve_for_platform("tpu") == "interpret"
  monkeypatch.setenv(_backend.INTERPRET_ENV_VAR, "bogus")
  with pytest.raises(ValueError, match="PALLAS_KERNELS_INTERPRET='bogus'"):
    _backend.forced_interpret_flavour()
  with pytest.raises(ValueError, match="flavour='x'"):
    with _backend.force_interpret("x"):
      pass


def test_tpu_interpreter_flavour_is_tpu_semantics():
  value = _backend.interpret_value("tpu")
  if _compat.HAS_TPU_INTERPRETER:
    assert isinstance(value, _compat.TpuInterpretParams)
  else:
    assert value is True


def test_resolve_for_platform():
  assert _backend.resolve_for_platform("tpu") == "mosaic_tpu"
  assert _backend.resolve_for_platform("cuda") == "gpu"
  assert _backend.resolve_for_platform("cpu") == "interpret"


def test_grad_through_auto_dispatch():
  @jax.custom_vjp
  def doubled(x):
    return toy_op(x)

  doubled.defvjp(lambda x: (toy_op(x), None), lambda _, g: (2 * g,))
  g = jax.grad(lambda x: doubled(x).sum())(jnp.ones((8, 128)))
  np.testing.assert_array_equal(np.asarray(g), 2 * np.ones((8, 128)))


def test_vmap_through_auto_dispatch():
  x = jnp.arange(3 * 8 * 128, dtype=jnp.float32).reshape(3, 8, 128)
  out = jax.vmap(toy_op)(x)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(x) * 2)


@pytest.mark.tpu_aot
def test_auto_dispatch_picks_mosaic_when_compiled_for_tpu(tpu_topologies):
  from pallas_kernels import tpu_aot
  result = tpu_aot.compile_for_tpu(
      toy_op, jax.ShapeDtypeStruct((8, 128), jnp.float32),
      topology=tpu_topologies[0])
  assert "tpu_custom_call" in result.hlo_text
