"""flash_attention's static masks and sinks on every backend, against the
float64 oracle; the masks' block classification; their errors; and the
Mosaic kernels with masks through the real TPU compiler.

The oracle gets each mask as a NumPy matrix built here from the documented
rules (positions aligned at the ends: p = i + kv_len - q_len), never from
``pallas_kernels.attention.masks``. Tolerances as in test_attention.py.
"""
from __future__ import annotations

import dataclasses
import itertools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import backends
import pallas_kernels as pk
from oracles import attention as oracle
from pallas_kernels.attention import masks, mosaic_tpu, triton
from test_attention import BLOCKS, TOLERANCES

# The TPU interpreter runs a few rows by default, the generic one every row.
ALL = backends.params(every_flavour=True)


# ----------------------------------------------- independent mask rules --

def _positions(lq, lk):
  return np.arange(lq)[:, None] + (lk - lq), np.arange(lk)[None, :]


def causal_np(lq, lk):
  p, j = _positions(lq, lk)
  return j <= p


def local_np(lq, lk, left, right):
  p, j = _positions(lq, lk)
  ok = np.ones((lq, lk), bool)
  if left is not None:
    ok &= j >= p - left
  if right is not None:
    ok &= j <= p + right
  return ok


def chunked_np(lq, lk, size):
  p, j = _positions(lq, lk)
  return (j <= p) & (np.floor_divide(p, size) == j // size)


def prefix_np(lq, lk, length):
  p, j = _positions(lq, lk)
  return (j < length) | (j <= p)


@dataclasses.dataclass(frozen=True)
class Case:
  """``mask(lq, lk, rng)`` -> (mask argument, allowed [H or 1, lq, lk])."""
  mask: object
  b: int = 1
  h: int = 4
  hk: int = 2
  lq: int = 300
  lk: int = 300
  d: int = 32
  dtype: str = "float32"
  sinks: bool = False
  bias: bool = False
  segments: bool = False
  kw: tuple = ()
  dv: int | None = None   # v's head dim (MLA), None: d


def _dense_random(lq, lk, rng):
  allowed = rng.random((lq, lk)) < 0.2
  allowed[7] = False                      # a row with no key
  allowed[:, 40:200] = False              # whole empty blocks
  # A query block and a kv block (at the interpreters' 128) with no pair:
  # their rows of the walk only write zeros.
  allowed[128:256] = False
  allowed[:, 256:] = False
  return masks.Dense(allowed), allowed[None]


def _per_head(lq, lk, rng):
  del rng
  heads = [masks.Causal(), masks.Local(40, 3), masks.ChunkedCausal(64),
           masks.PrefixLM(100)]
  allowed = [causal_np(lq, lk), local_np(lq, lk, 40, 3),
             chunked_np(lq, lk, 64), prefix_np(lq, lk, 100)]
  return heads, np.stack(allowed)


# Mask kinds with the other options: the combos below; these cases add
# what they leave out (bias, soft cap, bf16, four per-head kinds, Dense
# under a formula, rows without keys).
CASES = {
    "per_head": Case(_per_head, dv=24),   # v's head dim != q's (MLA)
    "dense_with_empty_rows": Case(_dense_random, lq=260, lk=330),
    "or_and_window_segments": Case(
        lambda lq, lk, rng: (masks.ChunkedCausal(64) | masks.Local(20, None),
                             (chunked_np(lq, lk, 64)
                              | local_np(lq, lk, 20, None))[None]),
        segments=True, kw=(("sliding_window", (200, 10)),)),
    "and_dense_formula": Case(
        lambda lq, lk, rng: (
            masks.Dense(rng.random((lq, lk)) < 0.5) & masks.Causal(),
            None), lq=200, lk=200),
    # v's head dim 48 != q's 32 (MLA)
    "chunked_sinks_bias_cap": Case(
        lambda lq, lk, rng: (masks.ChunkedCausal(129),
                             chunked_np(lq, lk, 129)[None]),
        sinks=True, bias=True, kw=(("logit_soft_cap", 3.0),), dv=48),
    "sinks_only_causal": Case(None, sinks=True, hk=1,
                              kw=(("causal", True),)),
    "sinks_empty_rows": Case(_dense_random, sinks=True, lq=140, lk=270),
    "bf16_chunked": Case(
        lambda lq, lk, rng: (masks.ChunkedCausal(128),
                             chunked_np(lq, lk, 128)[None]),
        dtype="bfloat16", d=64),
    # More queries than keys: the first 60 rows see no key (the band's
    # j <= p); head_dim 72 runs zero-padded to 80 on the Mosaic GPU kernels.
    "or_window_cap_sinks_empty_rows": Case(
        lambda lq, lk, rng: (masks.ChunkedCausal(64) | masks.Local(10, 5),
                             ((chunked_np(lq, lk, 64)
                               | local_np(lq, lk, 10, 5))
                              & local_np(lq, lk, 150, 0))[None]),
        lq=260, lk=200, d=72, dtype="bfloat16", sinks=True,
        kw=(("sliding_window", (150, 0)), ("logit_soft_cap", 4.0))),
    "prefix_and_local_gqa": Case(
        lambda lq, lk, rng: (masks.PrefixLM(70) & masks.Local(None, 40),
                             (prefix_np(lq, lk, 70)
                              & local_np(lq, lk, None, 40))[None]),
        h=4, hk=1, lq=200, lk=330, d=128, dtype="bfloat16"),
}


def _mosaic_gpu_case(case: Case) -> Case:
  """The Mosaic GPU kernels run bf16/fp16 with head_dim >= 64: the case at
  those (its masks, sinks and options unchanged)."""
  return dataclasses.replace(case, dtype="bfloat16", d=max(case.d, 64))


def _mosaic_gpu_refuses(mask, case: Case) -> bool:
  """What the Mosaic GPU kernels lack: bias, segment ids, per-head mask
  lists and a v head dim other than q's."""
  return (case.bias or case.segments or isinstance(mask, list)
          or case.dv not in (None, case.d))


def _inputs(case, rng):
  dtype = jnp.dtype(case.dtype)
  make = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)  # noqa: E731
  q = make(case.b, case.h, case.lq, case.d)
  k = make(case.b, case.hk, case.lk, case.d)
  dv = case.d if case.dv is None else case.dv
  v = make(case.b, case.hk, case.lk, dv)
  d_out = make(case.b, case.h, case.lq, dv)
  d_lse = jnp.asarray(rng.standard_normal((case.b, case.h, case.lq)),
                      jnp.float32)
  mask = allowed = None
  if case.mask is not None:
    mask, allowed = case.mask(case.lq, case.lk, rng)
    if allowed is None:          # "and_dense_formula": the Dense part & causal
      allowed = (mask.a.array & causal_np(case.lq, case.lk))[None]
  sinks = (jnp.asarray(2 * rng.standard_normal(case.h), jnp.float32)
           if case.sinks else None)
  bias = (jnp.asarray(rng.standard_normal((1, case.h, case.lq, case.lk)),
                      jnp.float32) if case.bias else None)
  kw = dict(case.kw)
  if case.segments:
    q_seg = np.sort(rng.integers(0, 3, (case.b, case.lq)), axis=1)
    kv_seg = np.sort(rng.integers(0, 3, (case.b, case.lk)), axis=1)
    kw["segment_ids"] = (jnp.asarray(q_seg), jnp.asarray(kv_seg))
  return q, k, v, d_out, d_lse, mask, allowed, sinks, bias, kw


