"""Roofline estimates from peak rates per chip.

Peak figures are per chip, dense (no sparsity), from vendor datasheets:
- TPU v4: 275 TFLOP/s bf16, int8 at the same rate (no int8 speed-up),
  1.2 TB/s HBM (Cloud TPU v4 docs).
- TPU v5e: 197 TFLOP/s bf16, 394 TOPS int8, 819 GB/s HBM (Cloud TPU v5e docs).
- TPU v5p: 459 TFLOP/s bf16, 918 TOPS int8, 2765 GB/s HBM (Cloud TPU v5p docs).
- TPU v6e (Trillium): 918 TFLOP/s bf16, 1836 TOPS int8, 1640 GB/s HBM
  (Cloud TPU v6e docs).
- H100 SXM: 989 TFLOP/s bf16 dense, 1979 TOPS int8 dense, 3.35 TB/s HBM3
  (NVIDIA H100 datasheet).
- H200 SXM: same compute as H100, 4.8 TB/s HBM3e (NVIDIA H200 datasheet).
VMEM per core (approximate; the scoped default is what a kernel gets unless it
raises vmem_limit_bytes): v4 16 MiB, v5e 128 MiB (16 MiB scoped
default), v5p 95 MiB, v6e 128 MiB (32 MiB scoped default).
"""
from __future__ import annotations

SPECS = {
    "v4": dict(bf16=275e12, int8=275e12, f32=275e12 / 4, hbm=1.2e12,
               vmem=16 * 2**20, scoped_vmem=16 * 2**20),
    "v5e": dict(bf16=197e12, int8=394e12, f32=197e12 / 4, hbm=819e9,
                vmem=128 * 2**20, scoped_vmem=16 * 2**20),
    "v5p": dict(bf16=459e12, int8=918e12, f32=459e12 / 4, hbm=2765e9,
                vmem=95 * 2**20, scoped_vmem=16 * 2**20),
    "v6e": dict(bf16=918e12, int8=1836e12, f32=918e12 / 4, hbm=1640e9,
                vmem=128 * 2**20, scoped_vmem=32 * 2**20),
    "h100": dict(bf16=989e12, int8=1979e12, f32=67e12, hbm=3.35e12),
    "h200": dict(bf16=989e12, int8=1979e12, f32=67e12, hbm=4.8e12),
}


def roofline(chip: str, flops: float, bytes_moved: float,
             dtype: str = "bf16") -> dict:
  """Lower-bound time of a kernel: max(compute time, memory time)."""
  spec = SPECS[chip]
  compute_s = flops / spec[dtype] if flops else 0.0
  memory_s = bytes_moved / spec["hbm"]
  bound = "compute" if compute_s >= memory_s else "memory"
  return dict(chip=chip, time_s=max(compute_s, memory_s), compute_s=compute_s,
              memory_s=memory_s, bound=bound,
              intensity=flops / bytes_moved if bytes_moved else float("inf"))
