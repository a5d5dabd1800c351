"""The generic JAX -> torch op mechanism, on small JAX functions of our own."""
from __future__ import annotations

import threading

import pytest

pytest.importorskip("torch_xla")
pytestmark = pytest.mark.torch

import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.debug.metrics as met  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from pallas_kernels import _backend  # noqa: E402
from torch_bridge import _core, _eager  # noqa: E402


def _scale_add(a, b, c, *, alpha, shift):
  """Two float outputs, one int output; ``c`` optional."""
  out = a * alpha + jnp.sin(b) + shift[0]
  if c is not None:
    out = out * c
  return out, (a * b).sum(), jnp.argmax(a.reshape(-1)).astype(jnp.int32)


PROBE = _core.JaxOp("_test_scale_add", _scale_add)


def _torch_scale_add(a, b, c, alpha, shift):
  out = a * alpha + torch.sin(b) + shift[0]
  if c is not None:
    out = out * c
  return out, (a * b).sum()


def _check_against_torch(device, rng, with_c):
  a0, b0, c0 = (torch.tensor(rng.standard_normal((3, 5)), dtype=torch.float32)
                for _ in range(3))
  def leaves():
    return [t.clone().to(device).requires_grad_() for t in (a0, b0, c0)]
  a, b, c = leaves()
  out, total, arg = PROBE([a, b, c if with_c else None], alpha=2.5,
                          shift=(0.5,))
  ra, rb, rc = (t.clone().requires_grad_() for t in (a0, b0, c0))
  r_out, r_total = _torch_scale_add(ra, rb, rc if with_c else None, 2.5,
                                    (0.5,))
  torch.testing.assert_close(out.cpu(), r_out.detach())
  torch.testing.assert_close(total.cpu(), r_total.detach())
  assert arg.dtype == torch.int32 and int(arg.cpu()) == int(a0.argmax())
  g = torch.tensor(rng.standard_normal((3, 5)), dtype=torch.float32)
  grads = torch.autograd.grad((out * g.to(device)).sum() + 3 * total,
                              [a, b] + ([c] if with_c else []))
  r_grads = torch.autograd.grad((r_out * g).sum() + 3 * r_total,
                                [ra, rb] + ([rc] if with_c else []))
  for got, want in zip(grads, r_grads):
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_c", [True, False])
def test_cpu_forward_and_grad(rng, with_c):
  _check_against_torch(torch.device("cpu"), rng, with_c)


@pytest.mark.parametrize("with_c", [True, False])
def test_xla_forward_and_grad(rng, xla_device, with_c):
  _check_against_torch(xla_device, rng, with_c)


def test_only_used_output_gets_cotangent(rng):
  a = torch.randn(3, 5, requires_grad=True)
  b = torch.randn(3, 5, requires_grad=True)
  _, total, _ = PROBE([a, b, None], alpha=1.0, shift=(0.0,))
  total.backward()
  torch.testing.assert_close(a.grad, b.detach())
  torch.testing.assert_close(b.grad, a.detach())


def test_meta_tensors_give_shapes():
  a = torch.empty(7, 2, device="meta")
  out, total, arg = PROBE([a, a, None], alpha=1.0, shift=(0.0,))
  assert out.device.type == "meta" and out.shape == (7, 2)
  assert total.shape == () and arg.dtype == torch.int32


def test_registered_in_torch_library(rng):
  a = torch.tensor(rng.standard_normal((2, 2)), dtype=torch.float32)
  static = _core.encode_static(dict(alpha=1.0, shift=(1.0,),
                                    _layout=(True, True, False)))
  out = torch.ops.pallas_kernels_impl._test_scale_add(static, [a, a])
  torch.testing.assert_close(out[0], a + torch.sin(a) + 1.0)
  torch.library.opcheck(torch.ops.pallas_kernels_impl._test_scale_add.default,
                        (static, [a.requires_grad_(), a.detach()]),
                        test_utils=("test_schema", "test_faketensor"))


def test_static_encoding_round_trips():
  static = {"b": (1, (2.5, None)), "a": True, "s": "x'y", "d": {"k": 3},
            "i": (float("inf"), -float("inf"))}
  text = _core.encode_static(static)
  assert _core.decode_static(text) == static
  assert text == _core.encode_static(dict(reversed(list(static.items()))))
  with pytest.raises(TypeError, match="static parameter"):
    _core.encode_static({"f": object()})


def test_symbolic_statics_are_specialized():
  """SymInt / SymFloat statics (what dynamic-shape tracing hands a static
  parameter) encode as their values, each guarded on that value."""
  from torch._dynamo.source import ConstantSource
  from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
  env = ShapeEnv()
  n = env.create_symintnode(env.create_symbol(
      5, ConstantSource("n"), dynamic_dim=DimDynamic.DYNAMIC), hint=5)
  f = env.create_symfloatnode(env.create_unspecified_symbol(
      0.25, ConstantSource("f"), dynamic_dim=DimDynamic.DYNAMIC), hint=0.25)
  assert isinstance(n, torch.SymInt) and isinstance(f, torch.SymFloat)
  static = dict(n=n, f=f, pair=(n, 2), flag=True)
  plain = dict(n=5, f=0.25, pair=(5, 2), flag=True)
  assert _core.encode_static_cached(static) == _core.encode_static(plain)
  assert _core.decode_static(_core.encode_static(static)) == plain
  assert len(env.guards) == 2   # n == 5 and f == 0.25


def test_mixed_devices_rejected(xla_device):
  a = torch.randn(2, 2)
  with pytest.raises(ValueError, match="one device"):
    PROBE([a, a.to(xla_device), None], alpha=1.0, shift=(0.0,))


