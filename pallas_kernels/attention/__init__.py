"""Flash attention: Mosaic TPU and GPU Pallas kernels plus a JAX reference.

    from pallas_kernels import flash_attention, shard_flash_attention

See ``api.flash_attention`` for the arguments, ``reference`` for the exact
semantics, ``mosaic_tpu`` for the TPU algorithm and ``block_sizes`` for the
per-generation block table.
"""
from pallas_kernels.attention.api import flash_attention, shard_flash_attention
from pallas_kernels.attention.block_sizes import BlockSizes

__all__ = ["flash_attention", "shard_flash_attention", "BlockSizes"]
