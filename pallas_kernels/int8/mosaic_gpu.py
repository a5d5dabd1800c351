"""Weight-only int8 matmul for Hopper GPUs at decode shapes: Mosaic GPU.

Problem: out [M, N] = x [M, K] (bf16) @ dequant(w) with w int8 stored [N, K]
(``weight_layout="nk"``), per-channel ``w_scale``, optional bias; M <= 128.
At these shapes the time is that of streaming w (K N bytes) once.

Formulation (keeps the tensor cores' N dimension small)
  out^T [N, M] = w [N, K] . x^T. The int8 w rows are the wgmma's M side
  (64 rows per compute warpgroup), x's padded rows its N side (Mp = 16, 32,
  64 or 128). Each step a compute warpgroup loads its int8 w tile from SMEM
  to registers, converts it to bf16 (exact) and issues a wgmma with the
  register operand A and x's tile from SMEM as B, accumulating in float32.

Pipeline (``plgpu.emit_pipeline_warp_specialized``)
  One CTA per (column tile of ``compute_wgs x 64`` output channels, K
  chunk). A memory warpgroup streams the w tiles ([rows, tile_k] int8) and
  x tiles with TMA into a ring of ``stages`` SMEM slots; the compute
  warpgroups release a slot once their wgmma on it has completed. x is read
  as [Mp, tile_k] tiles and handed to the wgmma transposed (K-major B), or,
  with ``x_pretransposed``, from an x^T [K, Mp] made by XLA.

Split K: the K range is split over the largest power of two (<=
  ``max_split``) of CTAs that keeps all CTAs in one wave of ``target_ctas``
  (132 SMs; the ring takes most of an SM's SMEM, so one CTA each): N = 14336
  with 128-row tiles runs 112 CTAs unsplit, N = 4096 32 tiles x 4. Each CTA
  writes its float32 partial out^T; one XLA fusion sums the partials,
  applies w_scale and bias, transposes and casts (also unsplit: the kernel
  always writes float32 out^T [split, Np, Mp]; 1.5-3 us at the shapes
  below).

Tiles (DEFAULT_TILES, by padded M; two compute warpgroups of 64 w rows):
  Mp 16/32 tile_k 256 x 4 stages, Mp 64 256 x 2, Mp 128 128 x 3. SMEM:
  stages x tile_k x (128 + 2 Mp) bytes of ring + 2 x 64 x Mp x 4 of
  epilogue, within the H100's 227 KiB.

Measured (H100, jax 0.11.2; bench/results/int8_matmul_mgpu-h100-*: public
call, 20 calls per program, host sync hidden; one run), us:
  =============  =====  ======  ==========  =========  =========  ========
  M x K x N      this   Triton  torch bf16  w TB/s     vs torch   vs Triton
  =============  =====  ======  ==========  =========  =========  ========
  16x4096x14336  34.1   37.7    48.4        1.72       1.42x      1.11x
  16x14336x4096  32.8   31.9    45.1        1.79       1.37x      0.97x
  128x4096x14336 45.2   52.9    47.0        1.30       1.04x      1.17x
  128x14336x4096 41.6   61.7    54.7        1.41       1.31x      1.48x
  =============  =====  ======  ==========  =========  =========  ========
  The Triton kernel's own time moved 29.8 -> 37.7 us between two runs at
  16x4096x14336 (int8_matmul_mgpu_sweep-h100-* has the first). Device time
  per call from a profile: this kernel 25.4 / 25.3 / 35.2 / 33.0 us (2.3
  TB/s of w at M = 16) plus the epilogue fusion 1.6 / 1.5 / 3.1 / 2.6 us;
  the rest of the timed ~34 us at M = 16 is launch gaps between calls.
  Tried: x^T made by XLA (B N-major) +10%; a finer split (two waves) +6-
  10%; tile_k 128 x 8 stages +4%; at M = 128 one compute warpgroup per CTA
  or 128 rows per warpgroup (tile_k 64) 24-27% slower.

Padding: M to Mp, N to the column tile, K to tile_k x split (zero-padded
copies of x / w where a dimension is not a multiple; the LLM shapes need
none for w).

Semantics: those of ``reference.matmul_2d`` in weight-only mode (float32
accumulation of x times the exact bf16 image of w, then
``acc * w_scale + bias`` in float32, cast to out dtype); summation order
differs (K in tiles, split partials), so results agree to float32 rounding
before the final cast.

Not handled (``supports`` says why; the Triton kernel runs instead): w
[K, N], x other than bf16, M > 128, empty inputs, non-Hopper GPUs, jax
without the Mosaic GPU API.

Testing without a GPU: jax's Mosaic GPU interpreter (jax >= 0.10) runs the
kernel on the CPU with the warp-specialised pipeline, its barriers and TMA
copies simulated; it cannot run a wgmma with a register operand, so under
``interpret`` the product is a float32-accumulated dot of the same tiles.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _compat, _mosaic_gpu

pl = _compat.pl

plgpu = _mosaic_gpu.plgpu

ROWS_PER_WG = 64  # one wgmma M tile of w rows per compute warpgroup
MAX_M = 128
SMEM_BYTES = 227 * 1024
_NEEDED_API = ("kernel", "wgmma", "wgmma_wait", "SMEM", "ACC",
               "emit_pipeline_warp_specialized", "BlockSpec",
               "copy_smem_to_gmem", "commit_smem", "wait_smem_to_gmem",
               "transpose_ref", "TilingTransform", "SwizzleTransform",
               "CompilerParams", "LoweringSemantics")


def api_missing() -> str | None:
  """Why this jax cannot build the kernel, or None when it can."""
  return _mosaic_gpu.api_missing("int8", _NEEDED_API)


interpret_params = _mosaic_gpu.interpret_params


@dataclasses.dataclass(frozen=True)
class MgpuBlockSizes:
  """tile_k (multiple of 128), stages (ring depth >= 2), compute_wgs (1 or
  2: column tile = compute_wgs x 64 output channels), split K limits
  (``max_split``, and the CTA count ``target_ctas`` the split aims for),
  ``x_pretransposed`` (B from an XLA-made x^T instead of a transposed SMEM
  view)."""
  tile_k: int | None = None  # None: DEFAULT_TILES by padded M
  stages: int | None = None
  compute_wgs: int = 2
  target_ctas: int = 132
  max_split: int = 8
  x_pretransposed: bool = False
  wg_rows: int = 64  # w rows per compute warpgroup: 64 or 128

  def resolved(self, m: int) -> "MgpuBlockSizes":
    tile_k, stages = DEFAULT_TILES[padded_m(min(max(m, 1), MAX_M))]
    return dataclasses.replace(self, tile_k=self.tile_k or tile_k,
                               stages=self.stages or stages).check()

  def check(self):
    if self.tile_k <= 0 or self.tile_k % 64:
      raise ValueError(f"MgpuBlockSizes.tile_k={self.tile_k}: must be a "
                       "positive multiple of 64")
    if self.wg_rows not in (64, 128):
      raise ValueError(f"MgpuBlockSizes.wg_rows={self.wg_rows}: must be 64 "
                       "or 128")
    if self.stages < 2:
      raise ValueError(f"MgpuBlockSizes.stages={self.stages}: must be >= 2")
    if self.compute_wgs not in (1, 2):
      raise ValueError(f"MgpuBlockSizes.compute_wgs={self.compute_wgs}: "
                       "must be 1 or 2")
    if self.max_split < 1 or self.target_ctas < 1:
      raise ValueError("MgpuBlockSizes.max_split and target_ctas must be >= 1")
    return self


# Padded M -> (tile_k, stages): the ring holds stages x tile_k x (128 w rows
# + 2 Mp x bytes) within the H100's 227 KiB of SMEM (module docstring).
DEFAULT_TILES = {16: (256, 4), 32: (256, 4), 64: (256, 2), 128: (128, 3)}


def default_block_sizes(m: int, k: int, n: int) -> MgpuBlockSizes:
  """The table (DEFAULT_TILES; bench/bench_int8_matmul.py --mgpu times
  MGPU_CONFIGS beside it)."""
  del k, n
  return MgpuBlockSizes().resolved(m)


def padded_m(m: int) -> int:
  """x rows as the wgmma N side: a power of two in [16, 128]."""
  mp = 16
  while mp < m:
    mp *= 2
  return mp


@dataclasses.dataclass(frozen=True)
class Plan:
  mp: int
  np_: int
  kp: int
  rows: int      # w rows (output channels) per CTA
  split: int
  steps: int     # K steps per CTA
  sizes: MgpuBlockSizes


def plan(m, k, n, sizes: MgpuBlockSizes | None = None) -> Plan:
  sizes = (sizes or MgpuBlockSizes()).resolved(m)
  rows = sizes.compute_wgs * sizes.wg_rows
  mp, np_ = padded_m(m), -(-n // rows) * rows
  tiles = np_ // rows
  k_tiles = -(-k // sizes.tile_k)
  # The largest split whose CTAs still run in one wave of target_ctas (a
  # second, partial wave cost more than the finer split gained).
  split = 1
  while (tiles * split * 2 <= sizes.target_ctas
         and split * 2 <= sizes.max_split and split * 2 <= k_tiles):
    split *= 2
  steps = -(-k_tiles // split)
  return Plan(mp, np_, steps * split * sizes.tile_k, rows, split, steps, sizes)


def smem_bytes(p: Plan) -> int:
  ring = p.sizes.stages * p.sizes.tile_k * (p.rows + 2 * p.mp)
  out = p.sizes.compute_wgs * ROWS_PER_WG * p.mp * 4  # epilogue chunks
  return ring + out + 2048  # barriers/alignment


def _swizzle(minor_bytes: int) -> int:
  for swizzle in (128, 64, 32):
    if minor_bytes % swizzle == 0:
      return swizzle
  raise ValueError(f"no swizzle for a {minor_bytes}-byte minor dimension")


def _transforms(minor: int, itemsize: int):
  swizzle = _swizzle(minor * itemsize)
  return (plgpu.TilingTransform((8, swizzle // itemsize)),
          plgpu.SwizzleTransform(swizzle))


def _on_hopper_or_no_gpu() -> str | None:
  try:
    gpus = jax.devices("gpu")
  except Exception:  # no GPU backend
    return None
  if gpus:
    capability = str(getattr(gpus[0], "compute_capability", "9.0"))
    if not capability.startswith("9"):
      return f"the Mosaic GPU int8 kernel needs sm_90 (found sm_{capability})"
  return None


def supports(x2, w, x_scale=None, *, mode, w_layout, block_sizes=None):
  """True when ``matmul`` handles this call, else a string saying why not."""
  reason = api_missing()
  if reason:
    return reason
  if mode != "weight_only":
    return "the Mosaic GPU int8 kernel is weight-only"
  if w_layout != "nk":
    return "the Mosaic GPU int8 kernel needs w stored [N, K]"
  if x_scale is not None:
    return "the Mosaic GPU int8 kernel takes no x_scale"
  if jnp.dtype(x2.dtype) != jnp.dtype(jnp.bfloat16):
    return "the Mosaic GPU int8 kernel needs bf16 x"
  m, k = x2.shape
  if not 0 < m <= MAX_M:
    return f"the Mosaic GPU int8 kernel needs 0 < M <= {MAX_M}, got {m}"
  if min(k, w.shape[0]) == 0:
    return "empty inputs are left to the Triton kernel"
  try:
    p = plan(m, k, w.shape[0], block_sizes)
  except ValueError as e:
    return str(e)
  if smem_bytes(p) > SMEM_BYTES:
    return "tile_k x stages do not fit in shared memory"
  return _on_hopper_or_no_gpu() or True


def _pad_to(a, shape):
  pads = [(0, t - s) for s, t in zip(a.shape, shape)]
  if all(p == (0, 0) for p in pads):
    return a
  return jnp.pad(a, pads)


def _partials(x2, w, p: Plan, interpret):
  """float32 out^T partial sums [split, Np, Mp] (no scale, no bias)."""
  sizes = p.sizes
  tk, wgs, rows, wg_rows = (sizes.tile_k, sizes.compute_wgs, p.rows,
                            sizes.wg_rows)
  chunk = p.steps * tk  # K per CTA
  interpreting = bool(interpret)
  w = _pad_to(w, (p.np_, p.kp))
  x = _pad_to(x2, (p.mp, p.kp))
  if sizes.x_pretransposed:
    x = x.T  # [Kp, Mp]
    x_spec = plgpu.BlockSpec((tk, p.mp), lambda s: (s, 0),
                             transforms=_transforms(p.mp, 2))
  else:
    x_spec = plgpu.BlockSpec((p.mp, tk), lambda s: (0, s),
                             transforms=_transforms(tk, 2))
  w_spec = plgpu.BlockSpec((rows, tk), lambda s: (0, s),
                           transforms=_transforms(tk, 1))

  def kernel(w_gmem, x_gmem, out_gmem):
    pl.run_scoped(functools.partial(scoped, w_gmem, x_gmem, out_gmem),
                  plgpu.SMEM((wgs, ROWS_PER_WG, p.mp), jnp.float32),
                  collective_axes="wg")

  def scoped(w_gmem, x_gmem, out_gmem, out_smem):
    tile = lax.axis_index("n_tiles")
    part = lax.axis_index("k_split")
    wg = lax.axis_index("wg")
    k_slice = pl.ds(part * chunk, chunk)
    row_slice = pl.ds(wg * wg_rows, wg_rows)

    def body(_, w_smem, x_smem, acc):
      w_tile = w_smem[row_slice].astype(jnp.bfloat16)  # exact for int8
      if interpreting:  # no transposed views there: transpose the value
        b = x_smem[...] if sizes.x_pretransposed else x_smem[...].T
        return acc + jnp.dot(w_tile, b, preferred_element_type=jnp.float32)
      if sizes.x_pretransposed:
        b_ref = x_smem
      else:
        b_ref = plgpu.transpose_ref(x_smem, (1, 0))
      plgpu.wgmma(acc, w_tile, b_ref)
      plgpu.wgmma_wait(0)  # the slot is released when the body returns
      return acc

    def compute_context(run_pipeline):
      if interpreting:
        acc = run_pipeline(jnp.zeros((wg_rows, p.mp), jnp.float32))
      else:
        def scope(acc_ref):
          run_pipeline(acc_ref)
          return acc_ref[...]
        acc = pl.run_scoped(scope, plgpu.ACC((wg_rows, p.mp), jnp.float32))
      for c in range(wg_rows // ROWS_PER_WG):  # through SMEM, 64 rows a time
        out_smem.at[wg][...] = acc[c * ROWS_PER_WG:(c + 1) * ROWS_PER_WG]
        plgpu.commit_smem()
        row0 = tile * rows + wg * wg_rows + c * ROWS_PER_WG
        plgpu.copy_smem_to_gmem(
            out_smem.at[wg], out_gmem.at[part, pl.ds(row0, ROWS_PER_WG)])
        plgpu.wait_smem_to_gmem(0)

    pipeline = plgpu.emit_pipeline_warp_specialized(
        body, grid=(p.steps,), memory_registers=40,
        in_specs=[w_spec, x_spec], wg_axis="wg", num_compute_wgs=wgs,
        max_concurrent_steps=sizes.stages, compute_context=compute_context)
    x_view = (x_gmem.at[k_slice, :] if sizes.x_pretransposed
              else x_gmem.at[:, k_slice])
    pipeline(w_gmem.at[pl.ds(tile * rows, rows), k_slice], x_view)

  kwargs = {}
  if interpret:
    kwargs["interpret"] = interpret
  return plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct((p.split, p.np_, p.mp), jnp.float32),
      grid=(p.np_ // rows, p.split),
      grid_names=("n_tiles", "k_split"),
      num_threads=wgs + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      **kwargs,
  )(w, x)


def matmul(x2, w, x_scale, w_scale, bias, *, mode, out_dtype, w_layout,
           block_sizes=None, interpret=False):
  """Weight-only x2 [M, K] bf16 @ w [N, K] int8 -> [M, N] out_dtype.

  Same contract as ``gpu.matmul``; call only where ``supports`` is True.
  ``interpret``: False on a GPU, an ``InterpretGPUParams`` (or True) to run
  in the Mosaic GPU interpreter.
  """
  ok = supports(x2, w, x_scale, mode=mode, w_layout=w_layout,
                block_sizes=block_sizes)
  if ok is not True:
    raise ValueError(f"int8 mosaic_gpu.matmul: unsupported call: {ok}")
  if interpret is True:
    interpret = interpret_params()
  m, k = x2.shape
  n = w.shape[0]
  p = plan(m, k, n, block_sizes)
  parts = _partials(x2, w, p, interpret)
  acc_t = parts.sum(axis=0) if p.split > 1 else parts[0]  # [Np, Mp]
  acc = acc_t[:n, :m].T
  out = acc if w_scale is None else acc * w_scale
  if bias is not None:
    out = out + bias
  return out.astype(out_dtype)


ENV_WEIGHT_ONLY = "PALLAS_KERNELS_INT8_GPU_WEIGHT_ONLY"


def choice() -> str:
  """auto | triton | mosaic from PALLAS_KERNELS_INT8_GPU_WEIGHT_ONLY."""
  value = os.environ.get(ENV_WEIGHT_ONLY, "auto").strip().lower() or "auto"
  if value not in ("auto", "triton", "mosaic"):
    raise ValueError(f"{ENV_WEIGHT_ONLY}={value!r}: must be auto, triton or "
                     "mosaic")
  return value
