"""torch_bridge.grouped_matmul and custom_kernel.gmm / tgmm / gmm_backward.

Two oracles: a float64 per-group loop written here (numpy; values and
gradients, any sizes: zeros, one group with every row, sums below M, sizes
past M or negative, odd M/K/N), and torch_xla 2.9's own ``custom_kernel.gmm``,
``tgmm``, ``gmm_backward`` (JAX's megablox kernels in Pallas' interpreter
through ``txla_interpret``; sizes its kernels accept: groups covering all M
rows, M a multiple of its row tile, K and N multiples of 128).
"""
from __future__ import annotations

import inspect

import numpy as np
import pytest

pytest.importorskip("torch_xla")
pytestmark = pytest.mark.torch

import torch  # noqa: E402

import torch_bridge as tb  # noqa: E402
from torch_bridge import custom_kernel  # noqa: E402

# float32 sums against float64 oracles: the error of a float32 sum is
# bounded relative to the sum of its terms' magnitudes (the oracle on |x|),
# whatever the summation order; 1e-5 is ~170 float32 ulps of that.
SUM_RTOL, SUM_ATOL = 1e-5, 1e-6


def _bounds(sizes, m):
  """(start, end) of each group's rows: sizes clamped as the op does."""
  start, out = 0, []
  for size in sizes:
    end = min(start + max(int(size), 0), m)
    out.append((start, end))
    start = end
  return out


def _oracle(lhs, rhs, sizes, dout, transpose_rhs=False):
  """float64 ``(out, d lhs, d rhs)`` by a loop over the groups."""
  lhs, rhs, dout = (np.asarray(a, np.float64) for a in (lhs, rhs, dout))
  w = rhs.transpose(0, 2, 1) if transpose_rhs else rhs  # [G, K, N]
  out = np.zeros((lhs.shape[0], w.shape[2]))
  dlhs, dw = np.zeros_like(lhs), np.zeros_like(w)
  for g, (s, e) in enumerate(_bounds(sizes, lhs.shape[0])):
    out[s:e] = lhs[s:e] @ w[g]
    dlhs[s:e] = dout[s:e] @ w[g].T
    dw[g] = lhs[s:e].T @ dout[s:e]
  return out, dlhs, dw.transpose(0, 2, 1) if transpose_rhs else dw


def _sizes(rng, kind, m, g):
  """int64 group sizes of one ``kind``."""
  if kind == "cover":  # a random split of all m rows, one group empty
    return _with_zero(rng, m, g)
  if kind == "one_group":
    sizes = np.zeros(g, np.int64)
    sizes[rng.integers(g)] = m
    return sizes
  if kind == "short":  # rows past the last group
    return rng.multinomial(int(rng.integers(0, m)), np.ones(g) / g)
  if kind == "clamped":  # negative sizes count as 0; a sum past m stops
    sizes = rng.integers(-5, m, size=g)
    sizes[0] = -3
    sizes[-1] = m + 4
    return sizes
  raise AssertionError(kind)


def _with_zero(rng, m, g):
  """A random split of m rows into g >= 2 groups, one of them empty."""
  sizes = rng.multinomial(m, np.ones(g - 1) / (g - 1))
  return np.insert(sizes, rng.integers(g), 0)


def _run(fn, lhs, rhs, sizes, dout, device, dtype=torch.float32, **kw):
  """``fn(lhs, rhs, sizes, **kw)`` on ``device`` with the gradients for
  ``dout``: numpy float64 (out, d lhs, d rhs)."""
  leaves = [torch.tensor(a, dtype=dtype).to(device).requires_grad_()
            for a in (lhs, rhs)]
  out = fn(*leaves, torch.tensor(sizes).to(device), **kw)
  grads = torch.autograd.grad(out, leaves,
                              torch.tensor(dout, dtype=out.dtype).to(device))
  return [t.detach().cpu().double().numpy() for t in (out, *grads)]


def _inputs(rng, m, k, n, g, transpose_rhs=False):
  rhs_shape = (g, n, k) if transpose_rhs else (g, k, n)
  return (rng.standard_normal((m, k)), rng.standard_normal(rhs_shape),
          rng.standard_normal((m, n)))


