"""Roofline estimates from peak rates per chip.

Peaks are per chip, dense (no sparsity), from public datasheets:
- TPU v4: 275 TFLOP/s bf16, int8 at the same rate, 1200 GB/s HBM (Cloud TPU
  v4 docs, "System architecture").
- TPU v5e: 197 TFLOP/s bf16, 393 TOP/s int8, 819 GB/s HBM (Cloud TPU v5e
  docs, "System architecture").
- TPU v5p: 459 TFLOP/s bf16, 918 TOP/s int8, 2765 GB/s HBM (Cloud TPU v5p
  docs, "System architecture").
- TPU v6e (Trillium): 918 TFLOP/s bf16, 1836 TOP/s int8, 1638 GB/s HBM
  (Cloud TPU v6e docs, "System architecture").
- TPU7x (Ironwood): 2307 TFLOP/s bf16, 4614 TFLOP/s fp8, 7380 GB/s HBM
  (Cloud TPU7x docs, "System architecture"); no int8 rate is published.
- H100 SXM: 989 TFLOP/s bf16, 1979 TOP/s int8, 3.35 TB/s HBM3 (NVIDIA H100
  datasheet). H200 SXM: the same compute, 4.8 TB/s HBM3e (NVIDIA H200
  datasheet).
VMEM per TensorCore (``jax/_src/tpu_info.py``): v4 16 MiB, v5e 128 MiB, v5p
64 MiB, v6e 128 MiB, TPU7x 64 MiB.
"""
from __future__ import annotations

MiB = 2**20

SPECS = {
    "v4": dict(bf16=275e12, int8=275e12, hbm=1200e9, vmem=16 * MiB),
    "v5e": dict(bf16=197e12, int8=393e12, hbm=819e9, vmem=128 * MiB),
    "v5p": dict(bf16=459e12, int8=918e12, hbm=2765e9, vmem=64 * MiB),
    "v6e": dict(bf16=918e12, int8=1836e12, hbm=1638e9, vmem=128 * MiB),
    "tpu7x": dict(bf16=2307e12, fp8=4614e12, hbm=7380e9, vmem=64 * MiB),
    "h100": dict(bf16=989e12, int8=1979e12, hbm=3.35e12),
    "h200": dict(bf16=989e12, int8=1979e12, hbm=4.8e12),
}
TPUS = ("v5e", "v5p", "v6e", "tpu7x")


def roofline(chip: str, flops: float, bytes_moved: float,
             dtype: str = "bf16") -> dict:
  """Lower-bound time of a kernel on ``chip``: max(compute, memory time).

  ``dtype`` names the matmul rate ("bf16", "int8", "fp8"); a chip without
  a published rate for it raises ValueError.
  """
  spec = SPECS[chip]
  if flops and dtype not in spec:
    raise ValueError(f"roofline: chip {chip!r} has no published {dtype} rate")
  compute_s = flops / spec[dtype] if flops else 0.0
  memory_s = bytes_moved / spec["hbm"]
  return dict(chip=chip, time_s=max(compute_s, memory_s), compute_s=compute_s,
              memory_s=memory_s,
              bound="compute" if compute_s >= memory_s else "memory",
              intensity=flops / bytes_moved if bytes_moved else float("inf"))


def rows(case: str, flops: float, bytes_moved: float, dtype: str = "bf16",
         chips=TPUS, useful_flops: float | None = None) -> list[dict]:
  """One estimate per chip that has a ``dtype`` rate, for results files.

  ``useful_flops`` (default ``flops``) gives the TFLOP/s column: the work
  the op needs, which a kernel that recomputes or skips may differ from.
  """
  out = []
  for chip in chips:
    if flops and dtype not in SPECS[chip]:
      continue
    est = roofline(chip, flops, bytes_moved, dtype)
    out.append(dict(case=case, chip=chip, dtype=dtype, flops=flops,
                    bytes=bytes_moved, intensity=est["intensity"],
                    time_ms=est["time_s"] * 1e3, bound=est["bound"],
                    tflops=(useful_flops if useful_flops is not None
                            else flops) / est["time_s"] / 1e12))
  return out
