"""Public decode-attention API: validation, gradient rule, kernel choice
(``mosaic_tpu``, ``triton``, ``reference``, best first). The gradient is the
reference's VJP, with 8-bit caches (``_frozen``) in q and sinks only.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _backend, _checks, _frozen
from pallas_kernels.decode import reference as _reference

OP = "decode_attention"
MAX_QUERIES = 16
_FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
# Caches stored in 8 bits, with a float32 scale per kv head.
QUANTIZED_DTYPES = (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2)


@dataclasses.dataclass(frozen=True)
class _Config:
  """Static parameters (hashable: they key the custom VJP's traces)."""
  sm_scale: float
  logit_soft_cap: float | None
  sliding_window: int | None
  backend: str | None

  def kwargs(self):
    return dict(sm_scale=self.sm_scale, logit_soft_cap=self.logit_soft_cap,
                sliding_window=self.sliding_window)


# ------------------------------------------------------------- backends --

def _module(name):
  return importlib.import_module(f"pallas_kernels.decode.{name}")


def _kernel_run(config, name):
  def run(*arrays, interpret=None):
    return _module(name).decode(
        *arrays, interpret=False if interpret is None else interpret,
        **config.kwargs())
  return run


def _reference_run(config, *arrays):
  return _reference.decode_attention_reference(*arrays, **config.kwargs())


def _rows(config, q, k_cache, v_cache, page_table):
  return [
      _backend.Kernel(
          "mosaic_tpu", _kernel_run(config, "mosaic_tpu"),
          supports=lambda: _module("mosaic_tpu").supports(q, k_cache,
                                                          page_table),
          hardware=lambda target: _module("mosaic_tpu").hardware(
              q, v_cache, page_table, target)),
      _backend.Kernel(
          "triton", _kernel_run(config, "triton"),
          supports=lambda: _module("triton").supports(q, k_cache, v_cache,
                                                      page_table)),
      _backend.Kernel("reference", functools.partial(_reference_run, config)),
  ]


_FACTOR_NAMES = {"b": "batch", "h": "heads", "g": "kv_heads", "t": "queries",
                 "s": "cache positions", "d": "head_dim",
                 "e": "v_head_dim", "p": "pages",
                 "n": "pages per sequence"}


def _sharding_rule(sinks, page_table, scales=False, backward=False):
  """Batch and heads split (query and kv heads together); a paged cache's
  pages are shared by the batch, so they stay whole (and their gradient is
  a sum over batch shards, as is the sinks'). An 8-bit cache's scales split
  with the kv heads."""
  from pallas_kernels import _sharding
  cache = "b g s d" if page_table is None else "p g s d"
  v_cache = cache[:-1] + "e"   # v's head_dim (MLA: not q's)
  operands = [("q", "b h t d"), ("k_cache", cache), ("v_cache", v_cache),
              ("kv_lengths", "b"), ("sinks", None if sinks is None else "h"),
              ("page_table", None if page_table is None else "b n")]
  if scales:
    operands += [("k_scale", "g"), ("v_scale", "g")]
  results, sums = ["b h t e"], None
  if backward:
    operands.append(("d_out", "b h t e"))
    cache_sum = "" if page_table is None else "b"
    results, sums = ["b h t d", cache, v_cache], ["", cache_sum, cache_sum]
    if sinks is not None:
      results.append("h")
      sums.append("b")
  return _sharding.make_rule(
      OP, operands, results, split="b h g", sums=sums, tied=["h g"],
      helper="jax.shard_map", names=_FACTOR_NAMES)


def call_rule(sinks, page_table, k_scale):
  """The forward rule on decode_attention's arrays (q, k_cache, v_cache,
  kv_lengths, sinks, page_table, k_scale, v_scale)."""
  return _sharding_rule(sinks, page_table, scales=k_scale is not None)


def _forward(config, q, k_cache, v_cache, kv_lengths, sinks, page_table,
             *scales):
  return _backend.dispatch(
      OP, config.backend, _rows(config, q, k_cache, v_cache, page_table),
      q, k_cache, v_cache, kv_lengths, sinks, page_table, *scales,
      rule=_sharding_rule(sinks, page_table, scales=bool(scales)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _decode(config, q, k_cache, v_cache, kv_lengths, sinks, page_table):
  return _forward(config, q, k_cache, v_cache, kv_lengths, sinks, page_table)


def _decode_fwd(config, q, k_cache, v_cache, kv_lengths, sinks, page_table):
  out = _forward(config, q, k_cache, v_cache, kv_lengths, sinks, page_table)
  return out, (q, k_cache, v_cache, kv_lengths, sinks, page_table)


def _reference_vjp(config, q, k_cache, v_cache, kv_lengths, sinks,
                   page_table, d_out):
  def fn(q, k_cache, v_cache, sinks):
    return _reference_run(config, q, k_cache, v_cache, kv_lengths, sinks,
                          page_table)
  _, vjp = jax.vjp(fn, q, k_cache, v_cache, sinks)
  grads = vjp(d_out)
  return grads if sinks is not None else grads[:3]


def _decode_bwd(config, residuals, d_out):
  q, k_cache, v_cache, kv_lengths, sinks, page_table = residuals
  from pallas_kernels import _sharding
  # Sharded like the forward: XLA alone cannot place the paged gather
  # under Explicit axes.
  grads = _sharding.run(
      _sharding_rule(sinks, page_table, backward=True),
      functools.partial(_reference_vjp, config), q, k_cache, v_cache,
      kv_lengths, sinks, page_table, d_out.astype(q.dtype), auto=False)
  dq, dk, dv, dsinks = tuple(grads) + (None,) * (4 - len(grads))
  dq, dk, dv, dsinks = _sharding.cotangents_like(
      (q, k_cache, v_cache, sinks), (dq, dk, dv, dsinks))
  return (dq, dk, dv, _checks.integer_cotangent(kv_lengths), dsinks,
          _checks.integer_cotangent(page_table))


_decode.defvjp(_decode_fwd, _decode_bwd)


_QUANTIZED_NAMES = ("q", "k_cache", "v_cache", "kv_lengths", "sinks",
                    "page_table", "k_scale", "v_scale")
_FROZEN = "an 8-bit KV cache and its scales are not differentiable"
_QUANTIZED_REASONS = {name: _FROZEN
                      for name in ("k_cache", "v_cache", "k_scale", "v_scale")}


def _quantized_linear(config, name):
  """The tangent of the output in operand ``name`` (q or sinks), through
  the reference (plain JAX, so reverse mode transposes it)."""
  index = _QUANTIZED_NAMES.index(name)

  def tangent(t, *operands):
    primal = operands[index]

    def fn(x):
      args = list(operands)
      args[index] = x
      return _reference_run(config, *args)
    return jax.jvp(fn, (primal,), (t.astype(primal.dtype),))[1]
  return tangent


def _decode_quantized(config, *operands):
  """8-bit caches: the kernel under ``_frozen`` (tangents in q and sinks
  only; the caches and scales are frozen)."""
  return _frozen.frozen(
      OP, functools.partial(_forward, config), _QUANTIZED_NAMES, operands,
      {name: _quantized_linear(config, name) for name in ("q", "sinks")},
      _QUANTIZED_REASONS)


# ----------------------------------------------------------- validation --

def _check_array(name, x, ndim):
  _checks.check_array(OP, name, x, ndim)


def _check_integer(name, x):
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{OP}: {name} must hold integers, got {x.dtype}")


def _concrete(x):
  """x as a numpy array, or None when it is traced."""
  if isinstance(x, jax.core.Tracer):
    return None
  return np.asarray(x)


def _quantized(dtype) -> bool:
  return dtype in [jnp.dtype(d) for d in QUANTIZED_DTYPES]


def _check_scales(k_cache, v_cache, k_scale, v_scale):
  """The scales as float32 ``[Hkv]`` (None for float caches)."""
  dtype = jnp.dtype(k_cache.dtype).name
  if not _quantized(k_cache.dtype):
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
      if scale is not None:
        raise ValueError(f"{OP}: {name} is only for 8-bit caches (int8, "
                         f"float8_e4m3fn, float8_e5m2); the caches are "
                         f"{dtype}: pass {name}=None")
    return None, None
  kv_heads = k_cache.shape[1]
  out = []
  for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
    if scale is None:
      raise ValueError(f"{OP}: {dtype} caches need {name} (float32, shape "
                       f"({kv_heads},): one scale per kv head, or a scalar)")
    scale = jnp.asarray(scale)
    if not jnp.issubdtype(scale.dtype, jnp.floating):
      raise TypeError(f"{OP}: {name} must be floats, got {scale.dtype}")
    if scale.shape not in ((), (kv_heads,)):
      raise ValueError(f"{OP}: {name} must have shape ({kv_heads},) (one per "
                       f"kv head) or be a scalar, got {tuple(scale.shape)}")
    out.append(jnp.broadcast_to(scale.astype(jnp.float32), (kv_heads,)))
  return tuple(out)


def _check_dtypes(q, k_cache, v_cache):
  if q.dtype not in [jnp.dtype(d) for d in _FLOAT_DTYPES]:
    raise TypeError(f"{OP}: q must be bfloat16, float16 or float32, got "
                    f"{q.dtype}")
  if k_cache.dtype != v_cache.dtype:
    raise TypeError(f"{OP}: k_cache and v_cache must share a dtype, got "
                    f"{k_cache.dtype} and {v_cache.dtype}")
  if q.dtype != k_cache.dtype and not _quantized(k_cache.dtype):
    raise TypeError(f"{OP}: q, k_cache and v_cache must share a dtype (or "
                    "the caches be 8-bit: int8, float8_e4m3fn, float8_e5m2, "
                    f"with k_scale/v_scale), got {q.dtype}, {k_cache.dtype}")


def _validate(q, k_cache, v_cache, kv_lengths, sm_scale, logit_soft_cap,
              sliding_window, sinks, page_table, backend):
  _backend.check_backend(OP, backend)
  for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
    _check_array(name, x, 4)
  _check_dtypes(q, k_cache, v_cache)
  # v's head_dim may differ from k's (MLA); nothing else may.
  dims = (("pages" if page_table is not None else "batch"), "kv_heads",
          ("page_size" if page_table is not None else "capacity"))
  for dim, k_size, v_size in zip(dims, k_cache.shape, v_cache.shape):
    if k_size != v_size:
      raise ValueError(
          f"{OP}: {dim} of v_cache ({v_size}) != {dim} of k_cache ({k_size})"
          f": the caches may differ only in head_dim, got "
          f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
  batch, heads, queries, head_dim = q.shape
  kv_heads = k_cache.shape[1]
  if queries > MAX_QUERIES:
    raise ValueError(
        f"{OP}: q holds {queries} new tokens per sequence (q.shape[2]); at "
        f"most {MAX_QUERIES} are supported: use flash_attention for prefill")
  if k_cache.shape[3] != head_dim:
    raise ValueError(f"{OP}: head_dim of k_cache ({k_cache.shape[3]}) != "
                     f"head_dim of q ({head_dim})")
  if (kv_heads == 0 and heads > 0) or (kv_heads and heads % kv_heads):
    raise ValueError(f"{OP}: heads of q ({heads}) must be a multiple of the "
                     f"caches' kv_heads ({kv_heads})")
  _check_array("kv_lengths", kv_lengths, 1)
  _check_integer("kv_lengths", kv_lengths)
  if kv_lengths.shape[0] != batch:
    raise ValueError(f"{OP}: kv_lengths must have shape ({batch},) (the batch "
                     f"of q), got {tuple(kv_lengths.shape)}")
  if page_table is None:
    if k_cache.shape[0] != batch:
      raise ValueError(f"{OP}: batch of k_cache/v_cache ({k_cache.shape[0]}) "
                       f"!= batch of q ({batch}); a paged cache needs "
                       "page_table=")
    capacity = k_cache.shape[2]
  else:
    _check_array("page_table", page_table, 2)
    _check_integer("page_table", page_table)
    if page_table.shape[0] != batch:
      raise ValueError(f"{OP}: page_table must have shape ({batch}, "
                       f"pages_per_seq), got {tuple(page_table.shape)}")
    capacity = page_table.shape[1] * k_cache.shape[2]
  sm_scale, logit_soft_cap = _checks.scale_and_cap(OP, sm_scale,
                                                   logit_soft_cap, head_dim)
  if sliding_window is not None:
    if (isinstance(sliding_window, bool)
        or not isinstance(sliding_window, numbers.Integral)):
      raise TypeError(f"{OP}: sliding_window must be an int or None, got "
                      f"{sliding_window!r}")
    if sliding_window < 0:
      raise ValueError(f"{OP}: sliding_window must be >= 0, got "
                       f"{sliding_window}")
    sliding_window = int(sliding_window)
  if sinks is not None:
    _check_array("sinks", sinks, 1)
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
      raise TypeError(f"{OP}: sinks must be floats, got {sinks.dtype}")
    if sinks.shape[0] != heads:
      raise ValueError(f"{OP}: sinks must have shape ({heads},) (one per "
                       f"query head), got {tuple(sinks.shape)}")
  _check_values(kv_lengths, page_table, capacity, k_cache.shape[0],
                k_cache.shape[2])
  config = _Config(sm_scale=float(sm_scale), logit_soft_cap=logit_soft_cap,
                   sliding_window=sliding_window, backend=backend)
  return config, capacity


def _check_values(kv_lengths, page_table, capacity, num_pages, page_size):
  """Range checks of concrete lengths and page-table entries (traced ones
  are clipped into range instead)."""
  lengths = _concrete(kv_lengths)
  if lengths is None:
    return
  bad = (lengths < 0) | (lengths > capacity)
  if bad.any():
    b = int(np.argmax(bad))
    raise ValueError(f"{OP}: kv_lengths[{b}] = {int(lengths[b])} is outside "
                     f"[0, {capacity}] (the cache's capacity)")
  table = None if page_table is None else _concrete(page_table)
  if table is None or page_size == 0:
    return
  used = np.arange(table.shape[1])[None, :] * page_size < lengths[:, None]
  bad = used & ((table < 0) | (table >= num_pages))
  if bad.any():
    b, p = (int(i) for i in np.argwhere(bad)[0])
    raise ValueError(f"{OP}: page_table[{b}, {p}] = {int(table[b, p])} is not "
                     f"a page of the cache (0 <= page < {num_pages})")


def decode_attention(q, k_cache, v_cache, kv_lengths, *, sm_scale=None,
                     logit_soft_cap=None, sliding_window=None, sinks=None,
                     page_table=None, k_scale=None, v_scale=None,
                     backend=None):
  """Attention of the T newest tokens of each sequence to its KV cache.

  Args:
    q: ``[B, H, T, D]`` bfloat16/float16/float32, ``1 <= T <= 16``. Query
      ``t`` of sequence ``b`` sits at position ``kv_lengths[b] - T + t`` and
      sees cache positions ``j <= kv_lengths[b] - T + t`` (causal among the
      new tokens, which are already in the cache).
    k_cache, v_cache: contiguous ``[B, Hkv, S, D]``, or paged ``[num_pages,
      Hkv, page_size, D]`` with ``page_table``; ``H % Hkv == 0`` (query head
      ``h`` reads kv head ``h // (H // Hkv)``). q's dtype, or 8-bit (int8,
      float8_e4m3fn, float8_e5m2; both the same) with ``k_scale``/``v_scale``.
      v_cache's head_dim ``Dv`` may differ from ``D`` (MLA, e.g. 192 and
      128); the caches agree in every other dimension.
    kv_lengths: ``[B]`` integers, ``0 <= kv_lengths[b] <= S`` (paged:
      ``pages_per_seq * page_size``). Cache rows at or past the length are
      never used. Traced lengths out of range are clipped.
    sm_scale: logit scale, default ``1 / sqrt(D)``.
    logit_soft_cap: ``cap * tanh(logits / cap)``.
    sliding_window: ``w``: a query at position p sees keys ``p - w <= j <=
      p``.
    sinks: ``[H]`` floats, a per-head logit that joins the softmax
      denominator only (its column is dropped).
    page_table: ``[B, pages_per_seq]`` integers: position ``j`` of sequence
      b is row ``j % page_size`` of page ``page_table[b, j // page_size]``.
      Entries past a sequence's last page are never read.
    k_scale, v_scale: 8-bit caches only: float ``[Hkv]`` (or a scalar); the
      cache holds ``k_real = k_cache * k_scale[hk]`` (v the same) and the
      result is attention over those values.
    backend: None (the best kernel for the platform lowered for),
      "mosaic_tpu", "triton", "gpu", "interpret" or "reference".

  Returns:
    ``[B, H, T, Dv]`` (v_cache's head_dim) in q's dtype; a query with no
    visible key gets 0.
    Differentiable in q, the caches and sinks (through the reference); with
    8-bit caches in q and sinks only (a gradient in a cache or scale raises
    a TypeError).
  """
  config, capacity = _validate(q, k_cache, v_cache, kv_lengths, sm_scale,
                               logit_soft_cap, sliding_window, sinks,
                               page_table, backend)
  k_scale, v_scale = _check_scales(k_cache, v_cache, k_scale, v_scale)
  if 0 in q.shape or 0 in k_cache.shape or 0 in v_cache.shape or (
      capacity == 0):
    return jnp.zeros(q.shape[:3] + v_cache.shape[3:], q.dtype)
  kv_lengths = jnp.clip(jnp.asarray(kv_lengths).astype(jnp.int32), 0,
                        capacity)
  if page_table is not None:
    page_table = jnp.asarray(page_table).astype(jnp.int32)
  if k_scale is not None:
    return _decode_quantized(config, q, k_cache, v_cache, kv_lengths, sinks,
                             page_table, k_scale, v_scale)
  return _decode(config, q, k_cache, v_cache, kv_lengths, sinks, page_table)
