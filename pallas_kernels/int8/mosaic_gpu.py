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

Epilogue (``fused``, the default wherever K is not split): each compute
  warpgroup multiplies its float32 accumulator rows by w_scale and adds the
  bias (both loaded from GMEM in the accumulator's row layout), casts, turns
  the tile into out's orientation with a register shuffle (WGMMA_TRANSPOSED
  layout) stored through a transposed SMEM view, and TMA-stores [Mp, 64] of
  out [M, N]: one launch per matmul.

Split K: the K range is split over the largest power of two (<=
  ``max_split``) of CTAs that keeps all CTAs in one wave of ``target_ctas``
  (132 SMs; the ring takes most of an SM's SMEM, so one CTA each): N = 14336
  with 128-row tiles runs 112 CTAs unsplit, N = 4096 32 tiles x 4. The
  partial sums meet either
    "xla" (default): each CTA writes its float32 partial out^T [split, Np,
      Mp]; one XLA fusion sums them, applies w_scale and bias, transposes
      and casts (1.5-3 us at the shapes below, plus a launch); or
    "cluster" (``split_reduce``, <= MAX_CLUSTER CTAs, 64-row warpgroups):
      the split's CTAs form a cluster; parts 1.. leave their partials in
      their own SMEM and arrive on part 0's cluster barrier, part 0 reads
      them through distributed shared memory (``cluster_ref``), adds and
      runs the fused epilogue; every CTA waits on a second barrier until
      part 0 has read, so no SMEM is read after its CTA left. Correct and
      repeatable on the H100, but slower as measured so far (clusters of 4
      CTAs of ~200 KiB SMEM do not all fit in one wave).

x multicast (``cluster``): CTAs of adjacent column tiles form a cluster and
  the pipeline loads each x tile once for all of them (TMA multicast; x
  BlockSpec ``collective_axes``). At Mp = 128 x is 2/3 of a CTA's loads (128
  x tile_k bf16 beside 128 x tile_k int8 w), all of it re-read from L2 by
  every CTA; pairs halve that. Default: pairs at Mp = 128 (split K or
  not; not with the cluster reduction, whose cluster is the split).

Tiles (DEFAULT_TILES, by padded M; two compute warpgroups of 64 w rows):
  Mp 16/32 tile_k 256 x 4 stages, Mp 64 256 x 2, Mp 128 128 x 3. SMEM:
  stages x tile_k x (128 + 2 Mp) bytes of ring + 2 x 64 x Mp x 4 of
  epilogue (twice that with the cluster reduction), within the H100's 227
  KiB.

Measured (H100, jax 0.11.2, us per call; JAX timed as programs of 10-20
calls on distinct input copies, host sync hidden; torch with CUDA events):
  this session (stop 11), bench/results/int8_matmul_{16,128}-h100-* (the
  public call, 10 per program) and int8_matmul_mgpu_variants*-h100-*
  (the variants side by side in one process, 20 per program):
  ==============  ==========================================  ==========
  M x K x N       this kernel (variant: us)                   torch bf16
  ==============  ==========================================  ==========
  16x4096x14336   old 34.9, fused 32.3, fused+x pairs 31.8;   48.4
                  public call, forced: fused 36.3             51.1
                  (the Triton kernel: 30.4, 32.3)
  16x14336x4096   split 4 + XLA 37.4; cluster sum (4) 45.8    46.6/45.1
                  (the Triton kernel: 34.8)
  128x4096x14336  old 47.1, fused 41.9, fused+x pairs 41.1,   48.3
                  x quads 43.9; public call (fused+pairs)
                  43.0 = 1.11x torch bf16                     47.6
  128x14336x4096  split 4 + XLA 47.0 (public call 44.1 =      54.6/54.9
                  1.24x), + x pairs 43.7 (1.25x), cluster
                  sum (2 x 64-row CTAs) 48.7
  ==============  ==========================================  ==========
  So: the fused epilogue saves 2.6-5 us (the XLA pass and its launch gap);
  x pairs (multicast) 0.5-3 us; the cluster sum of split partials is
  correct but slower (clusters of four 200 KiB-SMEM CTAs do not all run in
  one wave; pairs of one-warpgroup CTAs stream w slower). Run to run the
  same call moved by up to 10% (Triton at 16x4096x14336: 29.8-37.7 us
  over the sessions), so differences under ~3 us are not established.
  Last session's profile (int8_matmul_mgpu-h100-*): the kernel alone 25.4
  us at M = 16 (2.3 TB/s of w) and 33-35 us at M = 128; the timed call
  added ~5-7 us, most of it each sample's one dispatch and wait, which the
  bench's steady timing (stop 13) no longer counts. Tried before: x^T made
  by XLA (B N-major) +10%; a finer split (two waves) +6-10%; tile_k 128 x
  8 stages +4%; at M = 128 one compute warpgroup per CTA or 128 rows per
  warpgroup (tile_k 64) 24-27% slower.
  Stop 13 (int8_matmul_128-h100-2026-11-23, steady timing): the public
  call at M = 128 32.2 / 35.4 us = 1.44x / 1.50x torch bf16, kernels alone
  1.35x / 1.44x cuBLAS. ncu at 128x4096x14336: DRAM and L2 55% busy,
  tensor pipe 46% of elapsed cycles, SMs active 76% (112 CTAs): bound by
  each step's load-convert-wgmma-wait chain. Keeping one wgmma in flight
  (wgmma_wait(1), slots released a step late, the previous converted tile
  held live) is right at Mp 16 but WRONG at Mp 128
  (int8_matmul_overlap_probe): a live value does not pin the registers the
  in-flight wgmma reads, so wgmma_wait(0) stays.

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
``interpret`` the product is a float32-accumulated dot of the same tiles,
the epilogue's transpose is a value transpose, clusters are single CTAs
(no multicast), and it has no cluster barriers: a "cluster" split runs the
"xla" reduction there (the GPU bench checks the cluster sum: bench
``--variants``).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _compat, _mosaic_gpu

