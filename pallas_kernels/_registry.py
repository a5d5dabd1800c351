"""Every op of the package, declared once in ``FAMILIES``: the exports, the
references, the main job, the torch ops, the bench list and the docs' tables
read it. Standard library only (the command line is checked before any
environment exists).
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Op:
  """One public function.

  kind: "kernel" (a Pallas kernel beside a reference of the same name in the
  family's ``reference`` module), "helper" (a sharding or cache wrapper
  exported beside the kernels) or "layer" (``pallas_kernels.nn``).
  main_job: the main job has cases for it. torch: it is also
  ``torch_bridge.<name>`` and ``torch.ops.pallas_kernels.<name>``, whose
  schema types differ from the bridge's defaults by ``torch_types`` and
  whose outputs are ``torch_returns``.
  """
  name: str
  kind: str = "kernel"
  main_job: bool = True
  torch: bool = True
  torch_types: tuple[tuple[str, str], ...] = ()
  torch_returns: str = "Tensor"


@dataclasses.dataclass(frozen=True)
class Family:
  """A kernel family: the package that exports its ops, the title of its docs
  support table, its ops and benches (``bench.<name>``). Its modules
  (``reference``, ``cases``) are ``<home><module>``, home defaulting to
  ``<package>.``."""
  name: str
  package: str
  title: str
  ops: tuple[Op, ...]
  benches: tuple[str, ...] = ()
  home: str = ""

  def module(self, name: str) -> str:
    return (self.home or self.package + ".") + name


def _helper(name: str) -> Op:
  return Op(name, kind="helper", main_job=False, torch=False)


_BOX_OPS = ("iou", "giou", "diou", "ciou", "iou_loss", "giou_loss",
            "diou_loss", "ciou_loss", "pairwise_iou", "pairwise_giou",
            "pairwise_diou", "pairwise_ciou", "box_iou")

FAMILIES = (
    Family("attention", "pallas_kernels.attention", "flash_attention", (
        Op("flash_attention", torch_types=(("sliding_window", "int[1]"),)),
        _helper("shard_flash_attention"),
    ), benches=("attention", "attention_masks")),
    Family("decode", "pallas_kernels.decode", "decode_attention", (
        Op("decode_attention"),
    ), benches=("decode_attention",)),
    Family("int8", "pallas_kernels.int8", "int8_matmul", (
        Op("quantize_int8", torch_types=(("axis", "int?"),),
           torch_returns="(Tensor, Tensor)"),
        Op("int8_matmul"),
        _helper("shard_int8_matmul"),
        Op("int8_dense", kind="layer"),
    ), benches=("int8_matmul",), home="pallas_kernels.quant.int8_"),
    Family("quant", "pallas_kernels.quant", "quantized_matmul", (
        # Tensor[]: (q, scale) or (q, scale, zero).
        Op("quantize", torch_types=(("axis", "int?"),),
           torch_returns="Tensor[]"),
        Op("quantized_matmul"),
        Op("quantized_dense", kind="layer"),
    ), benches=("quantized_matmul",)),
    Family("iou", "pallas_kernels.boxes.iou", "IoU family",
           tuple(Op(name) for name in _BOX_OPS), benches=("giou",)),
    Family("nms", "pallas_kernels.boxes.nms", "NMS", (
        Op("nms", torch_returns="(Tensor, Tensor)"),
        Op("batched_nms", torch_returns="(Tensor, Tensor)"),
        Op("soft_nms", torch_returns="(Tensor, Tensor, Tensor)"),
        _helper("shard_batched_nms"),
    ), benches=("nms",)),
    Family("gmm", "pallas_kernels.gmm", "grouped_matmul", (
        Op("grouped_matmul"),
        _helper("shard_grouped_matmul"),
    ), benches=("grouped_matmul",)),
    Family("ragged", "pallas_kernels.ragged",
           "ragged_paged_attention, mla_ragged_paged_attention", (
        # Static float scales (JAX's), not decode_attention's tensors.
        Op("ragged_paged_attention",
           torch_types=(("k_scale", "float?"), ("v_scale", "float?"))),
        Op("mla_ragged_paged_attention",
           torch_types=(("k_scale", "float?"), ("v_scale", "float?"))),
        Op("write_kv_pages", main_job=False, torch=False),
    ), benches=("ragged_paged_attention",)),
)

FAMILY_NAMES = tuple(f.name for f in FAMILIES)
OPS = tuple(op for f in FAMILIES for op in f.ops)
# Benches that are not one family's.
SHARED_BENCHES = ("torch_bridge",)


def family_of(op_name: str) -> Family:
  for family in FAMILIES:
    if any(op.name == op_name for op in family.ops):
      return family
  raise KeyError(op_name)


def module_of(op: Op) -> str:
  """The module whose attribute ``op.name`` is the public function."""
  return ("pallas_kernels.nn" if op.kind == "layer"
          else family_of(op.name).package)


def exports() -> dict[str, str]:
  """``pallas_kernels.<name>`` -> the module that defines it."""
  return {op.name: module_of(op) for op in OPS if op.kind != "layer"}


def references() -> dict[str, str]:
  """``pallas_kernels.reference.<name>`` -> the module that defines it."""
  return {op.name: family_of(op.name).module("reference") for op in OPS
          if op.kind == "kernel"}


def main_job_ops() -> tuple[str, ...]:
  return tuple(op.name for op in OPS if op.main_job)


def torch_ops() -> tuple[Op, ...]:
  return tuple(op for op in OPS if op.torch)


def kernel_ops() -> tuple[str, ...]:
  return tuple(op.name for op in OPS if op.kind == "kernel")


def benches() -> tuple[str, ...]:
  return tuple(b for f in FAMILIES for b in f.benches) + SHARED_BENCHES
