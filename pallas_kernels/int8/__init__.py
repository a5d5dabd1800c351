"""int8 matmul family: quantization and int8 matmul with fused epilogues.

See ``api`` for the modes and semantics, ``mosaic_tpu`` / ``triton`` /
``mosaic_gpu`` for the kernels and ``block_sizes`` for the tile tables.
"""
from pallas_kernels.int8.api import (  # noqa: F401
    MAX_INT8_K, int8_matmul, quantize_int8, shard_int8_matmul)
from pallas_kernels.int8.block_sizes import BlockSizes  # noqa: F401

__all__ = ["BlockSizes", "MAX_INT8_K", "int8_matmul", "quantize_int8",
           "shard_int8_matmul"]

