"""Pallas kernels for TPU (Mosaic) and GPU, each beside a pure-JAX reference.

Public ops (each takes ``backend=None | "mosaic_tpu" | "gpu" | "interpret" |
"reference"``; see ``pallas_kernels._backend`` for how None is resolved):

  attention:   flash_attention, shard_flash_attention; decode_attention
  int8 matmul: quantize_int8, int8_matmul, shard_int8_matmul, nn.int8_dense
  quantized:   quantize, quantized_matmul (int8, int4, fp8), nn.quantized_dense
  experts:     grouped_matmul, nn.moe_feed_forward
  serving:     ragged_paged_attention, mla_ragged_paged_attention,
               write_kv_pages
  boxes:       giou, pairwise_giou, giou_loss, box_iou, ... ; nms, batched_nms,
               shard_batched_nms

``pallas_kernels.reference`` holds the plain-JAX versions with identical
semantics. ``force_interpret()`` runs everything in Pallas interpret mode.
Importing the package on a machine with no TPU or GPU attached selects JAX's
CPU platform unless ``JAX_PLATFORMS`` is set (libtpu's TPU probe is noisy).
"""
from __future__ import annotations

import importlib

from pallas_kernels import _quiet, _registry

# On a host with libtpu installed but no accelerator, JAX would probe for a TPU
# and libtpu would print start-up errors: select the CPU (AOT TPU compiles
# still work). A platform the user chose is kept.
_quiet.select_cpu_when_no_accelerator()

from pallas_kernels._backend import BACKENDS, force_interpret  # noqa: E402,F401

__version__ = "0.1.0"

# Public name -> module that defines it (the op registry). Families load on
# first use, so ``import pallas_kernels`` stays cheap and one family never
# breaks another.
_EXPORTS = _registry.exports()
_SUBMODULES = ("reference", "nn", "tpu_aot", "attention", "decode", "int8",
               "quant", "boxes", "gmm", "ragged")

__all__ = sorted(_EXPORTS) + ["BACKENDS", "force_interpret"] + list(_SUBMODULES)


def __getattr__(name):
  if name in _EXPORTS:
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
  elif name in _SUBMODULES:
    value = importlib.import_module(f"pallas_kernels.{name}")
  else:
    raise AttributeError(f"module 'pallas_kernels' has no attribute {name!r}")
  globals()[name] = value
  return value


def __dir__():
  return __all__
