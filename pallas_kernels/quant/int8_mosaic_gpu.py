"""Weight-only matmul of 8-bit and int4 weights for Hopper GPUs: Mosaic GPU.

``out = x (bf16, M <= 256) @ dequant(w)``, w int8/fp8/int4 in either layout,
per-channel or int4 group scales. Formed transposed (``out^T = w x^T``) so
w's rows fill the wgmma's M side; K split over CTAs when the column tiles
alone cannot fill the GPU. Structure: docs/design/int8.md.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _compat, _mosaic_gpu
from pallas_kernels.quant import int8_quantize as quant

pl = _compat.pl

plgpu = _mosaic_gpu.plgpu

ROWS_PER_WG = 64  # one wgmma M tile of w rows per compute warpgroup
COMPUTE_WGS = 2
ROWS = ROWS_PER_WG * COMPUTE_WGS  # w rows (output channels) per CTA
MAX_M = 256
INT4 = jnp.dtype(jnp.int4)
WEIGHT_DTYPES = tuple(jnp.dtype(d) for d in (
    jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.int4))
PAIR_MIN_MP = 128  # x tiles multicast to CTA pairs from this padded M on
SMEM_BYTES = 227 * 1024
KN_CHUNK = 64  # w [K, N]: K rows per bf16 conversion buffer (tile_k's unit)
GROUP_UNIT = 64  # group sizes are multiples of the smallest K chunk
_NEEDED_API = _mosaic_gpu.MATMUL_API


def api_missing() -> str | None:
  """Why this jax cannot build the kernel, or None when it can."""
  return _mosaic_gpu.api_missing("int8", _NEEDED_API)


interpret_params = _mosaic_gpu.interpret_params


def w_bits(w_dtype) -> int:
  return 4 if jnp.dtype(w_dtype) == INT4 else 8


@dataclasses.dataclass(frozen=True)
class MgpuBlockSizes:
  """``tile_k`` (K per ring slot, a multiple of 64) and ``stages`` (ring
  depth >= 2), None: the default tables by padded M; the K split aims at
  ``target_ctas`` CTAs (one per SM) with at most ``max_split`` pieces."""
  tile_k: int | None = None
  stages: int | None = None
  target_ctas: int = 132
  max_split: int = 8

  def resolved(self, m: int, w_layout: str = "nk",
               bits: int = 8) -> "MgpuBlockSizes":
    table = TILES[bits, w_layout]
    tile_k, stages = table[padded_m(min(max(m, 1), MAX_M))]
    return dataclasses.replace(self, tile_k=self.tile_k or tile_k,
                               stages=self.stages or stages).check()

  def check(self):
    if self.tile_k <= 0 or self.tile_k % 64:
      raise ValueError(f"MgpuBlockSizes.tile_k={self.tile_k}: must be a "
                       "positive multiple of 64")
    if self.stages < 2:
      raise ValueError(f"MgpuBlockSizes.stages={self.stages}: must be >= 2")
    if self.max_split < 1 or self.target_ctas < 1:
      raise ValueError("MgpuBlockSizes.max_split and target_ctas must be >= 1")
    return self


# (w bits, layout) -> padded M -> (tile_k, stages): the ring (stages x
# tile_k x (128 w rows x bits / 8 + 2 Mp x bytes)), the epilogue tile and,
# for w [K, N], the conversion buffers' 32 KiB fit the H100's 227 KiB of
# SMEM. int4 rows keep about the 8-bit rows' w bytes per slot.
TILES = {
    (8, "nk"): {16: (256, 4), 32: (256, 4), 64: (128, 4), 128: (128, 4),
                192: (64, 4), 256: (64, 4)},
    (8, "kn"): {16: (256, 3), 32: (256, 3), 64: (128, 4), 128: (128, 3),
                192: (64, 4), 256: (64, 4)},
    (4, "nk"): {16: (512, 4), 32: (512, 3), 64: (256, 3), 128: (128, 3),
                192: (64, 4), 256: (64, 4)},
    (4, "kn"): {16: (512, 3), 32: (256, 4), 64: (256, 3), 128: (128, 3),
                192: (64, 4), 256: (64, 4)},
}


def padded_m(m: int) -> int:
  """x rows as the wgmma N side: a power of two in [16, 128], then a
  multiple of 64 up to MAX_M."""
  mp = 16
  while mp < min(m, 128):
    mp *= 2
  return mp if m <= 128 else -(-m // 64) * 64


@dataclasses.dataclass(frozen=True)
class Plan:
  mp: int
  np_: int
  kp: int
  split: int     # CTAs along K
  steps: int     # K steps per CTA
  sizes: MgpuBlockSizes
  cluster: int   # CTAs of adjacent column tiles sharing x tiles
  group_size: int | None = None
  tables: int = 0  # group tables streamed with w: 1 scales, 2 and zeros

  @property
  def fused(self) -> bool:
    """The epilogue runs in the kernel (no K split)."""
    return self.split == 1


def plan(m, k, n, sizes: MgpuBlockSizes | None = None,
         w_layout: str = "nk", bits: int = 8, group_size: int | None = None,
         tables: int = 0) -> Plan:
  """``group_size`` with ``tables`` (1: scales, 2: and zeros) group tables:
  tile_k becomes a multiple of the group (the largest <= the table's, at
  least one group) and the ring loses stages (to 2) until it fits."""
  sizes = (sizes or MgpuBlockSizes()).resolved(m, w_layout, bits)
  if group_size is not None and sizes.tile_k % group_size:
    sizes = dataclasses.replace(
        sizes, tile_k=max(1, sizes.tile_k // group_size) * group_size)
  mp, np_ = padded_m(m), -(-n // ROWS) * ROWS
  tiles = np_ // ROWS
  k_tiles = -(-k // sizes.tile_k)
  # The largest split whose CTAs still run in one wave of target_ctas.
  split = 1
  while (tiles * split * 2 <= sizes.target_ctas
         and split * 2 <= min(sizes.max_split, k_tiles)):
    split *= 2
  steps = -(-k_tiles // split)
  cluster = 2 if pairs_ctas(mp, tiles, w_layout, bits) else 1
  p = Plan(mp, np_, steps * split * sizes.tile_k, split, steps, sizes,
           cluster, group_size, tables)
  while p.sizes.stages > 2 and smem_bytes(p, w_layout, bits) > SMEM_BYTES:
    p = dataclasses.replace(p, sizes=dataclasses.replace(
        p.sizes, stages=p.sizes.stages - 1))
  return p


def pairs_ctas(mp: int, tiles: int, w_layout: str, bits: int) -> bool:
  """Whether CTAs of adjacent column tiles share (multicast) x tiles: from
  Mp = PAIR_MIN_MP on with an even tile count, except 8-bit w [N, K],
  which measured faster unpaired (docs/design/int8.md)."""
  if mp < PAIR_MIN_MP or tiles % 2:
    return False
  return w_layout == "kn" or bits == 4


def k_chunk(tile_k: int, w_layout: str, bits: int,
            group_size: int | None) -> int:
  """K per conversion (and wgmma): w [K, N] KN_CHUNK rows; w [N, K] 8-bit
  the whole tile; int4 [N, K] 128 (64 where tile_k or the group is not a
  multiple of 128), so that a chunk lies in one group."""
  if w_layout == "kn":
    return KN_CHUNK
  if bits == 8 and group_size is None:
    return tile_k
  whole = tile_k % 128 == 0 and (group_size is None or group_size % 128 == 0)
  return 128 if whole else 64


def epilogue_cols(mp: int) -> int:
  """x rows (accumulator columns) per epilogue store: the staging tile is
  [64, cols], so that M = 256 leaves shared memory to the ring."""
  return min(mp, 64)


def smem_bytes(p: Plan, w_layout: str = "nk", bits: int = 8) -> int:
  ring = p.sizes.stages * p.sizes.tile_k * (ROWS * bits // 8 + 2 * p.mp)
  if p.tables:  # [tile_k // g, 128] float32 per table and slot
    ring += p.sizes.stages * p.sizes.tile_k // p.group_size * ROWS * 4 * (
        p.tables)
  out = COMPUTE_WGS * ROWS_PER_WG * epilogue_cols(p.mp) * 4  # epilogue tiles
  if w_layout == "kn":  # two bf16 conversion buffers per warpgroup
    out += COMPUTE_WGS * 2 * KN_CHUNK * ROWS_PER_WG * 2
  return ring + out + 2048  # barriers/alignment


def _swizzle(minor_bytes: int) -> int:
  for swizzle in (128, 64, 32):
    if minor_bytes % swizzle == 0:
      return swizzle
  raise ValueError(f"no swizzle for a {minor_bytes}-byte minor dimension")


def _transforms(minor: int, bits: int):
  """Tiling and swizzle of a shared-memory tile whose minor dimension
  holds ``minor`` elements of ``bits`` bits (one swizzle span per tile)."""
  swizzle = _swizzle(minor * bits // 8)
  return (plgpu.TilingTransform((8, swizzle * 8 // bits)),
          plgpu.SwizzleTransform(swizzle))


def hardware(target) -> str | None:
  """Why ``target`` cannot run the kernel (not a Hopper GPU), else None."""
  if target.hopper:
    return None
  found = target.gpu_capability or "no GPU"
  return f"the Mosaic GPU weight-only kernel needs a Hopper GPU (sm_90), found {found}"


def supports(x2, w, x_scale=None, *, mode, w_layout, block_sizes=None,
             group_size=None, w_zero=None):
  """None when ``matmul`` handles this call (on a Hopper GPU), else why not."""
  reason = api_missing()
  if reason:
    return reason
  if mode != "weight_only":
    return "the Mosaic GPU weight-only kernel is weight-only"
  if w_layout not in ("nk", "kn"):
    return f"the Mosaic GPU weight-only kernel takes w_layout 'nk' or 'kn', got {w_layout!r}"
  if x_scale is not None:
    return "the Mosaic GPU weight-only kernel takes no x_scale"
  w_dtype = jnp.dtype(w.dtype)
  if w_dtype not in WEIGHT_DTYPES:
    return (f"the Mosaic GPU weight-only kernel takes int8, int4 or float8 "
            f"w, got {w_dtype.name}")
  if group_size is not None and w_dtype != INT4:
    return "the Mosaic GPU weight-only kernel takes group scales for int4 w only"
  if group_size is not None and group_size % GROUP_UNIT:
    return (f"the Mosaic GPU weight-only kernel needs group_size a multiple "
            f"of {GROUP_UNIT}, got {group_size}")
  if w_zero is not None and group_size is None:
    return "the Mosaic GPU weight-only kernel takes w_zero with group scales only"
  if jnp.dtype(x2.dtype) != jnp.dtype(jnp.bfloat16):
    return "the Mosaic GPU weight-only kernel needs bf16 x"
  m, k = x2.shape
  if not 0 < m <= MAX_M:
    return f"the Mosaic GPU weight-only kernel needs 0 < M <= {MAX_M}, got {m}"
  n = w.shape[0 if w_layout == "nk" else 1]
  if min(k, n) == 0:
    return "the Mosaic GPU weight-only kernel needs K, N > 0"
  bits = w_bits(w_dtype)
  try:
    p = plan(m, k, n, block_sizes, w_layout, bits, group_size,
             0 if group_size is None else 1 + (w_zero is not None))
  except ValueError as e:
    return str(e)
  if smem_bytes(p, w_layout, bits) > SMEM_BYTES:
    return "tile_k x stages do not fit in shared memory"
  return None


def to_bf16(w_tile, interpreting: bool):
  """The w tile as bf16 values (exact for every format). Hopper converts
  float8 only to f16 in hardware: float8 goes through float32."""
  dtype = jnp.dtype(w_tile.dtype)
  if interpreting or dtype in (jnp.dtype(jnp.int8), INT4):
    return w_tile.astype(jnp.bfloat16)
  return w_tile.astype(jnp.float32).astype(jnp.bfloat16)


def dequantize(w_tile, scale, zero, channel_dim: int, integer_zero: bool,
               interpreting: bool):
  """bf16 of a w tile: the exact conversion, or ``(w - zero) * scale`` in
  float32 rounded to bf16, with the group's ``scale`` (and ``zero``), [64]
  float32 per output channel, spread along ``channel_dim``.
  ``integer_zero``: the zero points are integers in [-128, 127], so w -
  zero is an integer in [-135, 135], exact in bf16: it is formed there, in
  half the instructions of float32 arithmetic."""
  w_bf16 = to_bf16(w_tile, interpreting)
  if scale is None:
    return w_bf16
  spread = lambda v: lax.broadcast_in_dim(  # noqa: E731
      v, w_tile.shape, (channel_dim,))
  if zero is not None and integer_zero:
    w_bf16 = w_bf16 - spread(zero.astype(jnp.bfloat16))
    zero = None
  wf = w_bf16.astype(jnp.float32)  # exact
  if zero is not None:
    wf = wf - spread(zero)
  return (wf * spread(scale)).astype(jnp.bfloat16)


def _pad_to(a, shape):
  pads = [(0, t - s) for s, t in zip(a.shape, shape)]
  if all(p == (0, 0) for p in pads):
    return a
  return jnp.pad(a, pads)


def _kernel_call(x2, w, w_scale, bias, groups, p: Plan, out_dtype, interpret,
                 kn):
  """The kernel: the final [Mp, Np] out_dtype result (``p.fused``), else
  float32 out^T partial sums [split, Np, Mp] (no scale, no bias). ``kn``:
  w is [K, N]. ``groups``: None, or (group_size, scale [G, N], zero [G, N]
  | None, integer_zero): float32 tables applied while converting w."""
  tk = p.sizes.tile_k
  chunk = p.steps * tk  # K per CTA
  bits = w_bits(w.dtype)
  group_size = groups[0] if groups else None
  kc = k_chunk(tk, "kn" if kn else "nk", bits, group_size)
  interpreting = bool(interpret)
  cluster = 1 if interpreting else p.cluster
  w = _pad_to(w, (p.kp, p.np_) if kn else (p.np_, p.kp))
  x = _pad_to(x2, (p.mp, p.kp))
  # x tiles are the same for every column tile: with a cluster, one TMA
  # load multicasts each to the cluster's CTAs (less L2 traffic).
  x_spec = plgpu.BlockSpec((p.mp, tk), lambda s: (0, s),
                           transforms=_transforms(tk, 16),
                           collective_axes=("n_sub",) if cluster > 1 else ())
  if kn:  # each warpgroup's 64 columns are whole swizzle tiles
    w_spec = plgpu.BlockSpec((tk, ROWS), lambda s: (s, 0),
                             transforms=_transforms(ROWS_PER_WG, bits))
    converted = plgpu.SMEM((COMPUTE_WGS, 2, KN_CHUNK, ROWS_PER_WG),
                           jnp.bfloat16,
                           transforms=_transforms(ROWS_PER_WG, 16))
  else:  # each K chunk is whole swizzle tiles
    w_spec = plgpu.BlockSpec((ROWS, tk), lambda s: (0, s),
                             transforms=_transforms(kc, bits))
  tables, table_specs = [], []  # group scale (and zero) [G, Np] float32
  if groups:  # streamed with w: [tk // g, 128] per step
    tables = [_pad_to(t, (p.kp // group_size, p.np_))
              for t in groups[1:3] if t is not None]
    table_specs = [plgpu.BlockSpec((tk // group_size, ROWS),
                                   lambda s: (s, 0))] * len(tables)
  integer_zero = bool(groups) and groups[3]
  cols = epilogue_cols(p.mp)  # accumulator columns per epilogue store
  vectors, is_scale = [], []  # fused: w_scale and/or bias, [Np] float32
  if p.fused:
    for v, scale in ((w_scale, True), (bias, False)):
      if v is not None:
        vectors.append(_pad_to(v.reshape(-1).astype(jnp.float32), (p.np_,)))
        is_scale.append(scale)
    staging = plgpu.SMEM((COMPUTE_WGS, cols, ROWS_PER_WG), out_dtype)
  else:
    staging = plgpu.SMEM((COMPUTE_WGS, ROWS_PER_WG, cols), jnp.float32)

  def kernel(w_gmem, x_gmem, *refs):
    *vector_refs, out_gmem = refs
    table_gmems = vector_refs[:len(tables)]
    vector_refs = vector_refs[len(tables):]
    scratch = (staging, converted) if kn else (staging,)
    pl.run_scoped(functools.partial(scoped, w_gmem, x_gmem, table_gmems,
                                    vector_refs, out_gmem),
                  *scratch, collective_axes="wg")

  def scoped(w_gmem, x_gmem, table_gmems, vector_refs, out_gmem, out_smem,
             converted_smem=None):
    tile = lax.axis_index("n_tiles")
    if cluster > 1:
      tile = tile * cluster + lax.axis_index("n_sub")
    part = lax.axis_index("k_split")
    wg = lax.axis_index("wg")
    k_slice = pl.ds(part * chunk, chunk)
    row0 = tile * ROWS + wg * ROWS_PER_WG

    def group_tables(table_refs, c, channel_dim):
      """The (scale, zero) [64] of the group holding chunk ``c`` of this
      step (row c * kc // g of the step's [tk // g, 128] table tiles)
      for this warpgroup's output channels; (None, None) without groups."""
      if not table_refs:
        return None, None
      channels = pl.ds(pl.multiple_of(wg * ROWS_PER_WG, ROWS_PER_WG),
                       ROWS_PER_WG)
      layout = (plgpu.Layout.WGMMA.reduce(1) if channel_dim == 0 else None)
      out = []
      index = (c * kc // group_size, channels)
      for ref in table_refs:
        out.append(ref[index] if interpreting else _compat.mosaic_gpu_load(
            ref, index, layout=layout, optimized=False))
      return out[0], (out[1] if len(out) > 1 else None)

    def body_kn(_, w_smem, x_smem, *rest):
      """w_smem [tk, 128]: this warpgroup's 64 columns, KN_CHUNK K rows
      at a time, through its two bf16 buffers."""
      *table_refs, acc = rest
      cols = pl.ds(pl.multiple_of(wg * ROWS_PER_WG, ROWS_PER_WG),
                   ROWS_PER_WG)
      for c in range(tk // KN_CHUNK):
        rows = pl.ds(c * KN_CHUNK, KN_CHUNK)
        scale, zero = group_tables(table_refs, c, 1)
        # float32 zero subtraction here too (docs/design/quantized.md)
        w_tile = dequantize(w_smem[rows, cols], scale, zero, 1, False,
                            interpreting)
        if interpreting:  # no transposed views there: transpose the values
          acc = acc + jnp.dot(w_tile.T, x_smem[:, rows].T,
                              preferred_element_type=jnp.float32)
          continue
        buffer = converted_smem.at[wg, c % 2]
        if c >= 2:  # the wgmma that read this buffer two chunks ago
          plgpu.wgmma_wait(1)
        buffer[...] = w_tile
        plgpu.commit_smem()
        plgpu.wgmma(acc, plgpu.transpose_ref(buffer, (1, 0)),
                    plgpu.transpose_ref(x_smem.at[:, rows], (1, 0)))
      if not interpreting:
        plgpu.wgmma_wait(0)  # the slot is released when the body returns
      return acc

    def body(_, w_smem, x_smem, *rest):
      *table_refs, acc = rest
      rows = pl.ds(wg * ROWS_PER_WG, ROWS_PER_WG)
      for c in range(tk // kc):
        ks = pl.ds(c * kc, kc)
        scale, zero = group_tables(table_refs, c, 0)
        w_tile = dequantize(w_smem[rows, ks], scale, zero, 0, integer_zero,
                            interpreting)
        if interpreting:  # no transposed views there: transpose the value
          acc = acc + jnp.dot(w_tile, x_smem[:, ks].T,
                              preferred_element_type=jnp.float32)
        else:
          plgpu.wgmma(acc, w_tile,
                      plgpu.transpose_ref(x_smem.at[:, ks], (1, 0)))
      if not interpreting:
        plgpu.wgmma_wait(0)  # the slot is released when the body returns
      return acc

    def epilogue(acc):
      """acc [64, Mp]: * w_scale + bias per row, cast, stored as out
      [Mp, 64] at column row0, ``cols`` x rows at a time."""
      for ref, scale in zip(vector_refs, is_scale):
        if interpreting:
          v = ref[pl.ds(row0, ROWS_PER_WG)]
        else:  # one value per accumulator row, in the wgmma's row layout
          v = _compat.mosaic_gpu_load(
              ref, (pl.ds(row0, ROWS_PER_WG),),
              layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
        v = lax.broadcast_in_dim(v, (ROWS_PER_WG, p.mp), (0,))
        acc = acc * v if scale else acc + v
      val = acc.astype(out_dtype)
      for c in range(p.mp // cols):
        piece = val[:, c * cols:(c + 1) * cols]
        if interpreting:
          out_smem.at[wg][...] = piece.T
        else:  # a register shuffle to the transposed layout, then the store
          piece = plgpu.layout_cast(piece, plgpu.Layout.WGMMA_TRANSPOSED)
          plgpu.transpose_ref(out_smem.at[wg], (1, 0))[...] = piece
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
            out_smem.at[wg],
            out_gmem.at[pl.ds(c * cols, cols), pl.ds(row0, ROWS_PER_WG)])
        plgpu.wait_smem_to_gmem(0)

    def store_partial(acc):
      for c in range(p.mp // cols):
        out_smem.at[wg][...] = acc[:, c * cols:(c + 1) * cols]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
            out_smem.at[wg],
            out_gmem.at[part, pl.ds(row0, ROWS_PER_WG),
                        pl.ds(c * cols, cols)])
        plgpu.wait_smem_to_gmem(0)

    def compute_context(run_pipeline):
      if interpreting:
        acc = run_pipeline(jnp.zeros((ROWS_PER_WG, p.mp), jnp.float32))
      else:
        def scope(acc_ref):
          run_pipeline(acc_ref)
          return acc_ref[...]
        acc = pl.run_scoped(scope, plgpu.ACC((ROWS_PER_WG, p.mp),
                                             jnp.float32))
      (epilogue if p.fused else store_partial)(acc)

    pipeline = plgpu.emit_pipeline_warp_specialized(
        body_kn if kn else body, grid=(p.steps,), memory_registers=40,
        in_specs=[w_spec, x_spec, *table_specs], wg_axis="wg",
        num_compute_wgs=COMPUTE_WGS,
        max_concurrent_steps=p.sizes.stages, compute_context=compute_context)
    w_block = ((k_slice, pl.ds(tile * ROWS, ROWS)) if kn
               else (pl.ds(tile * ROWS, ROWS), k_slice))
    groups_per_cta = chunk // group_size if tables else 0
    table_blocks = [t.at[pl.ds(part * groups_per_cta, groups_per_cta),
                         pl.ds(tile * ROWS, ROWS)] for t in table_gmems]
    pipeline(w_gmem.at[w_block], x_gmem.at[:, k_slice], *table_blocks)

  kwargs = {}
  if interpret:
    kwargs["interpret"] = interpret
  if cluster > 1:
    kwargs.update(cluster=(cluster,), cluster_names=("n_sub",))
  if p.fused:
    out_type = jax.ShapeDtypeStruct((p.mp, p.np_), out_dtype)
  else:
    out_type = jax.ShapeDtypeStruct((p.split, p.np_, p.mp), jnp.float32)
  return plgpu.kernel(
      kernel,
      out_type=out_type,
      grid=(p.np_ // ROWS // cluster, p.split),
      grid_names=("n_tiles", "k_split"),
      num_threads=COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      **kwargs,
  )(w, x, *tables, *vectors)


def matmul(x2, w, x_scale, w_scale, bias, *, mode, out_dtype, w_layout,
           block_sizes=None, group_size=None, w_zero=None,
           integer_zero=False, interpret=False):
  """Weight-only x2 [M, K] bf16 @ w ([N, K] or [K, N] by ``w_layout``) ->
  [M, N] out_dtype. ``w_scale``: [1, N] per channel, or with ``group_size``
  (int4 w) [K // g, N], as is ``w_zero`` (float32 tables, as
  ``quant.operands`` normalizes them); ``integer_zero``: w_zero holds
  integers in [-128, 127] (it came as int4, uint4 or int8).

  Same contract as ``triton.int8_matmul``; call only where ``supports`` is None.
  ``interpret``: False on a GPU, an ``InterpretGPUParams`` (or True) to run
  in the Mosaic GPU interpreter.
  """
  why = supports(x2, w, x_scale, mode=mode, w_layout=w_layout,
                 block_sizes=block_sizes, group_size=group_size,
                 w_zero=w_zero)
  if why is not None:
    raise ValueError(f"mosaic_gpu.matmul (weight-only): unsupported call: {why}")
  if interpret is True:
    interpret = interpret_params()
  m, k = x2.shape
  kn = w_layout == "kn"
  n = w.shape[1 if kn else 0]
  p = plan(m, k, n, block_sizes, w_layout, w_bits(w.dtype), group_size,
           0 if group_size is None else 1 + (w_zero is not None))
  groups = None
  if group_size is not None:
    groups = (group_size, w_scale.astype(jnp.float32),
              None if w_zero is None else w_zero.astype(jnp.float32),
              integer_zero)
    w_scale = None
  if p.fused:
    out = _kernel_call(x2, w, w_scale, bias, groups, p, jnp.dtype(out_dtype),
                       interpret, kn)
    return out if out.shape == (m, n) else out[:m, :n]
  parts = _kernel_call(x2, w, None, None, groups, p, jnp.float32, interpret,
                       kn)
  acc = parts.sum(axis=0)[:n, :m].T
  return quant.epilogue(acc, None, w_scale, bias, out_dtype)
