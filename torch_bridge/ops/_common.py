"""Checks and conversions shared by the torch ops (dtypes, devices, ids,
boxes, 8-bit formats, partition_spec).
"""
from __future__ import annotations

import torch


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_INTS = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)
# Boxes as torchvision takes them: integers are upcast, float64 runs in float32.
_BOX_DTYPES = _FLOATS + (torch.float64,) + _INTS


# ---------------------------------------------------------------- checks --

def _check_tensor(op: str, name: str, t, *, dtypes=None, ndim=None,
                  min_ndim=None, optional=False):
  if t is None:
    if optional:
      return None
    raise TypeError(f"{op}: {name} must be a torch.Tensor, got None")
  if not isinstance(t, torch.Tensor):
    raise TypeError(f"{op}: {name} must be a torch.Tensor, got "
                    f"{type(t).__name__}")
  if dtypes is not None and t.dtype not in dtypes:
    names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
    raise TypeError(f"{op}: {name} must have dtype {names}; got "
                    f"{str(t.dtype).replace('torch.', '')}")
  if ndim is not None and t.dim() != ndim:
    raise ValueError(f"{op}: {name} must have {ndim} dimensions, got shape "
                     f"{tuple(t.shape)}")
  if min_ndim is not None and t.dim() < min_ndim:
    raise ValueError(f"{op}: {name} must have at least {min_ndim} "
                     f"dimension(s), got shape {tuple(t.shape)}")
  return t


def _check_devices(op: str, named: dict[str, torch.Tensor | None]):
  first = None
  for name, t in named.items():
    if t is None:
      continue
    if t.device.type not in ("cpu", "cuda", "xla", "meta"):
      raise ValueError(f"{op}: {name} is on device {t.device}; supported: "
                       "cpu, cuda, xla, meta")
    if first is None:
      first = (name, t.device)
    elif t.device != first[1]:
      raise ValueError(f"{op}: {name} is on {t.device} but {first[0]} is on "
                       f"{first[1]}; all tensors must share a device")


_INT32 = torch.iinfo(torch.int32)


def _ids_int32(*ids):
  """Integer id tensors as int32 with equality kept exactly: int64 values
  that may not fit are replaced by their rank among all the given ids (a
  sort on device; no host sync on XLA tensors or while tracing)."""
  from torch._subclasses.fake_tensor import is_fake

  from torch_bridge import _eager
  present = [t for t in ids if t is not None]
  wide = [t for t in present if t.dtype == torch.int64]
  lazy = wide and (_eager.transformed() or any(
      t.device.type in ("xla", "meta") or is_fake(t) for t in wide))
  if wide and (lazy or any(
      t.numel() and (int(t.min()) < _INT32.min or int(t.max()) > _INT32.max)
      for t in wide)):
    flat = torch.cat([t.reshape(-1).long() for t in present])
    values, order = torch.sort(flat)
    new = torch.zeros_like(values)
    new[1:] = (values[1:] != values[:-1]).long()
    ranks = torch.empty_like(flat).scatter_(0, order, torch.cumsum(new, 0))
    sizes = [t.numel() for t in present]
    present = [r.reshape(t.shape) for r, t in
               zip(torch.split(ranks, sizes), present)]
  it = iter(t.to(torch.int32) for t in present)
  return tuple(None if t is None else next(it) for t in ids)


def _as_float_boxes(*tensors):
  """torchvision's convention: integer boxes are upcast to float32; float64
  runs in float32 (JAX runs without 64-bit types). Returns the tensors and
  whether a float64 input asks for a float64 result."""
  wide = any(t is not None and t.dtype == torch.float64 for t in tensors)
  out = tuple(t if t is None or t.dtype in _FLOATS else t.float()
              for t in tensors)
  return out, wide


def _is_axis(a) -> bool:
  return isinstance(a, str) or (isinstance(a, int) and not isinstance(a, bool))


def _sharding(static: dict, partition_spec, mesh, op: str):
  if partition_spec is None:
    if mesh is not None:
      raise ValueError(f"{op}: mesh given without partition_spec")
    return static
  if not isinstance(partition_spec, (tuple, list)) or not all(
      e is None or _is_axis(e) or (isinstance(e, (tuple, list)) and
                                   all(_is_axis(a) for a in e))
      for e in partition_spec):
    raise TypeError(f"{op}: partition_spec must be a tuple with one entry per "
                    "dimension: a mesh axis name, a tuple of names, or None; "
                    f"got {partition_spec!r}")
  partition_spec = tuple(tuple(e) if isinstance(e, list) else e
                         for e in partition_spec)
  static = dict(static, _partition_spec=partition_spec)
  if mesh is not None:
    static["_mesh"] = str(mesh)
  return static


# -------------------------------------------------- quantized formats --

# torch dtypes of the 8-bit formats; float8 crosses DLPack as its bytes
# (uint8) and is bitcast back inside the JAX function.
_FLOAT8 = {torch.float8_e4m3fn: "float8_e4m3fn",
           torch.float8_e5m2: "float8_e5m2"}
_QUANT_DTYPES = {torch.int8: "int8", **_FLOAT8}


def _bytes_of(t):
  """``t`` as DLPack can carry it: float8 viewed as uint8, else itself."""
  return t.view(torch.uint8) if t is not None and t.dtype in _FLOAT8 else t


def _format_name(t):
  return None if t is None else _QUANT_DTYPES.get(t.dtype)


def _from_bytes(a, format_name):
  """The JAX side of ``_bytes_of``."""
  import jax
  import jax.numpy as jnp
  if a is None or format_name not in _FLOAT8.values():
    return a
  return jax.lax.bitcast_convert_type(a, getattr(jnp, format_name))


def _to_bytes(a):
  """float8 JAX results as uint8 (viewed back as float8 in torch)."""
  import jax
  import jax.numpy as jnp
  if jnp.dtype(a.dtype).name in _FLOAT8.values():
    return jax.lax.bitcast_convert_type(a, jnp.uint8)
  return a


def _torch_format(dtype, op: str, name: str) -> str:
  if dtype not in _QUANT_DTYPES:
    names = ", ".join(str(d).replace("torch.", "") for d in _QUANT_DTYPES)
    raise TypeError(
        f"{op}: {name} must be one of {names}, got "
        f"{str(dtype).replace('torch.', '')} (int4: torch has no 4-bit "
        "dtype that DLPack can carry; use pallas_kernels from JAX)")
  return _QUANT_DTYPES[dtype]


def _widened(t, wide: bool):
  return t.double() if wide else t
