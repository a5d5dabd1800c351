"""ragged_paged_attention against the float64 oracle (tests/oracles/ragged.py)
on the reference, the TPU kernel and the GPU (Triton) kernel in interpret
mode: mixed prefill and
decode batches with empty sequences, GQA at ratios 1-3, page tables in any
order whose unused entries hold garbage (out-of-range ids), NaN in cache
rows past each length and in unused pages, sliding window, soft cap, sinks,
8-bit caches, ``num_seqs`` below the table's rows; bad inputs; AOT compiles
for v5e and v6e; under shard_map split over heads (tensor parallel) and over
sequences (each device its own batch and cache). ``--runslow``: a random
sweep.

Tolerances (max |error| over outputs of magnitude <= 1-ish): float32 2e-5;
bfloat16 and 8-bit caches 3e-2 (bfloat16 probabilities and output).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import backends
import pallas_kernels as pk
from oracles import ragged as oracle
from pallas_kernels import _compat, tpu_aot

KERNELS = backends.params(["interpret", "interpret_generic", "triton",
                           "reference"])
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}


def make_batch(rng, q_lens, kv_lens, *, heads, kv_heads, head_dim, page_size,
               pages_per_seq, dtype=jnp.float32, cache_dtype=None,
               extra_tokens=2, extra_seqs=0, spare_pages=3, kv_row=None):
  """Inputs of one call: sequences with the given query and cache lengths
  (``extra_seqs`` more table rows past ``num_seqs`` holding garbage), pages
  dealt at random from a pool with spare pages; unused table entries are
  garbage ids, unused cache rows NaN (float caches). ``kv_row``: the shape
  of a token's cache row (default ``(2 * kv_heads, head_dim)``; MLA's
  ``(head_dim,)``)."""
  row = tuple(kv_row or (2 * kv_heads, head_dim))
  n = len(q_lens)
  s = n + extra_seqs
  used = [-(-k // page_size) for k in kv_lens]
  num_pages = sum(used) + spare_pages
  perm = rng.permutation(num_pages)
  table = rng.integers(-5, 10 * num_pages, (s, pages_per_seq)).astype(np.int32)
  cache_dtype = cache_dtype or dtype
  is_float = jnp.issubdtype(cache_dtype, jnp.floating)
  if is_float and jnp.dtype(cache_dtype).itemsize >= 2:
    pool = rng.standard_normal((num_pages, page_size) + row)
    pool[:] = np.nan    # rows never written
  else:
    pool = np.zeros((num_pages, page_size) + row)
  at = 0
  for i, (k, u) in enumerate(zip(kv_lens, used)):
    table[i, :u] = perm[at:at + u]
    for p in range(u):
      rows = min(page_size, k - p * page_size)
      data = rng.standard_normal((rows,) + row)
      if not is_float or jnp.dtype(cache_dtype).itemsize == 1:
        data = np.round(data * 30) if not is_float else data * 4
      pool[perm[at + p], :rows] = data
    at += u
  pool = jnp.asarray(pool, cache_dtype)
  cu = np.zeros(s + 1, np.int32)
  cu[1:n + 1] = np.cumsum(q_lens)
  cu[n + 1:] = rng.integers(0, 1000, extra_seqs)   # ignored
  lens = np.concatenate([kv_lens, rng.integers(0, 10**6, extra_seqs)])
  tokens = int(cu[n]) + extra_tokens
  q = jnp.asarray(rng.standard_normal((tokens, heads, head_dim)), dtype)
  return (q, pool, jnp.asarray(lens, jnp.int32), jnp.asarray(table),
          jnp.asarray(cu), jnp.asarray([n], jnp.int32))


def _check(backend, args, tol, **kw):
  got = backend.run(pk.ragged_paged_attention, *args, **kw)
  assert got.shape == args[0].shape and got.dtype == args[0].dtype
  n = int(args[5][0])
  cu, lens, table = (np.asarray(a) for a in (args[4], args[2], args[3]))
  want = oracle.ragged_paged_attention(
      np.asarray(args[0], np.float64), np.asarray(args[1], np.float64),
      lens, table, cu, [n], **{k: np.asarray(v) if k == "sinks" else v
                               for k, v in kw.items()
                               if not k.startswith("num_")})
  got = np.asarray(got, np.float64)
  assert np.isfinite(got).all()
  np.testing.assert_allclose(got, want, atol=tol, rtol=0)
  assert not got[cu[n]:].any()   # tokens past the sequences


CASES = {
    # prefill (chunked: its cache already holds 4 tokens), decode, an empty
    # sequence, a decode whose page is partly written; GQA 2
    "mixed": dict(q_lens=[7, 1, 0, 1], kv_lens=[11, 13, 5, 1], heads=4,
                  kv_heads=2, head_dim=128, page_size=4, pages_per_seq=4,
                  kw=dict(sm_scale=0.3, num_kv_pages_per_block=2,
                          num_queries_per_block=3)),
    # GQA 3, window, soft cap and sinks, rows over several kv blocks
    "window_cap": dict(q_lens=[5, 2], kv_lens=[21, 9], heads=6, kv_heads=2,
                       head_dim=128, page_size=8, pages_per_seq=3,
                       kw=dict(sm_scale=0.2, sliding_window=6, soft_cap=2.5,
                               sinks=jnp.linspace(-1.0, 2.0, 6),
                               num_kv_pages_per_block=1,
                               num_queries_per_block=2)),
    # GQA 4 over 2 kv heads: a prefill (the GPU kernel's 128-row items),
    # decodes and a 3-token step (its 16-row items, keys split over 3
    # programs, the window leaving one split empty); sinks and soft cap
    "two_classes": dict(q_lens=[20, 1, 3, 0], kv_lens=[40, 150, 70, 5],
                        heads=8, kv_heads=2, head_dim=64, page_size=16,
                        pages_per_seq=10,
                        kw=dict(sm_scale=0.15, sliding_window=50,
                                soft_cap=3.0,
                                sinks=jnp.linspace(-2.0, 1.0, 8))),
    # decode only, bfloat16, MHA, two garbage table rows past num_seqs
    "decode_bf16": dict(q_lens=[1, 1, 1], kv_lens=[3, 17, 9], heads=2,
                        kv_heads=2, head_dim=128, page_size=8,
                        pages_per_seq=3, dtype=jnp.bfloat16, extra_seqs=2,
                        kw=dict(sm_scale=0.1)),
}


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("name", [  # one case per backend in the oldest jax
    pytest.param(n, marks=pytest.mark.compat) if n == "two_classes" else n
    for n in sorted(CASES)])
def test_against_oracle(backend, name):
  case = dict(CASES[name])
  kw = case.pop("kw")
  dtype = case.get("dtype", jnp.float32)
  args = make_batch(np.random.default_rng(len(name)), **case)
  _check(backend, args, TOL[dtype], **kw)


def _pallas_calls(fn, *args):
  """The pallas_call equations of ``fn``'s jaxpr (nested ones included)."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "pallas_call":
        found.append(eqn)
      for v in eqn.params.values():
        for x in v if isinstance(v, (tuple, list)) else (v,):
          x = getattr(x, "jaxpr", x)    # a ClosedJaxpr's Jaxpr
          if hasattr(x, "eqns"):
            walk(x)
  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


