"""decode_attention on torch tensors."""
from __future__ import annotations

import torch

from torch_bridge import _shards
from torch_bridge._core import JaxOp
from torch_bridge.ops._common import (
    _FLOATS, _INTS, _QUANT_DTYPES, _bytes_of, _check_devices, _check_tensor,
    _format_name, _from_bytes, _sharding)


def _decode_jax(q, k_cache, v_cache, kv_lengths, sinks, page_table, k_scale,
                v_scale, *, cache_format, **static):
  import pallas_kernels
  return pallas_kernels.decode_attention(
      q, _from_bytes(k_cache, cache_format),
      _from_bytes(v_cache, cache_format), kv_lengths, sinks=sinks,
      page_table=page_table, k_scale=k_scale, v_scale=v_scale, **static)


def _decode_shards(static, spec, arrays, mesh):
  from pallas_kernels.decode import api
  _, _, _, _, sinks, page_table, k_scale, _ = arrays
  return _shards.specs(
      "decode_attention", api.call_rule(sinks, page_table, k_scale), spec,
      arrays, ("q", "k_cache", "v_cache", "kv_lengths", "sinks", "page_table",
               "k_scale", "v_scale"),
      lead="q", split="b", why="only the batch may be split")


_DECODE = JaxOp("decode_attention", _decode_jax, differentiable=(0, 4),
                shard_specs=_decode_shards)


def decode_attention(q, k_cache, v_cache, kv_lengths, *, sm_scale=None,
                     logit_soft_cap=None, sliding_window=None, sinks=None,
                     page_table=None, k_scale=None, v_scale=None,
                     backend=None, partition_spec=None, mesh=None):
  """``pallas_kernels.decode_attention``: ``q [B, H, T, D]`` attending to a
  contiguous ``[B, Hkv, S, D]`` or paged ``[pages, Hkv, page_size, D]`` KV
  cache (``page_table [B, pages_per_seq]``) of ``kv_lengths [B]`` tokens;
  v_cache's head_dim ``Dv`` may differ from D (MLA) and the output ``[B,
  H, T, Dv]`` takes it; 8-bit caches (int8, float8) with
  ``k_scale``/``v_scale [Hkv]``. Differentiable in q and sinks.

  ``partition_spec``: 4 entries for q's dims; only the batch may be split
  (a contiguous cache, kv_lengths and the page table follow it; a paged
  cache's pages are shared, so they are replicated).
  """
  op = "decode_attention"
  _check_tensor(op, "q", q, dtypes=_FLOATS, ndim=4)
  for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
    _check_tensor(op, name, t, dtypes=_FLOATS + tuple(_QUANT_DTYPES), ndim=4)
  _check_tensor(op, "kv_lengths", kv_lengths, dtypes=_INTS, ndim=1)
  _check_tensor(op, "sinks", sinks, dtypes=_FLOATS, ndim=1, optional=True)
  _check_tensor(op, "page_table", page_table, dtypes=_INTS, ndim=2,
                optional=True)
  for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
    _check_tensor(op, name, t, dtypes=_FLOATS, optional=True)
  if k_cache.dtype != v_cache.dtype:
    raise TypeError(f"{op}: k_cache and v_cache must share a dtype, got "
                    f"{k_cache.dtype} and {v_cache.dtype}")
  _check_devices(op, dict(q=q, k_cache=k_cache, v_cache=v_cache,
                          kv_lengths=kv_lengths, sinks=sinks,
                          page_table=page_table, k_scale=k_scale,
                          v_scale=v_scale))
  # Lengths and page numbers are int32 in JAX (no 64-bit types there).
  kv_lengths, page_table = (
      t if t is None or t.dtype == torch.int32 else t.to(torch.int32)
      for t in (kv_lengths, page_table))
  static = dict(cache_format=_format_name(k_cache), sm_scale=sm_scale,
                logit_soft_cap=logit_soft_cap, sliding_window=sliding_window,
                backend=backend)
  static = _sharding(static, partition_spec, mesh, op)
  return _DECODE([q, _bytes_of(k_cache), _bytes_of(v_cache), kv_lengths,
                  sinks, page_table, k_scale, v_scale], **static)[0]
