"""Arrays between torch and JAX: DLPack (zero-copy where the buffer suits the
consumer, cached views of torch memory), else a NumPy copy (empty tensors,
misaligned CPU buffers). XLA tensors never come here (``_xla.py``).
"""
from __future__ import annotations

import atexit
import ctypes
import functools
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


def _jaxlib_entry(name: str):
  """jaxlib's DLPack entry point ``name``, or None. Called directly they
  skip the public wrappers' checks and re-wraps (``jax.dlpack.from_dlpack``
  re-wraps through ``jnp.asarray``, ~60 us a tensor)."""
  try:
    from jax._src.lib import _jax as jaxlib_ext
  except ImportError:
    from jax._src.lib import xla_client
    jaxlib_ext = xla_client._xla
  return getattr(jaxlib_ext, name, None)


_TO_BUFFER = _jaxlib_entry("dlpack_managed_tensor_to_buffer")
_TO_CAPSULE = _jaxlib_entry("buffer_to_dlpack_managed_tensor")


def _ready_stream(device):
  try:
    return device.get_stream_for_external_ready_events()
  except Exception:  # CPU: no streams
    return None


def _public_import(t: torch.Tensor, device):
  del device  # DLPack names it
  return jax.dlpack.from_dlpack(t)


class _Importer:
  """``importer(t) -> jax.Array`` on one JAX device: ``_TO_BUFFER`` with
  the argument count this jaxlib takes (found on the first tensor), else
  the public ``jax.dlpack.from_dlpack``."""

  def __init__(self, device):
    self.device = device
    self.stream = _ready_stream(device)
    self.extra = None if _TO_BUFFER else _public_import
    self.cpu = device.platform == "cpu"

  def __call__(self, t: torch.Tensor):
    if self.extra is _public_import or t.dtype not in _FAST_DTYPES:
      return _public_import(t, self.device)
    capsule = torch.utils.dlpack.to_dlpack(t)  # streams ordered by to_jax
    if self.extra is not None:
      return _TO_BUFFER(capsule, self.device, self.stream, *self.extra)
    for extra in ((), (None,), (None, 1 if self.cpu else 2)):
      try:
        out = _TO_BUFFER(capsule, self.device, self.stream, *extra)
      except TypeError:  # another signature: the capsule is still unused
        continue
      self.extra = extra
      return out
    self.extra = _public_import
    return _public_import(t, self.device)


class _DLDevice(ctypes.Structure):
  _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
  _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8),
              ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
  _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice),
              ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
              ("shape", ctypes.POINTER(ctypes.c_int64)),
              ("strides", ctypes.POINTER(ctypes.c_int64)),
              ("byte_offset", ctypes.c_uint64)]


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _DLManagedTensor(ctypes.Structure):
  _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
              ("deleter", _DELETER)]


_NO_OWNER = _DELETER(lambda _: None)
_NEW_CAPSULE = ctypes.pythonapi.PyCapsule_New
_NEW_CAPSULE.restype = ctypes.py_object
_NEW_CAPSULE.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
# DLPack type codes: 0 int, 1 uint, 2 float, 4 bfloat, 6 bool.
_DL_TYPES = {torch.float32: (2, 32), torch.bfloat16: (4, 16),
             torch.float16: (2, 16), torch.int8: (0, 8), torch.uint8: (1, 8),
             torch.int16: (0, 16), torch.int32: (0, 32), torch.bool: (6, 8)}


def _unowned_capsule(t: torch.Tensor):
  """A DLPack capsule describing contiguous ``t``'s memory that holds no
  reference to it (its deleter does nothing), and the ctypes objects it
  points into, which must outlive the JAX array made from it."""
  code, bits = _DL_TYPES[t.dtype]
  shape = (ctypes.c_int64 * t.dim())(*t.shape)
  managed = _DLManagedTensor()
  managed.dl_tensor.data = t.data_ptr()
  managed.dl_tensor.device = _DLDevice(2 if t.is_cuda else 1, t.device.index
                                       or 0)
  managed.dl_tensor.ndim = t.dim()
  managed.dl_tensor.dtype = _DLDataType(code, bits, 1)
  managed.dl_tensor.shape = shape
  managed.deleter = _NO_OWNER
  capsule = _NEW_CAPSULE(ctypes.addressof(managed), b"dltensor", None)
  return capsule, (managed, shape)


class _Views:
  """JAX arrays over torch memory, by (address, shape, dtype): each address
  imported once, as a view that does not own it (``_unowned_capsule``; why
  that is safe: docs/design/torch_bridge.md, "Cached views")."""

  MAX_ENTRIES = 1024

  def __init__(self, importer: _Importer):
    self.importer = importer
    self.entries: dict[tuple, tuple] = {}

  def get(self, t: torch.Tensor):
    key = (t.data_ptr(), t.shape, t.dtype)
    entry = self.entries.get(key)
    if entry is not None:
      return entry[0]
    if t.dtype not in _DL_TYPES or self.importer.extra is None:
      return self.importer(t)  # the first import settles the signature
    capsule, keep = _unowned_capsule(t)
    try:
      view = _TO_BUFFER(capsule, self.importer.device, self.importer.stream,
                        *self.importer.extra)
    except Exception:  # jaxlib refused the unowned capsule: an owned import
      return self.importer(t)
    if view.unsafe_buffer_pointer() != t.data_ptr():  # a copy: not a view
      return view
    if len(self.entries) >= self.MAX_ENTRIES:
      del self.entries[next(iter(self.entries))]
    self.entries[key] = (view, keep)
    return view


_VIEWS: dict[Any, _Views] = {}  # by JAX device
_VIEWS_OF: dict[torch.device, _Views] = {}  # the same, by torch device


@atexit.register
def _drop_views():
  # Views are dropped while Python still runs their (Python) deleter; later,
  # at interpreter teardown, the callback would crash the process.
  _VIEWS_OF.clear()
  _VIEWS.clear()


def _import(t: torch.Tensor, views: _Views):
  """A JAX array over ``t``'s buffer (a copy where DLPack cannot carry it).
  On CUDA the caller has ordered JAX's external-ready stream after torch's
  current one (``to_jax``)."""
  t = t.detach()
  copied = not t.is_contiguous()
  if copied:  # a temporary: only an owned import keeps it alive
    t = t.contiguous()
  if t.numel() > 0:
    importer = views.importer
    try:
      if (copied or importer.extra is _public_import
          or t.dtype not in _FAST_DTYPES):
        return importer(t)
      return views.get(t)
    except Exception:  # alignment / dtype DLPack refuses: copy instead
      if t.device.type != "cpu":
        raise
  return jax.device_put(_numpy_copy(t), views.importer.device)


def _after_torch_work(torch_device: torch.device, importer) -> None:
  """Makes JAX's stream for external buffers wait for the work torch has
  queued on its current stream (what ``Tensor.__dlpack__(stream=...)`` does
  per tensor; here once per call)."""
  stream, event = _stream_and_event(importer.stream, torch_device)
  # One event serves every call: a wait takes the event's latest record.
  # The C methods: the Python wrappers only fill in default streams.
  _EVENT_RECORD(event, _current_stream(torch_device))
  _EVENT_WAIT(event, stream)


if hasattr(torch._C, "_CudaEventBase"):
  _EVENT_RECORD = torch._C._CudaEventBase.record
  _EVENT_WAIT = torch._C._CudaEventBase.wait


def _current_stream(torch_device: torch.device) -> torch.cuda.Stream:
  """``torch.cuda.current_stream(torch_device)``, without making a new
  Stream object per call."""
  return _torch_stream(*torch._C._cuda_getCurrentStream(
      _cuda_index(torch_device)))


@functools.lru_cache(maxsize=None)
def _torch_stream(stream_id: int, device_index: int, device_type: int):
  return torch.cuda.Stream(stream_id=stream_id, device_index=device_index,
                           device_type=device_type)


def _cuda_index(torch_device: torch.device) -> int:
  return torch_device.index if torch_device.index is not None else 0


@functools.lru_cache(maxsize=None)
def _stream_and_event(pointer: int, torch_device: torch.device):
  return (torch.cuda.ExternalStream(pointer, device=torch_device),
          torch.cuda.Event())


def _views_for(torch_device: torch.device) -> _Views:
  device = jax_device_for(torch_device)
  views = _VIEWS.get(device)
  if views is None:
    views = _VIEWS[device] = _Views(_Importer(device))
  _VIEWS_OF[torch_device] = views
  return views


def to_jax(tensors, torch_device: torch.device) -> list:
  """JAX arrays sharing the buffers of CPU/CUDA ``tensors`` (None stays
  None), ready once torch's work queued so far is done."""
  views = _VIEWS_OF.get(torch_device)
  if views is None:
    views = _views_for(torch_device)
  if torch_device.type == "cuda":
    _after_torch_work(torch_device, views.importer)
  entries, out = views.entries, []
  for t in tensors:
    # A contiguous tensor where a view was made before: the common case,
    # looked up before anything else (``_Views.get`` keys it the same way).
    entry = (entries.get((t.data_ptr(), t.shape, t.dtype))
             if t is not None and t.is_contiguous() else None)
    out.append(entry[0] if entry is not None
               else None if t is None else _import(t, views))
  return out


_fast_export: list[bool] = [_TO_CAPSULE is not None]


def _capsule(a, stream):
  if _fast_export[0]:
    try:
      return _TO_CAPSULE(a, stream=stream)
    except TypeError:  # another signature: the public path from now on
      _fast_export[0] = False
  return a.__dlpack__(stream=stream)


def _export(a, device: torch.device, stream) -> torch.Tensor:
  if a.size > 0:
    try:
      out = torch._C._from_dlpack(_capsule(a, stream))
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


def to_torch(arrays, device: torch.device, inputs=()) -> list[torch.Tensor]:
  """Torch tensors on ``device`` sharing the JAX ``arrays``' buffers where
  DLPack can, ordered on torch's current stream after JAX's work. An array
  that is one of the ``inputs``' buffers handed back (jit may alias) is
  copied, so no output aliases an input."""
  stream = None
  if device.type == "cuda":  # torch's DLPack convention: 1 = legacy default
    stream = torch._C._cuda_getCurrentRawStream(_cuda_index(device)) or 1
  out = [_export(a, device, stream) for a in arrays]
  in_ptrs = {t.data_ptr() for t in inputs if t is not None and t.numel()}
  if in_ptrs:
    out = [o.clone() if o.numel() and o.data_ptr() in in_ptrs else o
           for o in out]
  return out


@functools.lru_cache(maxsize=None)
def jax_device_for(device: torch.device):
  """The JAX device matching a CPU/CUDA torch device."""
  if device.type == "cpu":
    return jax.devices("cpu")[0]
  if device.type == "cuda":
    return jax.devices("cuda")[_cuda_index(device)]
  raise ValueError(f"no JAX device for torch device {device}")