def _bound(lhs, rhs, sizes, dout, transpose_rhs=False):
  """The oracle on magnitudes: each result's sum of |terms|."""
  return _oracle(*(np.abs(a) for a in (lhs, rhs)), sizes, np.abs(dout),
                 transpose_rhs)


def _close(got, want, magnitude, what, scale=1.0):
  """|got - want| <= scale * (SUM_RTOL * magnitude + SUM_ATOL)."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, (what, got.shape, want.shape)
  excess = np.abs(got - want) - scale * (SUM_RTOL * magnitude + SUM_ATOL)
  assert excess.max(initial=0) <= 0, (
      f"{what}: max error {np.abs(got - want).max()} exceeds the bound by "
      f"{excess.max()}")


def _assert_all_close(got, want, bound):
  for name, g, w, b in zip(("out", "d lhs", "d rhs"), got, want, bound):
    _close(g, w, b, name)


# -------------------------------------------------- torch_bridge op --

KINDS = ("cover", "one_group", "short", "clamped")


@pytest.mark.parametrize("transpose_rhs", [
    False, pytest.param(True, marks=pytest.mark.slow)])  # (d lhs flips it)
def test_kernel_matches_float64_oracle(rng, transpose_rhs):
  """The TPU kernel (Pallas' interpreter on CPU tensors) at odd sizes, small
  tiles (row tiles straddle groups), every kind of group sizes: values and
  gradients. One shape, so the kinds reuse one compile."""
  m, k, n, g = 37, 19, 11, 5
  lhs, rhs, dout = _inputs(rng, m, k, n, g, transpose_rhs)
  for kind in KINDS:
    sizes = _sizes(rng, kind, m, g)
    got = _run(tb.grouped_matmul, lhs, rhs, sizes, dout, "cpu",
               transpose_rhs=transpose_rhs, block_sizes=(8, 128, 128),
               backend="interpret")
    _assert_all_close(got, _oracle(lhs, rhs, sizes, dout, transpose_rhs),
                      _bound(lhs, rhs, sizes, dout, transpose_rhs))


def test_xla_tensors_match_float64_oracle(rng, xla_device):
  """On XLA tensors the kernel runs inside the torch_xla graph (the generic
  interpreter on PJRT_DEVICE=CPU), gradients from its saved inputs; int32
  sizes summing below M."""
  m, k, n, g = 29, 13, 7, 4
  lhs, rhs, dout = _inputs(rng, m, k, n, g)
  sizes = _sizes(rng, "short", m, g).astype(np.int32)
  got = _run(tb.grouped_matmul, lhs, rhs, sizes, dout, xla_device)
  _assert_all_close(got, _oracle(lhs, rhs, sizes, dout),
                    _bound(lhs, rhs, sizes, dout))


def test_bfloat16_and_preferred_element_type(rng):
  m, k, n, g = 24, 16, 8, 3
  lhs, rhs, dout = _inputs(rng, m, k, n, g)
  sizes = _sizes(rng, "cover", m, g)
  lhs_bf, rhs_bf = (torch.tensor(a, dtype=torch.bfloat16) for a in (lhs, rhs))
  exact = (lhs_bf.double().numpy(), rhs_bf.double().numpy(), sizes, dout)
  want, bound = _oracle(*exact)[0], _bound(*exact)[0]
  out = tb.grouped_matmul(lhs_bf, rhs_bf, torch.tensor(sizes),
                          preferred_element_type=torch.float32)
  assert out.dtype == torch.float32
  _close(out.numpy(), want, bound, "out")  # float32 sums of exact products
  same = tb.grouped_matmul(lhs_bf, rhs_bf, torch.tensor(sizes))
  assert same.dtype == torch.bfloat16
  # (rounded to bfloat16: 2**-9 of the value, relative)
  np.testing.assert_allclose(same.double().numpy(), want, rtol=2 ** -8,
                             atol=SUM_ATOL)


def test_group_sizes_take_no_gradient(rng):
  lhs = torch.randn(6, 4, requires_grad=True)
  rhs = torch.randn(2, 4, 3, requires_grad=True)
  out = torch.ops.pallas_kernels.grouped_matmul(lhs, rhs,
                                                torch.tensor([2, 4]))
  assert out.requires_grad
  dl, dr = torch.autograd.grad(out.sum(), [lhs, rhs])
  assert dl.shape == lhs.shape and dr.shape == rhs.shape


@pytest.mark.parametrize("dtype, group", [
    (torch.int8, None), (torch.float8_e4m3fn, 8)])
def test_quantized_rhs_matches_float64_oracle(rng, dtype, group):
  """int8 codes with per-channel scales, fp8 codes with per-K-group scales:
  values and the gradients in lhs and rhs_scale against the dequantized
  float64 oracle (d scale = sum over its K group of codes * d weight)."""
  m, k, n, g = 29, 16, 9, 3
  lhs, _, dout = _inputs(rng, m, k, n, g)
  if dtype == torch.int8:
    codes = torch.tensor(rng.integers(-127, 128, (g, k, n)), dtype=dtype)
  else:
    codes = torch.tensor(rng.standard_normal((g, k, n)) * 4).to(dtype)
  groups = 1 if group is None else k // group
  scale = rng.uniform(0.01, 0.1, (g, groups, n))
  exact = codes.double().numpy()
  weight = exact * np.repeat(scale, k // groups, axis=1)
  sizes = _sizes(rng, "short", m, g)
  want, dlhs, dw = _oracle(lhs, weight, sizes, dout)
  bound = _bound(lhs, weight, sizes, dout)
  dscale = (dw * exact).reshape(g, groups, k // groups, n).sum(2)
  dscale_bound = (bound[2] * np.abs(exact)).reshape(
      g, groups, k // groups, n).sum(2)
  leaves = [torch.tensor(a, dtype=torch.float32).requires_grad_()
            for a in (lhs, scale)]
  out = tb.grouped_matmul(leaves[0], codes, torch.tensor(sizes),
                          rhs_scale=leaves[1], backend="interpret",
                          block_sizes=(8, 128, 128))
  got = torch.autograd.grad(out, leaves, torch.tensor(dout,
                                                      dtype=torch.float32))
  _close(out.detach().numpy(), want, bound[0], "out")
  _close(got[0].numpy(), dlhs, bound[1], "d lhs")
  _close(got[1].numpy(), dscale, dscale_bound, "d rhs_scale")


BAD = {
    "lhs_rank": ((torch.zeros(2, 3, 4), torch.zeros(2, 4, 5),
                  torch.tensor([1, 1])), {}, ValueError,
                 "lhs must have 2 dimensions"),
    "rhs_rank": ((torch.zeros(3, 4), torch.zeros(4, 5), torch.tensor([3])),
                 {}, ValueError, "rhs must have 3 dimensions"),
    "k_mismatch": ((torch.zeros(3, 4), torch.zeros(2, 5, 6),
                    torch.tensor([1, 2])), {}, ValueError,
                   "rhs.shape\\[1\\]=5 must equal lhs's K=4"),
    "k_mismatch_transposed": ((torch.zeros(3, 4), torch.zeros(2, 4, 6),
                               torch.tensor([1, 2])),
                              dict(transpose_rhs=True), ValueError,
                              "rhs.shape\\[2\\]=6 must equal lhs's K=4"),
    "sizes_length": ((torch.zeros(3, 4), torch.zeros(2, 4, 5),
                      torch.tensor([3])), {}, ValueError,
                     "group_sizes must have shape \\(2,\\)"),
    "no_groups": ((torch.zeros(3, 4), torch.zeros(0, 4, 5),
                   torch.zeros(0, dtype=torch.long)), {}, ValueError,
                  "at least one group"),
    "codes_without_scale": ((torch.zeros(3, 4),
                             torch.zeros(2, 4, 5, dtype=torch.int8),
                             torch.tensor([1, 2])), {}, TypeError,
                            "rhs must have dtype float32"),
    "float_rhs_with_scale": ((torch.zeros(3, 4), torch.zeros(2, 4, 5),
                              torch.tensor([1, 2])),
                             dict(rhs_scale=torch.ones(2, 1, 5)), TypeError,
                             "rhs must have dtype int8"),
    "float_sizes": ((torch.zeros(3, 4), torch.zeros(2, 4, 5),
                     torch.tensor([1.0, 2.0])), {}, TypeError,
                    "group_sizes must have dtype"),
    "int_lhs": ((torch.zeros(3, 4, dtype=torch.int32), torch.zeros(2, 4, 5),
                 torch.tensor([1, 2])), {}, TypeError, "lhs must have dtype"),
    "float64": ((torch.zeros(3, 4, dtype=torch.float64),
                 torch.zeros(2, 4, 5), torch.tensor([1, 2])), {}, TypeError,
                "lhs must have dtype"),
    "out_dtype": ((torch.zeros(3, 4), torch.zeros(2, 4, 5),
                   torch.tensor([1, 2])),
                  dict(preferred_element_type=torch.int32), TypeError,
                  "preferred_element_type must be"),
    "transpose_not_bool": ((torch.zeros(3, 4), torch.zeros(2, 4, 5),
                            torch.tensor([1, 2])), dict(transpose_rhs=1),
                           TypeError, "transpose_rhs must be a bool"),
    "block_sizes_shape": ((torch.zeros(3, 4), torch.zeros(2, 4, 5),
                           torch.tensor([1, 2])), dict(block_sizes=(8, 128)),
                          ValueError, "block_sizes must be"),
    "block_sizes_multiple": ((torch.zeros(3, 4), torch.zeros(2, 4, 5),
                              torch.tensor([1, 2])),
                             dict(block_sizes=(8, 100, 128)), ValueError,
                             "block_sizes=.*multiples of 128"),
    "backend": ((torch.zeros(3, 4), torch.zeros(2, 4, 5),
                 torch.tensor([1, 2])), dict(backend="cuda"), ValueError,
                "backend='cuda'"),
    "spec_length": ((torch.zeros(3, 4), torch.zeros(2, 4, 5),
                     torch.tensor([1, 2])),
                    dict(partition_spec=(None, None, "model")), ValueError,
                    "one entry per dimension of the output"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_arguments(name):
  args, kwargs, error, match = BAD[name]
  with pytest.raises(error, match="grouped_matmul: .*" + match):
    tb.grouped_matmul(*args, **kwargs)


# ------------------------------------------------ custom_kernel drop-ins --

@pytest.mark.parametrize("name", ["gmm", "tgmm", "gmm_backward"])
def test_signature_matches_torch_xla(name):
  from torch_xla.experimental import custom_kernel as ck
  theirs = inspect.signature(getattr(ck, name)).parameters
  ours = inspect.signature(getattr(custom_kernel, name)).parameters
  assert list(ours) == list(theirs)
  for arg in theirs:
    assert ours[arg].kind == theirs[arg].kind, arg
    assert ours[arg].default == theirs[arg].default, arg


def _txla_sizes(rng, m, g):
  """Sizes torch_xla's kernels accept: all m rows covered, one group
  empty."""
  return _with_zero(rng, m, g).astype(np.int32)


def _torch_xla_case(rng, monkeypatch, device, m, k, n, g, transpose_rhs):
  import txla_interpret
  ck = txla_interpret.install(monkeypatch)
  lhs, rhs, dout = _inputs(rng, m, k, n, g, transpose_rhs)
  sizes = _txla_sizes(rng, m, g)
  t = lambda a: torch.tensor(a, dtype=torch.float32).to(device)  # noqa
  gs = torch.tensor(sizes).to(device)
  results = []
  for module in (ck, custom_kernel):
    out = module.gmm(t(lhs), t(rhs), gs, transpose_rhs=transpose_rhs)
    row = [out]
    if not transpose_rhs:  # (torch_xla's gmm_backward takes [G, K, N])
      row.append(module.tgmm(t(lhs).t(), t(dout), gs))
      row.extend(module.gmm_backward(t(dout), t(lhs), t(rhs), gs))
    results.append([r.cpu().double().numpy() for r in row])
  want = _oracle(lhs, rhs, sizes, dout, transpose_rhs)
  bound = _bound(lhs, rhs, sizes, dout, transpose_rhs)
  order = (0, 2, 1, 2)  # out; tgmm = d rhs; gmm_backward: d lhs, d rhs
  for i, (theirs, ours) in enumerate(zip(*results)):
    # (both float32: twice the bound of one against the exact value)
    _close(ours, theirs, bound[order[i]], f"vs torch_xla {i}", scale=2)
    _close(ours, want[order[i]], bound[order[i]], f"vs oracle {i}")


def test_matches_torch_xla(rng, monkeypatch, xla_device):
  """gmm, tgmm and gmm_backward against torch_xla's (same arguments,
  positional defaults) and the float64 oracle, on XLA tensors."""
  _torch_xla_case(rng, monkeypatch, xla_device, 256, 128, 256, 4, False)


@pytest.mark.slow
@pytest.mark.parametrize("m, k, n, g, transpose_rhs", [
    (256, 128, 256, 4, True), (512, 256, 128, 4, False),
    (384, 128, 384, 6, False)])
def test_matches_torch_xla_sweep(rng, monkeypatch, xla_device, m, k, n, g,
                                 transpose_rhs):
  _torch_xla_case(rng, monkeypatch, xla_device, m, k, n, g, transpose_rhs)


@pytest.mark.slow
def test_runs_where_torch_xla_default_tiling_fails(rng, monkeypatch,
                                                   xla_device):
  """torch_xla's default row tile for m=512, 3 groups is 384, which does
  not divide m: its gmm raises; ours runs (any m)."""
  import txla_interpret
  ck = txla_interpret.install(monkeypatch)
  m, k, n, g = 512, 128, 128, 3
  lhs, rhs, dout = _inputs(rng, m, k, n, g)
  sizes = _txla_sizes(rng, m, g)
  args = [torch.tensor(a, dtype=torch.float32).to(xla_device)
          for a in (lhs, rhs)] + [torch.tensor(sizes).to(xla_device)]
  with pytest.raises(ValueError, match="divisible by x-dimension tile"):
    ck.gmm(*args)
  _close(custom_kernel.gmm(*args).cpu().numpy(),
         _oracle(lhs, rhs, sizes, dout)[0],
         _bound(lhs, rhs, sizes, dout)[0], "out")


def test_drop_ins_match_float64_oracle_at_odd_sizes(rng):
  """Sizes torch_xla cannot run (odd, sums below M, negative): the drop-ins
  on CPU tensors against the oracle; ``num_actual_groups`` keeps the first
  groups; gmm is differentiable."""
  m, k, n, g = 31, 10, 7, 4
  lhs, rhs, dout = _inputs(rng, m, k, n, g)
  sizes = _sizes(rng, "clamped", m, g)
  want, dlhs, drhs = _oracle(lhs, rhs, sizes, dout)
  bound = _bound(lhs, rhs, sizes, dout)
  got = _run(custom_kernel.gmm, lhs, rhs, sizes, dout, "cpu")
  _assert_all_close(got, (want, dlhs, drhs), bound)
  t = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
  gs = torch.tensor(sizes)
  tg = custom_kernel.tgmm(t(lhs).t(), t(dout), gs, (8, 128, 128), None, 3)
  assert tg.shape == (3, k, n)
  _close(tg.numpy(), drhs[:3], bound[2][:3], "tgmm")
  back = custom_kernel.gmm_backward(t(dout), t(lhs), t(rhs), gs, None)
  for got, w, b in zip(back, (dlhs, drhs), bound[1:]):
    _close(got.numpy(), w, b, "gmm_backward")
  out = custom_kernel.gmm(t(lhs), t(rhs).transpose(1, 2).contiguous(), gs,
                          [16, 128, 256], None, True)
  _close(out.numpy(), want, bound[0], "gmm transposed")


_A, _W = torch.zeros(8, 4), torch.zeros(2, 4, 3)
_S = torch.tensor([3, 5], dtype=torch.int32)
DROP_IN_BAD = {
    "gmm_group_offset_range": (lambda: custom_kernel.gmm(
        _A, _W[:1], _S, group_offset=2), ValueError,
        "grouped_matmul: group_offset=2 must be in \\[0, 1\\]"),
    "gmm_group_offset_float": (lambda: custom_kernel.gmm(
        _A, _W[:1], _S, group_offset=torch.tensor([1.0])), ValueError,
        "grouped_matmul: group_offset must be an int or an integer tensor"),
    "gmm_group_offset_shape": (lambda: custom_kernel.gmm(
        _A, _W[:1], _S, group_offset=torch.tensor([0, 1])), ValueError,
        "group_offset must be an int or an integer tensor of one element"),
    "gmm_offset_sizes": (lambda: custom_kernel.gmm(
        _A, torch.zeros(3, 4, 3), _S, group_offset=0), ValueError,
        "with group_offset, group_sizes \\[G_total\\] must have at least"),
    "gmm_tiling_length": (lambda: custom_kernel.gmm(_A, _W, _S, (128, 128)),
                          ValueError, "gmm: tiling must be"),
    "gmm_tiling_multiple": (lambda: custom_kernel.gmm(_A, _W, _S,
                                                      (100, 128, 128)),
                            ValueError, "gmm: tiling=\\(100, 128, 128\\)"),
    "backward_tiling": (lambda: custom_kernel.gmm_backward(
        torch.zeros(8, 3), _A, _W, _S, (8, 128, 64)), ValueError,
        "gmm_backward: tiling="),
    "tgmm_groups": (lambda: custom_kernel.tgmm(
        _A.t(), torch.zeros(8, 3), _S, num_actual_groups=3), ValueError,
        "num_groups must be an int in \\[1, 2\\]"),
    "tgmm_rows": (lambda: custom_kernel.tgmm(_A.t(), torch.zeros(7, 3), _S),
                  ValueError, "tgmm: dout has 7 rows, lhs has 8"),
    "tgmm_lhs_rank": (lambda: custom_kernel.tgmm(_W, torch.zeros(8, 3), _S),
                      ValueError, "tgmm: lhs must be \\[k, m\\]"),
}


def _offset_oracle(lhs, rhs, sizes, dout, offset):
  """The oracle for rhs holding groups offset .. offset + G - 1 of sizes:
  the full problem with zero weights elsewhere, d rhs of the held groups."""
  full = np.zeros((len(sizes),) + rhs.shape[1:])
  full[offset:offset + rhs.shape[0]] = rhs
  out, dlhs, dw = _oracle(lhs, full, sizes, dout)
  return out, dlhs, dw[offset:offset + rhs.shape[0]]


def test_group_offset_matches_float64_oracle(rng):
  """Expert parallelism: rhs holds 2 of 5 groups, the offset an int, then
  a tensor (same compile for any value); rows of other groups give zeros;
  tgmm's num_actual_groups groups from the offset."""
  m, k, n, g_total, g = 33, 12, 9, 5, 2
  lhs, rhs, dout = _inputs(rng, m, k, n, g)
  sizes = _sizes(rng, "cover", m, g_total)
  for offset in (3, torch.tensor([1], dtype=torch.int32)):
    at = int(offset)
    want = _offset_oracle(lhs, rhs, sizes, dout, at)
    bound = _offset_oracle(np.abs(lhs), np.abs(rhs), sizes, np.abs(dout), at)
    got = _run(custom_kernel.gmm, lhs, rhs, sizes, dout, "cpu",
               group_offset=offset, tiling=(8, 128, 128))
    _assert_all_close(got, want, bound)
    t = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    tg = custom_kernel.tgmm(t(lhs).t(), t(dout), torch.tensor(sizes),
                            (8, 128, 128), offset, g)
    _close(tg.numpy(), want[2], bound[2], f"tgmm offset {at}")


@pytest.mark.parametrize("name", sorted(DROP_IN_BAD))
def test_drop_in_bad_arguments(name):
  call, error, match = DROP_IN_BAD[name]
  with pytest.raises(error, match=match):
    call()


# ------------------------------------------------------------ sweeps --

@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("backend", ["interpret", "reference"])
def test_sweep_matches_float64_oracle(seed, backend):
  rng = np.random.default_rng(seed)
  m, k, n = (int(x) for x in rng.integers(1, 70, size=3))
  g = int(rng.integers(1, 9))
  transpose_rhs = bool(rng.integers(2))
  lhs, rhs, dout = _inputs(rng, m, k, n, g, transpose_rhs)
  for kind in KINDS if g > 1 else ("one_group", "short", "clamped"):
    sizes = _sizes(rng, kind, m, g)
    got = _run(tb.grouped_matmul, lhs, rhs, sizes, dout, "cpu",
               transpose_rhs=transpose_rhs, backend=backend,
               block_sizes=(8, 128, 128) if seed % 2 else None)
    _assert_all_close(got, _oracle(lhs, rhs, sizes, dout, transpose_rhs),
                      _bound(lhs, rhs, sizes, dout, transpose_rhs))
