"""Drop-ins for ``torch_xla.experimental.custom_kernel`` (torch_xla 2.9):
flash_attention, gmm, tgmm, gmm_backward, ragged_paged_attention, on
``torch_bridge.ops``. Arguments and differences: docs/torch.md, "Migrating
from torch_xla's ...". Its other kernels raise an ImportError naming ours.
"""
from __future__ import annotations

import ast
import math
import numbers

import torch

from torch_bridge import ops

_OP = "flash_attention"


def _tensor(name, t, *, optional=False):
  if t is None and optional:
    return None
  if not isinstance(t, torch.Tensor):
    raise TypeError(f"{_OP}: {name} must be a torch.Tensor, got "
                    f"{type(t).__name__}")
  return t


def _parse_spec(partition_spec, ndim):
  """torch_xla's ``partition_spec``: a tuple (or its Python literal as a
  string) with one entry per dimension of q."""
  if partition_spec is None:
    return None
  spec = partition_spec
  if isinstance(spec, str):
    try:
      spec = ast.literal_eval(spec)
    except (ValueError, SyntaxError):
      raise ValueError(f"{_OP}: partition_spec string {partition_spec!r} is "
                       "not a Python literal tuple such as \"('data', None, "
                       "None, None)\"") from None
    if spec is None:
      return None
  if not isinstance(spec, (tuple, list)):
    raise ValueError(f"{_OP}: partition_spec must be a tuple (or its string "
                     f"form), got {partition_spec!r}")
  if len(spec) != ndim:
    raise ValueError(f"{_OP}: partition_spec {tuple(spec)!r} must have one "
                     f"entry per dimension of q ({ndim})")
  return tuple(spec)


def _merged_batch_entry(entries):
  """The spec entry of the leading dims flattened into one (their axes, in
  order), or None when none is split."""
  axes = []
  for e in entries:
    if e is None:
      continue
    axes.extend(e if isinstance(e, (tuple, list)) else (e,))
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else tuple(axes)


def _window(sliding_window, causal):
  """``(left, right)`` around the diagonal (None: unbounded); ``causal``
  caps ``right`` at 0."""
  if sliding_window is None:
    return None, (0 if causal else None)
  if isinstance(sliding_window, (tuple, list)):
    if len(sliding_window) != 2:
      raise ValueError(f"{_OP}: sliding_window must be an int or a (left, "
                       f"right) pair, got {sliding_window!r}")
    left, right = sliding_window
  else:
    left, right = sliding_window, (0 if causal else sliding_window)
  for what, value in (("left", left), ("right", right)):
    if value is not None and (isinstance(value, bool) or not isinstance(
        value, numbers.Integral) or value < 0):
      raise ValueError(f"{_OP}: sliding_window {what} must be a non-negative "
                       f"int or None, got {value!r}")
  if causal:
    right = 0 if right is None else min(right, 0)
  return left, right


