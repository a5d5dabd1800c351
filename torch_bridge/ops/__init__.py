"""The pallas_kernels ops as torch functions (autograd, torch.library, SPMD).

Each function takes and returns torch tensors, with the argument names and
semantics of the ``pallas_kernels`` op of the same name (see there), plus:

  partition_spec, mesh  under torch_xla SPMD: the kernel runs on each
      device's shard in manual sharding mode. ``partition_spec`` has one
      entry (a mesh axis name, a tuple of them, or None) per dimension of
      the op's main operand; the op's docstring says which dimensions may
      be split (those whose rows the op treats independently: batch, heads,
      rows, boxes, images). Splitting any other dimension, or naming an axis
      the mesh lacks, raises ValueError. A split dimension the mesh does not
      divide (an odd batch) is zero-padded up to a multiple inside the op
      and the results are cut back: the outputs always have the unsharded
      shapes. ``mesh`` defaults to the global mesh. The spec is checked
      everywhere but only used for XLA tensors under SPMD; there, calling an
      op without one runs it unsharded and warns once per op
      (``UnshardedWarning``; an all-None spec replicates it on purpose).

Where the tensors live picks how the op runs (``torch_bridge._core``): XLA
tensors embed the JAX op into the torch_xla graph (Mosaic kernel on TPU,
generic Pallas interpreter on CPU), CPU and CUDA tensors go through DLPack
to a jitted JAX call. Each function is also the public torch operator
``torch.ops.pallas_kernels.<name>``, whose schema has the tensors and static
parameters as typed arguments (``torch_bridge.schemas``; ``mask``,
``return_lse``, ``block_sizes``, ``partition_spec`` and ``mesh`` are Python
function only), and runs on internal ops
``torch.ops.pallas_kernels_impl.*`` (static parameters encoded in a string).

JAX runs without 64-bit types: ids given as int64 (torch's default;
segment and class ids) are passed as int32 with equality kept exactly (values
outside int32 are renumbered); box ops take integer boxes (upcast to float32,
as torchvision does) and float64 boxes (computed in float32, returned as
float64); index outputs are int32.

The functions live in one private module per family (``_attention``,
``_quant``, ``_decode``, ``_gmm``, ``_ragged``, ``_iou``, ``_nms``; shared
checks in ``_common``); each op's partition specs are derived from its
``pallas_kernels`` sharding rule by ``torch_bridge._shards``.
"""
from __future__ import annotations

from pallas_kernels import _registry
from torch_bridge import schemas
from torch_bridge._core import UnshardedWarning
from torch_bridge.ops._attention import flash_attention
from torch_bridge.ops._common import _ids_int32  # noqa: F401  (tests)
from torch_bridge.ops._decode import decode_attention
from torch_bridge.ops._gmm import grouped_matmul
from torch_bridge.ops._gmm import _grouped_matmul_tgmm  # noqa: F401
from torch_bridge.ops._iou import (
    box_iou, ciou, ciou_loss, diou, diou_loss, giou, giou_loss, iou,
    iou_loss, pairwise_ciou, pairwise_diou, pairwise_giou, pairwise_iou)
from torch_bridge.ops._iou import _EPS, _REDUCTIONS  # noqa: F401 (modules)
from torch_bridge.ops._nms import batched_nms, nms, soft_nms
from torch_bridge.ops._quant import (
    int8_dense, int8_matmul, quantize, quantize_int8, quantized_dense,
    quantized_matmul)
from torch_bridge.ops._ragged import (
    mla_ragged_paged_attention, ragged_paged_attention)

__all__ = ["UnshardedWarning"] + [op.name for op in _registry.torch_ops()]

for _name in __all__[1:]:  # shown (and pickled) as torch_bridge.ops.<name>
  globals()[_name].__module__ = __name__
del _name

# The public typed ops ``torch.ops.pallas_kernels.<name>`` (they call the
# functions above).
schemas.register({op.name: globals()[op.name]
                  for op in _registry.torch_ops()})
