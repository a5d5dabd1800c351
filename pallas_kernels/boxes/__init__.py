"""Box kernels: the IoU family (``boxes.iou``) and greedy NMS (``boxes.nms``).
The public ops are exported from ``pallas_kernels`` itself; this package
re-exports nothing, so no sub-package name can shadow an op.
"""
