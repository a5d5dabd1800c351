"""Mosaic TPU write of new K/V rows into their pages (``write_kv_pages``): the
cache is aliased to the output and stays in HBM; each grid step DMAs its
block of tokens' rows into their (page, row) slots, skipping tokens without
a slot, and waits for its DMAs before the buffer is reused.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _compat, _cost
from pallas_kernels._compat import pl, pltpu
from pallas_kernels.ragged import reference

TOKENS_PER_STEP = 64


def hardware(kv_pages, target) -> str | None:
  """Why the chip's compiler cannot take the call (interpreters can)."""
  del target
  if kv_pages.ndim == 3 and kv_pages.dtype.itemsize != 4:
    return (f"one row of a {kv_pages.dtype} [num_pages, page_size, D] page "
            "shares 32-bit words with its neighbours (packed sublanes): no "
            "DMA writes it alone; the XLA scatter (backend='reference') does")
  if kv_pages.ndim == 3 and _compat.JAX_VERSION < (0, 12):
    return ("a [num_pages, page_size, D] pool needs jax >= 0.12: this jax's "
            "Mosaic rejects DMAs of a single [1, D] row")
  return None


def _kernel(page_ref, row_ref, new_ref, pages_in, pages_out, sem, *,
            num_pages, block):
  del pages_in  # the same buffer as pages_out (aliased)
  first = pl.program_id(0) * block

  def copy(i):
    page, row = page_ref[first + i], row_ref[first + i]
    if len(pages_out.shape) == 3:   # MLA's [P, page_size, D]: a [1, D] row
      return pltpu.make_async_copy(new_ref.at[pl.ds(i, 1)],
                                   pages_out.at[page, pl.ds(row, 1)],
                                   sem.at[0])
    return pltpu.make_async_copy(new_ref.at[i], pages_out.at[page, row],
                                 sem.at[0])

  def start(i, carry):
    @pl.when(page_ref[first + i] < num_pages)
    def _():
      copy(i).start()
    return carry

  def wait(i, carry):
    @pl.when(page_ref[first + i] < num_pages)
    def _():
      copy(i).wait()
    return carry

  jax.lax.fori_loop(0, block, start, 0)
  jax.lax.fori_loop(0, block, wait, 0)


def write(kv_pages, new_kv, kv_lens, page_indices, cu_q_lens, num_seqs, *,
          interpret=False):
  """kv_pages [P, page_size, 2 Hkv, D] with new_kv [T, 2 Hkv, D] (or
  [P, page_size, D] with [T, D]) written to each token's slot; see
  ``write_kv_pages``."""
  if interpret not in (False, True) and _compat.JAX_VERSION < (0, 8, 0):
    # jax 0.7's TPU-semantics interpreter cannot alias a pl.ANY output:
    # there the same write runs as XLA's scatter.
    return reference.write_kv_pages(kv_pages, new_kv, kv_lens, page_indices,
                                    cu_q_lens, num_seqs)
  num_pages, page_size = kv_pages.shape[:2]
  tokens = new_kv.shape[0]
  page, row = reference.token_slots(kv_lens, page_indices, cu_q_lens,
                                    num_seqs, tokens, num_pages, page_size)
  block = min(TOKENS_PER_STEP, tokens)
  padded = pl.cdiv(tokens, block) * block
  if padded != tokens:  # padding tokens have no slot
    page = jnp.pad(page, (0, padded - tokens), constant_values=num_pages)
    row = jnp.pad(row, (0, padded - tokens))
    new_kv = jnp.pad(new_kv, ((0, padded - tokens),) + ((0, 0),) * (
        new_kv.ndim - 1))
  new_kv = new_kv.astype(kv_pages.dtype)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2, grid=(padded // block,),
      in_specs=[pl.BlockSpec((block,) + new_kv.shape[1:],
                             lambda i, p, r: (i,) + (0,) * (new_kv.ndim - 1)),
                pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec(memory_space=pl.ANY),
      scratch_shapes=[pltpu.SemaphoreType.DMA((1,))])
  kernel = functools.partial(_kernel, num_pages=num_pages, block=block)
  return _compat.pallas_call(
      kernel, grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct(kv_pages.shape, kv_pages.dtype),
      input_output_aliases={3: 0},
      compiler_params=_compat.tpu_compiler_params(
          dimension_semantics=("arbitrary",)),
      # Only the new rows move: read from VMEM, written into the pages.
      cost_estimate=_cost.estimate(flops=0,
                                   bytes_accessed=2 * _cost.nbytes(new_kv)),
      interpret=interpret, name="write_kv_pages")(page, row, new_kv,
                                                  kv_pages)