def flash_attention(q, k, v, causal=False, q_segment_ids=None,
                    kv_segment_ids=None, sm_scale=1.0, *, ab=None,
                    partition_spec=None, mesh=None, sliding_window=None,
                    logit_soft_cap=None, block_sizes=None, backend=None):
  """``softmax(mask(sm_scale * q @ k^T + ab)) @ v`` with torch_xla's API.

  Args:
    q: ``[*batch, heads, q_len, head_dim]`` (one or more batch dims, or
      none), float32/bfloat16/float16.
    k, v: ``[*batch, kv_heads, kv_len, head_dim]``; ``heads % kv_heads == 0``
      (query head ``h`` uses kv head ``h // (heads // kv_heads)``). v's
      head_dim may differ from q's and k's (MLA; an extension).
    causal: query ``i`` sees keys ``j <= i`` (the diagonal starts at the
      first query and the first key, as in torch_xla, also when q_len !=
      kv_len).
    q_segment_ids, kv_segment_ids: integer ``[*batch, q_len]`` and
      ``[*batch, kv_len]``, both or neither; attention only between equal
      ids.
    sm_scale: logit scale, default 1.0 (torch_xla's default; pass
      ``head_dim ** -0.5`` for the usual scaling).
    ab: additive float bias ``[*batch or 1s, heads or 1, q_len, kv_len]``,
      added after scaling; gets a gradient.
    partition_spec: under torch_xla SPMD, one mesh-axis entry per dimension
      of q (a tuple, or its Python-literal string); batch and heads may be
      split. k, v, segment ids and ab follow q.
    mesh: a ``torch_xla.distributed.spmd.Mesh`` or its string form
      (default: the global mesh); ignored without ``partition_spec``.
    sliding_window: keyword-only extra: ``w`` or ``(left, right)``: query
      ``i`` sees keys ``i - left <= j <= i + right`` (same diagonal as
      ``causal``; None in the pair: unbounded on that side).
    logit_soft_cap, block_sizes, backend: keyword-only extras, as in
      ``torch_bridge.flash_attention``.

  Returns:
    ``out`` with q's shape (v's head_dim last) and dtype. Rows that see no
    key are zero.

  Algorithm: ``torch_bridge.ops.flash_attention`` on the batch dims
  flattened; its ``causal`` aligns the sequence *ends*, so the mask becomes
  a shifted window (q_len > kv_len) or padded, dropped queries (q_len <
  kv_len).
  """
  for name, t in (("q", q), ("k", k), ("v", v)):
    _tensor(name, t)
    if t.dim() < 3:
      raise ValueError(f"{_OP}: {name} must be [*batch, heads, seq, "
                       f"head_dim] (at least 3 dims), got shape "
                       f"{tuple(t.shape)}")
  if not (q.dim() == k.dim() == v.dim()):
    raise ValueError(f"{_OP}: q, k and v must have the same number of dims, "
                     f"got shapes {tuple(q.shape)}, {tuple(k.shape)}, "
                     f"{tuple(v.shape)}")
  batch = tuple(q.shape[:-3])
  for name, t in (("k", k), ("v", v)):
    if tuple(t.shape[:-3]) != batch:
      raise ValueError(f"{_OP}: {name}'s batch dims {tuple(t.shape[:-3])} "
                       f"differ from q's {batch}")
  if not isinstance(causal, bool):
    raise ValueError(f"{_OP}: causal must be a bool, got {causal!r}")
  if (isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real)
      or not math.isfinite(sm_scale)):
    raise ValueError(f"{_OP}: sm_scale must be a finite Python number, got "
                     f"{sm_scale!r}")
  if (q_segment_ids is None) != (kv_segment_ids is None):
    missing = "kv_segment_ids" if kv_segment_ids is None else "q_segment_ids"
    raise ValueError(f"{_OP}: q_segment_ids and kv_segment_ids go together; "
                     f"{missing} is None")
  heads, q_len, head_dim = q.shape[-3:]
  kv_len = k.shape[-2]
  n = math.prod(batch)
  segment_ids = None
  if q_segment_ids is not None:
    for name, ids, length in (("q_segment_ids", q_segment_ids, q_len),
                              ("kv_segment_ids", kv_segment_ids, kv_len)):
      _tensor(name, ids)
      if tuple(ids.shape) != batch + (length,):
        raise ValueError(f"{_OP}: {name} must have shape "
                         f"{batch + (length,)} (q's batch dims, then the "
                         f"sequence), got {tuple(ids.shape)}")
    segment_ids = (q_segment_ids.reshape(n, q_len),
                   kv_segment_ids.reshape(n, kv_len))
  if ab is not None:
    _tensor("ab", ab)
    if ab.dim() != q.dim() or tuple(ab.shape[-2:]) != (q_len, kv_len):
      raise ValueError(f"{_OP}: ab must have shape {batch + (heads, q_len, kv_len)}"
                       f" (or 1 in batch/heads dims), got {tuple(ab.shape)}")
    lead = tuple(ab.shape[:-3])
    if any(a not in (1, b) for a, b in zip(lead, batch)) or \
        ab.shape[-3] not in (1, heads):
      raise ValueError(f"{_OP}: ab's shape {tuple(ab.shape)} does not "
                       f"broadcast to {batch + (heads, q_len, kv_len)}")
    if all(a == 1 for a in lead):
      ab = ab.reshape(1, *ab.shape[-3:])
    else:
      ab = ab.expand(*batch, *ab.shape[-3:]).reshape(n, *ab.shape[-3:])
  spec = _parse_spec(partition_spec, q.dim())
  if spec is not None and q.dim() != 4:
    spec = (_merged_batch_entry(spec[:-3]),) + spec[-3:]
  if spec is None:
    mesh = None  # torch_xla ignores a mesh without a partition_spec

  q4, k4, v4 = (t.reshape(n, *t.shape[-3:]) for t in (q, k, v))
  left, right = _window(sliding_window, causal)
  offset = kv_len - q_len  # ours: query i's diagonal is key i + offset
  pad = 0
  if offset == 0 or (left is None and right is None):
    our_causal, our_window = causal, sliding_window
  elif offset < 0:
    # Start-aligned (left, right) = end-aligned (left + offset,
    # right - offset); right - offset > right >= 0.
    if left is not None and left + offset < 0:
      raise ValueError(
          f"{_OP}: sliding_window left={left} with q_len {q_len} > kv_len "
          f"{kv_len} needs left >= q_len - kv_len ({-offset})")
    our_causal = False
    our_window = (None if left is None else left + offset,
                  None if right is None else right - offset)
  else:
    # q_len < kv_len: pad the queries to kv_len (offset 0), drop the rows.
    pad = offset
    our_causal, our_window = causal, sliding_window
    q4 = torch.nn.functional.pad(q4, (0, 0, 0, pad))
    if segment_ids is not None:
      segment_ids = (torch.nn.functional.pad(segment_ids[0], (0, pad)),
                     segment_ids[1])
    if ab is not None:
      ab = torch.nn.functional.pad(ab, (0, 0, 0, pad))
  out = ops.flash_attention(
      q4, k4, v4, causal=our_causal, sm_scale=float(sm_scale),
      segment_ids=segment_ids, sliding_window=our_window,
      logit_soft_cap=logit_soft_cap, bias=ab, block_sizes=block_sizes,
      backend=backend, partition_spec=spec, mesh=mesh)
  if pad:
    out = out[:, :, :q_len]
  return out.reshape(*q.shape[:-1], v.shape[-1])