def _run(q, k, v, sinks, bias, d_out, d_lse, *, backend, blocks, mask, **kw):
  def loss(q, k, v, sinks, bias):
    out, lse = pk.flash_attention(q, k, v, mask=mask, sinks=sinks, bias=bias,
                                  return_lse=True, block_sizes=blocks,
                                  backend=backend, **kw)
    total = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))
    total += jnp.sum(jnp.where(jnp.isinf(lse), 0.0, lse) * d_lse)
    return total, (out, lse)
  argnums = tuple(i for i, x in enumerate((q, k, v, sinks, bias))
                  if x is not None)
  grads, (out, lse) = jax.jit(jax.grad(loss, argnums, has_aux=True))(
      q, k, v, sinks, bias)
  return out, lse, grads


def _assert_close(actual, expected, tol, what):
  actual = np.asarray(actual).astype(np.float64)
  expected = np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
  inf = np.isinf(expected)
  np.testing.assert_array_equal(actual[inf], expected[inf], err_msg=what)
  err = np.max(np.abs(actual[~inf] - expected[~inf]), initial=0)
  scale = max(1.0, float(np.max(np.abs(expected[~inf]), initial=0)))
  assert err <= tol * scale, f"{what}: max abs error {err} > {tol * scale}"


# The TPU-semantics interpreter is the slowest backend: by default it runs
# the cases that combine the most features; --runslow runs every case.
_FAST_ON_INTERPRET = {"chunked_sinks_bias_cap", "dense_with_empty_rows",
                      "or_and_window_segments"}
