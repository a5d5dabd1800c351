"""int8 matmul: quantization and int8 matmul with fused epilogues.

The int8 format of the quantization family: its modules are
``pallas_kernels.quant.int8_*`` (``int8_api`` for the modes and semantics).
"""
from pallas_kernels.quant.int8_api import (  # noqa: F401
    MAX_INT8_K, int8_matmul, quantize_int8, shard_int8_matmul)
from pallas_kernels.quant.int8_block_sizes import BlockSizes  # noqa: F401

__all__ = ["BlockSizes", "MAX_INT8_K", "int8_matmul", "quantize_int8",
           "shard_int8_matmul"]

