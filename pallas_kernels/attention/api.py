"""Public flash-attention API: validation, custom VJP, kernel choice.

Semantics: :mod:`pallas_kernels.attention.reference`. Forward and backward
each pick the first kernel whose rule (``_rows``) accepts the call:
``mosaic_tpu``, ``mosaic_gpu``, ``triton``, ``reference``.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import numbers

import jax
import jax.numpy as jnp

from pallas_kernels import _backend, _checks, _compat
from pallas_kernels.attention import block_sizes as _bs
from pallas_kernels.attention import masks as _masks
from pallas_kernels.attention import reference as _reference

OP = "flash_attention"
_FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


@dataclasses.dataclass(frozen=True)
class _Config:
  """Static parameters (hashable: they key the custom VJP's traces)."""
  sm_scale: float
  causal: bool
  window_left: int | None
  window_right: int | None
  logit_soft_cap: float | None
  block_sizes: _bs.BlockSizes | None
  backend: str | None
  return_lse: bool
  # A static mask (or per-head tuple) beyond the causal/window band; the
  # band fields are then folded into it.
  mask: _masks.Mask | tuple[_masks.Mask, ...] | None = None
  # False: nothing reads the forward's lse (a primal call without
  # return_lse); the TPU kernel then writes none.
  need_lse: bool = True

  def kernel_kwargs(self):
    kwargs = dict(sm_scale=self.sm_scale, causal=self.causal,
                  window_left=self.window_left,
                  window_right=self.window_right,
                  logit_soft_cap=self.logit_soft_cap,
                  block_sizes=self.block_sizes)
    if self.mask is not None:
      kwargs["mask"] = self.mask
    return kwargs


# ------------------------------------------------------------- backends --

def _hopper(target):
  if target.hopper:
    return None
  return ("the Mosaic GPU attention kernels need a Hopper GPU (sm_90), "
          f"found {target.gpu_capability or 'none'}")


def _module(name):
  """``pallas_kernels.attention.<name>``, imported when a row needs it."""
  return importlib.import_module(f"pallas_kernels.attention.{name}")


def _mosaic_gpu_supports(config, module, *arrays):
  """The Mosaic GPU module's ``supports``, or why it cannot be imported."""
  try:
    supports = _module(module).supports
  except Exception as e:  # a broken optional dependency of this jax
    return f"pallas_kernels.attention.{module} cannot be imported: {e}"
  return supports(*arrays, mask=config.mask)


def _run(config, module, function, block_sizes=True, **extra):
  """A row's ``run``: ``module.function(*arrays, interpret=..., **config,
  **extra)``; the Mosaic GPU kernels take no block sizes (their tiles are
  fixed per head_dim)."""
  def run(*arrays, interpret=None):
    kwargs = dict(config.kernel_kwargs(), **extra)
    if not block_sizes:
      del kwargs["block_sizes"]
    return getattr(_module(module), function)(
        *arrays, interpret=False if interpret is None else interpret,
        **kwargs)
  return run


def _reference_forward(config, q, k, v, q_seg, kv_seg, bias):
  kwargs = config.kernel_kwargs()
  del kwargs["block_sizes"]
  return _reference.attention(q, k, v, q_seg, kv_seg, bias, **kwargs)


def _reference_backward(config, q, k, v, q_seg, kv_seg, bias, out, lse, d_out,
                        d_lse):
  """The gradient at the given (out, lse), as every backward kernel takes
  them: autodiff of the reference gives the gradient of the softmax
  normalized by its own lse_b; the cotangents ``w d_out`` and ``w (d_out .
  (out_b - out) + d_lse)`` with ``w = exp(lse_b - lse)`` make it the
  gradient under normalization by ``lse`` (ring attention's blocks; w = 1
  when lse is the block's own)."""
  def fn(q, k, v, bias):
    return _reference_forward(config, q, k, v, q_seg, kv_seg, bias)
  (out_b, lse_b), vjp = jax.vjp(fn, q, k, v, bias)
  w = jnp.where(lse_b == -jnp.inf, 0.0, jnp.exp(lse_b - lse))
  d_out = d_out.astype(jnp.float32)
  drift = jnp.sum(d_out * (out_b.astype(jnp.float32)
                           - out.astype(jnp.float32)), axis=-1)
  d_lse_b = w * (drift if d_lse is None else drift + d_lse)
  return vjp(((w[..., None] * d_out).astype(out_b.dtype), d_lse_b))


def _rows(config, function, q, k, v, q_seg, bias):
  """The kernels of the ``function`` pass ("forward" or "backward"), best
  first. Forward arrays: q, k, v, q_seg, kv_seg, bias -> (out, lse).
  Backward arrays: those, out, lse, d_out, d_lse -> (dq, dk, dv, dbias or
  None). The passes choose independently (e.g. a Mosaic GPU forward and a
  Triton backward): every forward's lse is the natural-log log-sum-exp with
  -inf for rows without keys, which every backward takes."""
  mosaic_gpu = "mosaic_gpu" if function == "forward" else "mosaic_gpu_bwd"
  reference = {"forward": _reference_forward,
               "backward": _reference_backward}[function]
  tpu_extra = {} if function == "backward" or config.need_lse else dict(
      lse=False)
  return [
      _backend.Kernel("mosaic_tpu", _run(config, "mosaic_tpu", function,
                                         **tpu_extra)),
      _backend.Kernel(
          "mosaic_gpu", _run(config, mosaic_gpu, function, block_sizes=False),
          supports=lambda: _mosaic_gpu_supports(config, mosaic_gpu, q, k, v,
                                                q_seg, bias),
          hardware=_hopper),
      _backend.Kernel("triton", _run(config, "triton", function)),
      _backend.Kernel("reference", functools.partial(reference, config)),
  ]


_FACTOR_NAMES = {"b": "batch", "h": "heads", "g": "kv_heads", "l": "q_len",
                 "m": "kv_len", "d": "head_dim", "e": "v_head_dim"}


def _sharding_rule(q_seg, kv_seg, bias, forward: bool, d_lse=None):
  """Batch and heads split (query and kv heads together); nothing else."""
  from pallas_kernels import _sharding
  seg = lambda x, f: f if x is not None else None
  bias_factors = (None if bias is None else
                  _sharding.broadcast_factors(bias.shape, "b h l m", "bias"))
  operands = [("q", "b h l d"), ("k", "b g m d"), ("v", "b g m e"),
              ("q_segment_ids", seg(q_seg, "b l")),
              ("kv_segment_ids", seg(kv_seg, "b m")), ("bias", bias_factors)]
  if forward:
    results, sums = ["b h l e", "b h l"], None
  else:
    operands += [("out", "b h l e"), ("lse", "b h l"), ("d_out", "b h l e"),
                 ("d_lse", seg(d_lse, "b h l"))]
    results = ["b h l d", "b g m d", "b g m e"]
    sums = ["", "", ""]
    if bias is not None:
      results.append(bias_factors)
      sums.append(" ".join(f for f, size in zip("b h".split(), bias.shape)
                           if size == 1))
  return _sharding.make_rule(
      OP, operands, results, split="b h g", sums=sums, tied=["h g"],
      helper="shard_flash_attention (or jax.shard_map)", names=_FACTOR_NAMES)


def call_rule(q_seg, kv_seg, bias, sinks):
  """The forward rule on flash_attention's arrays (q, k, v, q_segment_ids,
  kv_segment_ids, bias, sinks): sinks, one logit per query head, join
  outside the kernel."""
  rule = _sharding_rule(q_seg, kv_seg, bias, True)
  return dataclasses.replace(rule, operands=rule.operands + (
      ("sinks", None if sinks is None else ("h",)),))


def _forward(config, q, k, v, q_seg, kv_seg, bias):
  return _backend.dispatch(
      OP, config.backend, _rows(config, "forward", q, k, v, q_seg, bias),
      q, k, v, q_seg, kv_seg, bias,
      rule=_sharding_rule(q_seg, kv_seg, bias, True),
      auto_partition=not isinstance(config.mask, tuple))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(config, q, k, v, q_seg, kv_seg, bias):
  # Not differentiated here: lse is read only when returned.
  if not config.return_lse:
    config = dataclasses.replace(config, need_lse=False)
  return _forward(config, q, k, v, q_seg, kv_seg, bias)


def _attention_fwd(config, q, k, v, q_seg, kv_seg, bias):
  out, lse = _forward(config, q, k, v, q_seg, kv_seg, bias)
  return (out, lse), (q, k, v, q_seg, kv_seg, bias, out, lse)


def _backward(config, q, k, v, q_seg, kv_seg, bias, out, lse, d_out, d_lse):
  """(dq, dk, dv, dbias or None) at the residuals (out, lse); ``d_lse`` may
  be None."""
  return _backend.dispatch(
      OP, config.backend, _rows(config, "backward", q, k, v, q_seg, bias),
      q, k, v, q_seg, kv_seg, bias, out, lse, d_out, d_lse,
      rule=_sharding_rule(q_seg, kv_seg, bias, False, d_lse),
      auto_partition=not isinstance(config.mask, tuple))


def _attention_bwd(config, residuals, cotangents):
  q, k, v, q_seg, kv_seg, bias, out, lse = residuals
  d_out, d_lse = cotangents
  if not config.return_lse:
    d_lse = None
  dq, dk, dv, dbias = _backward(config, q, k, v, q_seg, kv_seg, bias, out, lse,
                                d_out.astype(q.dtype), d_lse)
  from pallas_kernels import _sharding
  dq, dk, dv, dbias = _sharding.cotangents_like((q, k, v, bias),
                                                (dq, dk, dv, dbias))
  return (dq, dk, dv, _checks.integer_cotangent(q_seg),
          _checks.integer_cotangent(kv_seg), dbias)


_attention.defvjp(_attention_fwd, _attention_bwd)


# ----------------------------------------------------------- validation --

def _check_array(name, x, ndim):
  _checks.check_array(OP, name, x, ndim)


def _check_float(name, x):
  if x.dtype not in [jnp.dtype(d) for d in _FLOAT_DTYPES]:
    raise TypeError(f"{OP}: {name} must be bfloat16, float16 or float32, got "
                    f"{x.dtype}")


def _window(sliding_window, causal):
  if sliding_window is None:
    return None, (0 if causal else None)
  def check(value, what):
    if value is None:
      return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
      raise TypeError(f"{OP}: sliding_window {what} must be an int or None, "
                      f"got {value!r}")
    if value < 0:
      raise ValueError(f"{OP}: sliding_window {what} must be >= 0, got {value}")
    return int(value)
  if isinstance(sliding_window, (tuple, list)):
    if len(sliding_window) != 2:
      raise ValueError(f"{OP}: sliding_window must be an int or a (left, "
                       f"right) pair, got {sliding_window!r}")
    left = check(sliding_window[0], "left")
    right = check(sliding_window[1], "right")
  else:
    left = check(sliding_window, "size")
    if left is None:
      raise TypeError(f"{OP}: sliding_window must be an int or a pair")
    right = 0 if causal else left
  return _reference.normalize_window((left, right), causal)


def _static_mask(mask, causal, left, right, heads, q_len, kv_len):
  """(mask for the kernels or None, causal, left, right): a mask that is the
  plain causal/window band stays on the band fields; anything else absorbs
  the band and is checked against the lengths."""
  if mask is None:
    return None, causal, left, right
  mask = _masks.per_head(mask, heads)
  if isinstance(mask, _masks.Causal) and left is None:
    return None, True, None, 0
  if isinstance(mask, _masks.Local) and not causal and left is None and (
      right is None):
    return None, False, mask.left, mask.right
  _masks.check(mask, q_len, kv_len)
  if left is not None or right is not None:
    band = _masks.Local(left, right)
    mask = (tuple(m & band for m in mask) if isinstance(mask, tuple)
            else mask & band)
  return mask, False, None, None


def _check_sinks(sinks, heads):
  if sinks is None:
    return None
  _check_array("sinks", sinks, 1)
  _check_float("sinks", sinks)
  if sinks.shape[0] != heads:
    raise ValueError(f"{OP}: sinks must have shape [heads] = [{heads}], got "
                     f"{tuple(sinks.shape)}")
  return sinks


def _validate(q, k, v, causal, sm_scale, segment_ids, sliding_window,
              logit_soft_cap, bias, return_lse, block_sizes, backend,
              mask=None):
  _backend.check_backend(OP, backend)
  for name, x in (("q", q), ("k", k), ("v", v)):
    _check_array(name, x, 4)
    _check_float(name, x)
  if not (q.dtype == k.dtype == v.dtype):
    raise TypeError(f"{OP}: q, k and v must share a dtype, got {q.dtype}, "
                    f"{k.dtype}, {v.dtype}")
  batch, heads, q_len, head_dim = q.shape
  if k.shape[:3] != v.shape[:3]:
    raise ValueError(f"{OP}: k and v must have the same [batch, kv_heads, "
                     f"kv_len], got {tuple(k.shape)} and {tuple(v.shape)}")
  if v.shape[3] < 1:
    raise ValueError(f"{OP}: v's head_dim must be >= 1, got "
                     f"{tuple(v.shape)}")
  if k.shape[0] != batch:
    raise ValueError(f"{OP}: batch of k/v ({k.shape[0]}) != batch of q "
                     f"({batch})")
  if k.shape[3] != head_dim:
    raise ValueError(f"{OP}: head_dim of k ({k.shape[3]}) != head_dim of q "
                     f"({head_dim})")
  if head_dim < 1:
    raise ValueError(f"{OP}: head_dim must be >= 1")
  kv_heads = k.shape[1]
  if (kv_heads < 1 and heads > 0) or (kv_heads and heads % kv_heads):
    raise ValueError(f"{OP}: heads ({heads}) must be a multiple of kv_heads "
                     f"({kv_heads})")
  if not isinstance(causal, (bool, jnp.bool_)):
    raise TypeError(f"{OP}: causal must be a bool, got {causal!r}")
  if not isinstance(return_lse, bool):
    raise TypeError(f"{OP}: return_lse must be a bool, got {return_lse!r}")
  sm_scale, logit_soft_cap = _checks.scale_and_cap(OP, sm_scale,
                                                   logit_soft_cap, head_dim)
  left, right = _window(sliding_window, bool(causal))
  kv_len = k.shape[2]
  q_seg = kv_seg = None
  if segment_ids is not None:
    if not isinstance(segment_ids, (tuple, list)) or len(segment_ids) != 2:
      raise TypeError(f"{OP}: segment_ids must be a (q_segment_ids, "
                      "kv_segment_ids) pair")
    q_seg, kv_seg = segment_ids
    for name, ids, length in (("q_segment_ids", q_seg, q_len),
                              ("kv_segment_ids", kv_seg, kv_len)):
      _check_array(f"segment_ids[{name}]", ids, 2)
      if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"{OP}: {name} must be integers, got {ids.dtype}")
      if tuple(ids.shape) != (batch, length):
        raise ValueError(f"{OP}: {name} must have shape {(batch, length)}, "
                         f"got {tuple(ids.shape)}")
    q_seg, kv_seg = q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32)
  if bias is not None:
    _check_array("bias", bias, 4)
    _check_float("bias", bias)
    b0, b1, b2, b3 = bias.shape
    if b0 not in (1, batch) or b1 not in (1, heads) or (b2, b3) != (q_len,
                                                                     kv_len):
      raise ValueError(
          f"{OP}: bias must have shape [batch or 1, heads or 1, q_len, "
          f"kv_len] = [{batch} or 1, {heads} or 1, {q_len}, {kv_len}], got "
          f"{tuple(bias.shape)}")
  blocks = _bs.as_block_sizes(block_sizes)
  mask, causal, left, right = _static_mask(mask, bool(causal), left, right,
                                           heads, q_len, kv_len)
  config = _Config(sm_scale=float(sm_scale), causal=bool(causal),
                   window_left=left, window_right=right,
                   logit_soft_cap=logit_soft_cap, block_sizes=blocks,
                   backend=backend, return_lse=return_lse, mask=mask)
  return config, q_seg, kv_seg


