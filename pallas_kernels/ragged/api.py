"""Public ops: ``ragged_paged_attention`` (JAX's calling convention),
``mla_ragged_paged_attention`` over MLA's latent cache, and ``write_kv_pages``,
the cache update of either. Kernels: mosaic_tpu, triton, reference.
Forward only.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _backend
from pallas_kernels.ragged import (cache_mosaic_tpu, mosaic_tpu, reference,
                                   triton)

OP = "ragged_paged_attention"
Q_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
KV_DTYPES = Q_DTYPES + (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2)
# JAX's default; masked logits are excluded exactly here, so it is unused.
DEFAULT_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens,
                           num_seqs, *, sm_scale: float = 1.0,
                           sliding_window: int | None = None,
                           soft_cap: float | None = None,
                           mask_value: float | None = DEFAULT_MASK_VALUE,
                           k_scale: float | None = None,
                           v_scale: float | None = None,
                           num_kv_pages_per_block: int | None = None,
                           num_queries_per_block: int | None = None,
                           vmem_limit_bytes: int | None = None,
                           sinks=None, backend: str | None = None):
  """Attention of a batch of ragged sequences (prefill and decode mixed)
  over a paged KV cache.

  Args:
    q: [T, H, D] float: the query tokens of all sequences, concatenated.
    kv_pages: [num_pages, page_size, 2 * Hkv, D]: K of kv head h at combined
      head 2h, its V at 2h + 1. float, or int8/float8 with scales.
    kv_lens: [S] int32: tokens in each sequence's cache (including its
      new tokens), clipped to ``pages_per_seq * page_size``.
    page_indices: [S, pages_per_seq] int32: sequence i's position p is
      row ``p % page_size`` of page ``page_indices[i, p // page_size]``.
      Entries past a sequence's length are not read (any value).
    cu_q_lens: [S + 1] int32: sequence i owns tokens
      ``cu_q_lens[i]:cu_q_lens[i+1]`` (clipped to [0, T], made
      non-decreasing).
    num_seqs: [1] int32: sequences at or past it are ignored.
    sm_scale: logit scale. sliding_window: a query at position p sees keys
      ``p - sliding_window < j <= p``. soft_cap: logits become
      ``soft_cap * tanh(s / soft_cap)``.
    mask_value: accepted for JAX's signature; masked logits are excluded
      exactly, so a query with no visible key gives zeros.
    k_scale, v_scale: float multipliers of the stored K and V (8-bit).
    num_kv_pages_per_block: pages per kv step of the kernel.
    num_queries_per_block: query tokens per kernel work item (TPU kernel
      default: by sequence, at most 16 // G new tokens in one 16-row item,
      longer sequences in items of 512 // G tokens; G = H / Hkv).
    vmem_limit_bytes: the kernel's scoped VMEM (default: what it needs).
    sinks: None or [H] float: per query head, ``exp(sinks[h])`` joins the
      softmax denominator (attention sinks; not scaled or capped).
    backend: None (the best kernel for the platform), "mosaic_tpu",
      "triton", "gpu", "interpret" or "reference".

  Returns:
    [T, H, D] in q's dtype. Token t of sequence i sits at position
    ``kv_lens[i] - q_len_i + (t - cu_q_lens[i])`` and attends causally to
    its sequence's cache positions up to it (H / Hkv query heads per kv
    head). Tokens outside the first ``num_seqs`` sequences give zeros.
  """
  del mask_value
  return _attention(
      OP, q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
      sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
      k_scale=k_scale, v_scale=v_scale,
      num_kv_pages_per_block=num_kv_pages_per_block,
      num_queries_per_block=num_queries_per_block,
      vmem_limit_bytes=vmem_limit_bytes, sinks=sinks, backend=backend)


def mla_ragged_paged_attention(q, kv_pages, kv_lens, page_indices,
                               cu_q_lens, num_seqs, *, latent_dim: int,
                               sm_scale: float | None = None,
                               sliding_window: int | None = None,
                               soft_cap: float | None = None,
                               k_scale: float | None = None,
                               v_scale: float | None = None,
                               num_kv_pages_per_block: int | None = None,
                               num_queries_per_block: int | None = None,
                               vmem_limit_bytes: int | None = None,
                               sinks=None, backend: str | None = None):
  """Absorbed multi-head latent attention (DeepSeek's MLA) of ragged
  sequences over a paged cache of one shared latent row per token.

  Args:
    q: [T, H, D] float: the absorbed queries (``q_nope @ W_UK`` ‖ ``q_rope``)
      of all sequences' new tokens, concatenated.
    kv_pages: [num_pages, page_size, D]: each token's cache row, the
      compressed latent ‖ its rotary key (D = latent_dim + rope dims). float,
      or int8/float8 with scales.
    kv_lens, page_indices, cu_q_lens, num_seqs: as in
      ``ragged_paged_attention``.
    latent_dim: V is the first latent_dim columns of the row.
    sm_scale: logit scale, default ``1 / sqrt(D)``; DeepSeek's is
      ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)`` (times its YaRN
      factor), pass it.
    sliding_window, soft_cap, k_scale, v_scale, num_kv_pages_per_block,
    num_queries_per_block, vmem_limit_bytes, sinks, backend: as in
      ``ragged_paged_attention`` (k_scale multiplies the row in the logits,
      v_scale in the values).

  Returns:
    [T, H, latent_dim] in q's dtype: every head attends to the rows with
    keys the whole row and values its first latent_dim columns (one kv head
    shared by all H, so the rows are read once for all heads), token t of
    sequence i at position ``kv_lens[i] - q_len_i + (t - cu_q_lens[i])``,
    causally. Tokens outside the first ``num_seqs`` sequences give zeros.
    Up-project the result with ``W_UV`` for the heads' values.
  """
  op = "mla_ragged_paged_attention"
  if (isinstance(latent_dim, bool) or not isinstance(latent_dim, int)
      or latent_dim <= 0):
    raise ValueError(f"{op}: latent_dim={latent_dim!r} must be a positive "
                     "integer")
  if sm_scale is None:
    sm_scale = jnp.shape(q)[-1] ** -0.5 if jnp.ndim(q) else 1.0
  return _attention(
      op, q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
      latent_dim=latent_dim, sm_scale=sm_scale, sliding_window=sliding_window,
      soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale,
      num_kv_pages_per_block=num_kv_pages_per_block,
      num_queries_per_block=num_queries_per_block,
      vmem_limit_bytes=vmem_limit_bytes, sinks=sinks, backend=backend)


def _attention(op, q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
               *, sm_scale, sliding_window, soft_cap, k_scale, v_scale,
               num_kv_pages_per_block, num_queries_per_block,
               vmem_limit_bytes, sinks, backend, latent_dim=None):
  """Either op, checked and dispatched (``latent_dim``: MLA's layout)."""
  q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs = _check(
      q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, op=op,
      latent_dim=latent_dim)
  static = dict(
      sm_scale=_float(op, "sm_scale", sm_scale),
      sliding_window=_positive_int(op, "sliding_window", sliding_window),
      soft_cap=_soft_cap(op, soft_cap),
      k_scale=_scale(op, "k_scale", k_scale),
      v_scale=_scale(op, "v_scale", v_scale))
  blocks = dict(
      num_kv_pages_per_block=_positive_int(op, "num_kv_pages_per_block",
                                           num_kv_pages_per_block),
      num_queries_per_block=_positive_int(op, "num_queries_per_block",
                                          num_queries_per_block),
      vmem_limit_bytes=_positive_int(op, "vmem_limit_bytes",
                                     vmem_limit_bytes))
  _backend.check_backend(op, backend)
  args = (q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
  if sinks is not None:
    sinks = jnp.asarray(sinks)
    if sinks.shape != (q.shape[1],) or not jnp.issubdtype(sinks.dtype,
                                                          jnp.floating):
      raise ValueError(f"{op}: sinks must be [H] = [{q.shape[1]}] float, "
                       f"got shape {sinks.shape} {sinks.dtype}")
    args += (sinks.astype(jnp.float32),)
  value_dim = latent_dim or q.shape[2]
  if q.shape[0] == 0 or page_indices.shape[0] == 0:
    return jnp.zeros(q.shape[:2] + (value_dim,), q.dtype)

  def tpu(*a, interpret=None):
    return mosaic_tpu.ragged(*a, interpret=interpret or False, **static,
                             **blocks, latent_dim=latent_dim)

  if latent_dim is None:
    ref = functools.partial(reference.ragged_paged_attention, **static)
  else:
    ref = functools.partial(reference.mla_ragged_paged_attention,
                            latent_dim=latent_dim, **static)
  rows = [
      _backend.Kernel(
          "mosaic_tpu", tpu,
          supports=lambda: mosaic_tpu.supports(q, kv_pages, page_indices),
          hardware=lambda target: mosaic_tpu.hardware(kv_pages, target)),
      _backend.Kernel(
          "triton", lambda *a, interpret=None: triton.ragged(
              *a, interpret=interpret or False, **static, **blocks,
              latent_dim=latent_dim),
          supports=lambda: triton.supports(q, kv_pages, latent_dim)),
      _backend.Kernel("reference", ref),
  ]
  return _backend.dispatch(op, backend, rows, *args)


def write_kv_pages(kv_pages, new_kv, kv_lens, page_indices, cu_q_lens,
                   num_seqs, *, backend: str | None = None):
  """Writes each sequence's new K/V rows into their cache pages (the step
  before ``ragged_paged_attention`` or ``mla_ragged_paged_attention``, same
  metadata).

  Args:
    kv_pages: [num_pages, page_size, 2 * Hkv, D] cache (K of kv head h at
      combined head 2h, V at 2h + 1), or MLA's [num_pages, page_size, D]
      (one latent row per token).
    new_kv: [T, 2 * Hkv, D]: the new tokens' K and V, interleaved the same
      way (``jnp.stack([k, v], 2).reshape(T, 2 * Hkv, D)``), or [T, D]
      rows for MLA's cache; in the order of ``cu_q_lens``; cast to the
      cache's dtype.
    kv_lens, page_indices, cu_q_lens, num_seqs: as in
      ``ragged_paged_attention`` (kv_lens include the new tokens).
    backend: None, "mosaic_tpu", "interpret" or "reference".

  Returns:
    kv_pages with token t of sequence i written at position
    ``kv_lens[i] - q_len_i + (t - cu_q_lens[i])``. Tokens outside the first
    ``num_seqs`` sequences, or whose slot is past the page table or names
    no page, are not written. The TPU kernel aliases the cache to the
    result: under ``jax.jit(..., donate_argnums=...)`` it is updated in
    place (no copy); the reference is an XLA scatter, in place likewise.
  """
  # The shared checks, with a stand-in q of the cache's heads.
  shape = jnp.shape(kv_pages)
  latent = len(shape) == 3   # MLA's pool: any latent_dim in [1, D]
  q_like = jax.ShapeDtypeStruct(
      (jnp.shape(new_kv)[0] if jnp.ndim(new_kv) else 0,
       max(shape[2] // 2, 1) if len(shape) == 4 else 1,
       shape[-1] if shape else 1), jnp.float32)
  _, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs = _check(
      q_like, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
      op="write_kv_pages", latent_dim=1 if latent else None)
  new_kv = jnp.asarray(new_kv)
  if (new_kv.ndim != kv_pages.ndim - 1
      or new_kv.shape[1:] != kv_pages.shape[2:]):
    want = (f"[T, D] = [T, {shape[2]}] (kv_pages' row)" if latent else
            f"[T, 2 * Hkv, D] = [T, {shape[2]}, {shape[3]}] (kv_pages' "
            "heads and head_dim)")
    raise ValueError(f"write_kv_pages: new_kv must be {want}, got shape "
                     f"{new_kv.shape}")
  _backend.check_backend("write_kv_pages", backend)
  if new_kv.shape[0] == 0:
    return kv_pages
  rows = [_backend.Kernel("mosaic_tpu", lambda *a, interpret=None:
                          cache_mosaic_tpu.write(
                              *a, interpret=interpret or False),
                          hardware=lambda target: cache_mosaic_tpu.hardware(
                              kv_pages, target)),
          _backend.Kernel("reference", reference.write_kv_pages)]
  return _backend.dispatch("write_kv_pages", backend, rows, kv_pages, new_kv,
                           kv_lens, page_indices, cu_q_lens, num_seqs)


def _positive_int(op, name, value):
  if value is None:
    return None
  if isinstance(value, bool) or int(value) != value or value <= 0:
    raise ValueError(f"{op}: {name}={value!r} must be a positive integer "
                     "or None")
  return int(value)


def _soft_cap(op, value):
  if value is None:
    return None
  if not float(value) > 0:
    raise ValueError(f"{op}: soft_cap={value!r} must be positive or None")
  return float(value)


def _scale(op, name, value):
  if value is None:
    return None
  return _float(op, name, value)


def _float(op, name, value):
  try:
    return float(value)
  except TypeError:
    raise ValueError(f"{op}: {name} must be a Python float or None (a "
                     f"static scale, as JAX's), got {type(value).__name__}"
                     ) from None


def _check(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
           op=OP, latent_dim=None):
  """The arrays, checked; ``latent_dim``: MLA's [P, page_size, D] pool."""
  if not isinstance(q, jax.ShapeDtypeStruct):  # write_kv_pages' stand-in
    q = jnp.asarray(q)
  kv_pages = jnp.asarray(kv_pages)
  kv_lens, page_indices = jnp.asarray(kv_lens), jnp.asarray(page_indices)
  cu_q_lens, num_seqs = jnp.asarray(cu_q_lens), jnp.asarray(num_seqs)
  if q.ndim != 3:
    raise ValueError(f"{op}: q must be [T, H, D], got shape {q.shape}")
  if latent_dim is not None:
    if kv_pages.ndim != 3:
      raise ValueError(f"{op}: kv_pages must be [num_pages, page_size, D] "
                       f"(one latent row per token), got shape "
                       f"{kv_pages.shape}")
  elif kv_pages.ndim != 4 or kv_pages.shape[2] % 2:
    raise ValueError(f"{op}: kv_pages must be [num_pages, page_size, 2 * "
                     f"Hkv, D] (K and V heads interleaved), got shape "
                     f"{kv_pages.shape}")
  if kv_pages.shape[-1] != q.shape[2]:
    raise ValueError(f"{op}: kv_pages head_dim {kv_pages.shape[-1]} must "
                     f"equal q's {q.shape[2]}")
  if 0 in kv_pages.shape:
    raise ValueError(f"{op}: kv_pages needs at least one page, row and "
                     f"head, got shape {kv_pages.shape}")
  if latent_dim is not None and not 0 < latent_dim <= kv_pages.shape[-1]:
    raise ValueError(f"{op}: latent_dim={latent_dim} must be in [1, D = "
                     f"{kv_pages.shape[-1]}] (V is the row's first "
                     "latent_dim columns)")
  kv_heads = 1 if latent_dim is not None else kv_pages.shape[2] // 2
  if q.shape[1] % kv_heads:
    raise ValueError(f"{op}: q's heads H={q.shape[1]} must be a multiple "
                     f"of the kv heads Hkv={kv_heads} (kv_pages.shape[2] / 2)")
  if page_indices.ndim != 2 or page_indices.shape[1] == 0:
    raise ValueError(f"{op}: page_indices must be [S, pages_per_seq] with "
                     f"pages_per_seq >= 1, got shape {page_indices.shape}")
  s = page_indices.shape[0]
  if kv_lens.shape != (s,):
    raise ValueError(f"{op}: kv_lens must be [S] = [{s}] (page_indices' "
                     f"rows), got shape {kv_lens.shape}")
  if cu_q_lens.shape != (s + 1,):
    raise ValueError(f"{op}: cu_q_lens must be [S + 1] = [{s + 1}], got "
                     f"shape {cu_q_lens.shape}")
  if num_seqs.shape != (1,):
    raise ValueError(f"{op}: num_seqs must be [1], got shape "
                     f"{num_seqs.shape}")
  for name, x in (("kv_lens", kv_lens), ("page_indices", page_indices),
                  ("cu_q_lens", cu_q_lens), ("num_seqs", num_seqs)):
    if x.dtype != jnp.int32:
      raise ValueError(f"{op}: {name} must be int32, got {x.dtype}")
  if q.dtype not in Q_DTYPES:
    raise ValueError(f"{op}: q must be float32, bfloat16 or float16, got "
                     f"{q.dtype}")
  if kv_pages.dtype not in KV_DTYPES:
    raise ValueError(f"{op}: kv_pages must be float32, bfloat16, float16, "
                     f"int8, float8_e4m3fn or float8_e5m2, got "
                     f"{kv_pages.dtype}")
  return q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs
