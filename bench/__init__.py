"""Benchmarks: ``python -m bench.<op>`` (attention, int8_matmul, giou, nms,
torch_bridge), or ``python -m bench.run`` for all; see ``bench.harness``."""