@pytest.mark.compat
@pytest.mark.parametrize("backend", backends.params(["interpret"]))
def test_default_splits_items_by_query_length(backend):
  """The default path cuts decode-like sequences (at most 16 // G tokens)
  into one-tile items and the others into 512-row items, one launch each,
  and matches the oracle on a batch with q lengths 0, 1, 3, 5 and 150 (two
  large items) plus tokens past the sequences; an explicit
  num_queries_per_block keeps one launch."""
  args = make_batch(np.random.default_rng(7), [3, 0, 150, 1, 5, 1],
                    [40, 9, 181, 77, 5, 1], heads=8, kv_heads=2,
                    head_dim=128, page_size=16, pages_per_seq=12,
                    extra_seqs=1, extra_tokens=3)
  kw = dict(sm_scale=0.2, soft_cap=5.0)
  _check(backend, args, TOL[jnp.float32], **kw)
  with backend.context():
    calls = _pallas_calls(lambda *a: pk.ragged_paged_attention(
        *a, backend=backend.backend, **kw), *args)
    one = _pallas_calls(lambda *a: pk.ragged_paged_attention(
        *a, backend=backend.backend, num_queries_per_block=8, **kw), *args)
  rows = sorted(c.outvars[0].aval.shape[2] for c in calls)
  assert rows == [16, 512], rows    # G = 4: 4 tokens and 128 per item
  assert [c.outvars[0].aval.shape[2] for c in one] == [32]


