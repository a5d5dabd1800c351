"""Grouped matmul for mixtures of experts (``jax.lax.ragged_dot`` semantics)."""
from pallas_kernels.gmm.api import grouped_matmul, shard_grouped_matmul

__all__ = ["grouped_matmul", "shard_grouped_matmul"]
