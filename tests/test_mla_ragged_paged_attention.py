"""mla_ragged_paged_attention against the float64 oracle
(tests/oracles/ragged.py, one sequence at a time) on the reference and the
TPU kernel in interpret mode: mixed prefill and decode batches with empty
sequences, page tables in any order whose unused entries hold garbage, NaN
in cache rows past each length and in unused pages, table rows past
``num_seqs``; DeepSeek's row (D 576, latent 512) and an odd small one (D 80,
latent 64, H 3); H 40 (two head groups in the Triton kernel); window, soft
cap, sinks; int8 and float8 caches with scales; the latent cache written by
``write_kv_pages``; bad inputs; AOT compiles at DeepSeek shapes for v5e and
v6e. ``--runslow``: a random sweep.

Tolerances (max |error|, outputs of magnitude <= 1-ish): float32 2e-5;
bfloat16 and 8-bit caches 3e-2 (bfloat16 probabilities and output).
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import backends
import pallas_kernels as pk
from oracles import ragged as oracle
from pallas_kernels import _compat, tpu_aot
from test_ragged_paged_attention import (_Fixed, make_batch, random_step,
                                         serve_per_device)

OP = pk.mla_ragged_paged_attention
KERNELS = backends.params(["interpret", "interpret_generic", "triton",
                           "reference"])
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}


def mla_batch(rng, q_lens, kv_lens, *, heads, head_dim, **kw):
  """``make_batch`` with MLA's pool: one ``[head_dim]`` row per token."""
  return make_batch(rng, q_lens, kv_lens, heads=heads, kv_heads=1,
                    head_dim=head_dim, kv_row=(head_dim,), **kw)


def _check(backend, args, tol, *, latent_dim, **kw):
  got = backend.run(OP, *args, latent_dim=latent_dim, **kw)
  tokens, heads, d = args[0].shape
  assert got.shape == (tokens, heads, latent_dim)
  assert got.dtype == args[0].dtype
  n = int(args[5][0])
  cu, lens, table = (np.asarray(a) for a in (args[4], args[2], args[3]))
  kw.setdefault("sm_scale", d ** -0.5)   # the op's default
  want = oracle.mla_ragged_paged_attention(
      np.asarray(args[0], np.float64), np.asarray(args[1], np.float64),
      lens, table, cu, [n], latent_dim=latent_dim,
      **{k: np.asarray(v) if k == "sinks" else v for k, v in kw.items()
         if not k.startswith("num_")})
  got = np.asarray(got, np.float64)
  assert np.isfinite(got).all()
  np.testing.assert_allclose(got, want, atol=tol, rtol=0)
  assert not got[cu[n]:].any()   # tokens past the sequences


CASES = {
    # a chunked prefill (4 tokens cached before), decodes, an empty
    # sequence, a decode on a partly written page; the odd small row; a
    # table row past num_seqs
    "mixed_small": dict(q_lens=[7, 1, 0, 1], kv_lens=[11, 13, 5, 1],
                        heads=3, head_dim=80, latent_dim=64, page_size=4,
                        pages_per_seq=4, extra_seqs=1,
                        kw=dict(num_kv_pages_per_block=2,
                                num_queries_per_block=3)),
    # DeepSeek's row in bfloat16, 16 heads (one token's heads fill 16 rows
    # of the q.k matmul); a decode over two kv blocks
    "deepseek_bf16": dict(q_lens=[2, 1], kv_lens=[19, 40], heads=16,
                          head_dim=576, latent_dim=512, page_size=16,
                          pages_per_seq=3, dtype=jnp.bfloat16,
                          kw=dict(sm_scale=192 ** -0.5,
                                  num_kv_pages_per_block=2)),
    # window, soft cap and sinks over several kv blocks
    "window_cap_sinks": dict(q_lens=[5, 2], kv_lens=[21, 9], heads=2,
                             head_dim=80, latent_dim=64, page_size=8,
                             pages_per_seq=3,
                             kw=dict(sm_scale=0.2, sliding_window=6,
                                     soft_cap=2.5,
                                     sinks=jnp.asarray([-1.0, 2.0]),
                                     num_kv_pages_per_block=1,
                                     num_queries_per_block=2)),
    # 40 heads: the Triton kernel splits them into 2 programs of 20 that
    # read the same row (per-group sinks, causal rows of a prefill)
    "head_groups": dict(q_lens=[3, 1], kv_lens=[10, 7], heads=40,
                        head_dim=80, latent_dim=64, page_size=4,
                        pages_per_seq=3,
                        kw=dict(sinks=jnp.linspace(-2.0, 2.0, 40))),
}