@pytest.mark.parametrize("generation", ["v4", "v5e", "v5p", "v6e", "tpu7x"])
def test_default_plans_fit_vmem(generation):
  """Each launch of the default plans (the VMEM limit the kernel asks for)
  fits the generation's VMEM, the large items shrinking where 512 rows
  would not (v4): Llama-3-8B's heads, MHA over 64 kv heads, head_dim 256,
  DeepSeek's MLA row at 16 and 128 heads."""
  from pallas_kernels.ragged import mosaic_tpu
  limit = pk._backend.TPU_VMEM_BYTES[generation]
  shapes = [  # tokens, heads, kv heads, D, page, pages, channels, Dv
      (2175, 32, 8, 128, 32, 256, None, None),
      (4096, 64, 64, 128, 16, 512, None, None),
      (4096, 32, 8, 256, 16, 512, None, None),
      (4096, 128, 1, 576, 64, 128, 1, 512),
      (4096, 16, 1, 576, 16, 512, 1, 512)]
  for t, h, hk, d, page, pages, channels, dv in shapes:
    plans = mosaic_tpu.make_plans(t, h, hk, d, 64, page, pages, 2, 2,
                                  generation=generation, channels=channels,
                                  value_dim=dv)
    assert plans[0].rows == max(16, h // hk), plans  # one tile per decode
    for plan in plans:
      need = mosaic_tpu.vmem_bytes(plan, hk, d, 2, 2, channels, dv)
      assert need * 5 // 4 <= limit, (generation, plan, need)
  llama = mosaic_tpu.make_plans(*shapes[0][:4], 64, *shapes[0][4:6], 2, 2,
                                generation=generation)
  assert [p.rows for p in llama] == [16, 128 if generation == "v4" else 512]


@pytest.mark.compat
@pytest.mark.parametrize("backend",
                         backends.params(["interpret", "triton", "reference"]))
def test_int8_cache_with_scales(backend):
  args = make_batch(np.random.default_rng(1), [3, 1], [6, 10], heads=4,
                    kv_heads=1, head_dim=128, page_size=8, pages_per_seq=2,
                    dtype=jnp.bfloat16, cache_dtype=jnp.int8)
  _check(backend, args, TOL[jnp.bfloat16], sm_scale=0.5, k_scale=0.01,
         v_scale=0.02)


def test_one_trace_serves_other_batches():
  """Lengths, boundaries and page tables are traced: a second batch of the
  same shapes reuses the first's trace."""
  rng = np.random.default_rng(5)
  shape = dict(heads=4, kv_heads=1, head_dim=128, page_size=4,
               pages_per_seq=4)
  a = make_batch(rng, [4, 2], [9, 2], **shape)            # 4 pages used
  b = make_batch(rng, [2, 4], [5, 16], spare_pages=1, **shape)
  traces = []

  @jax.jit
  def fn(*x):
    traces.append(1)
    return pk.ragged_paged_attention(*x, sm_scale=0.3, backend="reference")

  for args in (a, b):
    want = oracle.ragged_paged_attention(*args, sm_scale=0.3)
    np.testing.assert_allclose(np.asarray(fn(*args)), want, atol=2e-5)
  assert len(traces) == 1


@pytest.mark.compat
@pytest.mark.parametrize("bad,match", [
    (dict(q=jnp.zeros((4, 4))), "q must be"),
    (dict(kv_pages=jnp.zeros((3, 4, 3, 128))), "kv_pages must be"),
    (dict(kv_pages=jnp.zeros((3, 4, 6, 128))), "multiple of the kv heads"),
    (dict(kv_pages=jnp.zeros((3, 4, 4, 64))), "head_dim"),
    (dict(kv_lens=jnp.zeros((3,), jnp.int32)), "kv_lens must be"),
    (dict(kv_lens=jnp.zeros((2,), jnp.float32)), "kv_lens must be int32"),
    (dict(cu_q_lens=jnp.zeros((2,), jnp.int32)), "cu_q_lens must be"),
    (dict(num_seqs=jnp.int32(1)), "num_seqs must be"),
    (dict(page_indices=jnp.zeros((2, 0), jnp.int32)), "page_indices must"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(soft_cap=0.0), "soft_cap"),
    (dict(num_queries_per_block=0), "num_queries_per_block"),
    (dict(k_scale=jnp.ones(2)), "k_scale"),
    (dict(sinks=jnp.ones(3)), "sinks must be"),
])
def test_bad_inputs(bad, match):
  args = dict(q=jnp.zeros((4, 4, 128)), kv_pages=jnp.zeros((3, 4, 4, 128)),
              kv_lens=jnp.zeros((2,), jnp.int32),
              page_indices=jnp.zeros((2, 2), jnp.int32),
              cu_q_lens=jnp.zeros((3,), jnp.int32),
              num_seqs=jnp.ones((1,), jnp.int32))
  kw = {k: bad.pop(k) for k in list(bad) if k not in args}
  args.update(bad)
  with pytest.raises(ValueError, match=match):
    pk.ragged_paged_attention(*args.values(), backend="reference", **kw)


@pytest.mark.slow
@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("seed", range(12))
def test_random_sweep(backend, seed):
  rng = np.random.default_rng(100 + seed)
  kv_heads = int(rng.choice([1, 2]))
  heads = kv_heads * int(rng.choice([1, 2, 3, 4]))
  step, kw = random_step(rng, seed, heads, sm_scale=(0.05, 0.3))
  args = make_batch(rng, step["q_lens"], step["kv_lens"], heads=heads,
                    kv_heads=kv_heads, head_dim=128, **step["batch"])
  _check(backend, args, TOL[step["batch"]["dtype"]], **kw)


def random_lengths(rng, n, capacity):
  """``n`` cache lengths in [0, capacity] and their q lengths: 0, 1 or
  (40% of sequences) any count up to the cache length."""
  kv_lens = rng.integers(0, capacity + 1, n)
  q_lens = [int(rng.integers(0, k + 1)) if rng.random() < 0.4
            else min(int(k), 1) for k in kv_lens]
  return kv_lens, q_lens


def random_step(rng, seed, heads, *, sm_scale):
  """The sweeps' random serving step: lengths (q lengths 0, 1 or many),
  pages, dtype and options (window, soft cap, sinks, block sizes), drawn
  from ``rng``, the option mix cycling with ``seed``. Returns (lengths and
  ``make_batch`` keywords, op keywords)."""
  page_size = int(rng.choice([4, 8, 16]))
  pages_per_seq = int(rng.integers(1, 5))
  n = int(rng.integers(1, 6))
  kv_lens, q_lens = random_lengths(rng, n, pages_per_seq * page_size)
  dtype = jnp.bfloat16 if seed % 3 == 0 else jnp.float32
  kw = dict(sm_scale=float(rng.uniform(*sm_scale)))
  if seed % 2:
    kw["sliding_window"] = int(rng.integers(1, 20))
  if seed % 4 == 1:
    kw["soft_cap"] = 3.0
  if seed % 3 == 1:
    kw["sinks"] = jnp.asarray(rng.standard_normal(heads), jnp.float32)
  if rng.random() < 0.5:
    kw["num_queries_per_block"] = int(rng.integers(1, 9))
    kw["num_kv_pages_per_block"] = int(rng.integers(1, pages_per_seq + 1))
  batch = dict(page_size=page_size, pages_per_seq=pages_per_seq,
               dtype=dtype, extra_seqs=int(rng.integers(0, 3)))
  return dict(q_lens=q_lens, kv_lens=kv_lens, batch=batch), kw


# ------------------------------------------------------------------- AOT --

def _spec(*shape, dtype=jnp.int32):
  return jax.ShapeDtypeStruct(shape, dtype)


AOT_CASES = [  # (t, h, hk, d, page, pages, s, cache dtype, kwargs)
    (512, 32, 8, 128, 16, 128, 64, jnp.bfloat16, {}),
    (256, 8, 2, 128, 32, 64, 16, jnp.bfloat16,
     dict(sliding_window=128, soft_cap=30.0, sinks=jnp.zeros(8))),
    (64, 12, 4, 128, 24, 10, 8, jnp.float32, {}),
    (128, 16, 2, 128, 16, 32, 8, jnp.float8_e4m3fn,
     dict(k_scale=0.5, v_scale=0.25)),
]


def _aot_params():
  """Default: the bfloat16 cases on v5e, the fp8 one on v6e; --runslow:
  every case on both."""
  out = []
  for i, case in enumerate(AOT_CASES):
    for topology in ("v5e:2x2", "v6e:2x2"):
      default = ((topology == "v6e:2x2") == (case[7] == jnp.float8_e4m3fn)
                 and case[7] != jnp.float32)
      marks = () if default else (pytest.mark.slow,)
      out.append(pytest.param(topology, *case, marks=marks,
                              id=f"{topology}-{i}"))
  return out


@pytest.mark.compat
@pytest.mark.tpu_aot
@pytest.mark.parametrize("topology,t,h,hk,d,page,pages,s,dtype,kw",
                         _aot_params())
def test_compiles_for_tpu(topology, t, h, hk, d, page, pages, s, dtype, kw,
                          tpu_topologies):
  if topology not in tpu_topologies:
    pytest.skip(f"libtpu lacks {topology}")
  q_dtype = jnp.float32 if dtype == jnp.float32 else jnp.bfloat16
  args = (_spec(t, h, d, dtype=q_dtype),
          _spec(s * pages + 3, page, 2 * hk, d, dtype=dtype),
          _spec(s), _spec(s, pages), _spec(s + 1), _spec(1))

  def fn(*a):
    return pk.ragged_paged_attention(*a, backend="mosaic_tpu", **kw)

  if jnp.dtype(dtype).itemsize != 4 and _compat.JAX_VERSION < (0, 12):
    with pytest.raises(tpu_aot.TpuCompileError, match="needs jax >= 0.12"):
      tpu_aot.compile_for_tpu(fn, *args, topology=topology)
    return
  result = tpu_aot.compile_for_tpu(fn, *args, topology=topology)
  vmem = result.kernel_vmem_bytes
  assert vmem, "no Mosaic kernel in the program"
  limit = pk._backend.TPU_VMEM_BYTES[tpu_aot.topology_generation(topology)]
  assert max(vmem.values()) <= limit, vmem


def test_kernel_refuses_a_table_beyond_smem():
  q = jax.ShapeDtypeStruct((8, 4, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((16, 16, 4, 128), jnp.bfloat16)
  big = jax.ShapeDtypeStruct((1024, 256), jnp.int32)
  lens = jax.ShapeDtypeStruct((1024,), jnp.int32)
  cu = jax.ShapeDtypeStruct((1025,), jnp.int32)
  one = jax.ShapeDtypeStruct((1,), jnp.int32)
  with pytest.raises(ValueError, match="KiB of SMEM"):
    jax.eval_shape(lambda *a: pk.ragged_paged_attention(
        *a, backend="interpret"), q, kv, lens, big, cu, one)
  out = jax.eval_shape(lambda *a: pk.ragged_paged_attention(*a), q, kv, lens,
                       big, cu, one)   # backend=None: the reference
  assert out.shape == q.shape


@pytest.mark.compat
def test_same_semantics_as_jax_reference():
  """Migration check: JAX's own reference (where this jax ships it) gives
  the same outputs on valid inputs (no NaN in the cache: it masks by
  adding mask_value)."""
  try:
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
        kernel as jax_rpa)
  except ImportError:
    pytest.skip("this jax has no ragged_paged_attention")
  rng = np.random.default_rng(3)
  args = make_batch(rng, [6, 1, 2], [9, 12, 2], heads=6, kv_heads=2,
                    head_dim=128, page_size=4, pages_per_seq=3)
  args = (args[0], jnp.nan_to_num(args[1], nan=7.0)) + args[2:]
  kw = dict(sm_scale=0.2, sliding_window=5, soft_cap=4.0)
  want = jax_rpa.ref_ragged_paged_attention(
      *args[:3], jnp.clip(args[3], 0, args[1].shape[0] - 1), *args[4:], **kw)
  got = pk.ragged_paged_attention(*args, backend="reference", **kw)
  np.testing.assert_allclose(np.asarray(got[:want.shape[0]]),
                             np.asarray(want), atol=2e-5)


# ----------------------------------------------------------- sharding --

def _mesh(axis):
  return jax.sharding.Mesh(np.array(jax.devices()[:2]), (axis,))


@pytest.mark.compat
@pytest.mark.parametrize("backend", backends.params(["interpret",
                                                     "reference"]))
def test_sharded_over_heads(backend, rng):
  """Tensor parallel: each device holds half the kv heads (a contiguous
  run of the combined K/V head axis keeps each K beside its V) and their
  query heads; the result matches the oracle of the whole call."""
  args = make_batch(rng, [5, 1, 0, 3], [9, 6, 2, 12], heads=4, kv_heads=2,
                    head_dim=128, page_size=4, pages_per_seq=4)
  P = jax.sharding.PartitionSpec
  split = (P(None, "model"), P(None, None, "model"), P(), P(), P(), P())
  run = lambda *a: backend.run(pk.ragged_paged_attention, *a, sm_scale=0.2,
                               num_kv_pages_per_block=2)
  sharded = jax.jit(_compat.shard_map(run, mesh=_mesh("model"),
                                      in_specs=split,
                                      out_specs=P(None, "model")))
  _check(_Fixed(sharded(*args)), args, TOL[jnp.float32], sm_scale=0.2)


@pytest.mark.compat
@pytest.mark.parametrize("backend", backends.params(["interpret",
                                                     "reference"]))
def test_sharded_over_sequences(backend, rng):
  """Data parallel: each device serves its own batch over its own cache
  (every argument stacked on a leading device axis); each shard matches
  the oracle of its batch."""
  shape = dict(heads=2, kv_heads=1, head_dim=128, page_size=4,
               pages_per_seq=3, spare_pages=2)
  batches = [make_batch(rng, [4, 1], [7, 10], **shape),
             make_batch(rng, [1, 2], [3, 12], **shape)]
  padded, out = serve_per_device(backend, pk.ragged_paged_attention, batches,
                                 sm_scale=0.3)
  for i, parts in enumerate(padded):
    _check(_Fixed(out[i]), parts, TOL[jnp.float32], sm_scale=0.3)


def serve_per_device(backend, op, batches, **kw):
  """Each batch served on its own device (data parallel: every argument
  padded to the largest batch and stacked on a leading device axis):
  (the padded batches, the stacked results)."""
  tokens = max(b[0].shape[0] for b in batches)
  pages = max(b[1].shape[0] for b in batches)
  padded = [(jnp.pad(b[0], ((0, tokens - b[0].shape[0]), (0, 0), (0, 0))),
             jnp.pad(b[1], ((0, pages - b[1].shape[0]),)
                     + ((0, 0),) * (b[1].ndim - 1))) + b[2:]
            for b in batches]
  stacked = [jnp.stack(parts) for parts in zip(*padded)]
  P = jax.sharding.PartitionSpec

  def run(*a):
    return backend.run(op, *(x[0] for x in a), **kw)[None]
  sharded = jax.jit(_compat.shard_map(run, mesh=_mesh("data"),
                                      in_specs=(P("data"),) * 6,
                                      out_specs=P("data")))
  return padded, sharded(*stacked)


class _Fixed:
  """A backend whose op returns a given result (to check a shard's output
  with ``_check``)."""

  def __init__(self, result):
    self.result = result

  def run(self, op, *args, **kwargs):
    return self.result
