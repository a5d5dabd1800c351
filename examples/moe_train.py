"""Train a toy mixture-of-experts classifier with ``pk.nn.moe_feed_forward``.

Tokens are noisy points around ``--classes`` random centres; the model is
embed -> x + MoE(rms_norm(x)) -> rms_norm -> logits, trained with plain SGD
(``jax.grad``; no optimizer library) on cross-entropy plus 0.01 times the
load-balancing loss. Each step's batch is freshly drawn, of
``--batch`` x ``--seq`` tokens (odd by default). The script prints the loss
and the tokens each expert received per step and checks that the loss went
down.

    python examples/moe_train.py [--steps 30] [--backend reference]

``--backend``: "auto" (the default: the Mosaic kernel on a TPU, the TPU
kernel in the Pallas interpreter on a CPU), "reference" (XLA's ragged_dot),
"interpret", "mosaic_tpu", "triton", ... (``pk.BACKENDS``).
"""
from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
import jax.numpy as jnp

import pallas_kernels as pk

AUX_WEIGHT = 0.01


def _parse(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=30)
  p.add_argument("--batch", type=int, default=3)
  p.add_argument("--seq", type=int, default=25)
  p.add_argument("--d-in", type=int, default=16)
  p.add_argument("--d-model", type=int, default=32)
  p.add_argument("--d-ff", type=int, default=64)
  p.add_argument("--experts", type=int, default=6)
  p.add_argument("--top-k", type=int, default=2)
  p.add_argument("--classes", type=int, default=5)
  p.add_argument("--lr", type=float, default=0.5)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--backend", default="auto",
                 choices=("auto",) + tuple(pk.BACKENDS))
  return p.parse_args(argv)


def rms_norm(x):
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def init(key, args):
  k_embed, k_moe, k_head = jax.random.split(key, 3)
  return {
      "embed": jax.random.normal(k_embed, (args.d_in, args.d_model))
               / args.d_in ** 0.5,
      "moe": pk.nn.init_moe_feed_forward(k_moe, args.d_model, args.d_ff,
                                         args.experts),
      "head": jax.random.normal(k_head, (args.d_model, args.classes))
              / args.d_model ** 0.5,
  }


def model(params, x, *, top_k, backend):
  """x [batch, seq, d_in] -> (logits [batch, seq, classes], aux loss)."""
  h = x @ params["embed"]
  moe, aux = pk.nn.moe_feed_forward(rms_norm(h), **params["moe"],
                                    top_k=top_k, return_aux_loss=True,
                                    backend=backend)
  return rms_norm(h + moe) @ params["head"], aux


def batch(key, centres, args):
  k_label, k_noise = jax.random.split(key)
  labels = jax.random.randint(k_label, (args.batch, args.seq), 0,
                              args.classes)
  noise = jax.random.normal(k_noise, labels.shape + (args.d_in,))
  return centres[labels] + 0.7 * noise, labels


def main(argv=None) -> dict:
  args = _parse(argv)
  backend = None if args.backend == "auto" else args.backend
  key = jax.random.key(args.seed)
  k_params, k_centres, k_data = jax.random.split(key, 3)
  params = init(k_params, args)
  centres = jax.random.normal(k_centres, (args.classes, args.d_in))

  def loss_fn(params, x, labels):
    logits, aux = model(params, x, top_k=args.top_k, backend=backend)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None],
                               axis=-1)
    return jnp.mean(nll) + AUX_WEIGHT * aux, aux

  @functools.partial(jax.jit, donate_argnums=0)
  def step(params, x, labels):
    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        params, x, labels)
    params = jax.tree.map(lambda p, g: p - args.lr * g, params, grads)
    return params, loss, aux

  @jax.jit
  def expert_load(params, x):
    """Tokens per expert (what grouped_matmul's group_sizes holds)."""
    h = rms_norm(x @ params["embed"])
    _, chosen = jax.lax.top_k(h @ params["moe"]["w_router"], args.top_k)
    return jnp.bincount(chosen.reshape(-1), length=args.experts)

  losses = []
  start = time.perf_counter()
  for i, k in enumerate(jax.random.split(k_data, args.steps)):
    x, labels = batch(k, centres, args)
    load = expert_load(params, x)
    params, loss, aux = step(params, x, labels)
    losses.append(float(loss))
    print(f"step {i:3d}  loss {losses[-1]:.4f}  aux {float(aux):.3f}  "
          f"tokens per expert {load.tolist()}")
  seconds = time.perf_counter() - start
  head, tail = min(3, len(losses)), min(3, len(losses))
  first = sum(losses[:head]) / head
  last = sum(losses[-tail:]) / tail
  ok = last < first
  print(f"{args.steps} steps in {seconds:.1f} s (backend={args.backend}): "
        f"mean loss of the first 3 steps {first:.4f}, of the last 3 "
        f"{last:.4f}: {'decreased' if ok else 'DID NOT DECREASE'}")
  return {"losses": losses, "ok": ok, "seconds": seconds}


if __name__ == "__main__":
  sys.exit(0 if main()["ok"] else 1)