# The Mosaic GPU interpreter likewise: a formula walk with empty rows, GQA
# and padded head_dim, and a Dense walk; the refusals cost nothing.
_FAST_ON_MOSAIC_GPU = {"or_window_cap_sinks_empty_rows", "prefix_and_local_gqa",
                       "dense_with_empty_rows", "per_head",
                       "or_and_window_segments", "chunked_sinks_bias_cap"}


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("name", [
    name for name in sorted(CASES)])
def test_masks_and_sinks_match_float64(backend, name, rng, request):
  fast = {"interpret": _FAST_ON_INTERPRET,
          "mosaic_gpu": _FAST_ON_MOSAIC_GPU}.get(backend.name)
  if (fast is not None and name not in fast
      and not request.config.getoption("--runslow")):
    pytest.skip(f"slow in the {backend.name} interpreter (--runslow runs it)")
  case = CASES[name]
  if backend.name == "mosaic_gpu":
    case = _mosaic_gpu_case(case)
  q, k, v, d_out, d_lse, mask, allowed, sinks, bias, kw = _inputs(case, rng)
  if backend.name == "mosaic_gpu" and _mosaic_gpu_refuses(mask, case):
    with pytest.raises(ValueError, match="cannot run this call"):
      backend.run(pk.flash_attention, q, k, v, mask=mask, sinks=sinks,
                  bias=bias, **kw)
    return
  out, lse, grads = backend.run(_run, q, k, v, sinks, bias, d_out, d_lse,
                                blocks=BLOCKS.get(backend.name), mask=mask,
                                **kw)
  ref_out, ref_lse, ref_grads = oracle.attention(
      q, k, v, bias=bias, d_out=d_out, d_lse=d_lse, allowed=allowed,
      sinks=sinks, **kw)
  out_tol, lse_tol, grad_tol = TOLERANCES[case.dtype]
  _assert_close(out, ref_out, out_tol, "out")
  _assert_close(lse, ref_lse, lse_tol, "lse")
  names = ("dq", "dk", "dv", "dbias", "dsinks")
  wanted = dict(zip(names, ref_grads[:4] + (ref_grads[4:] or (None,))))
  got = dict(zip([n for n, x in zip(("dq", "dk", "dv", "dsinks", "dbias"),
                                    (q, k, v, sinks, bias)) if x is not None],
                 grads))
  for name, value in got.items():
    _assert_close(value, wanted[name], grad_tol, name)
  if allowed is not None and sinks is None:
    empty_rows = ~np.broadcast_to(allowed, (case.h, case.lq, case.lk)).any(-1)
    assert np.all(np.asarray(out)[:, empty_rows] == 0)


# ------------------------------------------- every mask kind x option --
#
# Each mask kind with each option (segment ids, sinks, GQA, a sliding
# window, q_len vs kv_len) at shapes where, at the backend's blocks, the
# call has full, partial and empty blocks (checked from the oracle's
# matrix): segment ids must mask the blocks a mask allows whole, too. The
# default tier runs a representative row per kind (each option on for
# several kinds; segments with the block-sparse kinds); --runslow runs the
# full product.

_TILE = 128   # the TPU interpreters' blocks; Triton's (32, 64) divide it


def _tiled_dense(lq, lk, rng):
  """A bool [lq, lk] matrix of 128-tiles each empty, full or random (so
  every backend's blocks include all three kinds)."""
  nq, nk = -(-lq // _TILE), -(-lk // _TILE)
  empty, full, noise = 0, 1, 2
  kinds = rng.integers(0, 3, (nq, nk))
  # One of each at least, where the sliding window keeps them so: a full
  # tile on the ends-aligned diagonal, noise in the padded last kv tile.
  kinds[-1, -2], kinds[-1, -1], kinds[0, -1] = full, noise, empty
  kinds = np.repeat(np.repeat(kinds, _TILE, 0), _TILE, 1)[:lq, :lk]
  return np.where(kinds == noise, rng.random((lq, lk)) < 0.5, kinds == full)


# kind -> (lq, lk, rng) -> (mask argument, allowed [H or 1, lq, lk]); the
# per-head kind serves two query heads.
MASK_KINDS = {
    "causal": lambda lq, lk, rng: (masks.Causal(), causal_np(lq, lk)[None]),
    "local": lambda lq, lk, rng: (masks.Local(220, 20),
                                  local_np(lq, lk, 220, 20)[None]),
    "chunked": lambda lq, lk, rng: (masks.ChunkedCausal(256),
                                    chunked_np(lq, lk, 256)[None]),
    "prefix_lm": lambda lq, lk, rng: (masks.PrefixLM(100),
                                      prefix_np(lq, lk, 100)[None]),
    "dense": lambda lq, lk, rng: (lambda a: (masks.Dense(a), a[None]))(
        _tiled_dense(lq, lk, rng)),
    "and": lambda lq, lk, rng: (
        masks.PrefixLM(60) & masks.Local(None, 30),
        (prefix_np(lq, lk, 60) & local_np(lq, lk, None, 30))[None]),
    "or": lambda lq, lk, rng: (
        masks.ChunkedCausal(256) | masks.Local(100, 0),
        (chunked_np(lq, lk, 256) | local_np(lq, lk, 100, 0))[None]),
    "per_head": lambda lq, lk, rng: (
        [masks.Causal(), masks.PrefixLM(100)],
        np.stack([causal_np(lq, lk), prefix_np(lq, lk, 100)])),
}
# Ends-aligned offsets of +-256 keep chunk and block edges aligned.
LENGTHS = {"equal": (300, 300), "q_shorter": (200, 456),
           "q_longer": (456, 200)}
WINDOW = (300, 60)


@dataclasses.dataclass(frozen=True)
class Combo:
  kind: str
  segments: bool
  sinks: bool
  gqa: bool
  window: bool
  lengths: str

  def __str__(self):
    on = [n for n in ("segments", "sinks", "gqa", "window") if getattr(self,
                                                                      n)]
    return "-".join([self.kind, *on, self.lengths])


# Default tier: one row per kind. Segments ride with six kinds (both
# materialised ones among them); sinks, GQA and the window with four each;
# every length pairing with two or three.
DEFAULT_COMBOS = [
    Combo("causal", True, False, True, False, "q_longer"),
    Combo("local", False, True, False, True, "q_shorter"),
    Combo("chunked", True, True, False, True, "equal"),
    Combo("prefix_lm", True, False, False, True, "q_shorter"),
    Combo("dense", True, True, True, False, "equal"),
    Combo("per_head", True, False, True, False, "q_shorter"),
    Combo("and", False, True, True, False, "q_longer"),
    Combo("or", True, False, False, True, "q_longer"),
]
ALL_COMBOS = [Combo(kind, *flags, lengths) for kind in MASK_KINDS
              for flags in itertools.product((False, True), repeat=4)
              for lengths in LENGTHS]
# The slow interpreters run a few default rows: the TPU-semantics one the
# materialised (Dense, per-head) masks with segment ids, the Mosaic GPU one
# a row it does not refuse.
_DEFAULT_ON = {"interpret": {"dense", "per_head"}, "mosaic_gpu": {"and"}}
# Triton at 64 (not test_attention's 32): a quarter of the interpreted
# steps, still several blocks a side.
_COMBO_BLOCKS = {**BLOCKS, "triton": triton.GpuBlockSizes(
    block_q=64, block_k=64, block_q_dq=64, block_k_dq=64, block_q_dkv=64,
    block_k_dkv=64)}


def _combo_params():
  slow = [pytest.mark.slow]
  out = [pytest.param(c, id=str(c)) for c in DEFAULT_COMBOS]
  out += [pytest.param(c, id=str(c), marks=slow) for c in ALL_COMBOS
          if c not in DEFAULT_COMBOS]
  return out


def _block_kinds(allowed, bq, bk):
  """{0 empty, 1 partial, 2 full} among the (bq, bk) blocks of a bool
  [lq, lk] matrix (a block with padded keys is never full)."""
  lq, lk = allowed.shape
  kinds = set()
  for r in range(0, lq, bq):
    for c in range(0, lk, bk):
      tile = allowed[r:r + bq, c:c + bk]
      kinds.add(2 if tile.all() and c + bk <= lk else 1 if tile.any() else 0)
  return kinds


def _combo_blocks(backend_name):
  """The backend's (block_q, block_kv) pairs of the combos' blocks."""
  if backend_name == "triton":
    b = _COMBO_BLOCKS["triton"]
    return [(b.block_q, b.block_k), (b.block_q_dq, b.block_k_dq),
            (b.block_q_dkv, b.block_k_dkv)]
  return [(_TILE, _TILE)]


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("combo", _combo_params())
def test_every_mask_kind_with_every_option_matches_float64(backend, combo,
                                                           rng, request):
  default_on = _DEFAULT_ON.get(backend.name)
  if (default_on is not None and combo.kind not in default_on
      and not request.config.getoption("--runslow")):
    pytest.skip(f"slow in the {backend.name} interpreter (--runslow runs it)")
  lq, lk = LENGTHS[combo.lengths]
  h, hk = (2, 1) if combo.gqa else (2, 2)
  dtype, d = ((jnp.bfloat16, 64) if backend.name == "mosaic_gpu"
              else (jnp.float32, 24))
  make = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)  # noqa: E731
  q, k, v, d_out = (make(1, h, lq, d), make(1, hk, lk, d), make(1, hk, lk, d),
                    make(1, h, lq, d))
  d_lse = jnp.asarray(rng.standard_normal((1, h, lq)), jnp.float32)
  mask, allowed = MASK_KINDS[combo.kind](lq, lk, rng)
  sinks = (jnp.asarray(2 * rng.standard_normal(h), jnp.float32)
           if combo.sinks else None)
  kw = {}
  if combo.window:
    kw["sliding_window"] = WINDOW
  band = oracle.mask(lq, lk, sliding_window=kw.get("sliding_window"))[0]
  for bq, bk in _combo_blocks(backend.name):
    kinds = set().union(*(_block_kinds(a, bq, bk) for a in allowed & band))
    assert kinds == {0, 1, 2}, (combo, bq, bk, kinds)
  if combo.segments:
    q_seg = np.sort(rng.integers(0, 3, (1, lq)), axis=1)
    kv_seg = (q_seg if lq == lk
              else np.sort(rng.integers(0, 3, (1, lk)), axis=1))
    kw["segment_ids"] = (jnp.asarray(q_seg), jnp.asarray(kv_seg))
  if backend.name == "mosaic_gpu" and (combo.segments
                                      or isinstance(mask, list)):
    with pytest.raises(ValueError, match="cannot run this call"):
      backend.run(pk.flash_attention, q, k, v, mask=mask, sinks=sinks, **kw)
    return
  out, lse, grads = backend.run(_run, q, k, v, sinks, None, d_out, d_lse,
                                blocks=_COMBO_BLOCKS.get(backend.name),
                                mask=mask, **kw)
  ref_out, ref_lse, ref_grads = oracle.attention(
      q, k, v, d_out=d_out, d_lse=d_lse, allowed=allowed, sinks=sinks, **kw)
  out_tol, lse_tol, grad_tol = TOLERANCES[jnp.dtype(dtype).name]
  _assert_close(out, ref_out, out_tol, "out")
  _assert_close(lse, ref_lse, lse_tol, "lse")
  for name, got, want in zip(("dq", "dk", "dv", "dsinks"), grads,
                             ref_grads[:3] + ref_grads[4:]):
    _assert_close(got, want, grad_tol, name)

