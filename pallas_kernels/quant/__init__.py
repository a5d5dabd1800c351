"""Quantized matmul family: int8, int4 and fp8 weights (and fp8 x fp8), the int8
ops, and their layers.
"""
from pallas_kernels.quant.api import quantize, quantized_matmul  # noqa: F401

__all__ = ["quantize", "quantized_matmul"]
