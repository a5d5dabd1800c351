"""pallas_kernels.nn.moe_feed_forward against a float64 numpy oracle written
here: each token's top-k experts in a loop, each a dense SwiGLU FFN, weighted
and summed; its gradients by hand (backpropagation through that loop, the
softmax and the auxiliary loss).

Routing is piecewise constant, so inputs are drawn with every token's k-th
and (k+1)-th router logits at least ``MARGIN`` apart: float32 rounding
cannot then change which experts a token picks, and the oracle's choice is
the layer's.

Tolerances, of the largest |value| of each expected array: float32 inputs
1e-5 (float32 sums over D and F, then over tokens for the weight
gradients); bfloat16 inputs 3e-2 (the gate/up outputs, the hidden
activation and the gradients are rounded to 8 bits of mantissa).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import nn

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 3e-2}
MARGIN = 1e-2
NAMES = ("w_router", "w_gate", "w_up", "w_down")
AUX_WEIGHT = 0.3  # the loss the gradients are of: sum(out * g) + 0.3 * aux


def _sigmoid(h):
  return 1 / (1 + np.exp(-h))


def _oracle(x, w_router, w_gate, w_up, w_down, top_k, renormalize, g):
  """(out, aux, grads) in float64; grads of sum(out * g) + AUX_WEIGHT * aux
  in x and the weights, in argument order."""
  x, wr, wg, wu, wd, g = (np.asarray(a, np.float64) for a in (
      x, w_router, w_gate, w_up, w_down, g))
  shape, d = x.shape, x.shape[-1]
  x, g = x.reshape(-1, d), g.reshape(-1, d)
  tokens, e = x.shape[0], wr.shape[1]
  z = x @ wr
  p = np.exp(z - z.max(1, keepdims=True))
  p /= p.sum(1, keepdims=True)
  chosen = np.argsort(-p, axis=1, kind="stable")[:, :top_k]
  counts = np.bincount(chosen.reshape(-1), minlength=e)
  fraction = counts / max(tokens * top_k, 1)
  aux = e * np.sum(fraction * p.mean(0)) if tokens else 0.0

  out = np.zeros_like(x)
  dx, dwr = np.zeros_like(x), np.zeros_like(wr)
  dwg, dwu, dwd = np.zeros_like(wg), np.zeros_like(wu), np.zeros_like(wd)
  for t in range(tokens):
    s = chosen[t]
    total = p[t, s].sum()
    w = p[t, s] / total if renormalize else p[t, s]
    dw = np.zeros(top_k)
    for j, ex in enumerate(s):
      h, u = x[t] @ wg[ex], x[t] @ wu[ex]
      sig = _sigmoid(h)
      a = h * sig * u
      y = a @ wd[ex]
      out[t] += w[j] * y
      # Backward through this expert's FFN, for dL/dout_t = g_t.
      dw[j] = g[t] @ y
      dy = w[j] * g[t]
      dwd[ex] += np.outer(a, dy)
      da = wd[ex] @ dy
      du = da * h * sig
      dh = da * u * sig * (1 + h * (1 - sig))
      dwg[ex] += np.outer(x[t], dh)
      dwu[ex] += np.outer(x[t], du)
      dx[t] += wg[ex] @ dh + wu[ex] @ du
    # Routing weights -> probabilities (the aux loss reaches every p_e).
    dp = AUX_WEIGHT * e * fraction / tokens
    if renormalize:
      dp[s] += (dw - np.dot(w, dw)) / total
    else:
      dp[s] += dw
    dz = p[t] * (dp - np.dot(p[t], dp))
    dwr += np.outer(x[t], dz)
    dx[t] += wr @ dz
  return out.reshape(shape), aux, (dx.reshape(shape), dwr, dwg, dwu, dwd)


def _inputs(rng, batch, d, f, e, top_k, dtype, dead_expert=None):
  """x [*batch, D] and the weights, every token's routing MARGIN-decided.
  ``dead_expert``: feature 0 of x is 1 and that expert's router weight on it
  -30, so no token picks it."""
  wr = rng.standard_normal((d, e)) / np.sqrt(d)
  if dead_expert is not None:
    wr[0, dead_expert] = -30.0
  wr = np.asarray(jnp.asarray(wr, dtype), np.float64)
  tokens = int(np.prod(batch))
  x = np.zeros((tokens, d))
  for t in range(tokens):  # redraw a token until its choice is clear-cut
    while True:
      row = np.asarray(jnp.asarray(rng.standard_normal(d), dtype), np.float64)
      if dead_expert is not None:
        row[0] = 1.0
      z = np.sort(row @ wr)[::-1]
      if top_k == e or z[top_k - 1] - z[top_k] > MARGIN:
        x[t] = row
        break
  weights = {
      "w_router": wr,
      "w_gate": rng.standard_normal((e, d, f)) / np.sqrt(d),
      "w_up": rng.standard_normal((e, d, f)) / np.sqrt(d),
      "w_down": rng.standard_normal((e, f, d)) / np.sqrt(f)}
  weights = {k: jnp.asarray(v, dtype) for k, v in weights.items()}
  return jnp.asarray(x.reshape(batch + (d,)), dtype), weights


def _check(got, want, tol, what):
  got = np.asarray(got, np.float64)
  assert got.shape == want.shape, what
  scale = max(np.abs(want).max(), 1e-30)
  err = np.abs(got - want).max() / scale
  assert err <= tol, f"{what}: max error {err:.2e} of max |value| > {tol}"


def _run_case(rng, backend, *, batch=(3, 5), d=12, f=20, e=5, top_k=2,
              renormalize=True, dtype=jnp.float32, dead_expert=None):
  x, w = _inputs(rng, batch, d, f, e, top_k, dtype, dead_expert)
  g = jnp.asarray(rng.standard_normal(x.shape), dtype)

  def loss(x_, w_):
    out, aux = nn.moe_feed_forward(x_, **w_, top_k=top_k,
                                   renormalize=renormalize,
                                   return_aux_loss=True, backend=backend)
    return jnp.sum(out.astype(jnp.float32) * g) + AUX_WEIGHT * aux, (out, aux)

  (_, (out, aux)), (dx, dw) = jax.jit(jax.value_and_grad(
      loss, (0, 1), has_aux=True))(x, w)
  want_out, want_aux, want_grads = _oracle(
      x, *(w[k] for k in NAMES), top_k, renormalize, g)
  tol = TOL[dtype]
  assert out.dtype == dtype and out.shape == x.shape
  _check(out, want_out, tol, "out")
  assert float(aux) == pytest.approx(want_aux, rel=1e-5)
  for name, got, want in zip(("x",) + NAMES, (dx,) + tuple(
      dw[k] for k in NAMES), want_grads):
    assert got.dtype == dtype, name
    _check(got, want, tol, f"d {name}")
  if dead_expert is not None:
    for name in ("w_gate", "w_up", "w_down"):
      assert not np.any(np.asarray(dw[name][dead_expert])), name
  return out


@pytest.mark.parametrize("backend", ["interpret", "reference"])
def test_matches_oracle_with_an_expert_left_idle(rng, backend):
  _run_case(rng, backend, dead_expert=int(rng.integers(5)))


@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_weight_modes_match_oracle(rng, renormalize):
  _run_case(rng, "reference", batch=(7,), renormalize=renormalize, top_k=3)


def test_bfloat16_matches_oracle(rng):
  _run_case(rng, "reference", batch=(9,), dtype=jnp.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["interpret", "reference"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("top_k,e,renormalize", [
    (1, 4, False), (1, 4, True), (2, 7, False), (4, 4, True), (3, 8, True)])
def test_matches_oracle_sweep(rng, backend, dtype, top_k, e, renormalize):
  _run_case(rng, backend, batch=(2, 3, 5), d=16, f=24, e=e, top_k=top_k,
            renormalize=renormalize, dtype=dtype,
            dead_expert=e - 1 if top_k < e else None)


def test_top1_renormalized_weights_are_one(rng):
  """top_k=1 with renormalize: out is the chosen expert's FFN (weight 1),
  so the router learns from the auxiliary loss only."""
  x, w = _inputs(rng, (5,), 8, 16, 4, 1, jnp.float32)
  grad = jax.grad(lambda wr: jnp.sum(nn.moe_feed_forward(
      x, wr, w["w_gate"], w["w_up"], w["w_down"], top_k=1,
      backend="reference")))(w["w_router"])
  assert not np.any(np.asarray(grad))


def test_no_tokens():
  w = nn.init_moe_feed_forward(jax.random.key(0), 8, 16, 4)
  out, aux = nn.moe_feed_forward(jnp.zeros((0, 3, 8)), **w, top_k=np.int32(2),
                                 return_aux_loss=True, backend="reference")
  assert out.shape == (0, 3, 8) and float(aux) == 0.0


def test_init_shapes_and_dtype():
  w = nn.init_moe_feed_forward(jax.random.key(1), 6, 10, 3,
                               dtype=jnp.bfloat16)
  assert {k: v.shape for k, v in w.items()} == {
      "w_router": (6, 3), "w_gate": (3, 6, 10), "w_up": (3, 6, 10),
      "w_down": (3, 10, 6)}
  assert all(v.dtype == jnp.bfloat16 for v in w.values())


def _bad(**changes):
  args = dict(x=jnp.zeros((5, 8)), w_router=jnp.zeros((8, 4)),
              w_gate=jnp.zeros((4, 8, 6)), w_up=jnp.zeros((4, 8, 6)),
              w_down=jnp.zeros((4, 6, 8)), top_k=2)
  args.update(changes)
  x = args.pop("x")
  return lambda: nn.moe_feed_forward(x, **args)


@pytest.mark.parametrize("call,error,match", [
    (_bad(top_k=5), ValueError, r"top_k must be an int in \[1, E\] with E = 4"),
    (_bad(top_k=0), ValueError, "top_k must be"),
    (_bad(top_k=2.0), ValueError, "top_k must be an int"),
    (_bad(top_k=True), ValueError, "top_k must be an int"),
    (_bad(top_k=np.int64(7)), ValueError, "top_k must be an int"),
    (_bad(x=jnp.zeros((5, 7))), ValueError,
     "w_router must be .D, E. with D = 7"),
    (_bad(x=jnp.zeros((5, 8), jnp.int32)), TypeError, "x must be"),
    (_bad(w_router=jnp.zeros((8,))), ValueError, "w_router must be"),
    (_bad(w_router=jnp.zeros((8, 0))), ValueError, "at least one expert"),
    (_bad(w_gate=jnp.zeros((3, 8, 6))), ValueError, "w_gate must be .E, D, F. "
     "with E = 4"),
    (_bad(w_up=jnp.zeros((4, 8, 5))), ValueError, "w_up must have w_gate's"),
    (_bad(w_down=jnp.zeros((4, 8, 6))), ValueError,
     r"w_down must be \[E, F, D\] = \(4, 6, 8\)"),
    (_bad(w_down=np.zeros((4, 6, 8), np.float64).tolist()), TypeError,
     "w_down must be"),
    (_bad(renormalize=1), TypeError, "renormalize must be a bool"),
    (_bad(return_aux_loss="yes"), TypeError, "return_aux_loss must be a bool"),
    (_bad(backend="cuda"), ValueError, "moe_feed_forward: backend='cuda'"),
])
def test_bad_arguments(call, error, match):
  with pytest.raises(error, match=match):
    call()


def test_training_example_loss_decreases(capsys):
  """examples/moe_train.py: a few SGD steps of a toy MoE classifier."""
  import importlib.util
  import pathlib
  path = pathlib.Path(__file__).resolve().parents[1] / "examples" / (
      "moe_train.py")
  spec = importlib.util.spec_from_file_location("moe_train", path)
  example = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(example)
  summary = example.main(["--steps", "8", "--backend", "reference"])
  assert summary["ok"] and summary["losses"][-1] < summary["losses"][0]
  assert "decreased" in capsys.readouterr().out
