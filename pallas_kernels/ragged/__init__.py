"""Ragged paged attention: mixed prefill and decode over a paged KV cache."""
from pallas_kernels.ragged.api import ragged_paged_attention

__all__ = ["ragged_paged_attention"]
