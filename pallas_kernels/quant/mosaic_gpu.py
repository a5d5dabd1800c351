"""8-bit x 8-bit matmul for Hopper GPUs: Mosaic GPU.

``out = x . w^T`` on the 8-bit tensor cores (fp8 summed in the tensor cores'
narrower float adds, int8 exactly in int32) with the dequant epilogue; a
persistent kernel, one CTA per SM walking output tiles in a snake order.
Structure and precision: docs/design/quantized.md.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _compat, _mosaic_gpu
from pallas_kernels.quant import int8_quantize as int8_quant
from pallas_kernels.quant import formats

pl = _compat.pl
plgpu = _mosaic_gpu.plgpu

COMPUTE_WGS = 2
SMEM_BYTES = 227 * 1024
DEFAULT_SMS = 132  # H100 SXM; the device's own count where there is one
FLOAT8 = tuple(jnp.dtype(d) for d in (jnp.float8_e4m3fn, jnp.float8_e5m2))
INT8 = jnp.dtype(jnp.int8)
_NEEDED_API = _mosaic_gpu.MATMUL_API + ("nd_loop", "planar_snake",
                                          "find_swizzle", "Layout")


def api_missing() -> str | None:
  """Why this jax cannot build the kernel, or None when it can."""
  return _mosaic_gpu.api_missing("8-bit matmul", _NEEDED_API)


interpret_params = _mosaic_gpu.interpret_params


@dataclasses.dataclass(frozen=True)
class Tiles:
  """The CTA's output tile (block_m rows, split between the two compute
  warpgroups; block_n <= 256 columns), K per ring slot (``tile_k``, a
  multiple of 128: one 128-byte swizzle row), ring depth, and the tile
  walk: ``minor`` ("m" or "n") is the axis walked first, in bands of
  ``snake`` tiles; ``ctas``: persistent CTAs (None: one per SM)."""
  block_m: int = 128
  block_n: int = 256
  tile_k: int = 128
  stages: int = 4
  minor: str = "m"
  snake: int = 8
  ctas: int | None = None

  def check(self) -> "Tiles":
    if self.block_m not in (128, 256):
      raise ValueError(f"Tiles.block_m={self.block_m}: must be 128 or 256")
    if self.block_n % 64 or not 64 <= self.block_n <= 256:
      raise ValueError(f"Tiles.block_n={self.block_n}: must be 64, 128, "
                       "192 or 256")
    if self.block_m * self.block_n > 128 * 256:
      raise ValueError(f"Tiles {self.block_m}x{self.block_n}: a compute "
                       "warpgroup holds at most 64x256 accumulators")
    if self.tile_k <= 0 or self.tile_k % 128:
      raise ValueError(f"Tiles.tile_k={self.tile_k}: must be a positive "
                       "multiple of 128")
    if self.stages < 2:
      raise ValueError(f"Tiles.stages={self.stages}: must be >= 2")
    if self.minor not in ("m", "n"):
      raise ValueError(f"Tiles.minor={self.minor!r}: must be 'm' or 'n'")
    if self.snake < 1:
      raise ValueError(f"Tiles.snake={self.snake}: must be >= 1")
    if self.ctas is not None and self.ctas < 1:
      raise ValueError(f"Tiles.ctas={self.ctas}: must be >= 1 or None")
    return self


DEFAULT_TILES = Tiles()
# Narrow tiles where the default's output tiles would leave this fraction
# of the SMs or more idle (few rows or columns).
NARROW_TILES = Tiles(block_m=128, block_n=128, tile_k=128, stages=6)
FILL_FRACTION = 0.6
# Smallest M for which the chooser takes this kernel over the Triton one,
# by x's kind (docs/design/quantized.md).
AUTO_MIN_M = {"float8": 1, "int8": 512}


def tiles_for(m: int, n: int) -> Tiles:
  """The tiles for an [m, *] x [*, n] product: DEFAULT_TILES, or
  NARROW_TILES where 128 x 256 output tiles would not fill FILL_FRACTION of
  the SMs."""
  tiles = -(-m // DEFAULT_TILES.block_m) * -(-n // DEFAULT_TILES.block_n)
  return DEFAULT_TILES if tiles >= FILL_FRACTION * num_sms() else NARROW_TILES


def epilogue_cols(out_dtype) -> int:
  """Columns per epilogue store: 128 bytes of out_dtype per row."""
  return 128 // jnp.dtype(out_dtype).itemsize


def smem_bytes(t: Tiles) -> int:
  """The ring and the output staging (128-byte rows for any out_dtype)."""
  ring = t.stages * t.tile_k * (t.block_m + t.block_n)
  staging = COMPUTE_WGS * 2 * 64 * 128  # two 64-row slots per warpgroup
  return ring + staging + 2048  # barriers, alignment


def hardware(target) -> str | None:
  """Why ``target`` cannot run the kernel (not a Hopper GPU), else None."""
  if target.hopper:
    return None
  found = target.gpu_capability or "no GPU"
  return f"the Mosaic GPU 8-bit matmul needs a Hopper GPU (sm_90), found {found}"


def supports(x2, w, *, mode, out_dtype, tiles: Tiles | None = None):
  """None when ``matmul`` handles this call (on a Hopper GPU), else why not.

  x2 [M, K] and w ([K, N] or [N, K]) both float8 or both int8 (modes
  dequant, raw), or float x2 and 8-bit w (dynamic)."""
  reason = api_missing()
  if reason:
    return reason
  x_dtype, w_dtype = jnp.dtype(x2.dtype), jnp.dtype(w.dtype)
  if mode not in ("dequant", "raw", "dynamic"):
    return ("the Mosaic GPU 8-bit matmul takes quantized x (dequant, raw or "
            f"dynamic mode), not {mode}")
  if mode == "dynamic":
    x_dtype = w_dtype  # x is quantized into w's format first
  if mode == "raw":
    out_dtype = jnp.int32
  if not ((x_dtype in FLOAT8 and w_dtype in FLOAT8)
          or (x_dtype == INT8 and w_dtype == INT8)):
    return (f"the Mosaic GPU 8-bit matmul takes float8 x float8 or int8 x "
            f"int8, got {x_dtype.name} x {w_dtype.name}")
  if jnp.dtype(out_dtype).itemsize > 4:
    return f"the Mosaic GPU 8-bit matmul cannot write {jnp.dtype(out_dtype)}"
  if 0 in x2.shape or 0 in w.shape:
    return "the Mosaic GPU 8-bit matmul needs M, K, N > 0"
  t = tiles or DEFAULT_TILES
  try:
    t.check()
  except ValueError as e:
    return str(e)
  if smem_bytes(t) > SMEM_BYTES:
    return "tile_k x stages x (block_m + block_n) does not fit in shared memory"
  return None


def auto_refusal(x2, w, *, mode, out_dtype, user_blocks=None):
  """Why the chooser does not take this kernel for the call, or None: the
  kernel's limits, then the M range where it beats the Triton kernel
  (``AUTO_MIN_M``); ``block_sizes`` given by the user are the Triton
  kernel's."""
  why = supports(x2, w, mode=mode, out_dtype=out_dtype)
  if why is not None:
    return why
  kind = "int8" if jnp.dtype(w.dtype) == INT8 else "float8"
  low = AUTO_MIN_M[kind]
  if x2.shape[0] < low:
    return (f"M={x2.shape[0]} is below {low}, where the Triton kernel is "
            f"faster for {kind}")
  if user_blocks is not None:
    return "block_sizes are for the Triton and TPU kernels"
  return None


def _pad_to(a, shape):
  pads = [(0, t - s) for s, t in zip(a.shape, shape)]
  if all(p == (0, 0) for p in pads):
    return a
  return jnp.pad(a, pads)


def _round_up(v, unit):
  return -(-v // unit) * unit


def num_sms() -> int:
  """The default device's SM count, or the H100's on a host without a GPU
  (what the CUDA lowering tests target)."""
  try:
    device = jax.devices()[0]
    if device.platform == "gpu":
      return int(device.core_count)
  except Exception:  # no backend initialized: lowering on a CPU host
    pass
  return DEFAULT_SMS


def _transforms(minor_bytes, itemsize):
  swizzle = plgpu.find_swizzle(minor_bytes * 8)
  return (plgpu.TilingTransform((8, swizzle // itemsize)),
          plgpu.SwizzleTransform(swizzle))


def _kernel_call(x, w, vectors, t: Tiles, out_dtype, interpreting, interpret):
  """x [Mp, Kp], w [Np, Kp] padded to the tiles; ``vectors``: (x_scale [Mp],
  w_scale [Np], bias [Np]), each float32 or None. Returns [Mp, Np]."""
  mp, kp = x.shape
  np_ = w.shape[0]
  m_tiles, n_tiles, k_steps = mp // t.block_m, np_ // t.block_n, kp // t.tile_k
  wg_m = t.block_m // COMPUTE_WGS
  integer = jnp.dtype(x.dtype) == INT8
  acc_dtype = jnp.int32 if integer else jnp.float32
  epi_n = epilogue_cols(out_dtype)
  in_transforms = _transforms(t.tile_k, 1)
  out_transforms = _transforms(epi_n * jnp.dtype(out_dtype).itemsize,
                               jnp.dtype(out_dtype).itemsize)
  scaled = any(v is not None for v in vectors)
  present = [v is not None for v in vectors]
  ctas = min(t.ctas or num_sms(), m_tiles * n_tiles)
  minor = 0 if t.minor == "m" else 1

  def pipeline(body, compute_context):
    spec = lambda rows: plgpu.BlockSpec(  # noqa: E731
        (rows, t.tile_k), lambda s: (0, s), transforms=in_transforms,
        delay_release=1)
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(k_steps,), memory_registers=40,
        in_specs=[spec(t.block_m), spec(t.block_n)], wg_axis="wg",
        num_compute_wgs=COMPUTE_WGS, max_concurrent_steps=t.stages,
        compute_context=compute_context)

  def kernel(x_gmem, w_gmem, *refs):
    *vector_refs, out_gmem = refs
    it = iter(vector_refs)
    xs_ref, ws_ref, b_ref = (next(it) if p else None for p in present)
    ignore = lambda *_, **__: None  # noqa: E731
    scratch = {}
    if interpreting:  # the accumulators, in shared memory there
      scratch["acc_smem"] = plgpu.SMEM((COMPUTE_WGS, wg_m, t.block_n),
                                       acc_dtype)
    pl.run_scoped(
        functools.partial(scoped, x_gmem, w_gmem, xs_ref, ws_ref, b_ref,
                          out_gmem),
        allocations=pipeline(ignore, ignore).get_allocations(x_gmem, w_gmem),
        out_smem=plgpu.SMEM((COMPUTE_WGS, 2, 64, epi_n), out_dtype,
                            transforms=out_transforms),
        collective_axes="wg", **scratch)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  def vector(ref, start, size, axis):
    """``size`` float32 values of ``ref`` from ``start``, broadcast along
    the accumulator's other axis."""
    if interpreting:
      v = ref[pl.ds(start, size)]
    else:
      v = _compat.mosaic_gpu_load(
          ref, (pl.ds(start, size),),
          layout=plgpu.Layout.WGMMA.reduce(1 - axis), optimized=False)
    return lax.broadcast_in_dim(v, (wg_m, t.block_n), (axis,))

  def scoped(x_gmem, w_gmem, xs_ref, ws_ref, b_ref, out_gmem, allocations,
             out_smem, acc_smem=None):
    wg = lax.axis_index("wg")
    wg_rows = pl.ds(wg * wg_m, wg_m)

    @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sm")
    def tile_loop(info):
      (linear,) = info.index
      mi, ni = plgpu.planar_snake(linear, (m_tiles, n_tiles), minor, t.snake)
      row0 = mi * t.block_m + wg * wg_m
      col0 = ni * t.block_n

      def body(_, x_smem, w_smem, acc_ref):
        if interpreting:  # a plain dot of the same tiles
          a = x_smem[wg_rows].astype(acc_dtype)
          b = w_smem[...].astype(acc_dtype)
          acc_ref[...] += jnp.dot(a, b.T, preferred_element_type=acc_dtype)
          return acc_ref
        plgpu.wgmma(acc_ref, x_smem.at[wg_rows],
                    plgpu.transpose_ref(w_smem, (1, 0)))
        plgpu.wgmma_wait(1)  # the previous step's slot is free to refill
        return acc_ref

      def epilogue(acc):
        if scaled:
          out = acc.astype(jnp.float32)
          if xs_ref is not None:
            out = out * vector(xs_ref, row0, wg_m, 0)
          if ws_ref is not None:
            out = out * vector(ws_ref, col0, t.block_n, 1)
          if b_ref is not None:
            out = out + vector(b_ref, col0, t.block_n, 1)
          acc = out
        acc = acc.astype(out_dtype)
        # the previous tile's stores have read their staging slots
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        for i in range(wg_m // 64):
          for j in range(t.block_n // epi_n):
            slot = (i * (t.block_n // epi_n) + j) % 2
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            out_smem[wg, slot] = acc[i * 64:(i + 1) * 64,
                                     j * epi_n:(j + 1) * epi_n]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(
                out_smem.at[wg, slot],
                out_gmem.at[pl.ds(row0 + i * 64, 64),
                            pl.ds(col0 + j * epi_n, epi_n)])

      def compute_context(run_pipeline):
        if interpreting:
          acc_ref = acc_smem.at[wg]
          acc_ref[...] = jnp.zeros((wg_m, t.block_n), acc_dtype)
          run_pipeline(acc_ref)
          epilogue(acc_ref[...])
          return

        def scope(acc_ref):
          run_pipeline(acc_ref)
          epilogue(acc_ref[...])  # waits for the last wgmma
        pl.run_scoped(scope, plgpu.ACC((wg_m, t.block_n), acc_dtype))

      pipeline(body, compute_context)(
          x_gmem.at[pl.ds(mi * t.block_m, t.block_m), :],
          w_gmem.at[pl.ds(ni * t.block_n, t.block_n), :],
          allocations=allocations)

  kwargs = {}
  if interpret:
    kwargs["interpret"] = interpret
  return plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct((mp, np_), out_dtype),
      grid=(ctas,),
      grid_names=("sm",),
      num_threads=COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      **kwargs,
  )(x, w, *(v for v in vectors if v is not None))


def matmul(x2, w, x_scale, w_scale, bias, *, mode, out_dtype, w_layout,
           tiles: Tiles | None = None, interpret=False):
  """x2 [M, K] . w -> [M, N] out_dtype for 8-bit x and w. w is [N, K] (w_layout
  "nk") or [K, N] ("kn", transposed first); x_scale [M, 1], w_scale and bias [1,
  N] float32 or None. ``tiles``: None picks ``tiles_for(M, N)``. Call only where
  ``supports`` is None. ``interpret``: False on a GPU, an ``InterpretGPUParams``
  (or True) for the Mosaic GPU interpreter."""
  why = supports(x2, w, mode=mode, out_dtype=out_dtype, tiles=tiles)
  if why is not None:
    raise ValueError(f"quant.mosaic_gpu.matmul: unsupported call: {why}")
  if interpret is True:
    interpret = interpret_params()
  if mode == "raw":
    out_dtype = jnp.int32
  if mode == "dynamic":  # per-row quantization into w's format, as the
    if jnp.dtype(w.dtype) == INT8:  # reference and Triton kernels round
      x2, x_scale = int8_quant.quantize(x2, axis=-1)
    else:
      fmt = formats.format_of(w.dtype)
      x2, x_scale = formats.symmetric(x2.astype(jnp.float32), fmt, 1)
  if w_layout == "kn":
    w = w.T
  m, k = x2.shape
  n = w.shape[0]
  t = tiles or tiles_for(m, n)
  mp, np_, kp = (_round_up(m, t.block_m), _round_up(n, t.block_n),
                 _round_up(k, t.tile_k))
  x = _pad_to(x2, (mp, kp))
  w = _pad_to(w, (np_, kp))
  vectors = (
      None if x_scale is None else _pad_to(x_scale.reshape(-1), (mp,)),
      None if w_scale is None else _pad_to(w_scale.reshape(-1), (np_,)),
      None if bias is None else _pad_to(bias.reshape(-1), (np_,)))
  vectors = tuple(None if v is None else v.astype(jnp.float32)
                  for v in vectors)
  out = _kernel_call(x, w, vectors, t, jnp.dtype(out_dtype), bool(interpret),
                     interpret)
  return out if out.shape == (m, n) else out[:m, :n]
