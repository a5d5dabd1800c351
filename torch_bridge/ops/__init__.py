"""The pallas_kernels ops as torch functions: the same names, arguments and
semantics, plus ``partition_spec``/``mesh`` for torch_xla SPMD (docs/torch.md;
docs/design/torch_bridge.md, "ops"). One private module per family; shared
checks in ``_common``; partition specs from ``torch_bridge._shards``.
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
