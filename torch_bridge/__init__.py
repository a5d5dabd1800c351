"""pallas_kernels as PyTorch ops and modules (torch_xla, CPU and CUDA tensors).

``ops`` (each also ``torch.ops.pallas_kernels.<name>``), ``modules`` and
``custom_kernel`` (torch_xla's drop-ins); guide and limits: docs/torch.md.
"""
from __future__ import annotations

import importlib

from pallas_kernels import _registry

_OPS = tuple(op.name for op in _registry.torch_ops()) + ("UnshardedWarning",)
_MODULES = ("Attention", "Int8Linear", "QuantizedLinear", "IoULoss",
            "GIoULoss", "DIoULoss", "CIoULoss")
_EXPORTS = {**{name: "torch_bridge.ops" for name in _OPS},
            **{name: "torch_bridge.modules" for name in _MODULES}}

__all__ = sorted(_EXPORTS) + ["ops", "modules", "custom_kernel"]


def __getattr__(name):
  if name in _EXPORTS:
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
  elif name in ("ops", "modules", "custom_kernel"):
    value = importlib.import_module(f"torch_bridge.{name}")
  else:
    raise AttributeError(f"module 'torch_bridge' has no attribute {name!r}")
  globals()[name] = value
  return value


def __dir__():
  return __all__