# ------------------------------------------------------ classification --

_MASK_MAKERS = [
    lambda rng: masks.Causal(),
    lambda rng: masks.Local(int(rng.integers(0, 40)),
                            int(rng.integers(0, 40))),
    lambda rng: masks.Local(None, int(rng.integers(0, 9))),
    lambda rng: masks.ChunkedCausal(int(rng.integers(1, 50))),
    lambda rng: masks.PrefixLM(int(rng.integers(0, 60))),
    lambda rng: masks.ChunkedCausal(int(rng.integers(1, 30)))
    | masks.PrefixLM(int(rng.integers(0, 30))),
    lambda rng: masks.Local(10, 10) & masks.PrefixLM(20),
]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, len(_MASK_MAKERS) - 1), st.integers(1, 90),
       st.integers(1, 90), st.sampled_from([1, 4, 8, 16]),
       st.sampled_from([1, 8, 16]), st.integers(0, 2**31 - 1))
def test_block_classes_never_call_a_partial_block_full_or_empty(
    which, lq, lk, bq, bk, seed):
  mask = _MASK_MAKERS[which](np.random.default_rng(seed))
  classes = masks.block_classes(mask, lq, lk, bq, bk)
  values = np.zeros((classes.shape[0] * bq, classes.shape[1] * bk), bool)
  values[:lq, :lk] = masks.dense(mask, lq, lk)
  blocks = values.reshape(classes.shape[0], bq, classes.shape[1], bk)
  some = blocks.any(axis=(1, 3))
  real_rows = np.zeros(values.shape[0], bool)
  real_rows[:lq] = True
  every = (values | ~real_rows[:, None]).reshape(blocks.shape).all(axis=(1, 3))
  assert not np.any((classes == 0) & some)
  assert not np.any((classes == 2) & ~every)
  # Formula masks without chunks or unions are classified exactly.
  if which in (0, 1, 2, 4):
    np.testing.assert_array_equal(classes == 0, ~some)
    np.testing.assert_array_equal(classes == 2, every)


