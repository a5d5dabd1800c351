"""Block-sparse masks and sinks: what they cost against dense attention.

    python -m bench.attention_masks [--quick] [--cases chunked] [--out DIR]

Each case times ``pallas_kernels.flash_attention`` with a static mask
("ours") and, in the same run, the same call without it ("dense", no mask)
and, for causal-like masks, with ``causal=True`` ("causal"). ``vs_dense`` is
dense time / masked time: a mask that empties most blocks should approach
1 / ``kept`` (the fraction of non-empty 128 x 64 blocks, printed per case).
The sinks case compares causal attention with and without sinks. Timing is
in-program (``harness.Timer``), forward and forward+backward (VJP of q, k,
v).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from bench import harness
from pallas_kernels.attention import masks

SHAPE = dict(batch=1, heads=16, seq=8192, head_dim=128, dtype="bfloat16")


def _documents(seq, lengths):
  """Block-diagonal causal mask of packed documents (a Dense mask)."""
  ids = np.repeat(np.arange(len(lengths)), lengths)[:seq]
  same = ids[:, None] == ids[None, :]
  return masks.Dense(same & np.tri(seq, dtype=bool))


def _cases(shape, quick):
  seq = shape["seq"]
  docs = [seq // 8, seq // 4, seq // 8, seq // 2]
  kinds = {
      "chunked_causal": masks.ChunkedCausal(seq // 8),
      "prefix_lm": masks.PrefixLM(seq // 4),
      "local_1k": masks.Local(seq // 8, 0),
      "documents": _documents(seq, docs),
      "sinks": None,
  }
  return [dict(shape, mask=name, make=make, quick=quick)
          for name, make in kinds.items()]


CASES = _cases(SHAPE, quick=False)
QUICK = [c for c in _cases(dict(batch=1, heads=2, seq=256, head_dim=64,
                                dtype="float32"), quick=True)
         if c["mask"] in ("chunked_causal", "sinks")]
MODES = ("fwd", "fwd+bwd")


def label(case):
  return (f"{case['mask']} B{case['batch']} H{case['heads']} "
          f"L{case['seq']} D{case['head_dim']}")


def kept_fraction(mask, seq, block_q=128, block_kv=64):
  classes = masks.block_classes(mask, seq, seq, min(block_q, seq),
                                min(block_kv, seq))
  return float(np.mean(classes > 0))


def run(case, timer):
  shape = (case["batch"], case["heads"], case["seq"], case["head_dim"])
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, do = (jax.random.normal(key, shape, case["dtype"]) for key in keys)
  sinks = jnp.linspace(-1.0, 1.0, case["heads"], dtype=jnp.float32)
  mask = case["make"]
  if mask is None:   # sinks: causal with and without them
    impls = {"ours": functools.partial(pk.flash_attention, causal=True,
                                       sinks=sinks),
             "no_sinks": functools.partial(pk.flash_attention, causal=True)}
    kept = 0.5
  else:
    impls = {"ours": functools.partial(pk.flash_attention, mask=mask),
             "dense": pk.flash_attention,
             "causal": functools.partial(pk.flash_attention, causal=True)}
    kept = kept_fraction(mask, case["seq"])
  rows = []
  for mode in MODES:
    name = f"{label(case)} {mode}"
    for impl, fn in impls.items():
      op = fn if mode == "fwd" else (
          lambda q, k, v, do, fn=fn: jax.vjp(fn, q, k, v)[1](do))
      args = (q, k, v) if mode == "fwd" else (q, k, v, do)
      harness.measure(rows, name, impl,
                      lambda op=op, args=args: timer.jax(op, *args)[0],
                      kept=round(kept, 3))
  return rows


def main(argv=None):
  return harness.main("attention_masks", CASES, QUICK, run, label=label,
                      argv=argv, doc=__doc__,
                      columns=["case", "impl", "ms", "kept", "vs_dense",
                               "vs_causal", "vs_no_sinks", "error"])


if __name__ == "__main__":
  main()
