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

# float32 kernels (float32 sums) against float64 oracles.
TOL = dict(rtol=2e-5, atol=2e-5)
# bfloat16 inputs (8-bit mantissas), float32 sums.
BF16_TOL = dict(rtol=2e-2, atol=2e-2)


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


def _assert_all_close(got, want, tol=TOL):
  for name, g, w in zip(("out", "d lhs", "d rhs"), got, want):
    np.testing.assert_allclose(g, w, err_msg=name, **tol)


# -------------------------------------------------- torch_bridge op --

KINDS = ("cover", "one_group", "short", "clamped")


@pytest.mark.parametrize("transpose_rhs", [False, True])
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
    _assert_all_close(got, _oracle(lhs, rhs, sizes, dout, transpose_rhs))


def test_default_backend_and_int32_sizes(rng):
  m, k, n, g = 21, 9, 6, 4
  lhs, rhs, dout = _inputs(rng, m, k, n, g)
  sizes = _sizes(rng, "short", m, g).astype(np.int32)
  got = _run(tb.grouped_matmul, lhs, rhs, sizes, dout, "cpu")
  _assert_all_close(got, _oracle(lhs, rhs, sizes, dout))


def test_xla_tensors_match_float64_oracle(rng, xla_device):
  """On XLA tensors the kernel runs inside the torch_xla graph (the generic
  interpreter on PJRT_DEVICE=CPU), gradients from its saved inputs."""
  m, k, n, g = 29, 13, 7, 4
  lhs, rhs, dout = _inputs(rng, m, k, n, g)
  sizes = _sizes(rng, "cover", m, g)
  got = _run(tb.grouped_matmul, lhs, rhs, sizes, dout, xla_device)
  _assert_all_close(got, _oracle(lhs, rhs, sizes, dout))


def test_bfloat16_and_preferred_element_type(rng):
  m, k, n, g = 24, 16, 8, 3
  lhs, rhs, dout = _inputs(rng, m, k, n, g)
  sizes = _sizes(rng, "cover", m, g)
  lhs_bf, rhs_bf = (torch.tensor(a, dtype=torch.bfloat16) for a in (lhs, rhs))
  want = _oracle(lhs_bf.double().numpy(), rhs_bf.double().numpy(), sizes,
                 dout)[0]
  out = tb.grouped_matmul(lhs_bf, rhs_bf, torch.tensor(sizes),
                          preferred_element_type=torch.float32)
  assert out.dtype == torch.float32
  np.testing.assert_allclose(out.double().numpy(), want, rtol=1e-5,
                             atol=1e-5)  # float32 sums of exact products
  same = tb.grouped_matmul(lhs_bf, rhs_bf, torch.tensor(sizes))
  assert same.dtype == torch.bfloat16
  np.testing.assert_allclose(same.double().numpy(), want, **BF16_TOL)


def test_group_sizes_take_no_gradient(rng):
  lhs = torch.randn(6, 4, requires_grad=True)
  rhs = torch.randn(2, 4, 3, requires_grad=True)
  out = torch.ops.pallas_kernels.grouped_matmul(lhs, rhs,
                                                torch.tensor([2, 4]))
  assert out.requires_grad
  dl, dr = torch.autograd.grad(out.sum(), [lhs, rhs])
  assert dl.shape == lhs.shape and dr.shape == rhs.shape


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
    "spec_rows": ((torch.zeros(3, 4), torch.zeros(2, 4, 5),
                   torch.tensor([1, 2])), dict(partition_spec=("fsdp", None)),
                  ValueError, "splits the output's dim 0 \\(rows\\) over "
                  "mesh axis 'fsdp'"),
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