def flash_attention(q, k, v, *, causal=False, sm_scale=None, segment_ids=None,
                    sliding_window=None, logit_soft_cap=None, bias=None,
                    sinks=None, mask=None, return_lse=False, block_sizes=None,
                    backend=None):
  """Softmax attention ``softmax(mask(cap(sm_scale q k^T) + bias)) v``.

  Args:
    q: ``[batch, heads, q_len, head_dim]``, bfloat16/float16/float32.
    k: ``[batch, kv_heads, kv_len, head_dim]`` with ``heads % kv_heads ==
      0`` (MHA, GQA, MQA); query head ``h`` uses kv head
      ``h // (heads // kv_heads)``.
    v: ``[batch, kv_heads, kv_len, v_head_dim]``; ``v_head_dim`` may differ
      from ``head_dim`` (MLA, e.g. DeepSeek-V3's 192 and 128; the Mosaic
      GPU kernels need them equal).
    causal: query ``i`` sees keys ``j <= i + kv_len - q_len`` (ends aligned).
    sm_scale: logit scale, default ``1 / sqrt(head_dim)``.
    segment_ids: ``(q_segment_ids [batch, q_len], kv_segment_ids [batch,
      kv_len])`` integers; attention only between equal ids.
    sliding_window: ``w`` (``(w, 0)`` if causal else ``(w, w)``) or
      ``(left, right)``: query ``i`` sees keys ``i + off - left <= j <= i +
      off + right`` (None in the pair: unbounded on that side).
    logit_soft_cap: ``cap * tanh(logits / cap)`` before bias and mask.
    bias: additive float ``[batch or 1, heads or 1, q_len, kv_len]``.
    sinks: float ``[heads]``: a learnable logit per head that joins every
      row's softmax denominator and carries no value (gpt-oss); the output
      is ``softmax([logits, sink])`` with the sink's column dropped, so a row
      with no allowed key puts all weight on the sink and outputs 0.
      Differentiable (``d sinks`` too); lse then includes the sink.
    mask: a static mask from ``pallas_kernels.attention.masks``
      (``Causal()``, ``Local(left, right)``, ``ChunkedCausal(size)``,
      ``PrefixLM(length)``, ``Dense(bool [q_len, kv_len])``, combined with
      ``&``/``|``), or a list of one per query head. It intersects with
      ``causal``/``sliding_window`` and segment ids; the kernels skip the
      blocks it empties in forward and backward.
    return_lse: also return the float32 log-sum-exp ``[batch, heads, q_len]``
      (differentiable).
    block_sizes: the TPU kernels' ``BlockSizes``, ``(block_q, block_kv)`` or
      dict (None: the per-generation table,
      ``pallas_kernels.attention.block_sizes``); or the Triton kernels'
      ``pallas_kernels.attention.triton.GpuBlockSizes``. Other kernels
      ignore them.
    backend: None (the best kernel for the platform lowered for),
      "mosaic_tpu", "mosaic_gpu", "triton", "gpu" (the best GPU kernel),
      "interpret" (the TPU kernel in Pallas' interpreter) or "reference". A
      named kernel that cannot run the call raises ValueError.

  Returns:
    ``out [batch, heads, q_len, v_head_dim]`` in q's dtype, or ``(out,
    lse)``. A query row with no
    allowed key gets ``out = 0``, ``lse = -inf`` and zero gradients.
  """
  config, q_seg, kv_seg = _validate(
      q, k, v, causal, sm_scale, segment_ids, sliding_window, logit_soft_cap,
      bias, return_lse, block_sizes, backend, mask)
  batch, heads, q_len, head_dim = q.shape
  sinks = _check_sinks(sinks, heads)
  if 0 in (batch, heads, q_len, k.shape[2]):
    # Nothing to attend to: zero output, -inf lse, zero gradients.
    out = jnp.zeros(q.shape[:3] + v.shape[3:], q.dtype)
    lse = jnp.full((batch, heads, q_len), -jnp.inf, jnp.float32)
  else:
    if sinks is not None:   # the sink enters through lse: its cotangent too
      config = dataclasses.replace(config, return_lse=True)
    out, lse = _attention(config, q, k, v, q_seg, kv_seg, bias)
  if sinks is not None:
    out, lse = _reference.with_sinks(out, lse, sinks)
  return (out, lse) if return_lse else out
