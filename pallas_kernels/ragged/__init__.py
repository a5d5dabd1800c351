"""Ragged paged attention: mixed prefill and decode over a paged KV cache
(or MLA's latent cache), and the write of the new tokens' K/V into it."""
from pallas_kernels.ragged.api import (mla_ragged_paged_attention,
                                       ragged_paged_attention, write_kv_pages)

__all__ = ["mla_ragged_paged_attention", "ragged_paged_attention",
           "write_kv_pages"]