pl = _compat.pl

plgpu = _mosaic_gpu.plgpu

ROWS_PER_WG = 64  # one wgmma M tile of w rows per compute warpgroup
MAX_M = 128
MAX_CLUSTER = 4  # CTAs per cluster for the in-cluster split-K reduction
AUTO_CLUSTER_MIN_MP = 128  # x multicast by default from this padded M on
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
  view), ``wg_rows``, and the epilogue / cluster switches ``fused``,
  ``cluster`` and ``split_reduce`` (module docstring)."""
  tile_k: int | None = None  # None: DEFAULT_TILES by padded M
  stages: int | None = None
  compute_wgs: int = 2
  target_ctas: int = 132
  max_split: int = 8
  x_pretransposed: bool = False
  wg_rows: int = 64  # w rows per compute warpgroup: 64 or 128
  # True: no K split, the epilogue in the kernel (one launch); None: so
  # wherever the column tiles alone fill target_ctas; False: never.
  fused: bool | None = None
  # Column tiles per CTA cluster sharing (multicast) x tiles; None: 2
  # where x tiles are wide (Mp 128: x is 2/3 of a CTA's loads there) and
  # the column tiles pair up, else 1.
  cluster: int | None = None
  # Where a K split's partial sums meet: "xla" (float32 partials, one XLA
  # pass adds them and applies the epilogue) or "cluster" (the split's CTAs
  # form a cluster; the first sums the others' partials from their shared
  # memory and runs the fused epilogue: one launch).
  split_reduce: str = "xla"

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
    if self.cluster not in (None, 1, 2, 4):
      raise ValueError(f"MgpuBlockSizes.cluster={self.cluster}: must be 1, "
                       "2 or 4")
    if self.split_reduce not in ("xla", "cluster"):
      raise ValueError(f"MgpuBlockSizes.split_reduce={self.split_reduce!r}: "
                       "must be 'xla' or 'cluster'")
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
  fused: bool = False   # epilogue in the kernel (one launch)
  cluster: int = 1      # CTAs per cluster along the column tiles
  cluster_reduce: bool = False  # split partials summed within a cluster


def plan(m, k, n, sizes: MgpuBlockSizes | None = None) -> Plan:
  sizes = (sizes or MgpuBlockSizes()).resolved(m)
  rows = sizes.compute_wgs * sizes.wg_rows
  mp, np_ = padded_m(m), -(-n // rows) * rows
  tiles = np_ // rows
  k_tiles = -(-k // sizes.tile_k)
  # The largest split whose CTAs still run in one wave of target_ctas (a
  # second, partial wave cost more than the finer split gained).
  cluster_reduce = (sizes.split_reduce == "cluster" and sizes.fused is not False
                    and sizes.wg_rows == ROWS_PER_WG)
  max_split = min(sizes.max_split, MAX_CLUSTER if cluster_reduce else 1 << 30)
  split = 1
  while (sizes.fused is not True and tiles * split * 2 <= sizes.target_ctas
         and split * 2 <= max_split and split * 2 <= k_tiles):
    split *= 2
  steps = -(-k_tiles // split)
  cluster_reduce = cluster_reduce and split > 1
  fused = (split == 1 or cluster_reduce) and sizes.fused is not False
  cluster = sizes.cluster
  if cluster is None:
    cluster = 2 if mp >= AUTO_CLUSTER_MIN_MP else 1
  if tiles % cluster or cluster_reduce:
    cluster = 1
  return Plan(mp, np_, steps * split * sizes.tile_k, rows, split, steps, sizes,
              fused, cluster, cluster_reduce)


def smem_bytes(p: Plan) -> int:
  ring = p.sizes.stages * p.sizes.tile_k * (p.rows + 2 * p.mp)
  out = p.sizes.compute_wgs * ROWS_PER_WG * p.mp * 4  # epilogue chunks
  if p.cluster_reduce:  # + the float32 partials the cluster's first CTA reads
    out += p.sizes.compute_wgs * ROWS_PER_WG * p.mp * 4
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


def hardware(target) -> str | None:
  """Why ``target`` cannot run the kernel (not a Hopper GPU), else None."""
  if target.hopper:
    return None
  found = target.gpu_capability or "no GPU"
  return f"the Mosaic GPU int8 kernel needs a Hopper GPU (sm_90), found {found}"


def supports(x2, w, x_scale=None, *, mode, w_layout, block_sizes=None):
  """None when ``matmul`` handles this call (on a Hopper GPU), else why not."""
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
  return None


def _pad_to(a, shape):
  pads = [(0, t - s) for s, t in zip(a.shape, shape)]
  if all(p == (0, 0) for p in pads):
    return a
  return jnp.pad(a, pads)


def _cluster_fence():
  """fence.acq_rel.cluster: orders this thread's shared-memory writes before
  its later barrier arrivals as seen from the other CTAs of the cluster."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import llvm

  @plgpu.inline_mgpu()
  def fence(ctx):
    del ctx
    llvm.inline_asm(ir.Type.parse("!llvm.void"), [], "fence.acq_rel.cluster;",
                    "", has_side_effects=True)
  fence()


