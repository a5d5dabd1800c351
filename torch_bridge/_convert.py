"""Moving arrays between torch and JAX without copies where possible.

CPU and CUDA tensors cross via DLPack (zero-copy when the buffer's alignment
and layout suit the consumer); tensors DLPack cannot carry (empty tensors,
misaligned CPU buffers) fall back to a NumPy copy. XLA tensors never come
here: they are embedded into the torch_xla graph (``_xla.py``).
"""
from __future__ import annotations

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


def to_jax(t: torch.Tensor | None, device=None):
  """A JAX array sharing ``t``'s buffer (CPU or CUDA); None stays None."""
  if t is None:
    return None
  t = t.detach()
  if not t.is_contiguous():
    t = t.contiguous()
  if t.numel() > 0:
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
