"""Flash attention, forward and forward+backward, against cuDNN and torch SDPA.

    python -m bench.attention [--quick] [--cases D128] [--tag T] [--out DIR]

ours: ``pallas_kernels.flash_attention`` (backend=None: the GPU kernels on a
GPU). Peers in the same run: cuDNN (``jax.nn.dot_product_attention(
implementation="cudnn")``), torch SDPA with the flash and the cuDNN backend
forced; with ``--quick`` (CPU) XLA's attention and torch's math backend.
fwd+bwd is the VJP for q, k and v. TFLOP/s count 4·B·H·L²·D forward (causal:
half) and 3.5 times that forward+backward. ``err`` is ours against the first
JAX peer (output, or dq), relative to its largest magnitude. TPU rows: the
Mosaic TPU kernels' own FLOP and byte counts (``mosaic_tpu.cost``, blocks of
the TPU table) on each chip's roofline; no TPU is measured.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from bench import harness, roofline

CASES = [dict(batch=4, heads=16, seq=4096, head_dim=d, causal=c,
              dtype="bfloat16") for d in (128, 64, 256, 96, 80) for c in (False, True)]
QUICK = [dict(batch=1, heads=2, seq=128, head_dim=64, causal=c,
              dtype="float32") for c in (False, True)]
MODES = ("fwd", "fwd+bwd")


def label(case):
  return (f"B{case['batch']} H{case['heads']} L{case['seq']} "
          f"D{case['head_dim']}" + (" causal" if case["causal"] else ""))


def useful_flops(case, mode):
  b, h, l, d = case["batch"], case["heads"], case["seq"], case["head_dim"]
  flops = 4.0 * b * h * l * l * d * (0.5 if case["causal"] else 1.0)
  return flops * (3.5 if mode == "fwd+bwd" else 1.0)


def _with_vjp(fn, mode):
  if mode == "fwd":
    return fn
  return lambda q, k, v, do: jax.vjp(fn, q, k, v)[1](do)


def jax_impls(case, quick):
  """name -> (fn on [B, H, L, D] or [B, L, H, D] arrays, layout)."""
  dpa = functools.partial(jax.nn.dot_product_attention,
                          is_causal=case["causal"])
  peers = ("xla",) if quick else ("cudnn",)
  return {"ours": (functools.partial(pk.flash_attention,
                                     causal=case["causal"]), "bhld"),
          **{p: (functools.partial(dpa, implementation=p), "blhd")
             for p in peers}}


def torch_impls(case, quick, arrays):
  """name -> {mode: thunk} for torch SDPA; {} without torch."""
  torch = harness.torch_module()
  if torch is None:
    return {}
  from torch.nn.attention import SDPBackend, sdpa_kernel
  cuda = torch.cuda.is_available() and not quick
  backends = ({"torch_flash": SDPBackend.FLASH_ATTENTION,
               "torch_cudnn": SDPBackend.CUDNN_ATTENTION} if cuda
              else {"torch_math": SDPBackend.MATH})
  dtype = getattr(torch, case["dtype"])
  q, k, v, do = (torch.from_numpy(np.array(x, np.float32)).to(
      "cuda" if cuda else "cpu", dtype) for x in arrays)
  for x in (q, k, v):
    x.requires_grad_(True)
  sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention,
                           is_causal=case["causal"])

  def modes(backend):
    def fwd():
      with sdpa_kernel([backend]), torch.no_grad():
        return sdpa(q, k, v)

    def fwd_bwd():
      with sdpa_kernel([backend]):
        return torch.autograd.grad(sdpa(q, k, v), (q, k, v), do)
    return {"fwd": fwd, "fwd+bwd": fwd_bwd}
  return {name: modes(backend) for name, backend in backends.items()}


def run(case, timer):
  shape = (case["batch"], case["heads"], case["seq"], case["head_dim"])
  keys = jax.random.split(jax.random.key(0), 4)
  arrays = [jax.random.normal(key, shape, case["dtype"]) for key in keys]
  layouts = {"bhld": arrays, "blhd": [jnp.swapaxes(x, 1, 2) for x in arrays]}
  torch_peers = torch_impls(case, timer.quick, arrays)
  rows = []
  for mode in MODES:
    name, flops = f"{label(case)} {mode}", useful_flops(case, mode)
    outs, ours = {}, None
    for impl, (fn, layout) in jax_impls(case, timer.quick).items():
      args = layouts[layout][:3 if mode == "fwd" else 4]

      def timed(fn=fn, args=args, impl=impl, layout=layout):
        seconds, out = timer.jax(_with_vjp(fn, mode), *args)
        first = out if mode == "fwd" else out[0]  # the output, or dq
        outs[impl] = first if layout == "bhld" else jnp.swapaxes(first, 1, 2)
        return seconds
      row = harness.measure(rows, name, impl, timed, flops=flops)
      ours = ours or row
    for impl, thunks in torch_peers.items():
      harness.measure(rows, name, impl,
                      lambda t=thunks[mode]: timer.torch(t), flops=flops)
    peer = next((p for p in outs if p != "ours"), None)
    if "ours" in outs and peer:
      ours["err"] = harness.rel_error(outs["ours"], outs[peer])
  return rows


def tpu_rows(cases):
  """The Mosaic TPU kernels' work per chip, on the roofline."""
  try:
    from pallas_kernels.attention.mosaic_tpu import cost
  except ImportError:
    return []
  try:  # the TPU table's blocks; 512 x 512 where the table is not found
    from pallas_kernels.attention.block_sizes import table_block_sizes
  except ImportError:
    table_block_sizes = None
  rows = []
  for case in cases:
    b, h, l, d = case["batch"], case["heads"], case["seq"], case["head_dim"]
    itemsize = jnp.dtype(case["dtype"]).itemsize
    for chip in roofline.TPUS:
      blocks = (table_block_sizes(chip, d) if table_block_sizes else None)
      fwd = cost(b, h, l, l, d, itemsize, causal=case["causal"],
                 block_q=blocks.block_q if blocks else 512,
                 block_kv=blocks.block_kv if blocks else 512)
      bwd = cost(b, h, l, l, d, itemsize, causal=case["causal"],
                 block_q=blocks.block_q_bwd if blocks else 512,
                 block_kv=blocks.block_kv_bwd if blocks else 512,
                 backward=True)
      for mode, parts in (("fwd", [fwd]), ("fwd+bwd", [fwd, bwd])):
        for row in roofline.rows(
            f"{label(case)} {mode}", sum(p["flops"] for p in parts),
            sum(p["bytes_accessed"] for p in parts), chips=(chip,),
            useful_flops=useful_flops(case, mode)):
          vmem = max(p["vmem_bytes"] for p in parts)
          rows.append(dict(row, vmem_mib=vmem / 2**20,
                           fits_vmem=vmem <= roofline.SPECS[chip]["vmem"]))
  return rows


def main(argv=None):
  return harness.main("attention", CASES, QUICK, run, label=label,
                      tpu_rows=tpu_rows, argv=argv, doc=__doc__,
                      columns=["case", "impl", "ms", "tflops", "err",
                               "vs_cudnn", "vs_torch_flash", "vs_torch_cudnn",
                               "vs_xla", "vs_torch_math", "error"])


if __name__ == "__main__":
  main()