def test_xla_step_has_no_transfer_and_no_recompile(rng, xla_device):
  """Three identical steps: one compile, no device-to-host copies."""
  a = torch.randn(4, 3, device=xla_device, requires_grad=True)
  b = torch.randn(4, 3, device=xla_device)
  torch_xla.sync()
  counts = []
  transfers = None
  for step in range(3):
    out, total, _ = PROBE([a, b, None], alpha=0.5, shift=(1.0,))
    (out.sum() + total).backward()
    with torch.no_grad():
      a -= 0.1 * a.grad
    a.grad = None
    torch_xla.sync()
    if step == 0:
      transfers = (met.metric_data("TransferFromDeviceTime") or [0])[0]
    counts.append((met.metric_data("CompileTime") or [0])[0])
  assert counts[1] == counts[2]
  assert (met.metric_data("TransferFromDeviceTime") or [0])[0] == transfers


def test_torch_compile_openxla(rng, xla_device):
  def model(a, b):
    out, total, _ = PROBE([a, b, None], alpha=2.0, shift=(0.25,))
    return out.sum() * 3 + total

  a0 = torch.tensor(rng.standard_normal((3, 4)), dtype=torch.float32)
  b0 = torch.tensor(rng.standard_normal((3, 4)), dtype=torch.float32)
  compiled = torch.compile(model, backend="openxla", fullgraph=True)
  a = a0.to(xla_device).requires_grad_()
  value = compiled(a, b0.to(xla_device))
  value.backward()
  ra = a0.clone().requires_grad_()
  want = model(ra, b0)
  want.backward()
  torch.testing.assert_close(value.detach().cpu(), want.detach(), rtol=1e-5,
                             atol=1e-5)
  torch.testing.assert_close(a.grad.cpu(), ra.grad, rtol=1e-5, atol=1e-5)


def test_torch_compile_cpu_inductor_free(rng):
  """torch.compile on CPU tensors with the eager backend (no C++ compiler)."""
  compiled = torch.compile(
      lambda a: PROBE([a, a, None], alpha=1.0, shift=(0.0,))[0],
      backend="aot_eager", fullgraph=True)
  a = torch.tensor(rng.standard_normal(5), dtype=torch.float32)
  torch.testing.assert_close(compiled(a), a + torch.sin(a))


def _flavour_probe(a, *, alpha):
  """Records the interpreter flavour forced whenever it is traced."""
  FLAVOURS_SEEN.append(_backend.forced_interpret_flavour())
  return (a * alpha,)


FLAVOURS_SEEN: list = []
FLAVOUR_PROBE = _core.JaxOp("_test_flavour_probe", _flavour_probe)


@pytest.mark.parametrize("path", ["fast", "custom ops"])
def test_backward_on_another_thread_keeps_forced_flavour(monkeypatch, path):
  """autograd runs a CUDA backward on its device thread, where the caller's
  ``force_interpret`` context is gone: the backward must still be traced
  with the forward's flavour (and find the forward's residual plan)."""
  if path == "custom ops":
    monkeypatch.setattr(_eager, "plain_device", lambda tensors: None)
  # An alpha of its own per case: nothing cached by another test.
  alpha = {"fast": 1.25, "custom ops": 1.5}[path]
  a = torch.randn(4, requires_grad=True)
  FLAVOURS_SEEN.clear()
  with pk.force_interpret("generic"):
    out = FLAVOUR_PROBE([a], alpha=alpha)[0]
  errors = []

  def backward():
    try:
      out.sum().backward()
    except Exception as e:  # reported below, on the test's thread
      errors.append(e)
  thread = threading.Thread(target=backward)
  thread.start()
  thread.join()
  assert not errors, errors
  torch.testing.assert_close(a.grad, torch.full((4,), alpha))
  assert FLAVOURS_SEEN and set(FLAVOURS_SEEN) == {"generic"}, FLAVOURS_SEEN


def test_forced_flavour_recorded_in_static():
  a = torch.randn(3)
  with pk.force_interpret("generic"):
    inside = _core.encode_static_cached(dict(alpha=2.0, _layout=(True,),
                                             _interpret="generic"))
  assert _core.flavour_of(inside) == "generic"
  outside = _core.encode_static(dict(alpha=2.0, _layout=(True,),
                                     _interpret=None))
  with pk.force_interpret("generic"):
    assert _core.flavour_of(outside) is None   # recorded: none forced
    direct = _core.encode_static(dict(alpha=2.0, _layout=(True,)))
    assert _core.flavour_of(direct) == "generic"  # not recorded: now's
  torch.testing.assert_close(FLAVOUR_PROBE([a], alpha=2.0)[0], 2 * a)


from hypothesis import given, strategies as st  # noqa: E402

_static_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) |
    st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.tuples(inner, inner) | st.dictionaries(
        st.text(min_size=1, max_size=3), inner, max_size=3),
    max_leaves=6)


@given(st.dictionaries(st.text(min_size=1, max_size=4), _static_values,
                       max_size=4))
def test_static_encoding_property(static):
  assert _core.decode_static(_core.encode_static(static)) == static


@pytest.mark.parametrize("static", [
    dict(a=1), dict(a=True), dict(a=1.0), dict(a=0.0), dict(a=-0.0),
    dict(a=None, b="x", c=(True, False)), dict(c=(1, 0)), dict(c=(1.0, 0)),
    dict(d={"k": 2}), dict(e=(("nested",),)), dict(f=2.5, g=float("inf"))])
def test_cached_static_encoding_keeps_types_apart(static):
  # Repeated twice so the second reads the cache; 1, 1.0 and True, or 0.0
  # and -0.0, must never share an entry.
  for _ in range(2):
    assert _core.encode_static_cached(dict(static)) == _core.encode_static(
        static)
  with pytest.raises(ValueError, match="NaN"):
    _core.encode_static_cached(dict(a=float("nan")))
