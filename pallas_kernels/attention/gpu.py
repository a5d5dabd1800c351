"""Flash attention for NVIDIA GPUs: Pallas kernels with the Triton lowering.

Algorithm
  Forward (FlashAttention-2): one program per (q block, batch, head). It keeps
  its q tile in registers and walks the kv blocks with a ``lax.fori_loop``
  doing the online softmax (running max ``m``, running sum ``l``, unnormalised
  float32 accumulator), in the base-2 domain (``exp2``; the scale is folded
  into one multiply). It writes ``out = acc / l`` and ``lse = (m + log2 l) ln 2``.
  Backward: ``delta = rowsum(dO * O)`` in plain JAX, then two kernels that
  recompute ``p = exp(s - lse)``: a dq kernel (one program per q block, loop
  over kv blocks; also writes ``dS`` when the bias gradient is wanted) and a
  dk/dv kernel (one program per kv block and kv head, looping over the query
  heads of its GQA group and the q blocks), so no atomics are needed.

Semantics are those of ``pallas_kernels.attention.reference`` (shared with the
TPU kernel): logits ``sm_scale * q.k`` in float32, optional soft cap
``cap * tanh(s / cap)``, then the additive bias, then the mask (causal and
sliding window aligned at the sequence ends, ``offset = Lk - Lq``; segment
ids). Fully masked rows give ``out = 0``, ``lse = -inf`` and zero gradients.

Block skipping and masking cost
  Loop bounds come from the causal/window band, so kv blocks outside it are
  never loaded (causal runs in about 0.6x the time of full attention at
  L=4096 on the H100). Each loop is split
  into masked edge blocks and unmasked interior blocks: only the edge blocks
  pay for building the mask. Segment ids mask every visited block (their
  structure is data, not known to the loop bounds).

Padding (where it costs speed)
  Triton tiles need power-of-two sizes of at least 16, so ``Lq`` and ``Lk`` are
  padded (``jnp.pad``, an extra copy of q/k/v) to multiples of the block sizes
  and ``head_dim`` to the next power of two >= 16. Padded keys are masked,
  padded queries dropped, padded feature columns are zeros (exact). Aligned
  shapes (``L % 128 == 0``, ``head_dim`` in {16, 32, 64, 128, 256}) pay nothing.
  A head_dim such as 80 or 96 wastes the padded fraction of the matmul work.

Block sizes (``GpuBlockSizes``), by bytes per row (head_dim * itemsize);
(block_q, block_k, num_warps, num_stages). The middle row was tuned on an H100
(bf16, B=4, H=16, L=4096, D=128: bench/bench_attention.py --tune); the others
follow the usual Triton choices and were checked for correctness there, not
tuned.
  ==============  =====================  ==============  ==============
  row bytes       forward                dq              dk/dv
  ==============  =====================  ==============  ==============
  <= 128 (D<=64)  128, 64, 4, 3          64, 64, 4, 2    64, 64, 4, 2
  256 (D=128)     256, 64, 8, 3 full     64, 64, 4, 2    64, 64, 4, 2
                  128, 64, 8, 3 banded
                    or with a bias
  > 256           64, 32, 4, 2           64, 32, 4, 2    32, 64, 4, 2
  ==============  =====================  ==============  ==============
  ("banded": causal or sliding window. With a bias the 256-row forward tile
  and its float32 bias tiles overflow the H100's 227 KiB of shared memory.)
  Blocks shrink to the power-of-two
  (>= 16) sequence length for short inputs. Pass a ``GpuBlockSizes`` as
  ``block_sizes`` to override any field; other values (for instance the TPU
  kernel's block sizes) are ignored here.

Measured (H100, bf16, B=4, H=16, L=4096; bench/results/attention-h100-*.json)
  Speed relative to cuDNN (jax.nn.dot_product_attention), D=128: forward
  0.80 (full) / 0.77 (causal), forward+backward 0.76 / 0.77; relative to
  jax's Pallas Triton ``mha``: forward 1.1-1.2, forward+backward 2.4-2.5.
  Without warp specialisation (which the Triton lowering does not expose) the
  exp work is not overlapped with the matmuls, which bounds this design near
  two thirds of the matmul peak. D=64: 0.74-0.83x cuDNN. D=256: forward
  0.6x, backward far slower (0.32x for forward+backward): untuned tiles.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _compat

pl = _compat.pl

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
NEG_INF = float("-inf")
MIN_BLOCK = 16  # smallest tile dimension a Triton dot accepts


@dataclasses.dataclass(frozen=True)
class GpuBlockSizes:
  """Tile sizes and launch parameters; None picks the default (see table)."""
  block_q: int | None = None
  block_k: int | None = None
  num_warps: int | None = None
  num_stages: int | None = None
  block_q_dq: int | None = None
  block_k_dq: int | None = None
  num_warps_dq: int | None = None
  num_stages_dq: int | None = None
  block_q_dkv: int | None = None
  block_k_dkv: int | None = None
  num_warps_dkv: int | None = None
  num_stages_dkv: int | None = None

  def resolved(self, row_bytes: int, banded: bool,
               bias: bool = False) -> "GpuBlockSizes":
    """Fills the defaults (module docstring's table).

    ``row_bytes``: bytes of one padded q/k/v row (head_dim * itemsize);
    ``banded``: causal or sliding window; ``bias``: a bias is given (its
    float32 tiles also sit in shared memory).
    """
    if row_bytes <= 128:  # head_dim <= 64 in bf16
      fwd, dq, dkv = (128, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 2)
    elif row_bytes <= 256:  # head_dim 128 in bf16 (tuned on the H100)
      fwd = (128, 64, 8, 3) if banded or bias else (256, 64, 8, 3)
      dq, dkv = (64, 64, 4, 2), (64, 64, 4, 2)
    else:  # head_dim 256 in bf16, or 128 in float32: keep tiles in smem
      fwd, dq, dkv = (64, 32, 4, 2), (64, 32, 4, 2), (32, 64, 4, 2)
    names = ("block_q{}", "block_k{}", "num_warps{}", "num_stages{}")
    defaults = {}
    for suffix, config in (("", fwd), ("_dq", dq), ("_dkv", dkv)):
      defaults.update({n.format(suffix): c for n, c in zip(names, config)})
    values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    for name, value in values.items():
      if value is None:
        values[name] = defaults[name]
      elif name.startswith("block") and (value < MIN_BLOCK
                                         or value & (value - 1)):
        raise ValueError(
            f"GpuBlockSizes.{name}={value}: must be a power of two >= "
            f"{MIN_BLOCK}")
      elif value < 1:
        raise ValueError(f"GpuBlockSizes.{name}={value}: must be >= 1")
    return GpuBlockSizes(**values)


def _next_pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def _fit_block(block: int, length: int) -> int:
  """The block for a sequence of ``length``: no larger than needed."""
  return max(MIN_BLOCK, min(block, _next_pow2(length)))


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _pad_axis(x, axis: int, size: int, value=0):
  if x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths, constant_values=value)


@dataclasses.dataclass(frozen=True)
class _Mask:
  """Static mask structure. ``left``/``right`` None means unbounded."""
  lq: int
  lk: int
  left: int | None
  right: int | None
  segments: bool

  @property
  def offset(self) -> int:
    return self.lk - self.lq


def _make_mask(lq, lk, causal, window_left, window_right, segments) -> _Mask:
  right = window_right
  if causal:
    right = 0 if right is None else min(right, 0)
  return _Mask(lq, lk, window_left, right, segments)


# Scalar index arithmetic inside the kernels. Operands are clamped to >= 0
# before dividing, so truncating division equals floor division.
def _floordiv(x, d: int):
  return lax.div(jnp.maximum(x, 0), d)


def _cdiv(x, d: int):
  return lax.div(jnp.maximum(x, 0) + (d - 1), d)


def _clip(x, lo, hi):
  return jnp.minimum(jnp.maximum(x, lo), hi)


def _kv_blocks(row0, rows: int, block_k: int, mask: _Mask):
  """kv block ranges for q rows [row0, row0 + rows).

  Returns (lo, a, b, hi): blocks [lo, hi) hold some unmasked entry; those in
  [a, b) are unmasked for every row (no mask needed).
  """
  nk = -(-mask.lk // block_k)  # blocks holding some real key
  last_row = jnp.minimum(row0 + rows - 1, mask.lq - 1)
  full_k = mask.lk // block_k  # kv blocks without padded keys
  off = mask.offset
  if mask.right is None:
    hi = jnp.int32(nk)
    b = jnp.int32(full_k)
  else:
    hi = jnp.minimum(_cdiv(last_row + off + mask.right + 1, block_k), nk)
    b = jnp.minimum(_floordiv(row0 + off + mask.right + 1, block_k), full_k)
  if mask.left is None:
    lo = jnp.int32(0)
    a = jnp.int32(0)
  else:
    lo = _floordiv(row0 + off - mask.left, block_k)
    a = _cdiv(last_row + off - mask.left, block_k)
  hi = jnp.maximum(hi, lo)
  if mask.segments:
    a = b = hi
  a = _clip(a, lo, hi)
  b = _clip(b, a, hi)
  return lo, a, b, hi


def _q_blocks(col0, cols: int, block_q: int, mask: _Mask):
  """q block ranges for kv columns [col0, col0 + cols); see ``_kv_blocks``.

  Padded q rows need no mask here: their dO is zero and their lse +inf.
  """
  nq = -(-mask.lq // block_q)  # blocks holding some real query
  last_col = jnp.minimum(col0 + cols - 1, mask.lk - 1)
  off = mask.offset
  if mask.right is None:
    lo = jnp.int32(0)
    a = jnp.int32(0)
  else:
    lo = _floordiv(col0 - off - mask.right, block_q)
    a = _cdiv(col0 + cols - 1 - off - mask.right, block_q)
  if mask.left is None:
    hi = jnp.int32(nq)
    b = jnp.int32(nq)
  else:
    hi = jnp.minimum(_cdiv(last_col - off + mask.left + 1, block_q), nq)
    b = jnp.minimum(_floordiv(col0 - off + mask.left + 1, block_q), nq)
  hi = jnp.maximum(hi, lo)
  if mask.segments:
    a = b = hi
  if mask.lk % cols:
    # A block holding padded keys is masked throughout.
    b = jnp.where(col0 + cols > mask.lk, a, b)
  a = _clip(a, lo, hi)
  b = _clip(b, a, hi)
  return lo, a, b, hi


def _band_mask(rows, cols, mask: _Mask):
  """Boolean mask (True = attend) from broadcastable row/col index arrays."""
  ok = cols < mask.lk  # padded keys
  if mask.right is not None:
    ok = jnp.logical_and(ok, cols <= rows + (mask.offset + mask.right))
  if mask.left is not None:
    ok = jnp.logical_and(ok, cols >= rows + (mask.offset - mask.left))
  return ok


def _logits(qk, bias, *, sm_scale, soft_cap):
  """float32 logits in the base-2 domain, and tanh(x / cap) (None w/o cap)."""
  if soft_cap is None:
    s = qk * (sm_scale * LOG2E) if bias is None else qk * sm_scale
    t = None
  else:
    t = jnp.tanh(qk * (sm_scale / soft_cap))
    s = t * soft_cap
  if bias is not None:
    s = (s + bias) * LOG2E
  elif soft_cap is not None:
    s = s * LOG2E
  return s, t


def _dot_nt(a, b):
  """a @ b.T with float32 accumulation."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                         preferred_element_type=jnp.float32)


def _dot_nn(a, b):
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())),
                         preferred_element_type=jnp.float32)