def test_spec_changes_no_result_off_spmd(rng):
  lhs, rhs = torch.randn(5, 3), torch.randn(2, 3, 4)
  sizes = torch.tensor([2, 3])
  torch.testing.assert_close(
      tb.grouped_matmul(lhs, rhs, sizes, partition_spec=(None, "model")),
      tb.grouped_matmul(lhs, rhs, sizes), rtol=0, atol=0)


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
  for theirs, ours in zip(*results):
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)
  want, dlhs, drhs = _oracle(lhs, rhs, sizes, dout, transpose_rhs)
  for got, w in zip(results[1], [want, drhs, dlhs, drhs]):
    np.testing.assert_allclose(got, w, **TOL)


def test_matches_torch_xla(rng, monkeypatch, xla_device):
  """gmm, tgmm and gmm_backward against torch_xla's (same arguments,
  positional defaults) and the float64 oracle, on XLA tensors."""
  _torch_xla_case(rng, monkeypatch, xla_device, 256, 128, 256, 4, False)


@pytest.mark.slow
@pytest.mark.parametrize("m, k, n, g, transpose_rhs", [
    (256, 128, 256, 4, True), (512, 256, 128, 3, False),
    (384, 128, 384, 6, False)])
def test_matches_torch_xla_sweep(rng, monkeypatch, xla_device, m, k, n, g,
                                 transpose_rhs):
  _torch_xla_case(rng, monkeypatch, xla_device, m, k, n, g, transpose_rhs)


def test_drop_ins_match_float64_oracle_at_odd_sizes(rng):
  """Sizes torch_xla cannot run (odd, sums below M, negative): the drop-ins
  on CPU tensors against the oracle; ``num_actual_groups`` keeps the first
  groups; gmm is differentiable."""
  m, k, n, g = 31, 10, 7, 4
  lhs, rhs, dout = _inputs(rng, m, k, n, g)
  sizes = _sizes(rng, "clamped", m, g)
  want, dlhs, drhs = _oracle(lhs, rhs, sizes, dout)
  got = _run(custom_kernel.gmm, lhs, rhs, sizes, dout, "cpu")
  _assert_all_close(got, (want, dlhs, drhs))
  t = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
  gs = torch.tensor(sizes)
  tg = custom_kernel.tgmm(t(lhs).t(), t(dout), gs, (8, 128, 128), None, 3)
  assert tg.shape == (3, k, n)
  np.testing.assert_allclose(tg.double().numpy(), drhs[:3], **TOL)
  back = custom_kernel.gmm_backward(t(dout), t(lhs), t(rhs), gs, None)
  for got, w in zip(back, (dlhs, drhs)):
    np.testing.assert_allclose(got.double().numpy(), w, **TOL)
  out = custom_kernel.gmm(t(lhs), t(rhs).transpose(1, 2).contiguous(), gs,
                          [16, 128, 256], None, True)
  np.testing.assert_allclose(out.double().numpy(), want, **TOL)


_A, _W = torch.zeros(8, 4), torch.zeros(2, 4, 3)
_S = torch.tensor([3, 5], dtype=torch.int32)
DROP_IN_BAD = {
    "gmm_group_offset": (lambda: custom_kernel.gmm(
        _A, _W, _S, group_offset=torch.tensor(1, dtype=torch.int32)),
        NotImplementedError, "gmm: group_offset is not supported"),
    "tgmm_group_offset": (lambda: custom_kernel.tgmm(
        _A.t(), torch.zeros(8, 3), _S, group_offset=torch.tensor(0)),
        NotImplementedError, "tgmm: group_offset is not supported"),
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
        "num_actual_groups must be None or an int in \\[1, 2\\]"),
    "tgmm_rows": (lambda: custom_kernel.tgmm(_A.t(), torch.zeros(7, 3), _S),
                  ValueError, "tgmm: dout has 7 rows, lhs has 8"),
    "tgmm_lhs_rank": (lambda: custom_kernel.tgmm(_W, torch.zeros(8, 3), _S),
                      ValueError, "tgmm: lhs must be \\[k, m\\]"),
}


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
    _assert_all_close(got, _oracle(lhs, rhs, sizes, dout, transpose_rhs))