def _kernel_call(x2, w, w_scale, bias, p: Plan, out_dtype, interpret):
  """The kernel: the final [Mp, Np] out_dtype result (``p.fused``), else
  float32 out^T partial sums [split, Np, Mp] (no scale, no bias)."""
  sizes = p.sizes
  tk, wgs, rows, wg_rows = (sizes.tile_k, sizes.compute_wgs, p.rows,
                            sizes.wg_rows)
  chunk = p.steps * tk  # K per CTA
  interpreting = bool(interpret)
  cluster = 1 if interpreting else p.cluster
  w = _pad_to(w, (p.np_, p.kp))
  x = _pad_to(x2, (p.mp, p.kp))
  # x tiles are the same for every column tile: with a cluster, one TMA
  # load multicasts each to the cluster's CTAs (less L2 traffic).
  collective = ("n_sub",) if cluster > 1 else ()
  if sizes.x_pretransposed:
    x = x.T  # [Kp, Mp]
    x_spec = plgpu.BlockSpec((tk, p.mp), lambda s: (s, 0),
                             transforms=_transforms(p.mp, 2),
                             collective_axes=collective)
  else:
    x_spec = plgpu.BlockSpec((p.mp, tk), lambda s: (0, s),
                             transforms=_transforms(tk, 2),
                             collective_axes=collective)
  w_spec = plgpu.BlockSpec((rows, tk), lambda s: (0, s),
                           transforms=_transforms(tk, 1))
  vectors = []  # fused: w_scale then bias, [Np] float32 each
  if p.fused:
    vectors = [_pad_to(v.reshape(-1).astype(jnp.float32), (p.np_,))
               for v in (w_scale, bias) if v is not None]
  is_scale = [True] * (p.fused and w_scale is not None) + [False] * (
      p.fused and bias is not None)
  if p.fused:  # the out tile, transposed from the accumulator's rows
    staging = [plgpu.SMEM((wgs, p.mp, ROWS_PER_WG), out_dtype)]
  else:
    staging = [plgpu.SMEM((wgs, ROWS_PER_WG, p.mp), jnp.float32)]
  if p.cluster_reduce:  # partials, "partials written", "partials read"
    staging += [[plgpu.SMEM((ROWS_PER_WG, p.mp), jnp.float32)
                 for _ in range(wgs)],
                plgpu.ClusterBarrier(collective_axes=("k_split",),
                                     num_arrivals=wgs, leader_tracked=True),
                plgpu.ClusterBarrier(collective_axes=("k_split",),
                                     num_arrivals=wgs)]

  def kernel(w_gmem, x_gmem, *refs):
    *vector_refs, out_gmem = refs
    pl.run_scoped(functools.partial(scoped, w_gmem, x_gmem, vector_refs,
                                    out_gmem),
                  *staging, collective_axes="wg")

  def scoped(w_gmem, x_gmem, vector_refs, out_gmem, out_smem, *reduction):
    tile = lax.axis_index("n_tiles")
    if cluster > 1:
      tile = tile * cluster + lax.axis_index("n_sub")
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

    def epilogue(acc, row0):
      """acc [64, Mp]: * w_scale + bias per row, cast, stored as out
      [Mp, 64] at column row0."""
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
      if interpreting:
        out_smem.at[wg][...] = val.T
      else:  # a register shuffle to the transposed layout, then the store
        val = plgpu.layout_cast(val, plgpu.Layout.WGMMA_TRANSPOSED)
        plgpu.transpose_ref(out_smem.at[wg], (1, 0))[...] = val
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_smem.at[wg],
                              out_gmem.at[:, pl.ds(row0, ROWS_PER_WG)])
      plgpu.wait_smem_to_gmem(0)

    def cluster_sum_and_store(acc, row0):
      """K split within a cluster: the CTAs of parts 1.. leave their
      partials in their shared memory, part 0 adds them to its own and
      stores the result; each CTA leaves only once part 0 has read."""
      partial_smems, written, read = reduction

      for g, partial_smem in enumerate(partial_smems):  # static refs
        @pl.when((part != 0) & (wg == g))
        def _():
          partial_smem[...] = acc
          plgpu.commit_smem()  # the whole warpgroup's rows written
          _cluster_fence()
      plgpu.barrier_arrive(written)  # lands on part 0's barrier

      @pl.when(part == 0)
      def _():
        plgpu.barrier_wait(written)
        _cluster_fence()
        for g, partial_smem in enumerate(partial_smems):
          @pl.when(wg == g)
          def _():
            total = acc
            for r in range(1, p.split):
              total = total + plgpu.cluster_ref(partial_smem,
                                                {"k_split": r})[...]
            epilogue(total, row0)
        plgpu.barrier_arrive(read)

      @pl.when(part != 0)
      def _():
        plgpu.barrier_arrive(read)
      plgpu.barrier_wait(read)

    def compute_context(run_pipeline):
      if interpreting:
        acc = run_pipeline(jnp.zeros((wg_rows, p.mp), jnp.float32))
      else:
        def scope(acc_ref):
          run_pipeline(acc_ref)
          return acc_ref[...]
        acc = pl.run_scoped(scope, plgpu.ACC((wg_rows, p.mp), jnp.float32))
      for c in range(wg_rows // ROWS_PER_WG):  # through SMEM, 64 rows a time
        piece = acc[c * ROWS_PER_WG:(c + 1) * ROWS_PER_WG]
        row0 = tile * rows + wg * wg_rows + c * ROWS_PER_WG
        if p.cluster_reduce:
          cluster_sum_and_store(piece, row0)
          continue
        if p.fused:
          epilogue(piece, row0)
          continue
        out_smem.at[wg][...] = piece
        plgpu.commit_smem()
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
  grid, grid_names = (p.np_ // rows // cluster, p.split), ("n_tiles", "k_split")
  if cluster > 1:
    kwargs.update(cluster=(cluster,), cluster_names=("n_sub",))
  if p.cluster_reduce:
    grid, grid_names = grid[:1], grid_names[:1]
    kwargs.update(cluster=(p.split,), cluster_names=("k_split",))
  if p.fused:
    out_type = jax.ShapeDtypeStruct((p.mp, p.np_), out_dtype)
  else:
    out_type = jax.ShapeDtypeStruct((p.split, p.np_, p.mp), jnp.float32)
  return plgpu.kernel(
      kernel,
      out_type=out_type,
      grid=grid,
      grid_names=grid_names,
      num_threads=wgs + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      **kwargs,
  )(w, x, *vectors)


def matmul(x2, w, x_scale, w_scale, bias, *, mode, out_dtype, w_layout,
           block_sizes=None, interpret=False):
  """Weight-only x2 [M, K] bf16 @ w [N, K] int8 -> [M, N] out_dtype.

  Same contract as ``triton.matmul``; call only where ``supports`` is None.
  ``interpret``: False on a GPU, an ``InterpretGPUParams`` (or True) to run
  in the Mosaic GPU interpreter.
  """
  why = supports(x2, w, x_scale, mode=mode, w_layout=w_layout,
                 block_sizes=block_sizes)
  if why is not None:
    raise ValueError(f"int8 mosaic_gpu.matmul: unsupported call: {why}")
  if interpret is True:
    interpret = interpret_params()
  m, k = x2.shape
  n = w.shape[0]
  p = plan(m, k, n, block_sizes)
  if interpret and p.cluster_reduce:  # no cluster barriers in the interpreter
    p = dataclasses.replace(p, fused=False, cluster_reduce=False)
  if p.fused:
    out = _kernel_call(x2, w, w_scale, bias, p, jnp.dtype(out_dtype),
                       interpret)
    return out if out.shape == (m, n) else out[:m, :n]
  parts = _kernel_call(x2, w, None, None, p, jnp.float32, interpret)
  acc_t = parts.sum(axis=0) if p.split > 1 else parts[0]  # [Np, Mp]
  acc = acc_t[:n, :m].T
  out = acc if w_scale is None else acc * w_scale
  if bias is not None:
    out = out + bias
  return out.astype(out_dtype)