def _oracle_params():
  """Default: every backend on the small mix, the TPU-semantics interpreter
  on the others but the Triton-only head_groups, the Triton kernel on all
  but DeepSeek's row (20 s in the generic interpreter of jax 0.7; lowered
  for CUDA by default below); --runslow: all."""
  for name in sorted(CASES):
    for b in KERNELS:
      default = (name == "mixed_small"
                 or (b.id == "interpret" and name != "head_groups")
                 or (b.id == "triton" and name != "deepseek_bf16"))
      yield pytest.param(b.values[0], name, id=f"{name}-{b.id}",
                         marks=list(b.marks) + ([] if default
                                          else [pytest.mark.slow]))


@pytest.mark.compat
@pytest.mark.parametrize("backend,name", list(_oracle_params()))
def test_against_oracle(backend, name, rng):
  case = dict(CASES[name])
  kw, latent_dim = case.pop("kw"), case.pop("latent_dim")
  args = mla_batch(rng, **case)
  _check(backend, args, TOL[case.get("dtype", jnp.float32)],
         latent_dim=latent_dim, **kw)


@pytest.mark.parametrize("cache_dtype", [jnp.int8, jnp.float8_e4m3fn])
@pytest.mark.parametrize("backend", [
    *backends.params(["interpret", "triton"]),
    pytest.param(*backends.params(["reference"])[0].values, id="reference",
                 marks=pytest.mark.slow)])
def test_8bit_cache_with_scales(backend, cache_dtype, rng):
  args = mla_batch(rng, [3, 1], [6, 10], heads=4, head_dim=80,
                   page_size=8, pages_per_seq=2, dtype=jnp.bfloat16,
                   cache_dtype=cache_dtype)
  _check(backend, args, TOL[jnp.bfloat16], latent_dim=64, sm_scale=0.5,
         k_scale=0.01 if cache_dtype == jnp.int8 else 0.2, v_scale=0.03)


