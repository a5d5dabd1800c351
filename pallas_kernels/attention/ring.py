"""Context parallelism: ring attention over the mesh axis of the sequence.

Each device holds a slice of q and K/V; the K/V slices travel around the ring
(``ppermute``) and each step's flash-attention partial is merged by
log-sum-exp. Causal attention runs in zig-zag order (device r: chunks r and
2N-1-r of 2N); windows and static masks follow a trace-time plan. The backward
is a ring too. Design: docs/design/attention.md.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import jax
import jax.experimental
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import _backend, _checks, _sharding
from pallas_kernels.attention import api as _api
from pallas_kernels.attention import masks as _masks
from pallas_kernels.attention import reference as _reference

SEQUENCE_LAYOUTS = ("contiguous", "zigzag")
_HELPER = "shard_flash_attention"


@dataclasses.dataclass(frozen=True)
class _Ring:
  """Static parameters of one ring call (hashable: the custom VJP's key)."""
  config: Any   # api._Config of the whole (unsharded) call
  axis: str     # the mesh axis that splits the sequence
  size: int     # devices on it
  # The TPU-semantics interpreter waits for every device at each launch.
  launches_wait_for_all: bool
  plan: _Plan | None = None   # None: plain causal or no mask
  # Else the bias columns are in contiguous order, the slices in zig-zag.
  bias_in_slice_order: bool = True

  @property
  def unmasked(self):
    """The config of a block that needs no mask."""
    return _unmasked(self.config)

  @property
  def last_step(self):
    """The last step with a live pair on some device."""
    return self.size - 1 if self.plan is None else self.plan.last_step

  def shift(self, tree, by=1):
    """Every array of ``tree`` sent ``by`` devices on along the ring."""
    perm = [(i, (i + by) % self.size) for i in range(self.size)]
    return self.fence(jax.tree_util.tree_map(
        lambda x: lax.ppermute(x, self.axis, perm), self.fence(tree)))

  def fence(self, tree):
    """``tree`` through an ordered host callback under
    ``launches_wait_for_all`` (so no device waits in a send another device,
    blocked in a kernel launch, has not joined); else ``tree``."""
    if not self.launches_wait_for_all:
      return tree
    leaves = [jnp.ravel(x)[:1] for x in jax.tree_util.tree_leaves(tree)]
    token = jax.experimental.io_callback(
        lambda *_: np.zeros((), np.int32),
        jax.ShapeDtypeStruct((), jnp.int32), *leaves, ordered=True)
    return lax.optimization_barrier((token, tree))[1]

  def source(self, step):
    """The device whose K/V slice visits at ``step``."""
    return (lax.axis_index(self.axis) + (self.size - step)) % self.size

  def _column_pieces(self, columns, step):
    """(start, width) of the visiting slice's key columns among the local
    bias rows' ``columns``."""
    src = self.source(step)
    width = columns // self.size
    if self.bias_in_slice_order:
      return [(src * width, width)]
    half = width // 2
    return [(src * half, half), ((2 * self.size - 1 - src) * half, half)]

  def bias_columns(self, bias, step):
    """The local bias rows' block of the slice visiting at ``step`` (None
    for no bias): sliced here, so the bias never travels."""
    if bias is None:
      return None
    return jnp.concatenate(
        [lax.dynamic_slice_in_dim(bias, start, width, 3)
         for start, width in self._column_pieces(bias.shape[3], step)], 3)

  def put_bias_columns(self, d_bias, step, block):
    """``d_bias`` with the visiting slice's columns set to ``block``."""
    done = 0
    for start, width in self._column_pieces(d_bias.shape[3], step):
      d_bias = lax.dynamic_update_slice_in_dim(
          d_bias, lax.slice_in_dim(block, done, done + width, axis=3), start,
          3)
      done += width
    return d_bias

  def is_earlier(self, step):
    """Whether the slice visiting at ``step`` (>= 1) comes from a device
    before this one: ``(r - step) mod N < r`` exactly when ``step <= r``."""
    return step <= lax.axis_index(self.axis)


def _unmasked(config):
  return dataclasses.replace(config, causal=False, window_left=None,
                             window_right=None, mask=None)


# ------------------------------------------------------------ mask plans --

@dataclasses.dataclass(frozen=True)
class _Plan:
  """How a window or static mask splits over the ring's block pairs:
  ``table[step][r]`` indexes ``branches`` (0: skipped; else a block config)."""
  branches: tuple
  table: tuple
  last_step: int
  zigzag: bool


def _starts(r, n, length, zigzag):
  """(first global index of each piece of device r's slice, piece)."""
  if zigzag:
    piece = length // (2 * n)
    return (r * piece, (2 * n - 1 - r) * piece), piece
  return (r * (length // n),), length // n


def _placed(mask, r, src, n, q_len, kv_len, zigzag):
  """The mask of device r's queries against device src's keys."""
  q_starts, q_piece = _starts(r, n, q_len, zigzag)
  kv_starts, kv_piece = _starts(src, n, kv_len, zigzag)
  heads = mask if isinstance(mask, tuple) else (mask,)
  placed = tuple(_masks.place(m, q_starts, kv_starts, q_piece, kv_piece,
                              offset=kv_len - q_len) for m in heads)
  return placed[0] if all(m == placed[0] for m in placed) else placed


def _classes(mask, q_len, kv_len, block_q, block_kv):
  """Block classes (0 empty, 1 partial, 2 full) of a mask or per-head tuple
  of a ``q_len`` x ``kv_len`` pair: [heads, rows, cols]."""
  heads = mask if isinstance(mask, tuple) else (mask,)
  return np.stack([_masks.block_classes(m, q_len, kv_len, block_q, block_kv)
                   for m in heads])


def _busiest(mask, n, q_len, kv_len, zigzag):
  """The largest fraction of block pairs with allowed entries that one device
  computes over the ring (blocks of 1/16 of a slice)."""
  q_local, kv_local = q_len // n, kv_len // n
  return max(sum(np.mean(_classes(
      _placed(mask, r, src, n, q_len, kv_len, zigzag), q_local, kv_local,
      -(-q_local // 16), -(-kv_local // 16)) > 0) for src in range(n))
             for r in range(n))


def _masked_config(config, mask):
  """The block config of a pair with ``mask`` (a causal or window band stays
  on the band fields, as ``flash_attention`` keeps it)."""
  if isinstance(mask, _masks.Causal):
    return dataclasses.replace(_unmasked(config), causal=True, window_right=0)
  if isinstance(mask, _masks.Local):
    return dataclasses.replace(_unmasked(config), window_left=mask.left,
                               window_right=mask.right)
  return dataclasses.replace(_unmasked(config), mask=mask)


def _band_mask(config, q_len, kv_len):
  """The config's causal/window band as a mask, or None when the ring's
  plain paths cover it (full attention; causal of equal lengths)."""
  if config.mask is not None:
    return config.mask
  if config.window_left is None and config.window_right is None:
    return None
  if config.window_left is None and config.causal and q_len == kv_len:
    return None
  return _masks.Local(config.window_left, config.window_right)


def _mask_plan(config, mask, n, q_len, kv_len, zigzag_inputs):
  """The ``_Plan`` of ``mask`` on ``n`` devices; contiguous inputs move to
  zig-zag order when that lowers the busiest device's work."""
  zigzag = zigzag_inputs or (
      n > 1 and q_len % (2 * n) == 0 and kv_len % (2 * n) == 0
      and _busiest(mask, n, q_len, kv_len, True)
      < _busiest(mask, n, q_len, kv_len, False))
  q_local, kv_local = q_len // n, kv_len // n
  branches = [None, _unmasked(config)]
  table = []
  for step in range(n):
    row = []
    for r in range(n):
      placed = _placed(mask, r, (r - step) % n, n, q_len, kv_len, zigzag)
      kind = _classes(placed, q_local, kv_local, q_local, kv_local)
      if not kind.any():
        row.append(0)
        continue
      if (kind == 2).all():
        row.append(1)
        continue
      branch = _masked_config(config, placed)
      if branch not in branches:
        branches.append(branch)
      row.append(branches.index(branch))
    table.append(tuple(row))
  live = [s for s in range(1, n) if any(table[s])]
  return _Plan(tuple(branches), tuple(table), max(live, default=0), zigzag)


# ---------------------------------------------------------- zig-zag order --

def zigzag_order(length: int, num_shards: int):
  """Indices that put a sequence of ``length`` in zig-zag order for
  ``num_shards`` devices: ``x[..., zigzag_order(L, N), :]`` split evenly
  gives device ``r`` the chunks ``r`` and ``2N-1-r`` of ``2N``. Pass such
  tensors with ``sequence_layout="zigzag"`` to skip the reorder inside the
  op; ``argsort`` of the indices undoes it."""
  if length % (2 * num_shards):
    raise ValueError(f"zigzag_order: length {length} is not divisible by "
                     f"2 * num_shards = {2 * num_shards}")
  chunks = np.arange(length).reshape(2 * num_shards, -1)
  order = [c for r in range(num_shards)
           for c in (r, 2 * num_shards - 1 - r)]
  return chunks[order].reshape(-1)


def _zigzag_home(chunk, n):
  """The device that holds ``chunk`` (of ``2n``) in zig-zag order."""
  return chunk if chunk < n else 2 * n - 1 - chunk


def _halves(x, axis):
  half = x.shape[axis] // 2
  return (lax.slice_in_dim(x, 0, half, axis=axis),
          lax.slice_in_dim(x, half, None, axis=axis))


def to_zigzag(x, axis_name, n, axis):
  """The local slice of contiguous order (chunks ``2r, 2r+1``) -> zig-zag
  order (chunks ``r, 2n-1-r``), along dimension ``axis``."""
  if n == 1:
    return x
  even, odd = _halves(x, axis)
  even = lax.ppermute(even, axis_name,
                      [(d, _zigzag_home(2 * d, n)) for d in range(n)])
  odd = lax.ppermute(odd, axis_name,
                     [(d, _zigzag_home(2 * d + 1, n)) for d in range(n)])
  even_first = lax.axis_index(axis_name) % 2 == 0
  return jnp.where(even_first, jnp.concatenate([even, odd], axis),
                   jnp.concatenate([odd, even], axis))


def from_zigzag(x, axis_name, n, axis):
  """The inverse of :func:`to_zigzag`."""
  if n == 1:
    return x
  first, second = _halves(x, axis)
  even_first = lax.axis_index(axis_name) % 2 == 0
  even = jnp.where(even_first, first, second)
  odd = jnp.where(even_first, second, first)
  even = lax.ppermute(even, axis_name,
                      [(_zigzag_home(2 * d, n), d) for d in range(n)])
  odd = lax.ppermute(odd, axis_name,
                     [(_zigzag_home(2 * d + 1, n), d) for d in range(n)])
  return jnp.concatenate([even, odd], axis)


# ----------------------------------------------------------------- blocks --

def _rows_from(x, start, stop=None):
  """``x[:, :, start:stop]`` (q/k/v/out/lse/bias) or ``x[:, start:stop]``
  (segment ids), None for None."""
  if x is None:
    return None
  axis = 1 if x.ndim == 2 else 2
  return lax.slice_in_dim(x, start, stop, axis=axis)


def _columns_from(bias, start, stop=None):
  """``bias[..., start:stop]``, None for None."""
  return None if bias is None else lax.slice_in_dim(bias, start, stop, axis=3)


def _pad(x, rows, value, before, axis=2):
  """``x`` with ``rows`` entries of ``value`` along ``axis`` (its sequence
  axis; 3 for bias columns), before or after its own; None for None."""
  if x is None:
    return None
  shape = list(x.shape)
  shape[axis] = rows
  fill = jnp.full(shape, value, x.dtype)
  return jnp.concatenate([fill, x] if before else [x, fill], axis)


def _block_forward(config, q, k, v, q_seg, kv_seg, bias):
  out, lse = _api._forward(config, q, k, v, q_seg, kv_seg, bias)
  return out.astype(jnp.float32), lse


def _skipped_forward(ring, q, k, v, q_seg, kv_seg, bias):
  """The (0, -inf) result of a pair with no allowed entry. Under
  ``launches_wait_for_all`` the kernel still runs (every device must launch
  as many kernels as the others) and its result is dropped."""
  if ring.launches_wait_for_all:
    _block_forward(ring.unmasked, q, k, v, q_seg, kv_seg, bias)
  return (jnp.zeros(q.shape[:3] + v.shape[3:], jnp.float32),
          jnp.full(q.shape[:3], -jnp.inf, jnp.float32))


def _planned(ring, step, skipped, block, *operands):
  """``block(config, *operands)`` with the plan's branch for this device at
  ``step``, or ``skipped(*operands)``."""
  index = jnp.asarray(np.asarray(ring.plan.table, np.int32))[
      step, lax.axis_index(ring.axis)]
  branches = [functools.partial(skipped, ring)] + [
      functools.partial(block, config) for config in ring.plan.branches[1:]]
  if len(branches) == 1:
    return branches[0](*operands)
  return lax.switch(index, branches, *operands)


def _visit_forward(ring, step, q, q_seg, bias, visiting):
  """(out float32, lse) of the local queries against the visiting slice;
  ``bias``: the local bias rows (every column) or None."""
  k, v, kv_seg = visiting
  bias = ring.bias_columns(bias, step)
  if ring.plan is not None:
    return _planned(ring, step, _skipped_forward, _block_forward, q, k, v,
                    q_seg, kv_seg, bias)
  if not ring.config.causal:
    return _block_forward(ring.unmasked, q, k, v, q_seg, kv_seg, bias)
  half = q.shape[2] // 2

  def earlier():   # every query, the first visiting chunk
    return _block_forward(ring.unmasked, q, _rows_from(k, 0, half),
                          _rows_from(v, 0, half), q_seg,
                          _rows_from(kv_seg, 0, half),
                          _columns_from(bias, 0, half))

  def later():     # the second query chunk, both visiting chunks
    out, lse = _block_forward(ring.unmasked, _rows_from(q, half), k, v,
                              _rows_from(q_seg, half), kv_seg,
                              _rows_from(bias, half))
    return (_pad(out, half, 0, before=True),
            _pad(lse, half, -jnp.inf, before=True))

  return lax.cond(ring.is_earlier(step), earlier, later)


def _merge(acc, part):
  """Log-sum-exp merge of two partial (out float32, lse) results."""
  out_a, lse_a = acc
  out_b, lse_b = part
  lse = jnp.logaddexp(lse_a, lse_b)

  def weight(x):   # rows without keys so far stay 0 (not NaN)
    return jnp.where(lse == -jnp.inf, 0.0, jnp.exp(x - lse))[..., None]

  return out_a * weight(lse_a) + out_b * weight(lse_b), lse


def _block_backward(config, q, k, v, q_seg, kv_seg, bias, out, lse, d_out,
                    d_lse):
  """float32 (dq, dk, dv) and d bias (bias dtype, None without bias)."""
  dq, dk, dv, d_bias = _api._backward(config, q, k, v, q_seg, kv_seg, bias,
                                      out, lse, d_out, d_lse)
  return (tuple(g.astype(jnp.float32) for g in (dq, dk, dv))
          + (None if bias is None else d_bias.astype(bias.dtype),))


def _skipped_backward(ring, q, k, v, q_seg, kv_seg, bias, *operands):
  """Zero gradients of a pair with no allowed entry (see
  ``_skipped_forward``)."""
  if ring.launches_wait_for_all:
    _block_backward(ring.unmasked, q, k, v, q_seg, kv_seg, bias, *operands)
  return (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32),
          jnp.zeros(v.shape, jnp.float32),
          None if bias is None else jnp.zeros(bias.shape, bias.dtype))


def _visit_backward(ring, step, q, q_seg, bias, out, lse, d_out, d_lse,
                    visiting):
  """float32 (dq, dk, dv) and the bias block's gradient of the visiting
  block at the final (out, lse)."""
  k, v, kv_seg = visiting
  bias = ring.bias_columns(bias, step)
  if ring.plan is not None:
    return _planned(ring, step, _skipped_backward, _block_backward, q, k, v,
                    q_seg, kv_seg, bias, out, lse, d_out, d_lse)
  if not ring.config.causal:
    return _block_backward(ring.unmasked, q, k, v, q_seg, kv_seg, bias, out,
                           lse, d_out, d_lse)
  half = q.shape[2] // 2

  def earlier():
    dq, dk, dv, d_bias = _block_backward(
        ring.unmasked, q, _rows_from(k, 0, half), _rows_from(v, 0, half),
        q_seg, _rows_from(kv_seg, 0, half), _columns_from(bias, 0, half),
        out, lse, d_out, d_lse)
    return (dq, _pad(dk, half, 0, before=False),
            _pad(dv, half, 0, before=False),
            _pad(d_bias, half, 0, before=False, axis=3))

  def later():
    rows = lambda x: _rows_from(x, half)  # noqa: E731
    dq, dk, dv, d_bias = _block_backward(
        ring.unmasked, rows(q), k, v, rows(q_seg), kv_seg, rows(bias),
        rows(out), rows(lse), rows(d_out), rows(d_lse))
    return (_pad(dq, half, 0, before=True), dk, dv,
            _pad(d_bias, half, 0, before=True))

  return lax.cond(ring.is_earlier(step), earlier, later)


# ------------------------------------------------------------------- ring --

def _around_the_ring(ring, visiting, carry, visit):
  """Runs ``carry = visit(step, visiting_slice, carry)`` for steps ``1 ..
  ring.last_step``, each slice sent on before it is used; ``visiting`` is
  the slice of step 1, already sent."""
  def body(step, state):
    current, carry = state
    return ring.shift(current), visit(step, current, carry)

  last = ring.last_step
  if last > 1:
    visiting, carry = lax.fori_loop(1, last, body, (visiting, carry))
  if last > 0:   # the last slice goes nowhere
    carry = visit(last, visiting, carry)
  return carry


def _ring_forward(ring, q, k, v, q_seg, kv_seg, bias):
  q, k, v, q_seg, kv_seg, bias = ring.fence((q, k, v, q_seg, kv_seg, bias))
  local = (k, v, kv_seg)
  visiting = ring.shift(local) if ring.last_step > 0 else None
  # Step 0: the local slice; causal attention of the local slices is the
  # mask of chunks (r, 2N-1-r) against themselves.
  if ring.plan is not None:
    acc = _visit_forward(ring, 0, q, q_seg, bias, local)
  else:
    acc = _block_forward(ring.config, q, k, v, q_seg, kv_seg,
                         ring.bias_columns(bias, 0))

  def visit(step, current, acc):
    return _merge(acc, _visit_forward(ring, step, q, q_seg, bias, current))

  out, lse = _around_the_ring(ring, visiting, acc, visit)
  return ring.fence((out.astype(q.dtype), lse))


def _ring_backward(ring, q, k, v, q_seg, kv_seg, bias, out, lse, d_out,
                   d_lse):
  """(dq, dk, dv, d bias or None). The bias gradient stays local: each step
  writes the visiting slice's columns of the local rows."""
  q, k, v, q_seg, kv_seg, bias, out, lse, d_out, d_lse = ring.fence(
      (q, k, v, q_seg, kv_seg, bias, out, lse, d_out, d_lse))
  local = (k, v, kv_seg)
  visiting = ring.shift(local) if ring.last_step > 0 else None
  if ring.plan is not None:
    dq, dk, dv, d_block = _visit_backward(ring, 0, q, q_seg, bias, out, lse,
                                          d_out, d_lse, local)
  else:
    dq, dk, dv, d_block = _block_backward(
        ring.config, q, k, v, q_seg, kv_seg, ring.bias_columns(bias, 0), out,
        lse, d_out, d_lse)
  d_bias = None
  if bias is not None:   # pairs never visited (after last_step) stay 0
    d_bias = ring.put_bias_columns(jnp.zeros(bias.shape, bias.dtype), 0,
                                   d_block)

  def visit(step, current, carry):
    dq, d_bias, travelling = carry
    # The visiting slice's accumulators come from the device it just left.
    arriving = ring.shift(travelling)
    dq_s, dk_s, dv_s, d_block = _visit_backward(
        ring, step, q, q_seg, bias, out, lse, d_out, d_lse, current)
    if d_bias is not None:
      d_bias = ring.put_bias_columns(d_bias, step, d_block)
    return dq + dq_s, d_bias, (arriving[0] + dk_s, arriving[1] + dv_s)

  dq, d_bias, (dk, dv) = _around_the_ring(ring, visiting,
                                          (dq, d_bias, (dk, dv)), visit)
  if ring.last_step > 0:   # they belong to the slice of device r - last
    dk, dv = ring.shift((dk, dv), by=ring.size - ring.last_step)
  return ring.fence((dq.astype(q.dtype), dk.astype(k.dtype),
                     dv.astype(v.dtype), d_bias))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_attention(ring, q, k, v, q_seg, kv_seg, bias):
  return _ring_forward(ring, q, k, v, q_seg, kv_seg, bias)


def _ring_attention_fwd(ring, q, k, v, q_seg, kv_seg, bias):
  out, lse = _ring_forward(ring, q, k, v, q_seg, kv_seg, bias)
  return (out, lse), (q, k, v, q_seg, kv_seg, bias, out, lse)


def _ring_attention_bwd(ring, residuals, cotangents):
  q, k, v, q_seg, kv_seg, bias, out, lse = residuals
  d_out, d_lse = cotangents
  if not ring.config.return_lse:
    d_lse = None
  dq, dk, dv, d_bias = _ring_backward(ring, q, k, v, q_seg, kv_seg, bias, out,
                                      lse, d_out.astype(q.dtype), d_lse)
  return (dq, dk, dv, _checks.integer_cotangent(q_seg),
          _checks.integer_cotangent(kv_seg), d_bias)


_ring_attention.defvjp(_ring_attention_fwd, _ring_attention_bwd)


def _local_ring_attention(config, axis_name, num_shards, q, k, v, q_seg=None,
                          kv_seg=None, bias=None, *, zigzag_inputs=False,
                          plan=None):
  """Per-device ring attention inside ``shard_map``: (out, lse) of the local
  queries. q/k/v/segment ids are this device's sequence slices (contiguous
  unless ``zigzag_inputs``); ``bias`` holds the local rows, every column."""
  rows = _api._rows(config, "forward", q, k, v, q_seg, bias)
  zigzag = config.causal if plan is None else plan.zigzag
  reorder = zigzag and not zigzag_inputs and num_shards > 1
  ring = _Ring(config, axis_name, num_shards,
               launches_wait_for_all=_backend.runs_with_callbacks(
                   _api.OP, config.backend, rows), plan=plan,
               bias_in_slice_order=not reorder)
  if reorder:
    q, k, v = (to_zigzag(x, axis_name, num_shards, 2) for x in (q, k, v))
    q_seg, kv_seg = (None if s is None else
                     to_zigzag(s, axis_name, num_shards, 1)
                     for s in (q_seg, kv_seg))
    if bias is not None:   # its rows follow the queries
      bias = to_zigzag(bias, axis_name, num_shards, 2)
  out, lse = _ring_attention(ring, q, k, v, q_seg, kv_seg, bias)
  if reorder:
    out = from_zigzag(out, axis_name, num_shards, 2)
    lse = from_zigzag(lse, axis_name, num_shards, 2)
  return out, lse


# ------------------------------------------------------------ the helper --

def _check_keywords(kwargs):
  taken = inspect.signature(_api.flash_attention).parameters
  for name in kwargs:
    if name not in taken:
      raise TypeError(f"{_HELPER}: unexpected keyword argument {name!r}")


def _check_lengths(q_len, kv_len, n, axis, why_2n):
  for name, length in (("q_len", q_len), ("kv_len", kv_len)):
    if length % (2 * n if why_2n else n):
      raise ValueError(
          f"{_HELPER}: {name} {length} must be divisible by "
          + (f"2 x the {n} devices of sequence_axis {axis!r} ({why_2n} ring "
             f"attention cuts it into {2 * n} chunks)" if why_2n
             else f"the {n} devices of sequence_axis {axis!r}"))


def shard_ring_attention(mesh, q, k, v, *, batch_axis, head_axis,
                         sequence_axis, sequence_layout, segment_ids, bias,
                         **kwargs):
  """``shard_flash_attention`` with ``sequence_axis`` set (see there)."""
  from jax.sharding import PartitionSpec as P
  _check_keywords(kwargs)
  if sequence_axis in (batch_axis, head_axis):
    raise ValueError(f"{_HELPER}: sequence_axis {sequence_axis!r} must differ "
                     f"from batch_axis and head_axis")
  if sequence_layout not in SEQUENCE_LAYOUTS:
    raise ValueError(f"{_HELPER}: sequence_layout must be one of "
                     f"{SEQUENCE_LAYOUTS}, got {sequence_layout!r}")
  sinks = kwargs.pop("sinks", None)
  return_lse = kwargs.pop("return_lse", False)
  config, q_seg, kv_seg = _api._validate(
      q, k, v, causal=kwargs.get("causal", False),
      sm_scale=kwargs.get("sm_scale"), segment_ids=segment_ids,
      sliding_window=kwargs.get("sliding_window"),
      logit_soft_cap=kwargs.get("logit_soft_cap"), bias=bias,
      return_lse=return_lse, block_sizes=kwargs.get("block_sizes"),
      backend=kwargs.get("backend"), mask=kwargs.get("mask"))
  sinks = _api._check_sinks(sinks, q.shape[1])
  if sinks is not None:   # the sink enters through lse: its cotangent too
    config = dataclasses.replace(config, return_lse=True)
  n = mesh.shape[sequence_axis]
  q_len, kv_len = q.shape[2], k.shape[2]
  zigzag_inputs = sequence_layout == "zigzag"
  mask = _band_mask(config, q_len, kv_len)
  if mask is None:
    why_2n = "causal" if config.causal else None
  else:
    why_2n = "zig-zag masked" if zigzag_inputs else None
  _check_lengths(q_len, kv_len, n, sequence_axis, why_2n)
  if 0 in (q.shape[0], q.shape[1], q_len, kv_len):
    out = jnp.zeros(q.shape[:3] + v.shape[3:], q.dtype)
    lse = jnp.full(q.shape[:3], -jnp.inf, jnp.float32)
  else:
    plan = (None if mask is None
            else _mask_plan(config, mask, n, q_len, kv_len, zigzag_inputs))
    qkv_spec = P(batch_axis, head_axis, sequence_axis, None)
    seg_spec = P(batch_axis, sequence_axis)
    has_segments = q_seg is not None
    args = [q, k, v] + ([q_seg, kv_seg] if has_segments else [])
    in_specs = [qkv_spec] * 3 + [seg_spec] * (2 * has_segments)
    if bias is not None:   # rows split with q; never travels
      args.append(bias)
      in_specs.append(P(batch_axis if bias.shape[0] > 1 else None,
                        head_axis if bias.shape[1] > 1 else None,
                        sequence_axis, None))

    def local(q, k, v, *rest):
      q_seg, kv_seg = rest[:2] if has_segments else (None, None)
      local_bias = rest[-1] if bias is not None else None
      return _local_ring_attention(config, sequence_axis, n, q, k, v, q_seg,
                                   kv_seg, local_bias,
                                   zigzag_inputs=zigzag_inputs, plan=plan)

    out, lse = _sharding.shard_map(
        local, mesh=mesh, in_specs=tuple(in_specs),
        out_specs=(qkv_spec, P(batch_axis, head_axis, sequence_axis)))(*args)
  if sinks is not None:   # once, on the merged (out, lse)
    out, lse = _reference.with_sinks(out, lse, sinks)
  return (out, lse) if return_lse else out