# ------------------------------------------------------ grouped matmuls --

def _tiling(op, tiling):
  """torch_xla's ``tiling`` as the kernel's ``block_sizes`` (None: the
  kernel's own tiles)."""
  if tiling is None:
    return None
  if (not isinstance(tiling, (tuple, list)) or len(tiling) != 3 or not all(
      isinstance(t, numbers.Integral) and not isinstance(t, bool)
      for t in tiling)):
    raise ValueError(f"{op}: tiling must be None or three ints (tm, tk, "
                     f"tn), got {tiling!r}")
  tm, tk, tn = (int(t) for t in tiling)
  if tm <= 0 or tm % 8 or tk <= 0 or tk % 128 or tn <= 0 or tn % 128:
    raise ValueError(f"{op}: tiling={tuple(tiling)!r}: the kernel's tiles "
                     "(tm, tk, tn) must be a positive multiple of 8 and "
                     "positive multiples of 128 (they are clamped to the "
                     "problem, so large tiles fit small inputs)")
  return tm, tk, tn


def gmm(lhs, rhs, group_sizes, tiling=None, group_offset=None,
        transpose_rhs=False):
  """``out[rows of group g] = lhs[rows of g] @ rhs[g]`` with torch_xla's API.

  Args:
    lhs: ``[m, k]`` float32/bfloat16/float16, rows sorted by group.
    rhs: ``[num_groups, k, n]`` (``[num_groups, n, k]`` with
      ``transpose_rhs``).
    group_sizes: integer ``[num_groups]``: group g owns the next
      ``group_sizes[g]`` rows (clamped to the rows that exist).
    tiling: ``(tm, tk, tn)``, the kernel's ``block_sizes``; None: its own.
    group_offset: None, or an integer tensor ``[1]`` (or an int): rhs then
      holds groups ``group_offset .. group_offset + num_groups - 1`` of
      ``group_sizes [total_groups]`` (expert parallelism); rows of other
      groups give zeros.
    transpose_rhs: rhs is ``[num_groups, n, k]``.

  Returns:
    ``[m, n]`` in lhs's dtype; zeros on rows past the last group.
    Differentiable in lhs and rhs (``torch_bridge.grouped_matmul``).
  """
  return ops.grouped_matmul(lhs, rhs, group_sizes,
                            transpose_rhs=transpose_rhs,
                            group_offset=group_offset,
                            block_sizes=_tiling("gmm", tiling))


