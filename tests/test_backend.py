"""Dispatch, the interpret switch and bad backend values."""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _backend, _compat, _mosaic_gpu
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


def _double_gpu(x, *, interpret=None):
  del interpret
  return x * 2


def toy_op(x, backend=None, gpu_supported=True, hopper_kernel=False):
  rows = [_backend.Kernel("mosaic_tpu", _recording("mosaic_tpu", _double_tpu))]
  if hopper_kernel:
    rows.append(_backend.Kernel(
        "mosaic_gpu", _recording("mosaic_gpu", _double_gpu),
        hardware=lambda t: None if t.hopper else "needs a Hopper GPU"))
  rows.append(_backend.Kernel(
      "triton", _recording("triton", _double_gpu),
      supports=lambda: None if gpu_supported else "toy has no GPU kernel"))
  rows.append(_backend.Kernel("reference",
                              _recording("reference", lambda x: x * 2)))
  return _backend.dispatch("toy_op", backend, rows, x)


@pytest.fixture(autouse=True)
def _clear_calls(monkeypatch):
  monkeypatch.delenv(_backend.INTERPRET_ENV_VAR, raising=False)
  CALLS.clear()


def test_auto_on_cpu_runs_interpret_branch():
  x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
  out = jax.jit(toy_op)(x)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(x) * 2)
  # Every platform's branch is traced, but the CPU executes the interpreter.
  assert "mosaic_tpu" in CALLS and "triton" in CALLS


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
  with pytest.raises(ValueError, match="toy_op: backend='gpu' has no GPU "
                     "kernel for this call .triton: toy has no GPU kernel"):
    toy_op(jnp.ones(3), backend="gpu", gpu_supported=False)
  with pytest.raises(ValueError, match="toy_op: backend='triton' cannot run "
                     "this call: toy has no GPU kernel"):
    toy_op(jnp.ones(3), backend="triton", gpu_supported=False)
  with pytest.raises(ValueError, match="toy_op: backend='mosaic_gpu' is not "
                     "supported: no mosaic_gpu kernel exists for this op"):
    toy_op(jnp.ones(3), backend="mosaic_gpu")


def test_named_kernel_checks_the_chip_unless_interpreted():
  x = jnp.ones((8, 128), jnp.float32)
  with pytest.raises(ValueError, match="mosaic_gpu.*needs a Hopper GPU"):
    toy_op(x, backend="mosaic_gpu", hopper_kernel=True)
  with _backend.force_interpret("generic"):
    if _mosaic_gpu.interpret_params() is None:
      with pytest.raises(ValueError, match="cannot be interpreted"):
        toy_op(x, backend="mosaic_gpu", hopper_kernel=True)
      return
    toy_op(x, backend="mosaic_gpu", hopper_kernel=True)
  assert CALLS == ["mosaic_gpu"]


def test_best_gpu_kernel_follows_the_target():
  x = jnp.ones((8, 128), jnp.float32)
  with _backend.force_interpret("generic"):
    toy_op(x, backend="gpu", hopper_kernel=True)
    with _backend.target_override(gpu_capability="9.0"):
      toy_op(x, backend="gpu", hopper_kernel=True)
  interpreted = _mosaic_gpu.interpret_params() is not None
  assert CALLS == ["triton", "mosaic_gpu" if interpreted else "triton"]


def test_target_override_and_device_kinds():
  assert _backend.target().tpu_generation == "v5e"  # CPU host: the default
  assert not _backend.target().hopper
  with _backend.target_override(tpu_generation="v6e", gpu_capability="9.0"):
    assert _backend.target() == _backend.Target("v6e", "9.0")
    assert _backend.target().hopper
  with pytest.raises(ValueError, match="tpu_generation='v9'"):
    with _backend.target_override(tpu_generation="v9"):
      pass
  kinds = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5e": "v5e",
           "TPU v5p": "v5p", "TPU v5": "v5p", "TPU v6 lite": "v6e", "TPU v6e": "v6e",
           "TPU7x": "tpu7x"}
  for kind, generation in kinds.items():
    assert _backend.generation_from_device_kind(kind) == generation, kind


def test_kernel_rows_are_checked():
  with pytest.raises(AssertionError, match="unknown kernel name"):
    _backend.Kernel("cuda", lambda x: x)
  with pytest.raises(AssertionError, match="needs a reference"):
    _backend.dispatch("toy", "interpret", [
        _backend.Kernel("mosaic_tpu", _double_tpu)], jnp.ones(3))


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
  rows = [_backend.Kernel("triton", _double_gpu, supports=lambda: "no"),
          _backend.Kernel("reference", lambda x: x)]
  assert _backend.resolve_for_platform("cuda", rows) == "reference"
  assert _backend.resolve_for_platform("cpu", rows) == "reference"


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


@pytest.mark.tpu_aot
def test_aot_compile_lowers_for_the_topologys_generation(tpu_topologies):
  from pallas_kernels import tpu_aot
  seen = []

  def op(x):
    seen.append(_backend.target().tpu_generation)
    return toy_op(x)

  for topology in tpu_topologies:
    tpu_aot.compile_for_tpu(op, jax.ShapeDtypeStruct((8, 128), jnp.float32),
                            topology=topology)
  assert seen == [tpu_aot.topology_generation(t) for t in tpu_topologies]
  assert seen[0] == tpu_topologies[0].split(":")[0]


# ------------------------------------------------------------- race detection
def _racy_copy_kernel(x_hbm, o_ref, buf, sem):
  copy = _compat.pltpu.make_async_copy(x_hbm, buf, sem)
  copy.start()
  o_ref[...] = buf[...]   # reads the DMA's destination before waiting: a race
  copy.wait()


def _racy_then_clean(x, interpret):
  any_space = getattr(_compat.pltpu, "ANY", None) or pl.ANY
  y = pl.pallas_call(
      _racy_copy_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      in_specs=[pl.BlockSpec(memory_space=any_space)],
      scratch_shapes=[_compat.pltpu.VMEM(x.shape, x.dtype),
                      _compat.pltpu.SemaphoreType.DMA],
      interpret=interpret)(x)
  return _double_tpu(y, interpret=interpret)   # a clean kernel launched last


@pytest.mark.skipif(not _compat.HAS_TPU_INTERPRETER,
                    reason="this jax has no TPU interpreter")
def test_find_races_sees_a_race_in_a_kernel_before_the_last():
  x = jnp.ones((8, 128), jnp.float32)
  _, log = _backend.find_races(
      lambda x: _racy_then_clean(x, _backend.interpret_value()), x)
  assert log.launches == 2
  assert log.racy_launches == [0], log
  # What the interpreter itself keeps describes the clean last launch only.
  assert not _compat.races_found()


@pytest.mark.skipif(not _compat.HAS_TPU_INTERPRETER,
                    reason="this jax has no TPU interpreter")
def test_find_races_reports_none_for_clean_kernels():
  x = jnp.ones((8, 128), jnp.float32)
  out, log = _backend.find_races(
      lambda x: _double_tpu(_double_tpu(x, interpret=_backend.interpret_value()),
                            interpret=_backend.interpret_value()), x)
  np.testing.assert_array_equal(out, 4 * np.ones((8, 128)))
  assert log.launches == 2 and not log.found, log
