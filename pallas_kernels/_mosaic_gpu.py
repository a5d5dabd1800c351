"""What every Mosaic GPU (Hopper) kernel shares: the Pallas Mosaic GPU module
where this jax has one, the check for the API a kernel uses, its CPU
interpreter, and whether the default device is a Hopper.
"""
from __future__ import annotations

import jax

from pallas_kernels import _compat

try:  # Mosaic GPU Pallas: absent or incomplete on old jax releases.
  from jax.experimental.pallas import mosaic_gpu as plgpu
except Exception as e:  # pragma: no cover - depends on the jax build
  plgpu = None
  IMPORT_ERROR = f"jax.experimental.pallas.mosaic_gpu is unavailable: {e}"
else:
  IMPORT_ERROR = None


# The plgpu names the warp-specialized matmul kernels (int8 weight-only,
# 8-bit x 8-bit) build on; each adds its own.
MATMUL_API = ("kernel", "wgmma", "wgmma_wait", "SMEM", "ACC",
              "emit_pipeline_warp_specialized", "BlockSpec",
              "copy_smem_to_gmem", "commit_smem", "wait_smem_to_gmem",
              "transpose_ref", "TilingTransform", "SwizzleTransform",
              "CompilerParams", "LoweringSemantics")


def api_missing(kernel: str, needed_api) -> str | None:
  """Why this jax cannot build the Mosaic GPU ``kernel`` (which uses the
  ``plgpu`` names ``needed_api``), or None when it can."""
  if plgpu is None:
    return IMPORT_ERROR
  if _compat.JAX_VERSION < (0, 10, 0):
    return (f"the Mosaic GPU {kernel} kernel needs jax >= 0.10 "
            f"(found {jax.__version__})")
  missing = [name for name in needed_api if not hasattr(plgpu, name)]
  if missing:
    return f"jax.experimental.pallas.mosaic_gpu lacks {', '.join(missing)}"
  return None


def interpret_params():
  """The ``interpret`` value that runs a Mosaic GPU kernel in the Mosaic GPU
  interpreter on a CPU, or None where this jax has no such interpreter."""
  try:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  except Exception:
    return None
  return InterpretGPUParams()


def is_hopper() -> bool:
  """A Hopper (sm_90) GPU is the default device; decided at trace time."""
  try:
    if jax.default_backend() != "gpu":
      return False
    device = jax.devices()[0]
  except Exception:  # no backend: tracing on a host without a GPU
    return False
  return str(getattr(device, "compute_capability", "")).startswith("9")