def tgmm(lhs, rhs, group_sizes, tiling=(512, 512, 512), group_offset=None,
         num_actual_groups=None):
  """``out[g] = lhs[:, rows of g] @ rhs[rows of g, :]`` with torch_xla's API.

  Args:
    lhs: ``[k, m]`` float (the transpose of gmm's lhs).
    rhs: ``[m, n]`` float (gmm's output gradient; computed in lhs's dtype).
    group_sizes: integer ``[num_groups]``, as for ``gmm``.
    tiling: ``(tm, tk, tn)``, the kernel's ``block_sizes``; None: its own.
    group_offset: None, or an integer tensor ``[1]`` (or an int): the
      output's first group is group ``group_offset`` of group_sizes.
    num_actual_groups: the output's groups (default all of group_sizes,
      or those from an int group_offset on).

  Returns:
    ``[num_actual_groups, k, n]`` in lhs's dtype; zeros for a group with no
    rows. No gradient.
  """
  for name, t in (("lhs", lhs), ("rhs", rhs), ("group_sizes", group_sizes)):
    if not isinstance(t, torch.Tensor):
      raise TypeError(f"tgmm: {name} must be a torch.Tensor, got "
                      f"{type(t).__name__}")
  if lhs.dim() != 2:
    raise ValueError(f"tgmm: lhs must be [k, m] (2 dims), got shape "
                     f"{tuple(lhs.shape)}")
  return ops._grouped_matmul_tgmm(lhs.t(), rhs, group_sizes,
                                  out_dtype=lhs.dtype,
                                  block_sizes=_tiling("tgmm", tiling),
                                  group_offset=group_offset,
                                  num_groups=num_actual_groups)


def gmm_backward(grad, lhs, rhs, group_sizes, tiling=(512, 512, 512)):
  """``(grad_lhs [m, k], grad_rhs [num_groups, k, n])`` of ``gmm(lhs, rhs,
  group_sizes)`` (rhs ``[num_groups, k, n]``) for the output gradient
  ``grad [m, n]``: ``grad_lhs`` by gmm on rhs's transpose (no copy: the
  kernel's ``transpose_rhs``), in grad's dtype; ``grad_rhs`` by tgmm, in
  lhs's dtype. ``tiling`` as for ``gmm``."""
  block_sizes = _tiling("gmm_backward", tiling)
  grad_lhs = ops.grouped_matmul(grad, rhs, group_sizes, transpose_rhs=True,
                                block_sizes=block_sizes)
  grad_rhs = ops._grouped_matmul_tgmm(lhs, grad, group_sizes,
                                      out_dtype=lhs.dtype,
                                      block_sizes=block_sizes)
  return grad_lhs, grad_rhs


# ------------------------------------------------ ragged paged attention --

def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens,
                           num_seqs, *, sm_scale=1.0, sliding_window=None,
                           soft_cap=None, mask_value=None, k_scale=None,
                           v_scale=None, use_kernel=True,
                           num_kv_pages_per_block=None,
                           num_queries_per_block=None,
                           vmem_limit_bytes=None):
  """torch_xla's ``ragged_paged_attention`` (its v2 kernel's convention):
  ``q [T, H, D]``, ``kv_pages [num_pages, page_size, 2 * Hkv, D]`` (K and
  V heads interleaved), ``kv_lens [S]``, ``page_indices [S,
  pages_per_seq]``, ``cu_q_lens [S + 1]``, ``num_seqs [1]`` -> ``[T, H,
  D]`` in q's dtype, by ``torch_bridge.ragged_paged_attention``.
  ``use_kernel=False``: the reference implementation. No gradient.
  """
  if not isinstance(use_kernel, bool):
    raise TypeError(f"ragged_paged_attention: use_kernel must be a bool, "
                    f"got {use_kernel!r}")
  return ops.ragged_paged_attention(
      q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
      sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
      mask_value=mask_value, k_scale=k_scale, v_scale=v_scale,
      num_kv_pages_per_block=num_kv_pages_per_block,
      num_queries_per_block=num_queries_per_block,
      vmem_limit_bytes=vmem_limit_bytes,
      backend=None if use_kernel else "reference")


# torch_xla 2.9's other public kernels: where each need is served here.
_ELSEWHERE = {
    **dict.fromkeys(
        ("paged_attention", "multi_queries_paged_attention"),
        "decode over a (paged) KV cache is torch_bridge.decode_attention(q, "
        "k_cache, v_cache, kv_lengths, page_table=...): 1-16 new tokens per "
        "sequence, pages [num_pages, kv_heads, page_size, head_dim]"),
    "quantized_matmul_int8": (
        "int8 matmuls are torch_bridge.int8_matmul / quantized_matmul "
        "(w8a8 or weight-only) and the Int8Linear / QuantizedLinear modules"),
}


def __getattr__(name):
  if name in _ELSEWHERE:
    raise ImportError(f"torch_bridge.custom_kernel has no {name} (torch_xla's "
                      f"custom_kernel.{name}): {_ELSEWHERE[name]}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["flash_attention", "gmm", "tgmm", "gmm_backward",
           "ragged_paged_attention"]
