"""Quantized matmul family: int8, int4 and fp8 weights (and fp8 x fp8).

See ``api`` for the modes and semantics, ``formats`` for the quantization
arithmetic, ``mosaic_tpu`` / ``triton`` for the kernels and ``block_sizes``
for the tiles.
"""
from pallas_kernels.quant.api import quantize, quantized_matmul  # noqa: F401

__all__ = ["quantize", "quantized_matmul"]
