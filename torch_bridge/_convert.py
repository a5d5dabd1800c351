"""Moving arrays between torch and JAX without copies where possible.

CPU and CUDA tensors cross via DLPack (zero-copy when the buffer's alignment
and layout suit the consumer); tensors DLPack cannot carry (empty tensors,
misaligned CPU buffers) fall back to a NumPy copy. XLA tensors never come
here: they are embedded into the torch_xla graph (``_xla.py``).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

_TORCH_TO_JAX = {
    torch.float32: jnp.float32,
    torch.float64: jnp.float64,
    torch.float16: jnp.float16,
    torch.bfloat16: jnp.bfloat16,
    torch.int8: jnp.int8,
    torch.uint8: jnp.uint8,
    torch.int16: jnp.int16,
    torch.int32: jnp.int32,
    torch.int64: jnp.int64,
    torch.bool: jnp.bool_,
}
_JAX_TO_TORCH = {np.dtype(v): k for k, v in _TORCH_TO_JAX.items()}


def jax_dtype(dtype: torch.dtype):
  try:
    return _TORCH_TO_JAX[dtype]
  except KeyError:
    raise TypeError(f"torch dtype {dtype} has no JAX equivalent here") from None


def torch_dtype(dtype) -> torch.dtype:
  try:
    return _JAX_TO_TORCH[np.dtype(dtype)]
  except KeyError:
    raise TypeError(f"JAX dtype {dtype} has no torch equivalent here") from None


def shape_dtype(t: torch.Tensor) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(tuple(t.shape), jax_dtype(t.dtype))


def _numpy_copy(t: torch.Tensor) -> np.ndarray:
  t = t.detach().cpu()
  if t.dtype == torch.bfloat16:  # NumPy has no bfloat16: go through its bits
    return t.view(torch.int16).numpy().view(jnp.bfloat16)
  return t.numpy()


# dtypes JAX keeps as they are without x64 (others it would canonicalize).
_FAST_DTYPES = {torch.float32, torch.bfloat16, torch.float16, torch.int8,
                torch.uint8, torch.int16, torch.int32, torch.bool}
_fast_import_arity: list[int | None] = []  # [] unknown, [None] unavailable


def _ready_stream(device):
  try:
    return device.get_stream_for_external_ready_events()
  except Exception:  # CPU: no streams
    return None


_STREAMS: dict[Any, Any] = {}


def _fast_import(t: torch.Tensor, device):
  """DLPack import without ``jax.dlpack.from_dlpack``'s ``jnp.asarray``
  re-wrap (which costs ~60 us a tensor); None where this jaxlib's private
  entry point has another shape, and the public path is used instead."""
  if _fast_import_arity == [None] or t.dtype not in _FAST_DTYPES:
    return None
  try:
    from jax._src.lib import _jax as jaxlib_ext
  except ImportError:
    from jax._src.lib import xla_client
    jaxlib_ext = xla_client._xla
  to_buffer = getattr(jaxlib_ext, "dlpack_managed_tensor_to_buffer", None)
  if to_buffer is None:
    _fast_import_arity[:] = [None]
    return None
  if device not in _STREAMS:
    _STREAMS[device] = _ready_stream(device)
  stream = _STREAMS[device]
  capsule = t.__dlpack__(stream=stream)
  arities = _fast_import_arity or [3, 4, 5]
  for arity in arities:
    extra = (None, 1 if device.platform == "cpu" else 2)[:arity - 3]
    try:
      out = to_buffer(capsule, device, stream, *extra)
    except TypeError:  # another signature: the capsule is still unused
      continue
    _fast_import_arity[:] = [arity]
    return out
  _fast_import_arity[:] = [None]
  return None


def to_jax(t: torch.Tensor | None, device=None):
  """A JAX array sharing ``t``'s buffer (CPU or CUDA); None stays None."""
  if t is None:
    return None
  t = t.detach()
  if not t.is_contiguous():
    t = t.contiguous()
  if t.numel() > 0:
    if device is not None:
      try:
        fast = _fast_import(t, device)
      except Exception:  # e.g. a misaligned CPU buffer: the public path
        fast = None
      if fast is not None:
        return fast
    try:
      return jax.dlpack.from_dlpack(t)
    except Exception:  # alignment / dtype DLPack refuses: copy instead
      if t.device.type != "cpu":
        raise
  return jax.device_put(_numpy_copy(t), device)


def to_torch(a, device: torch.device) -> torch.Tensor:
  """A torch tensor on ``device`` sharing ``a``'s buffer where DLPack can."""
  if a.size > 0:
    try:
      out = torch.from_dlpack(a)
      if out.device != device:
        out = out.to(device)
      return out
    except Exception:
      if device.type != "cpu":
        raise
  host = np.asarray(a)
  if host.dtype == jnp.bfloat16:
    return torch.from_numpy(host.view(np.int16).copy()).view(
        torch.bfloat16).to(device)
  return torch.from_numpy(np.array(host)).to(device)


def jax_device_for(device: torch.device):
  """The JAX device matching a CPU/CUDA torch device."""
  if device.type == "cpu":
    return jax.devices("cpu")[0]
  if device.type == "cuda":
    index = device.index if device.index is not None else 0
    return jax.devices("cuda")[index]
  raise ValueError(f"no JAX device for torch device {device}")