# ---------------------------------------------------------------------------
# Forward


def _split_refs(refs, segments, has_bias):
  """(q, k, v, q_seg|None, kv_seg|None, bias|None, remaining refs)."""
  q_ref, k_ref, v_ref, *rest = refs
  qseg_ref = kvseg_ref = bias_ref = None
  if segments:
    qseg_ref, kvseg_ref, *rest = rest
  if has_bias:
    bias_ref, *rest = rest
  return q_ref, k_ref, v_ref, qseg_ref, kvseg_ref, bias_ref, rest


def _kv_block_logits(q, k, bias_ref, kvseg_ref, qseg, rows, c, kv_slice,
                     masked, *, mask, sm_scale, soft_cap):
  """Logits of a query block against kv block ``c`` (rows of the query block
  in ``rows``); ``masked`` applies the band and segment masks as -inf."""
  block_q, block_k = rows.shape
  bias = None
  if bias_ref is not None:
    bias = bias_ref[:, kv_slice].astype(jnp.float32)
  s, t = _logits(_dot_nt(q, k), bias, sm_scale=sm_scale, soft_cap=soft_cap)
  if masked:
    cols = c * block_k + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
    ok = _band_mask(rows, cols, mask)
    if qseg is not None:
      ok = jnp.logical_and(ok, qseg[:, None] == kvseg_ref[kv_slice][None, :])
    s = jnp.where(ok, s, NEG_INF)
  return s, t


