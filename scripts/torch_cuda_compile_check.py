"""The public ``torch.ops.pallas_kernels`` ops under ``torch.compile`` with
inductor on CUDA tensors: one full graph each (``fullgraph=True`` raises on
a graph break), values and gradients equal to the eager torch functions.

    python scripts/torch_cuda_compile_check.py   # on a machine with CUDA

Needs torch, jax with CUDA and this repository on the path; prints one line
per op and exits 1 if any differs.
"""
from __future__ import annotations

import sys

import torch

import torch_bridge as tb
import torch_bridge.ops  # noqa: F401  (registers the public ops)

OPS = torch.ops.pallas_kernels


def _boxes(n, gen):
  xy = torch.rand(n, 2, generator=gen) * 50
  wh = torch.rand(n, 2, generator=gen) * 20 + 1
  return torch.cat([xy, xy + wh], 1).cuda()


def cases(gen):
  """name -> (fn of tensors, eager fn, tensors, which need gradients)."""
  b1, b2 = _boxes(300, gen), _boxes(300, gen)
  q, k, v = (torch.randn(2, 4, 200, 64, generator=gen).cuda().bfloat16()
             for _ in range(3))
  x = torch.randn(37, 256, generator=gen).cuda().bfloat16()
  w = torch.randint(-127, 128, (256, 96), generator=gen,
                    dtype=torch.int8).cuda()
  w_scale = (torch.rand(96, generator=gen) * 0.01).cuda()
  qd = torch.randn(3, 8, 1, 96, generator=gen).cuda().bfloat16()
  cache = torch.randn(3, 2, 333, 96, generator=gen).cuda().bfloat16()
  lengths = torch.tensor([333, 17, 200], dtype=torch.int32).cuda()
  scores = torch.rand(300, generator=gen).cuda()
  return {
      "giou_loss": (
          lambda a, b: OPS.giou_loss(a, b, reduction="mean") * 2,
          lambda a, b: tb.giou_loss(a, b, reduction="mean") * 2,
          (b1, b2), (True, False)),
      "flash_attention": (
          lambda q_, k_, v_: OPS.flash_attention(q_, k_, v_, causal=True),
          lambda q_, k_, v_: tb.flash_attention(q_, k_, v_, causal=True),
          (q, k, v), (True, True, True)),
      "quantized_matmul": (
          lambda x_, w_, s_: OPS.quantized_matmul(x_, w_, w_scale=s_,
                                                  weight_only=True) + 1,
          lambda x_, w_, s_: tb.quantized_matmul(x_, w_, w_scale=s_,
                                                 weight_only=True) + 1,
          (x, w, w_scale), (True, False, False)),
      "decode_attention": (
          lambda q_, k_, v_, n_: OPS.decode_attention(q_, k_, v_, n_),
          lambda q_, k_, v_, n_: tb.decode_attention(q_, k_, v_, n_),
          (qd, cache, cache, lengths), (False,) * 4),
      "nms": (
          lambda b, s: OPS.nms(b, s, iou_threshold=0.5,
                               max_output_size=100)[0],
          lambda b, s: tb.nms(b, s, iou_threshold=0.5,
                              max_output_size=100)[0],
          (b1, scores), (False, False)),
  }


def _run(fn, tensors, grads):
  tensors = [t.detach().clone().requires_grad_(g)
             for t, g in zip(tensors, grads)]
  out = fn(*tensors)
  results = [out.detach().float()]
  if any(grads):
    out.float().sum().backward()
    results += [t.grad.float() for t, g in zip(tensors, grads) if g]
  return results


def main() -> int:
  if not torch.cuda.is_available():
    print("no CUDA device")
    return 1
  gen = torch.Generator().manual_seed(0)
  failed = []
  for name, (fn, eager, tensors, grads) in cases(gen).items():
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="inductor")
    try:
      got = _run(compiled, tensors, grads)
    except Exception as e:  # noqa: BLE001  (reported per op)
      print(f"{name}: FAILED to compile or run: {type(e).__name__}: "
            f"{str(e)[:300]}")
      failed.append(name)
      continue
    want = _run(eager, tensors, grads)
    diffs = [float((g - w).abs().max() / w.abs().max().clamp_min(1e-30))
             for g, w in zip(got, want)]
    ok = all(d <= 1e-6 for d in diffs)
    print(f"{name}: {'ok' if ok else 'DIFFERS'}, one graph, outputs and "
          f"gradients: max relative difference {max(diffs):.2e}")
    if not ok:
      failed.append(name)
  print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}: "
        f"{len(failed)} of {len(cases(gen))} failed {failed}")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