@pytest.mark.compat
def test_written_cache_is_what_attention_reads(rng):
  """A step: ``write_kv_pages`` puts the new tokens' rows into the latent
  pool (in the TPU kernel, interpreted), then attention over it equals the
  oracle over a pool written row by row."""
  args = mla_batch(rng, [4, 1, 0], [9, 6, 3], heads=2, head_dim=80,
                   page_size=4, pages_per_seq=3, extra_seqs=1)
  q, pool = args[0], jnp.nan_to_num(args[1], nan=-3.0)
  meta = args[2:]
  new = jnp.asarray(rng.standard_normal((q.shape[0], 80)), jnp.float32)
  with pk.force_interpret("tpu"):
    written = jax.jit(pk.write_kv_pages, static_argnames="backend")(
        pool, new, *meta, backend="interpret")
  want = np.array(pool)
  lens, table, cu = (np.asarray(a) for a in meta[:3])
  for i in range(int(meta[3][0])):
    q_len = cu[i + 1] - cu[i]
    for t in range(q_len):
      pos = lens[i] - q_len + t
      want[table[i, pos // 4], pos % 4] = new[cu[i] + t]
  np.testing.assert_array_equal(np.asarray(written), want)
  _check(backends.ALL[-1], (q, written) + meta, TOL[jnp.float32],
         latent_dim=48, sm_scale=0.3)


@pytest.mark.parametrize("head_dim,latent_dim,match", [
    (136, 128, "head_dim a multiple of 16, got 136"),
    (96, 40, "latent_dim a multiple of 16 .*got 40")])
def test_triton_refuses_rows_off_its_tiles(head_dim, latent_dim, match):
  """Triton tiles are powers of two >= 16 columns: a row or latent width
  off the 16 grid is refused, naming it (backend=None falls back)."""
  args = (jnp.zeros((2, 4, head_dim)), jnp.zeros((3, 4, head_dim)),
          jnp.full((2,), 1, jnp.int32), jnp.zeros((2, 2), jnp.int32),
          jnp.arange(3, dtype=jnp.int32), jnp.full((1,), 2, jnp.int32))
  with pytest.raises(ValueError, match=match):
    OP(*args, latent_dim=latent_dim, backend="triton")


@pytest.mark.parametrize("heads,cache_dtype", [
    (128, jnp.bfloat16), (16, jnp.float8_e4m3fn)])
def test_cuda_lowering_runs_the_triton_kernel(heads, cache_dtype):
  """backend=None lowered for CUDA on this host: the Triton kernel (not the
  reference) at DeepSeek's row (D 576, latent 512), one launch per class
  of items (decode, prefill), the heads split into programs of <= 32
  (grid x: the virtual kv heads)."""
  spec = jax.ShapeDtypeStruct
  args = (spec((77, heads, 576), jnp.bfloat16),
          spec((300, 16, 576), cache_dtype), spec((9,), jnp.int32),
          spec((9, 33), jnp.int32), spec((10,), jnp.int32),
          spec((1,), jnp.int32))
  scales = {} if cache_dtype == jnp.bfloat16 else dict(k_scale=0.5,
                                                         v_scale=0.5)
  fn = lambda *a: OP(*a, latent_dim=512, sm_scale=192 ** -0.5,  # noqa: E731
                     sliding_window=1000, **scales)
  assert jax.eval_shape(fn, *args).shape == (77, heads, 512)
  text = _compat.lower_for_cuda(fn, *args).as_text()
  assert text.count('"mla_ragged_paged_attention_gpu"') == 2
  assert re.findall(r"grid_x = (\d+)", text) == [str(-(-heads // 32))] * 2


@pytest.mark.parametrize("bad,match", [
    (dict(kv_pages=jnp.zeros((3, 4, 2, 80))), "kv_pages must be"),
    (dict(kv_pages=jnp.zeros((3, 4, 64))), "head_dim"),
    (dict(latent_dim=81), "latent_dim=81 must be in"),
    (dict(latent_dim=0), "latent_dim=0 must be a positive"),
    (dict(q=jnp.zeros((4, 80))), "q must be"),
    (dict(sinks=jnp.ones(3)), "sinks must be"),
    (dict(sliding_window=0), "mla_ragged_paged_attention: sliding_window"),
])
def test_bad_inputs(bad, match):
  args = dict(q=jnp.zeros((4, 4, 80)), kv_pages=jnp.zeros((3, 4, 80)),
              kv_lens=jnp.zeros((2,), jnp.int32),
              page_indices=jnp.zeros((2, 2), jnp.int32),
              cu_q_lens=jnp.zeros((3,), jnp.int32),
              num_seqs=jnp.ones((1,), jnp.int32))
  kw = dict(latent_dim=64)
  kw.update({k: bad.pop(k) for k in list(bad) if k not in args})
  args.update(bad)
  with pytest.raises(ValueError, match=match):
    OP(*args.values(), backend="reference", **kw)


def test_empty_batch_gives_latent_width_zeros():
  out = OP(jnp.zeros((0, 4, 80)), jnp.zeros((3, 4, 80)),
           jnp.zeros((2,), jnp.int32), jnp.zeros((2, 2), jnp.int32),
           jnp.zeros((3,), jnp.int32), jnp.ones((1,), jnp.int32),
           latent_dim=64)
  assert out.shape == (0, 4, 64)


@pytest.mark.slow
@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("seed", range(10))
def test_random_sweep(backend, seed):
  rng = np.random.default_rng(200 + seed)
  heads = int(rng.choice([1, 3, 16]))
  head_dim, latent_dim = [(80, 64), (576, 512), (136, 128)][seed % 3]
  if backend.name == "triton" and head_dim % 16:   # Triton's 16-column tiles
    head_dim = 144
  step, kw = random_step(rng, seed, heads, sm_scale=(0.02, 0.1))
  args = mla_batch(rng, step["q_lens"], step["kv_lens"], heads=heads,
                   head_dim=head_dim, **step["batch"])
  _check(backend, args, TOL[step["batch"]["dtype"]], latent_dim=latent_dim,
         **kw)


# ------------------------------------------------------------------- AOT --

def _spec(*shape, dtype=jnp.int32):
  return jax.ShapeDtypeStruct(shape, dtype)


AOT_CASES = [  # (topology, t, h, page, pages, s, cache dtype, kwargs, slow)
    ("v5e:2x2", 256, 16, 16, 512, 32, jnp.bfloat16, {}, False),
    ("v6e:2x2", 256, 128, 64, 128, 32, jnp.bfloat16, {}, False),
    ("v5e:2x2", 256, 128, 64, 128, 32, jnp.bfloat16, {}, True),
    ("v6e:2x2", 256, 16, 16, 512, 32, jnp.float8_e4m3fn,
     dict(k_scale=0.5, v_scale=0.5, sliding_window=1024, soft_cap=30.0,
          sinks=jnp.zeros(16)), True),
    ("v5e:2x2", 256, 16, 16, 512, 32, jnp.int8,
     dict(k_scale=0.5, v_scale=0.5), True),
    # decode: 256 sequences x 1 token over 8k caches, one token per item
    # (the table of 16-token pages would exceed SMEM: 64-token pages)
    ("v5e:2x2", 256, 16, 64, 128, 256, jnp.bfloat16,
     dict(num_queries_per_block=1), True),
    ("v6e:2x2", 256, 128, 64, 128, 256, jnp.bfloat16,
     dict(num_queries_per_block=1), True),
    ("v5p:2x2x1", 256, 128, 64, 128, 256, jnp.bfloat16,
     dict(num_queries_per_block=1), True),
    ("tpu7x:2x2x1", 256, 16, 64, 128, 256, jnp.float8_e4m3fn,
     dict(num_queries_per_block=1, k_scale=0.5, v_scale=0.5), True),
]


@pytest.mark.tpu_aot
@pytest.mark.parametrize(
    "topology,t,h,page,pages,s,dtype,kw",
    [pytest.param(*c[:-1], marks=(pytest.mark.slow,) if c[-1] else (),
                  id=f"{c[0]}-{i}") for i, c in enumerate(AOT_CASES)])
def test_compiles_for_tpu(topology, t, h, page, pages, s, dtype, kw,
                          tpu_topologies):
  """DeepSeek's row (D 576, latent 512): the kernel fits the generation's
  VMEM."""
  if topology not in tpu_topologies:
    pytest.skip(f"libtpu lacks {topology}")
  args = (_spec(t, h, 576, dtype=jnp.bfloat16),
          _spec(s * pages + 3, page, 576, dtype=dtype),
          _spec(s), _spec(s, pages), _spec(s + 1), _spec(1))

  def fn(*a):
    return OP(*a, latent_dim=512, sm_scale=192 ** -0.5, backend="mosaic_tpu",
              **kw)

  if _compat.JAX_VERSION < (0, 12):
    with pytest.raises(tpu_aot.TpuCompileError, match="needs jax >= 0.12"):
      tpu_aot.compile_for_tpu(fn, *args, topology=topology)
    return
  result = tpu_aot.compile_for_tpu(fn, *args, topology=topology)
  vmem = result.kernel_vmem_bytes
  # One launch per class of items (two by default).
  launches = 1 if kw.get("num_queries_per_block") else 2
  assert len(vmem) == launches, vmem
  assert all(k.startswith("mla_ragged_paged_attention") for k in vmem), vmem
  limit = pk._backend.TPU_VMEM_BYTES[tpu_aot.topology_generation(topology)]
  assert max(vmem.values()) <= limit, vmem


@pytest.mark.compat
@pytest.mark.tpu_aot
def test_old_jax_compiles_a_lane_aligned_row(tpu_topologies):
  """D a multiple of 128 (no strided or odd-width DMAs) compiles on every
  supported jax, bfloat16 included."""
  args = (_spec(64, 16, 640, dtype=jnp.bfloat16),
          _spec(200, 16, 640, dtype=jnp.bfloat16), _spec(8), _spec(8, 16),
          _spec(9), _spec(1))
  result = tpu_aot.compile_for_tpu(
      lambda *a: OP(*a, latent_dim=512, backend="mosaic_tpu"), *args,
      topology="v5e:2x2")
  assert result.kernel_vmem_bytes


@pytest.mark.parametrize("backend", backends.params(["interpret",
                                                     "reference"]))
def test_sharded_over_heads(backend, rng):
  """Tensor parallel: each device takes half the query heads; the latent
  cache, one row per token for every head, is replicated. The result
  matches the oracle of the whole call."""
  args = mla_batch(rng, [5, 1, 0, 3], [9, 6, 2, 12], heads=4, head_dim=80,
                   page_size=4, pages_per_seq=4)
  P = jax.sharding.PartitionSpec
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("model",))
  run = lambda *a: backend.run(OP, *a, latent_dim=64, sm_scale=0.2)  # noqa: E731
  sharded = jax.jit(_compat.shard_map(
      run, mesh=mesh, in_specs=(P(None, "model"),) + (P(),) * 5,
      out_specs=P(None, "model")))
  _check(_Fixed(sharded(*args)), args, TOL[jnp.float32], latent_dim=64,
         sm_scale=0.2)


@pytest.mark.parametrize("backend", backends.params(["interpret",
                                                     "reference"]))
def test_sharded_over_sequences(backend, rng):
  """Data parallel: each device serves its own batch over its own latent
  cache; each shard matches the oracle of its batch."""
  shape = dict(heads=3, head_dim=80, page_size=4, pages_per_seq=3,
               spare_pages=2)
  batches = [mla_batch(rng, [4, 1], [7, 10], **shape),
             mla_batch(rng, [1, 2], [3, 12], **shape)]
  padded, out = serve_per_device(backend, OP, batches, latent_dim=64,
                                 sm_scale=0.3)
  for i, parts in enumerate(padded):
    _check(_Fixed(out[i]), parts, TOL[jnp.float32], latent_dim=64,
           sm_scale=0.3)
