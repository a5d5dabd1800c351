"""pallas_kernels as PyTorch ops: torch_xla graphs, CPU and CUDA tensors.

    from torch_bridge import flash_attention, Int8Linear, GIoULoss

Ops (``torch_bridge.ops``), each with the arguments of the
``pallas_kernels`` op of the same name, and each also a public torch
operator ``torch.ops.pallas_kernels.<name>`` with a typed schema (tensors and
static parameters as typed arguments; ``torch_bridge.schemas``, registered
when ``torch_bridge.ops`` is imported):

  attention     flash_attention, decode_attention, ragged_paged_attention,
                mla_ragged_paged_attention (serving: ragged prefill +
                decode over a paged KV cache, or MLA's latent one)
  int8          quantize_int8, int8_matmul, int8_dense
  quantized     quantize, quantized_matmul, quantized_dense (int8, float8;
                float8 crosses DLPack as bytes)
  MoE           grouped_matmul (jax.lax.ragged_dot's semantics; gradients
                in lhs and rhs)
  boxes         iou, giou, diou, ciou (matching boxes); pairwise_iou,
                pairwise_giou, pairwise_diou, pairwise_ciou, box_iou (every
                pair); iou_loss, giou_loss, diou_loss, ciou_loss
  NMS           nms, batched_nms, soft_nms

Modules (``torch_bridge.modules``): Attention, Int8Linear, QuantizedLinear
(frozen int8/float8 weight + LoRA), IoULoss, GIoULoss, DIoULoss, CIoULoss.

How it works (``torch_bridge._core``): every op is a JAX function wrapped
once, generically, as internal ``torch.library`` custom ops
(``torch.ops.pallas_kernels_impl.*``, static parameters encoded in a string)
with a fake (meta) implementation and an autograd formula that runs the JAX
VJP; the public typed op calls the function, which runs them.

  XLA tensors   the JAX op is lowered for torch_xla's platform and spliced
                into the lazy graph (no host transfer, no extra compile per
                step); on TPU that is the Mosaic kernel, on PJRT_DEVICE=CPU
                the generic Pallas interpreter. Under SPMD pass
                ``partition_spec``/``mesh`` (batch, heads) to run the kernel
                per shard (``_xla.py``).
  CPU / CUDA    DLPack to a jitted JAX call and back (``_convert.py``);
                plain tensors outside torch.compile and tracing skip the
                custom-op dispatch (``_eager.py``: same jitted functions,
                same results).
  meta / fake   shapes from ``jax.eval_shape``.

SPMD / FSDP:
  * FSDPv2 (``SpmdFullyShardedDataParallel``): pass ``partition_spec`` to
    the ops, or ``batch_axis``/``head_axis`` to the modules; the kernel runs
    per shard in manual-sharding mode. Every op and module takes them
    (``ops`` says which dimensions each can split; any other raises
    ValueError). A batch the mesh axis does not divide is zero-padded inside
    the op and the outputs are cut back, so shapes are always the unsharded
    ones; reduced losses reduce the per-box losses in torch. Without a spec
    under SPMD an op runs unsharded and warns once (``UnshardedWarning``).
    Gradients of inputs replicated over an
    axis the others are split on (a weight, a broadcast bias) are partial
    sums, reduced by the SPMD partitioner. ``examples/train_vit_fsdp.py``
    trains a ViT this way on CPU XLA devices (tests run it on 4 and 8,
    with a batch the devices do not divide).
  * FSDPv1 (``XlaFullyShardedDataParallel``): nothing to shard manually
    (one replica per device); ``train_vit_fsdp.py --fsdp v1``. Unverified:
    it cannot run on the CPU PJRT client here (see that script).

Drop-in for torch_xla users: ``torch_bridge.custom_kernel.flash_attention``,
``gmm``, ``tgmm``, ``gmm_backward`` and ``ragged_paged_attention`` have
``torch_xla.experimental.custom_kernel``'s signatures and semantics
(docs/torch.md: "Migrating from torch_xla's flash_attention" and "... gmm,
tgmm, gmm_backward").

Autograd saves the JAX op's residuals (flash attention: output and
log-sum-exp), so the backward runs only the backward kernels.

Known limits:
  * Per-call overhead on CPU/CUDA tensors: ``python -m bench.torch_bridge``
    reports it against the jitted JAX op called directly, for the eager
    fast path and for the custom ops (``bench/results/torch_bridge-*``).
  * ``quantize_int8`` and ``quantize`` have no gradient;
    ``int8_matmul`` and ``quantized_matmul`` have the JAX ops' (float x of
    weight-only calls, bias), ``quantized_dense`` in x, bias and the LoRA
    pair, ``decode_attention`` in q and sinks; int4 weights
    stay JAX-only (torch has no 4-bit dtype DLPack carries); ``nms``,
    ``batched_nms`` and ``soft_nms`` return indices (no gradient, also
    none for soft_nms' decayed scores).
  * Import torch_xla and touch its device (``torch_xla.device()``) before the
    first CPU backward of the process when you will also train on XLA
    devices: torch's autograd engine sizes its device queues once
    (otherwise an internal assert in engine.cpp fires).
  * ``torch.compile``: static shapes only (the fake implementation needs
    concrete shapes); backend "openxla" for XLA tensors.
  * The TPU-semantics interpreter (``force_interpret("tpu")``) cannot run
    inside a torch_xla graph; XLA tensors use the generic interpreter.
"""
from __future__ import annotations

import importlib

from pallas_kernels import _registry

_OPS = tuple(op.name for op in _registry.torch_ops()) + ("UnshardedWarning",)
_MODULES = ("Attention", "Int8Linear", "QuantizedLinear", "IoULoss",
            "GIoULoss", "DIoULoss", "CIoULoss")
_EXPORTS = {**{name: "torch_bridge.ops" for name in _OPS},
            **{name: "torch_bridge.modules" for name in _MODULES}}

__all__ = sorted(_EXPORTS) + ["ops", "modules", "custom_kernel"]


def __getattr__(name):
  if name in _EXPORTS:
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
  elif name in ("ops", "modules", "custom_kernel"):
    value = importlib.import_module(f"torch_bridge.{name}")
  else:
    raise AttributeError(f"module 'torch_bridge' has no attribute {name!r}")
  globals()[name] = value
  return value


def __dir__():
  return __all__
