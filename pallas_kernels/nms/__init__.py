"""Greedy non-maximum suppression: blocked on-chip kernels for TPU and GPU.

``nms`` (one image), ``batched_nms`` (many images, optionally class-aware)
and ``soft_nms`` (reference only). See ``reference`` for the semantics,
``mosaic_tpu`` and ``gpu`` for the algorithms.

``pallas_kernels.nms`` names both this package and the op: once the package
is imported, Python binds the package to that attribute. Until the package
gets a name of its own (its modules import each other relatively, so a
rename touches only the importers), the package itself is made callable:
calling it runs :func:`nms`.
"""
import sys
import types

from .api import batched_nms, nms, soft_nms

__all__ = ["nms", "batched_nms", "soft_nms"]


class _CallableFamily(types.ModuleType):
  def __call__(self, *args, **kwargs):
    return nms(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableFamily
