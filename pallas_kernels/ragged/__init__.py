"""Ragged paged attention: mixed prefill and decode over a paged KV cache,
and the write of the new tokens' K/V into it."""
from pallas_kernels.ragged.api import ragged_paged_attention, write_kv_pages

__all__ = ["ragged_paged_attention", "write_kv_pages"]