def test_mask_elementwise_rules_match_the_documented_ones():
  for lq, lk in ((37, 37), (20, 45), (45, 20)):
    np.testing.assert_array_equal(masks.dense(masks.Causal(), lq, lk),
                                  causal_np(lq, lk))
    np.testing.assert_array_equal(masks.dense(masks.ChunkedCausal(6), lq, lk),
                                  chunked_np(lq, lk, 6))
    np.testing.assert_array_equal(masks.dense(masks.PrefixLM(9), lq, lk),
                                  prefix_np(lq, lk, 9))
    np.testing.assert_array_equal(masks.dense(masks.Local(3, None), lq, lk),
                                  local_np(lq, lk, 3, None))


def test_kernels_visit_blocks_in_proportion_to_the_mask():
  def geometry(mask):
    return mosaic_tpu._geometry(4096, 4096, 512, 512, False, False, None,
                                None, mask)
  def visited(mask):
    return geometry(mask).visited_blocks()
  assert visited(masks.ChunkedCausal(512)) == 8             # the diagonal
  assert visited(masks.ChunkedCausal(1024)) == 8 + 4        # + one per chunk
  assert visited(masks.PrefixLM(1024)) == 36 + 1    # causal + block (0, 1)
  assert visited(masks.Dense(np.eye(4096, dtype=bool))) == 8
  # The walk steps once per live block: 12 steps, not 8 x 8.
  assert geometry(masks.ChunkedCausal(1024)).grid("kv", 1, 1) == (1, 1, 12)
  # Per-head tables count each head's blocks.
  per_head = (masks.ChunkedCausal(512), masks.Causal())
  assert geometry(per_head).visited_blocks(2) == 8 + 36


def test_tables_beyond_smem_raise_a_clear_error():
  with pytest.raises(ValueError, match="pass larger block_sizes"):
    mosaic_tpu._geometry(131072, 131072, 128, 128, False, True, None, None)


# --------------------------------------------------------------- errors --

@pytest.mark.parametrize("kwargs,error,match", [
    (dict(mask=masks.Dense(np.ones((5, 5), bool))), ValueError,
     r"Dense mask has shape \(5, 5\).*\(12, 16\)"),
    (dict(mask=[masks.Causal()] * 3), ValueError, "one mask per query head"),
    (dict(mask="causal"), TypeError, "mask must be a mask"),
    (dict(sinks=jnp.zeros((3,))), ValueError, r"sinks must have shape \[heads\]"),
    (dict(sinks=jnp.zeros((2,), jnp.int32)), TypeError, "sinks must be"),
    (dict(sinks=jnp.zeros((2, 1))), ValueError, "sinks must have 1 dim"),
])
def test_bad_masks_and_sinks_raise(kwargs, error, match):
  q = jnp.zeros((1, 2, 12, 8))
  k = jnp.zeros((1, 2, 16, 8))
  with pytest.raises(error, match=match):
    pk.flash_attention(q, k, k, **kwargs)


