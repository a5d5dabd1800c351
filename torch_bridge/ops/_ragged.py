"""ragged_paged_attention and mla_ragged_paged_attention (forward only)."""
from __future__ import annotations

import torch

from torch_bridge._core import JaxOp
from torch_bridge.ops._common import (
    _FLOATS, _INTS, _QUANT_DTYPES, _bytes_of, _check_devices, _check_tensor,
    _format_name, _from_bytes)


def _ragged_jax(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                sinks, *, cache_format, **static):
  import pallas_kernels
  return pallas_kernels.ragged_paged_attention(
      q, _from_bytes(kv_pages, cache_format), kv_lens, page_indices,
      cu_q_lens, num_seqs, sinks=sinks, **static)


def _mla_jax(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sinks,
             *, cache_format, **static):
  import pallas_kernels
  return pallas_kernels.mla_ragged_paged_attention(
      q, _from_bytes(kv_pages, cache_format), kv_lens, page_indices,
      cu_q_lens, num_seqs, sinks=sinks, **static)


# pallas_kernels.ragged's (JAX's) default, computed without importing JAX.
_RAGGED_MASK_VALUE = -0.7 * float(torch.finfo(torch.float32).max)
# Forward only (serving): the kernels have no VJP.
_RAGGED = JaxOp("ragged_paged_attention", _ragged_jax, differentiable=())
_MLA = JaxOp("mla_ragged_paged_attention", _mla_jax, differentiable=())


def _static_float(op: str, name: str, value):
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise TypeError(f"{op}: {name} must be a Python float or None, got "
                    f"{type(value).__name__}")
  return float(value)


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens,
                           num_seqs, *, sm_scale=1.0, sliding_window=None,
                           soft_cap=None, mask_value=_RAGGED_MASK_VALUE,
                           k_scale=None, v_scale=None,
                           num_kv_pages_per_block=None,
                           num_queries_per_block=None, vmem_limit_bytes=None,
                           sinks=None, backend=None):
  """``pallas_kernels.ragged_paged_attention`` (JAX's convention): the
  query tokens ``q [T, H, D]`` of ragged sequences (``cu_q_lens [S + 1]``;
  prefill and decode mixed) attend causally to their paged KV cache
  ``kv_pages [num_pages, page_size, 2 * Hkv, D]`` (K of kv head h at
  combined head 2h, V at 2h + 1; float, or int8/float8 with the float
  ``k_scale``/``v_scale``) of ``kv_lens [S]`` tokens through
  ``page_indices [S, pages_per_seq]``; only the first ``num_seqs [1]``
  sequences count. Token t of sequence i sits at position ``kv_lens[i] -
  q_len_i + (t - cu_q_lens[i])``. ``sinks [H]``: attention sinks.
  ``mask_value`` is accepted and unused (masked logits are excluded
  exactly). Returns ``[T, H, D]`` in q's dtype (zeros for tokens outside
  the sequences). Forward only: no gradient. No ``partition_spec`` (under
  SPMD it runs unsharded).
  """
  op = "ragged_paged_attention"
  args, static = _paged_args(
      op, 4, q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sinks,
      sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
      k_scale=k_scale, v_scale=v_scale,
      num_kv_pages_per_block=num_kv_pages_per_block,
      num_queries_per_block=num_queries_per_block,
      vmem_limit_bytes=vmem_limit_bytes, backend=backend)
  del mask_value
  return _RAGGED(args, **static)[0]


def mla_ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens,
                               num_seqs, *, latent_dim, sm_scale=None,
                               sliding_window=None, soft_cap=None,
                               k_scale=None, v_scale=None,
                               num_kv_pages_per_block=None,
                               num_queries_per_block=None,
                               vmem_limit_bytes=None, sinks=None,
                               backend=None):
  """``pallas_kernels.mla_ragged_paged_attention``: DeepSeek's absorbed MLA
  over a paged cache of one latent row per token, ``kv_pages [num_pages,
  page_size, D]`` (latent ‖ rope); every head of ``q [T, H, D]`` attends
  with keys the whole row and values its first ``latent_dim`` columns.
  Metadata and options as ``ragged_paged_attention``'s; ``sm_scale``
  defaults to ``1 / sqrt(D)``. Returns ``[T, H, latent_dim]`` in q's dtype.
  Forward only; no ``partition_spec``.
  """
  op = "mla_ragged_paged_attention"
  args, static = _paged_args(
      op, 3, q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sinks,
      sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
      k_scale=k_scale, v_scale=v_scale,
      num_kv_pages_per_block=num_kv_pages_per_block,
      num_queries_per_block=num_queries_per_block,
      vmem_limit_bytes=vmem_limit_bytes, backend=backend)
  return _MLA(args, latent_dim=latent_dim, **static)[0]


def _paged_args(op, cache_ndim, q, kv_pages, kv_lens, page_indices,
                cu_q_lens, num_seqs, sinks, *, sm_scale, soft_cap, k_scale,
                v_scale, **static):
  """The paged ops' checked tensors (lengths as int32, the cache as bytes)
  and static arguments."""
  _check_tensor(op, "q", q, dtypes=_FLOATS, ndim=3)
  _check_tensor(op, "kv_pages", kv_pages,
                dtypes=_FLOATS + tuple(_QUANT_DTYPES), ndim=cache_ndim)
  _check_tensor(op, "kv_lens", kv_lens, dtypes=_INTS, ndim=1)
  _check_tensor(op, "page_indices", page_indices, dtypes=_INTS, ndim=2)
  _check_tensor(op, "cu_q_lens", cu_q_lens, dtypes=_INTS, ndim=1)
  _check_tensor(op, "num_seqs", num_seqs, dtypes=_INTS, ndim=1)
  _check_tensor(op, "sinks", sinks, dtypes=_FLOATS, ndim=1, optional=True)
  _check_devices(op, dict(q=q, kv_pages=kv_pages, kv_lens=kv_lens,
                          page_indices=page_indices, cu_q_lens=cu_q_lens,
                          num_seqs=num_seqs, sinks=sinks))
  # Lengths and page numbers are int32 in JAX (no 64-bit types there).
  kv_lens, page_indices, cu_q_lens, num_seqs = (
      t if t.dtype == torch.int32 else t.to(torch.int32)
      for t in (kv_lens, page_indices, cu_q_lens, num_seqs))
  static = dict(static, cache_format=_format_name(kv_pages),
                sm_scale=_static_float(op, "sm_scale", sm_scale),
                soft_cap=_static_float(op, "soft_cap", soft_cap),
                k_scale=_static_float(op, "k_scale", k_scale),
                v_scale=_static_float(op, "v_scale", v_scale))
  return [q, _bytes_of(kv_pages), kv_lens, page_indices, cu_q_lens,
          num_seqs, sinks], static