def _forward_kernel(q_ref, k_ref, v_ref, qseg_ref, kvseg_ref, bias_ref,
                    o_ref, lse_ref, *, sm_scale, soft_cap, mask: _Mask,
                    block_q, block_k, reverse_q, nq):
  i = pl.program_id(0)
  if reverse_q:
    i = nq - 1 - i
  row0 = i * block_q
  q = q_ref[...]
  dim = q.shape[-1]
  rows = row0 + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
  qseg = None if qseg_ref is None else qseg_ref[...]

  def body(c, carry, masked):
    acc, m_prev, l_prev = carry
    kv_slice = pl.ds(c * block_k, block_k)
    s, _ = _kv_block_logits(q, k_ref[kv_slice, :], bias_ref, kvseg_ref, qseg,
                            rows, c, kv_slice, masked, mask=mask,
                            sm_scale=sm_scale, soft_cap=soft_cap)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    m_shift = m_next
    if masked or bias_ref is not None:
      # A row with nothing unmasked yet keeps m = -inf; shift it by 0.
      m_shift = jnp.where(m_next == NEG_INF, 0.0, m_next)
    alpha = jnp.exp2(m_prev - m_shift)
    p = jnp.exp2(s - m_shift[:, None])
    l_next = l_prev * alpha + jnp.sum(p, axis=1)
    v = v_ref[kv_slice, :]
    acc = acc * alpha[:, None] + _dot_nn(p.astype(v.dtype), v)
    return acc, m_next, l_next

  lo, a, b, hi = _kv_blocks(row0, block_q, block_k, mask)
  carry = (jnp.zeros((block_q, dim), jnp.float32),
           jnp.full((block_q,), NEG_INF, jnp.float32),
           jnp.zeros((block_q,), jnp.float32))
  masked_body = functools.partial(body, masked=True)
  carry = lax.fori_loop(lo, a, masked_body, carry)
  carry = lax.fori_loop(a, b, functools.partial(body, masked=False), carry)
  acc, m, l = lax.fori_loop(b, hi, masked_body, carry)

  empty = l == 0.0
  o_ref[...] = (acc / jnp.where(empty, 1.0, l)[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(empty, NEG_INF, (m + jnp.log2(l)) * LN2)


def _prepare(q, k, v, q_segment_ids, kv_segment_ids, bias, bq, bk, dp):
  """Pads sequences to tile multiples and head_dim to ``dp`` (zeros)."""
  lq_pad = _round_up(q.shape[2], bq)
  lk_pad = _round_up(k.shape[2], bk)
  q = _pad_axis(_pad_axis(q, 2, lq_pad), 3, dp)
  k = _pad_axis(_pad_axis(k, 2, lk_pad), 3, dp)
  v = _pad_axis(_pad_axis(v, 2, lk_pad), 3, dp)
  if q_segment_ids is not None:
    q_segment_ids = _pad_axis(q_segment_ids.astype(jnp.int32), 1, lq_pad)
    kv_segment_ids = _pad_axis(kv_segment_ids.astype(jnp.int32), 1, lk_pad)
  if bias is not None:
    bias = _pad_axis(_pad_axis(bias, 2, lq_pad), 3, lk_pad)
  return q, k, v, q_segment_ids, kv_segment_ids, bias


def _head_dim_padded(head_dim: int) -> int:
  return max(MIN_BLOCK, _next_pow2(head_dim))


def _sizes(block_sizes, dp: int, dtype, mask: _Mask,
           bias) -> GpuBlockSizes:
  if not isinstance(block_sizes, GpuBlockSizes):
    block_sizes = GpuBlockSizes()
  banded = mask.left is not None or mask.right is not None
  return block_sizes.resolved(dp * jnp.dtype(dtype).itemsize, banded,
                              bias is not None)


def _crop(x, shape):
  """x[:shape] without emitting a slice when nothing is cut."""
  if tuple(x.shape) == tuple(shape):
    return x
  return x[tuple(slice(0, n) for n in shape)]


def forward(q, k, v, q_segment_ids, kv_segment_ids, bias, *, sm_scale,
            causal, window_left, window_right, logit_soft_cap, block_sizes,
            interpret):
  """Attention forward. Returns (out [B,H,Lq,D] q.dtype, lse [B,H,Lq] f32)."""
  batch, heads, lq, dim = q.shape
  kv_heads, lk = k.shape[1], k.shape[2]
  if lq == 0 or lk == 0 or dim == 0 or batch == 0:
    return (jnp.zeros(q.shape, q.dtype),
            jnp.full((batch, heads, lq), NEG_INF, jnp.float32))
  group = heads // kv_heads
  dp = _head_dim_padded(dim)
  segments = q_segment_ids is not None
  mask = _make_mask(lq, lk, causal, window_left, window_right, segments)
  sizes = _sizes(block_sizes, dp, q.dtype, mask, bias)
  bq = _fit_block(sizes.block_q, lq)
  bk = _fit_block(sizes.block_k, lk)
  q, k, v, qseg, kvseg, bias = _prepare(
      q, k, v, q_segment_ids, kv_segment_ids, bias, bq, bk, dp)
  lq_pad, lk_pad = q.shape[2], k.shape[2]
  nq, nk = lq_pad // bq, lk_pad // bk
  # Causal rows near the end do the most work: start them first.
  reverse_q = mask.right is not None and mask.left is None

  def qi(i):
    return nq - 1 - i if reverse_q else i

  in_specs = [
      pl.BlockSpec((None, None, bq, dp), lambda i, b, h: (b, h, qi(i), 0)),
      pl.BlockSpec((None, None, lk_pad, dp),
                   lambda i, b, h: (b, h // group, 0, 0)),
      pl.BlockSpec((None, None, lk_pad, dp),
                   lambda i, b, h: (b, h // group, 0, 0)),
  ]
  args = [q, k, v]
  if segments:
    in_specs += [pl.BlockSpec((None, bq), lambda i, b, h: (b, qi(i))),
                 pl.BlockSpec((None, lk_pad), lambda i, b, h: (b, 0))]
    args += [qseg, kvseg]
  if bias is not None:
    per_batch, per_head = bias.shape[0] != 1, bias.shape[1] != 1
    in_specs.append(pl.BlockSpec(
        (None, None, bq, lk_pad),
        lambda i, b, h: (b if per_batch else 0, h if per_head else 0,
                         qi(i), 0)))
    args.append(bias)

  def kernel(*refs):
    (q_ref, k_ref, v_ref, qseg_ref, kvseg_ref, bias_ref,
     rest) = _split_refs(refs, segments, bias is not None)
    o_ref, lse_ref = rest
    _forward_kernel(q_ref, k_ref, v_ref, qseg_ref, kvseg_ref, bias_ref,
                    o_ref, lse_ref, sm_scale=sm_scale,
                    soft_cap=logit_soft_cap, mask=mask, block_q=bq,
                    block_k=bk, reverse_q=reverse_q, nq=nq)

  out, lse = pl.pallas_call(
      kernel,
      grid=(nq, batch, heads),
      in_specs=in_specs,
      out_specs=[
          pl.BlockSpec((None, None, bq, dp), lambda i, b, h: (b, h, qi(i), 0)),
          pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, qi(i))),
      ],
      out_shape=[jax.ShapeDtypeStruct((batch, heads, lq_pad, dp), q.dtype),
                 jax.ShapeDtypeStruct((batch, heads, lq_pad), jnp.float32)],
      compiler_params=_compat.gpu_compiler_params(
          num_warps=sizes.num_warps, num_stages=sizes.num_stages),
      interpret=interpret,
      name="flash_attention_fwd_gpu",
  )(*args)
  return _crop(out, (batch, heads, lq, dim)), _crop(lse, (batch, heads, lq))


# ---------------------------------------------------------------------------
# Backward


def _dq_kernel(q_ref, k_ref, v_ref, qseg_ref, kvseg_ref, bias_ref, do_ref,
               lse_ref, delta_ref, dq_ref, dbias_ref, *, sm_scale, soft_cap,
               mask: _Mask, block_q, block_k, nk):
  row0 = pl.program_id(0) * block_q
  q = q_ref[...]
  do = do_ref[...]
  lse = lse_ref[...]
  # +inf for empty rows makes their p exactly 0.
  lse2 = jnp.where(lse == NEG_INF, jnp.inf, lse * LOG2E)
  delta = delta_ref[...]
  rows = row0 + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
  qseg = None if qseg_ref is None else qseg_ref[...]

  def body(c, dq, masked):
    kv_slice = pl.ds(c * block_k, block_k)
    k = k_ref[kv_slice, :]
    v = v_ref[kv_slice, :]
    s, t = _kv_block_logits(q, k, bias_ref, kvseg_ref, qseg,
                            rows, c, kv_slice, masked, mask=mask,
                            sm_scale=sm_scale, soft_cap=soft_cap)
    p = jnp.exp2(s - lse2[:, None])
    ds = p * (_dot_nt(do, v) - delta[:, None])
    if dbias_ref is not None:
      dbias_ref[:, kv_slice] = ds
    if t is not None:
      ds = ds * (1.0 - t * t)
    return dq + _dot_nn(ds.astype(k.dtype), k)

  lo, a, b, hi = _kv_blocks(row0, block_q, block_k, mask)
  if dbias_ref is not None:
    # Skipped blocks still need their (zero) bias gradient written.
    def zero(c, carry):
      dbias_ref[:, pl.ds(c * block_k, block_k)] = jnp.zeros(
          (block_q, block_k), jnp.float32)
      return carry
    lax.fori_loop(0, lo, zero, 0)
    lax.fori_loop(hi, nk, zero, 0)
  dq = jnp.zeros(q.shape, jnp.float32)
  masked_body = functools.partial(body, masked=True)
  dq = lax.fori_loop(lo, a, masked_body, dq)
  dq = lax.fori_loop(a, b, functools.partial(body, masked=False), dq)
  dq = lax.fori_loop(b, hi, masked_body, dq)
  dq_ref[...] = (dq * sm_scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, qseg_ref, kvseg_ref, bias_ref, do_ref,
                lse_ref, delta_ref, dk_ref, dv_ref, *, sm_scale, soft_cap,
                mask: _Mask, block_q, block_k, group, bias_per_head):
  col0 = pl.program_id(0) * block_k
  k = k_ref[...]
  v = v_ref[...]
  # Work in the transposed orientation: rows are keys, columns are queries.
  cols_k = col0 + lax.broadcasted_iota(jnp.int32, (block_k, block_q), 0)
  kvseg = None if kvseg_ref is None else kvseg_ref[...]

  def body(i, carry, g, masked):
    dk, dv = carry
    q_slice = pl.ds(i * block_q, block_q)
    q = q_ref[g, q_slice, :]
    do = do_ref[g, q_slice, :]
    lse = lse_ref[g, q_slice]
    lse2 = jnp.where(lse == NEG_INF, jnp.inf, lse * LOG2E)
    delta = delta_ref[g, q_slice]
    bias = None
    if bias_ref is not None:
      bias_g = g if bias_per_head else 0
      bias = bias_ref[bias_g, q_slice, :].astype(jnp.float32).T
    s, t = _logits(_dot_nt(k, q), bias, sm_scale=sm_scale, soft_cap=soft_cap)
    if masked:
      rows_q = i * block_q + lax.broadcasted_iota(
          jnp.int32, (block_k, block_q), 1)
      ok = _band_mask(rows_q, cols_k, mask)
      if kvseg is not None:
        ok = jnp.logical_and(ok, kvseg[:, None] == qseg_ref[q_slice][None, :])
      s = jnp.where(ok, s, NEG_INF)
    p = jnp.exp2(s - lse2[None, :])
    dv = dv + _dot_nn(p.astype(do.dtype), do)
    ds = p * (_dot_nt(v, do) - delta[None, :])
    if t is not None:
      ds = ds * (1.0 - t * t)
    dk = dk + _dot_nn(ds.astype(q.dtype), q)
    return dk, dv

  lo, a, b, hi = _q_blocks(col0, block_k, block_q, mask)

  def head(g, carry):
    masked_body = functools.partial(body, g=g, masked=True)
    carry = lax.fori_loop(lo, a, masked_body, carry)
    carry = lax.fori_loop(a, b, functools.partial(body, g=g, masked=False),
                          carry)
    return lax.fori_loop(b, hi, masked_body, carry)

  zeros = jnp.zeros(k.shape, jnp.float32)
  dk, dv = lax.fori_loop(0, group, head, (zeros, zeros))
  dk_ref[...] = (dk * sm_scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def backward(q, k, v, q_segment_ids, kv_segment_ids, bias, out, lse, d_out, *,
             sm_scale, causal, window_left, window_right, logit_soft_cap,
             block_sizes, interpret, d_lse=None):
  """Attention backward: (dq, dk, dv, dbias or None) for ``forward``'s output.

  ``d_lse`` (optional, [B, H, Lq]) is the cotangent of lse: since
  d lse_i / d s_ij = p_ij it only shifts delta (ds = p * (dp - delta + d_lse)).
  """
  batch, heads, lq, dim = q.shape
  kv_heads, lk = k.shape[1], k.shape[2]
  dbias_wanted = bias is not None
  if lq == 0 or lk == 0 or dim == 0 or batch == 0:
    return (jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v),
            None if bias is None else jnp.zeros_like(bias))
  group = heads // kv_heads
  dp = _head_dim_padded(dim)
  segments = q_segment_ids is not None
  mask = _make_mask(lq, lk, causal, window_left, window_right, segments)
  sizes = _sizes(block_sizes, dp, q.dtype, mask, bias)
  bq_dq = _fit_block(sizes.block_q_dq, lq)
  bk_dq = _fit_block(sizes.block_k_dq, lk)
  bq_kv = _fit_block(sizes.block_q_dkv, lq)
  bk_kv = _fit_block(sizes.block_k_dkv, lk)

  delta = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1)
  if d_lse is not None:
    delta = delta - d_lse.astype(jnp.float32)
  bias_shape, bias_dtype = (None, None) if bias is None else (bias.shape,
                                                              bias.dtype)
  q, k, v, qseg, kvseg, bias = _prepare(
      q, k, v, q_segment_ids, kv_segment_ids, bias, max(bq_dq, bq_kv),
      max(bk_dq, bk_kv), dp)
  lq_pad, lk_pad = q.shape[2], k.shape[2]
  d_out = _pad_axis(_pad_axis(d_out.astype(q.dtype), 2, lq_pad), 3, dp)
  lse = _pad_axis(lse.astype(jnp.float32), 2, lq_pad, jnp.inf)
  delta = _pad_axis(delta, 2, lq_pad)
  per_batch = per_head = False
  if bias is not None:
    per_batch, per_head = bias.shape[0] != 1, bias.shape[1] != 1

  # dq (and dS for the bias gradient): grid over q blocks.
  nq, nk = lq_pad // bq_dq, lk_pad // bk_dq
  q_block = pl.BlockSpec((None, None, bq_dq, dp), lambda i, b, h: (b, h, i, 0))
  kv_full = pl.BlockSpec((None, None, lk_pad, dp),
                         lambda i, b, h: (b, h // group, 0, 0))
  row_block = pl.BlockSpec((None, None, bq_dq), lambda i, b, h: (b, h, i))
  in_specs = [q_block, kv_full, kv_full]
  args = [q, k, v]
  if segments:
    in_specs += [pl.BlockSpec((None, bq_dq), lambda i, b, h: (b, i)),
                 pl.BlockSpec((None, lk_pad), lambda i, b, h: (b, 0))]
    args += [qseg, kvseg]
  if bias is not None:
    in_specs.append(pl.BlockSpec(
        (None, None, bq_dq, lk_pad),
        lambda i, b, h: (b if per_batch else 0, h if per_head else 0, i, 0)))
    args.append(bias)
  in_specs += [q_block, row_block, row_block]
  args += [d_out, lse, delta]
  out_specs = [q_block]
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
  if dbias_wanted:
    out_specs.append(pl.BlockSpec((None, None, bq_dq, lk_pad),
                                  lambda i, b, h: (b, h, i, 0)))
    out_shape.append(
        jax.ShapeDtypeStruct((batch, heads, lq_pad, lk_pad), jnp.float32))

  def dq_kernel(*refs):
    refs = list(refs)
    q_ref, k_ref, v_ref = refs[:3]
    rest = refs[3:]
    qseg_ref = kvseg_ref = bias_ref = dbias_ref = None
    if segments:
      qseg_ref, kvseg_ref, *rest = rest
    if bias is not None:
      bias_ref, *rest = rest
    do_ref, lse_ref, delta_ref, dq_ref, *rest = rest
    if dbias_wanted:
      (dbias_ref,) = rest
    _dq_kernel(q_ref, k_ref, v_ref, qseg_ref, kvseg_ref, bias_ref, do_ref,
               lse_ref, delta_ref, dq_ref, dbias_ref, sm_scale=sm_scale,
               soft_cap=logit_soft_cap, mask=mask, block_q=bq_dq,
               block_k=bk_dq, nk=nk)

  results = pl.pallas_call(
      dq_kernel, grid=(nq, batch, heads), in_specs=in_specs,
      out_specs=out_specs, out_shape=out_shape,
      compiler_params=_compat.gpu_compiler_params(
          num_warps=sizes.num_warps_dq, num_stages=sizes.num_stages_dq),
      interpret=interpret, name="flash_attention_dq_gpu",
  )(*args)
  dq = results[0]
  dbias = results[1] if dbias_wanted else None

  # dk, dv: grid over kv blocks and kv heads; loops over the group's q heads.
  nq, nk = lq_pad // bq_kv, lk_pad // bk_kv
  kv_block = pl.BlockSpec((None, None, bk_kv, dp),
                          lambda j, b, hk: (b, hk, j, 0))
  q_group = pl.BlockSpec((None, group, lq_pad, dp),
                         lambda j, b, hk: (b, hk, 0, 0))
  rows_group = pl.BlockSpec((None, group, lq_pad), lambda j, b, hk: (b, hk, 0))
  in_specs = [q_group, kv_block, kv_block]
  args = [q, k, v]
  if segments:
    in_specs += [pl.BlockSpec((None, lq_pad), lambda j, b, hk: (b, 0)),
                 pl.BlockSpec((None, bk_kv), lambda j, b, hk: (b, j))]
    args += [qseg, kvseg]
  if bias is not None:
    in_specs.append(pl.BlockSpec(
        (None, group if per_head else 1, lq_pad, bk_kv),
        lambda j, b, hk: (b if per_batch else 0, hk if per_head else 0, 0, j)))
    args.append(bias)
  in_specs += [q_group, rows_group, rows_group]
  args += [d_out, lse, delta]

  def dkv_kernel(*refs):
    (q_ref, k_ref, v_ref, qseg_ref, kvseg_ref, bias_ref,
     rest) = _split_refs(refs, segments, bias is not None)
    do_ref, lse_ref, delta_ref, dk_ref, dv_ref = rest
    _dkv_kernel(q_ref, k_ref, v_ref, qseg_ref, kvseg_ref, bias_ref, do_ref,
                lse_ref, delta_ref, dk_ref, dv_ref, sm_scale=sm_scale,
                soft_cap=logit_soft_cap, mask=mask, block_q=bq_kv,
                block_k=bk_kv, group=group, bias_per_head=per_head)

  dk, dv = pl.pallas_call(
      dkv_kernel, grid=(nk, batch, kv_heads), in_specs=in_specs,
      out_specs=[kv_block, kv_block],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype),
                 jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=_compat.gpu_compiler_params(
          num_warps=sizes.num_warps_dkv, num_stages=sizes.num_stages_dkv),
      interpret=interpret, name="flash_attention_dkv_gpu",
  )(*args)

  dq = _crop(dq, (batch, heads, lq, dim))
  dk = _crop(dk, (batch, kv_heads, lk, dim))
  dv = _crop(dv, (batch, kv_heads, lk, dim))
  if dbias is not None:
    dbias = _crop(dbias, (batch, heads, lq, lk))
    axes = tuple(a for a in (0, 1) if bias_shape[a] == 1)
    if axes:
      dbias = jnp.sum(dbias, axis=axes, keepdims=True)
    dbias = dbias.astype(bias_dtype)
  return dq, dk, dv, dbias
