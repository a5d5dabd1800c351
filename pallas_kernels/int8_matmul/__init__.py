"""int8 matmul family: quantization and int8 matmul with fused epilogues.

See ``api`` for the modes and semantics, ``mosaic_tpu`` / ``gpu`` for the
kernels and ``block_sizes`` for the tile tables and VMEM budget.
"""
import sys
import types

from pallas_kernels.int8_matmul.api import (  # noqa: F401
    MAX_INT8_K, int8_matmul, quantize_int8)
from pallas_kernels.int8_matmul.block_sizes import BlockSizes  # noqa: F401

__all__ = ["BlockSizes", "MAX_INT8_K", "int8_matmul", "quantize_int8"]


class _CallableFamily(types.ModuleType):
  """Importing this package binds ``pallas_kernels.int8_matmul`` to the
  package, shadowing the function of the same name; calling the package
  calls the function, so ``pallas_kernels.int8_matmul(x, w)`` always works."""

  def __call__(self, *args, **kwargs):
    return int8_matmul(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableFamily
