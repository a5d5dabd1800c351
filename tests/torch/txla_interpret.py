"""Run torch_xla's own Pallas TPU custom kernels on the CPU, interpreted.

torch_xla (``torch_xla.experimental.custom_kernel``) lowers a JAX Pallas
kernel for TPU, takes the Mosaic payload out of the lowered module
(``trace_pallas``) and emits it as a TPU custom call
(``torch_xla._XLAC._xla_tpu_custom_call``); neither runs on CPU.
``install(monkeypatch)`` replaces those two hooks: ``trace_pallas`` traces
the same kernel function with the same static arguments to a jaxpr and keeps
its ``pallas_call`` equation as the payload, and the custom call binds that
equation with ``interpret=True`` (Pallas' CPU interpreter) on the operands
torch_xla prepared. Everything else (block sizes, padding, segment-id
layout, the l/m residuals, the backward's kernels) is torch_xla's own code.
The custom call runs eagerly (operands copied to host and back), so it is
for tests only.

Kernels torch_xla hands to ``xla_builder.call_jax`` instead (``gmm``,
``tgmm``: JAX's megablox kernels) are run the same way: ``call_jax`` is
replaced by a host call of the same JAX function with ``interpret=True``
(the real one lowers for the XLA device, where a Pallas TPU kernel needs
Mosaic, and needs torchax, which this environment cannot import).
"""
from __future__ import annotations

import numpy as np
import torch


def _pallas_eqn(jaxpr):
  from jax._src.pallas import pallas_call
  for eqn in jaxpr.eqns:
    if eqn.primitive is pallas_call.pallas_call_p:
      return eqn
    for param in eqn.params.values():
      inner = getattr(param, "jaxpr", None)
      inner = getattr(inner, "jaxpr", inner)
      if inner is not None and hasattr(inner, "eqns"):
        found = _pallas_eqn(inner)
        if found is not None:
          return found
  return None


def _trace_pallas(kernel, *args, static_argnums=None, static_argnames=None,
                  use_cache=False, **kwargs):
  import jax
  from jax._src.pallas import pallas_call
  from torch_xla.experimental import custom_kernel as ck
  del static_argnames, use_cache  # keyword arguments are all static here
  abstract, tensors = [], []
  for a in args:
    if torch.is_tensor(a):
      abstract.append(ck.to_jax_shape_dtype_struct(a))
      tensors.append(a)
    else:
      abstract.append(a)
  static = set(static_argnums or ())
  dynamic = [i for i in range(len(abstract)) if i not in static]

  def fn(*values):
    full = list(abstract)
    for i, value in zip(dynamic, values):
      full[i] = value
    return kernel(*full, **kwargs)

  eqn = _pallas_eqn(jax.make_jaxpr(fn)(*[abstract[i] for i in dynamic]).jaxpr)
  if eqn is None:
    raise AssertionError(f"no pallas_call in {kernel}")
  params = dict(eqn.params, interpret=True)
  return (lambda *ops: pallas_call.pallas_call_p.bind(*ops, **params)), tensors


def _tpu_custom_call(args, payload, shapes, dtypes):
  import jax.numpy as jnp
  device = args[0].device
  outs = payload(*[jnp.asarray(a.detach().cpu().numpy()) for a in args])
  return [torch.from_numpy(np.array(o)).to(device=device, dtype=d).reshape(s)
          for o, s, d in zip(outs, shapes, dtypes)]


def _host_value(a):
  import jax.numpy as jnp
  from torch_bridge import _convert
  if torch.is_tensor(a):
    host = a.detach().cpu()
    if host.dtype == torch.bfloat16:  # numpy has no bfloat16
      return jnp.asarray(host.float().numpy()).astype(jnp.bfloat16)
    return jnp.asarray(host.numpy())
  if isinstance(a, torch.dtype):
    return _convert.jax_dtype(a)
  return a


def _call_jax(jax_func, args, kwargs=None, name=None, override_hash=None):
  """``xla_builder.call_jax``: ``jax_func`` (a Pallas TPU kernel's wrapper)
  interpreted on the host, results back on the first tensor's device."""
  import jax
  import jax.numpy as jnp
  from torch_bridge import _convert
  del name, override_hash
  device = next(a.device for a in args if torch.is_tensor(a))
  outs = jax_func(*[_host_value(a) for a in args],
                  **{k: _host_value(v) for k, v in (kwargs or {}).items()},
                  interpret=True)

  def back(o):
    dtype = _convert.torch_dtype(o.dtype)
    host = np.array(o.astype(jnp.float32) if dtype == torch.bfloat16 else o)
    return torch.from_numpy(host).to(device=device, dtype=dtype)
  return jax.tree.map(back, outs)


def install(monkeypatch):
  """torch_xla's custom kernels run in Pallas' interpreter until
  ``monkeypatch`` undoes it; returns ``torch_xla...custom_kernel``."""
  import torch_xla
  import torch_xla.core.xla_builder as xb
  from torch_xla.experimental import custom_kernel as ck
  monkeypatch.setattr(ck, "trace_pallas", _trace_pallas)
  monkeypatch.setattr(torch_xla._XLAC, "_xla_tpu_custom_call",
                      _tpu_custom_call)
  monkeypatch.setattr(xb, "call_jax", _call_jax)
  return ck