def test_mask_constructors_check_their_arguments():
  with pytest.raises(ValueError, match="chunk_size must be >= 1"):
    masks.ChunkedCausal(0)
  with pytest.raises(TypeError, match="Local.left must be an int"):
    masks.Local(1.5)
  with pytest.raises(TypeError, match="must be boolean"):
    masks.Dense(np.zeros((3, 3)))
  with pytest.raises(TypeError, match="cannot combine a mask"):
    masks.Causal() & True
  with pytest.raises(TypeError, match="concrete array"):
    jax.jit(lambda m: masks.Dense(m))(jnp.ones((3, 3), bool))


def test_plain_causal_and_local_masks_use_the_band_kernels(rng):
  q = jnp.asarray(rng.standard_normal((1, 2, 70, 16)), jnp.float32)
  for mask, kw in ((masks.Causal(), dict(causal=True)),
                   (masks.Local(9, 4), dict(sliding_window=(9, 4)))):
    a = pk.flash_attention(q, q, q, mask=mask, backend="reference")
    b = pk.flash_attention(q, q, q, backend="reference", **kw)
    np.testing.assert_array_equal(a, b)


def test_masks_are_hashable_values():
  assert masks.ChunkedCausal(4) == masks.ChunkedCausal(4)
  assert hash(masks.Dense(np.eye(3, dtype=bool))) == hash(
      masks.Dense(np.eye(3, dtype=bool)))
  assert masks.Dense(np.eye(3, dtype=bool)) != masks.Dense(
      np.ones((3, 3), bool))


# ------------------------------------------------------------ TPU AOT --

@pytest.mark.tpu_aot
@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
@pytest.mark.parametrize("mask", [
    masks.ChunkedCausal(1024),
    masks.Dense(np.tril(np.ones((2048, 2048), bool), k=-300)),
    (masks.ChunkedCausal(512), masks.PrefixLM(700)),
], ids=["chunked", "dense", "per_head"])
def test_masked_kernels_compile_for_tpu(topology, mask, tpu_topologies):
  if topology not in tpu_topologies:
    pytest.skip(f"libtpu lacks {topology}")
  from pallas_kernels import tpu_aot
  spec = jax.ShapeDtypeStruct((1, 2, 2048, 128), jnp.bfloat16)
  sinks = jax.ShapeDtypeStruct((2,), jnp.float32)

  def fn(q, k, v, sinks):
    def loss(q, k, v, sinks):
      out = pk.flash_attention(q, k, v, mask=mask, sinks=sinks,
                               backend="mosaic_tpu")
      return jnp.sum(out.astype(jnp.float32))
    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sinks)
  result = tpu_aot.compile_for_tpu(fn, spec, spec, spec, sinks,
                                   topology=topology)
  assert result.hlo_text.count('custom_call_target="tpu_custom_call"') >= 3


def test_shard_helper_splits_sinks_with_heads_and_keeps_masks(rng):
  from jax.sharding import Mesh
  devices = np.array(jax.devices()[:4]).reshape(2, 2)
  mesh = Mesh(devices, ("data", "model"))
  q = jnp.asarray(rng.standard_normal((2, 4, 96, 16)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((2, 2, 96, 16)), jnp.float32)
  sinks = jnp.asarray(rng.standard_normal(4), jnp.float32)
  kw = dict(mask=masks.ChunkedCausal(40), sinks=sinks, backend="reference")
  sharded = pk.shard_flash_attention(mesh, q, k, k, **kw)
  np.testing.assert_allclose(sharded, pk.flash_attention(q, k, k, **kw),
                             atol=1e-6)
  with pytest.raises(ValueError, match="per-head mask list cannot be split"):
    pk.shard_flash_attention(mesh, q, k, k,
                             mask=[masks.Causal()] * 4)
