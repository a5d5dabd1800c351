"""Public int8 ops: ``quantize_int8`` and ``int8_matmul`` (modes raw, dequant,
dynamic and weight-only; w [K, N] or [N, K] with ``weight_layout="nk"``).
Kernel choice: the first of mosaic_tpu, mosaic_gpu, triton, reference that
supports the call. Modes and layouts: docs/design/int8.md.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _backend, _frozen, _sharding
from pallas_kernels.quant import int8_block_sizes as bs
from pallas_kernels.quant import int8_mosaic_gpu as mosaic_gpu
from pallas_kernels.quant import int8_mosaic_tpu as mosaic_tpu
from pallas_kernels.quant import operands
from pallas_kernels.quant import int8_quantize as quant
from pallas_kernels.quant import int8_reference as reference
from pallas_kernels.quant import triton
from pallas_kernels.quant import mosaic_gpu as product_kernel

MAX_INT8_K = operands.MAX_INT8_K


# ----------------------------------------------------------------------------
# quantize_int8


def quantize_int8(x, *, axis=-1, backend=None):
  """Symmetric int8 quantization: ``(q, scale)`` with ``x ~= q * scale``.

  scale = max|x| * float32(1/127) over ``axis``, or 1 where that max is 0;
  q = clip(round_half_even(x * (1 / scale)), -127, 127) as int8 (one
  reciprocal per row, so every implementation rounds alike). NaN quantizes to
  0 and makes its row's scale NaN (inf: an inf scale), so nothing
  dequantized from a bad row looks plausible.

  Args:
    x: bfloat16, float16 or float32 array.
    axis: the axis reduced (an int), or None for one scale over all of x.
    backend: None, "mosaic_tpu", "interpret" or "reference" (the kernel
      quantizes along the last axis; other axes run XLA). "gpu" runs the
      reference, which XLA fuses into one pass: there is no GPU kernel.
  Returns:
    q: int8, x's shape.
    scale: float32, x's shape with ``axis`` kept as size 1 (0-d for
      ``axis=None``).
  """
  axis = operands.quantize_axis(x, axis)
  _backend.check_backend("quantize_int8", backend)
  xla = functools.partial(quant.quantize, axis=axis)
  if axis is None or axis != x.ndim - 1 or x.size == 0:
    return xla(x)
  if backend == "gpu":
    backend = "reference"

  def tpu(x_, interpret=None):
    q, s = mosaic_tpu.quantize_rows(x_.reshape(-1, x_.shape[-1]),
                                    interpret=interpret or False)
    return q.reshape(x_.shape), s.reshape(x_.shape[:-1] + (1,))

  rule = quantize_rule("quantize_int8", x.ndim, x.ndim - 1)
  return _backend.dispatch(
      "quantize_int8", backend,
      [_backend.Kernel("mosaic_tpu", tpu), _backend.Kernel("reference", xla)],
      x, rule=rule)


def quantize_rule(op, ndim, axis):
  """Every dimension of x split but ``axis`` (the scale is the maximum over
  it, kept as size 1); with ``axis=None`` (one scale, 0-d) none."""
  dims = [f"a{i}" for i in range(ndim)]
  if axis is None:
    x = " ".join(dims)
    return _sharding.make_rule(op, [("x", x)], [x, ""], split="",
                               helper="jax.shard_map",
                               names={d: "axis=None" for d in dims})
  dims[axis] = "r"
  x = " ".join(dims)
  return _sharding.make_rule(
      op, [("x", x)], [x, " ".join("one" if d == "r" else d for d in dims)],
      split=" ".join(d for d in dims if d != "r"), helper="jax.shard_map",
      names={"r": f"axis={axis}" if axis != ndim - 1 else "quantized (last)"})


# ----------------------------------------------------------------------------
# int8_matmul


def as_block_sizes(block_sizes, op="int8_matmul"):
  """(BlockSizes | None, TPU generation | None) from None | BlockSizes |
  (bm, bk, bn[, warps, stages]) | dict | a TPU generation name."""
  if block_sizes is None or isinstance(block_sizes, bs.BlockSizes):
    return block_sizes, None
  if isinstance(block_sizes, str):
    if block_sizes not in bs.TPU_GENERATIONS:
      raise ValueError(f"{op}: block_sizes={block_sizes!r} names no TPU "
                       f"generation of {bs.TPU_GENERATIONS}")
    return None, block_sizes
  if isinstance(block_sizes, dict):
    return bs.BlockSizes(**block_sizes), None
  if isinstance(block_sizes, (tuple, list)) and 3 <= len(block_sizes) <= 5:
    return bs.BlockSizes(*block_sizes), None
  raise TypeError(f"{op}: block_sizes={block_sizes!r} must be None, a "
                  "BlockSizes, a (bm, bk, bn) tuple, a dict or a TPU "
                  "generation name")


def int8_matmul(x, w, *, x_scale=None, w_scale=None, bias=None, out_dtype=None,
                block_sizes=None, weight_only=False, weight_layout="kn",
                backend=None):
  """x @ w for int8 w with a fused epilogue.

  Modes: raw (int8 x, no scales or bias: exact int32); dequant (int8 x with
  scales, bias or a float out_dtype: ``((acc * x_scale) * w_scale + bias)``
  in float32); dynamic (float x quantized per row, then dequant); weight_only
  (float x times w upcast to x's dtype, float32 sums). Differentiable in
  weight-only x and in bias only. Details: docs/design/int8.md.

  Args:
    x: [..., K] int8, or bfloat16/float16/float32 (dynamic or weight-only).
    w: [K, N] int8, or [N, K] with weight_layout="nk".
    x_scale: scalar or x.shape[:-1] + (1,) float, int8 x only.
    w_scale: scalar, [N] or [1, N] float (per output channel; "nk" also
      [N, 1]).
    bias: [N] or [1, N] float, added after scaling.
    out_dtype: int32 (raw mode only) or a float dtype.
    block_sizes: None (table), BlockSizes / (bm, bk, bn[, warps, stages]),
      or a TPU generation name ("v5e", "v6e", ...) to use that table row.
    weight_only: float x is multiplied by the dequantized w (w8a16).
    weight_layout: "kn" (w is [K, N]) or "nk" (w is [N, K], no transpose
      per call on GPUs).
    backend: None (chosen per platform), "mosaic_tpu", "triton",
      "mosaic_gpu", "gpu" (the best GPU kernel), "interpret" or "reference".
  Returns:
    x.shape[:-1] + (N,): int32 in raw mode, else out_dtype (default
    bfloat16 for int8 x, x's dtype for float x).
  Raises:
    ValueError: K > MAX_INT8_K (131071) in an int8 x int8 mode, where the
      int32 sum could overflow.
  """
  _backend.check_backend("int8_matmul", backend)
  call = operands.int8_matmul_call(x, w, x_scale=x_scale, w_scale=w_scale,
                              bias=bias, out_dtype=out_dtype,
                              weight_only=weight_only,
                              weight_layout=weight_layout)
  user_blocks, generation = as_block_sizes(block_sizes)
  if call.empty:
    return call.result(reference.matmul_2d(*call.operands, **call.static))
  x2, w, x_scale, w_scale, bias = call.operands
  kernels = _matmul_kernels(x2, w, x_scale, call.static, user_blocks,
                            generation)
  rule = matmul_rule(weight_layout, x_scale, w_scale, bias)
  out = _frozen.frozen(
      "int8_matmul", lambda *a: _backend.dispatch("int8_matmul", backend,
                                                  kernels, *a, rule=rule),
      ("x", "w", "x_scale", "w_scale", "bias"), call.operands,
      _matmul_linear(call), _MATMUL_REASONS)
  return call.result(out)


_FROZEN = "int8 weights are frozen (not differentiable)"
_MATMUL_REASONS = {
    "x": ("float x is quantized per row on the fly (dynamic mode), which has "
          "no gradient: pass weight_only=True, or train through "
          "pallas_kernels.nn.int8_dense"),
    "x_scale": "x_scale belongs to the int8 x: not differentiable",
    "w_scale": (f"w_scale belongs to the int8 weight w: {_FROZEN}; train "
                "through pallas_kernels.nn.int8_dense or quantized_dense"),
}


def _matmul_linear(call):
  """Tangents in x (weight-only) and bias, in plain JAX (see _frozen)."""
  m, n = call.operands[0].shape[0], call.n

  def bias(t, *_):
    return jnp.broadcast_to(t.astype(jnp.float32), (m, n))

  def x(t, x2, w, xs, ws, b):
    return reference.matmul_2d(t, w, None, ws, None, mode="weight_only",
                               out_dtype=jnp.float32,
                               w_layout=call.w_layout)
  return ({"x": x, "bias": bias} if call.mode == "weight_only"
          else {"bias": bias})


def mosaic_gpu_refusal(x2, w, x_scale, mode, w_layout, user_blocks, *,
                       group_size=None, w_zero=None):
  """Why the Mosaic GPU weight-only kernel does not take this call, or None:
  the kernel's own limits, then the M range where it beats the Triton
  kernel (``block_sizes.gpu_weight_only_mosaic_m``)."""
  why = mosaic_gpu.supports(x2, w, x_scale, mode=mode, w_layout=w_layout,
                            group_size=group_size, w_zero=w_zero)
  low, high = bs.gpu_weight_only_mosaic_m(w.dtype, w_layout)
  m = x2.shape[0]
  if why is None and not low <= m <= high:
    why = (f"M={m} is outside [{low}, {high}], where the Triton kernel is "
           "faster")
  if why is None and user_blocks is not None:
    why = "block_sizes are for the Triton and TPU kernels"
  return why


def _matmul_kernels(x2, w, x_scale, static, user_blocks, generation):
  """int8_matmul's implementations for one normalized call, best first."""
  def tpu(*arrays, interpret=None):
    return mosaic_tpu.matmul(*arrays, **static, block_sizes=user_blocks,
                             generation=generation,
                             interpret=interpret or False)

  product = static["mode"] != "weight_only"

  def mgpu(*arrays, interpret=None):
    kernel = product_kernel if product else mosaic_gpu
    return kernel.matmul(*arrays, **static, interpret=interpret or False)

  def mgpu_supports():
    if product:
      return product_kernel.auto_refusal(
          x2, w, mode=static["mode"], out_dtype=static["out_dtype"],
          user_blocks=user_blocks)
    return mosaic_gpu_refusal(x2, w, x_scale, static["mode"],
                              static["w_layout"], user_blocks)

  def triton_(*arrays, interpret=None):
    return triton.int8_matmul(*arrays, **static, block_sizes=user_blocks,
                         interpret=interpret or False)

  return [
      _backend.Kernel("mosaic_tpu", tpu),
      _backend.Kernel("mosaic_gpu", mgpu, supports=mgpu_supports,
                      hardware=(product_kernel.hardware if product
                                else mosaic_gpu.hardware)),
      _backend.Kernel("triton", triton_),
      _backend.Kernel("reference", functools.partial(reference.matmul_2d,
                                                     **static)),
  ]


def matmul_rule(weight_layout, x_scale, w_scale, bias, x_ndim=2):
  """Rows (m) and output columns (n) split; K is contracted, never split.

  ``x_ndim``: x's rank (``[..., K]``, the public call's; the kernel's is
  2); the scales and bias broadcast against x and the output numpy-style.
  """
  rows = _sharding.row_factors(x_ndim - 1)
  maybe = lambda value, factors: (
      None if value is None else
      _sharding.trailing_factors(value.shape, factors, "one"))
  return _sharding.make_rule(
      "int8_matmul",
      [("x", rows + " k"), ("w", "k n" if weight_layout == "kn" else "n k"),
       ("x_scale", maybe(x_scale, rows + " s")),
       ("w_scale", maybe(w_scale, "s n")), ("bias", maybe(bias, "s n"))],
      [rows + " n"], split=rows + " n",
      helper="shard_int8_matmul (or jax.shard_map)",
      names={"k": "K (contracted)", "n": "N (output columns)",
             **{m: "rows" for m in rows.split()}})


def shard_int8_matmul(mesh, x, w, *, row_axis=None, n_axis=None, k_axis=None,
                      x_scale=None, w_scale=None, bias=None, out_dtype=None,
                      weight_layout="kn", **kwargs):
  """``int8_matmul`` with rows, N (column parallel) and/or K (row parallel)
  split over mesh axes, as in tensor-parallel layers.

  ``x [M, K]`` is split as ``(row_axis, k_axis)``; ``w`` as ``(k_axis,
  n_axis)`` (``(n_axis, k_axis)`` for ``weight_layout="nk"``); per-row
  ``x_scale [M, 1]`` follows the rows, ``w_scale``/``bias [N]`` follow N.
  With ``k_axis`` every device multiplies its K slice and the partial
  products are summed over that axis (``psum``, in float32, or int32 in
  raw mode) before the bias is added. The result is split as ``(row_axis,
  n_axis)``. Other keyword arguments go to ``int8_matmul``.

  Example::

      mesh = jax.make_mesh((2, 4), ("data", "model"))
      y = shard_int8_matmul(mesh, x_q, w_q, x_scale=sx, w_scale=sw,
                            row_axis="data", n_axis="model")
  """
  from jax.sharding import PartitionSpec as P
  operands.check_array("shard_int8_matmul", "x", x)
  operands.check_array("shard_int8_matmul", "w", w)
  if x.ndim != 2:
    raise ValueError(f"shard_int8_matmul: x must be [M, K], got shape "
                     f"{x.shape}")
  for name, axis in (("row_axis", row_axis), ("n_axis", n_axis),
                     ("k_axis", k_axis)):
    if axis is not None and axis not in mesh.shape:
      raise ValueError(f"shard_int8_matmul: {name}={axis!r} is not a mesh "
                       f"axis ({tuple(mesh.shape)})")
  # Shapes only: the operands' own placement (K split) is the helper's job.
  unplaced = [jax.ShapeDtypeStruct(a.shape, a.dtype)
              if hasattr(a, "dtype") and hasattr(a, "shape") else a
              for a in (x, w, x_scale, w_scale, bias)]
  final_dtype = jax.eval_shape(
      lambda *a: int8_matmul(*a[:2], x_scale=a[2], w_scale=a[3], bias=a[4],
                             out_dtype=out_dtype, weight_layout=weight_layout,
                             **kwargs),
      *unplaced).dtype
  w_spec = (P(k_axis, n_axis) if weight_layout == "kn" else P(n_axis, k_axis))
  def vector(v, row_spec=None):
    if v is None:
      return None
    if jnp.size(v) <= 1:
      return P()
    if row_spec is not None:
      return row_spec
    return P(n_axis) if jnp.ndim(v) == 1 else P(None, n_axis)
  args = [x, w, x_scale, w_scale, bias]
  specs = [P(row_axis, k_axis), w_spec, vector(x_scale, P(row_axis, None)),
           vector(w_scale), vector(bias)]
  present = [i for i, a in enumerate(args) if a is not None]

  def local(*arrays):
    full = [None] * 5
    for i, a in zip(present, arrays):
      full[i] = a
    xl, wl, xs, ws, b = full
    if k_axis is None:
      return int8_matmul(xl, wl, x_scale=xs, w_scale=ws, bias=b,
                         out_dtype=out_dtype, weight_layout=weight_layout,
                         **kwargs)
    partial_dtype = (jnp.int32 if final_dtype == jnp.int32 else jnp.float32)
    part = int8_matmul(xl, wl, x_scale=xs, w_scale=ws,
                       out_dtype=None if partial_dtype == jnp.int32 and
                       out_dtype is None else partial_dtype,
                       weight_layout=weight_layout, **kwargs)
    total = jax.lax.psum(part.astype(partial_dtype), k_axis)
    if b is not None:
      total = total + jnp.reshape(b, (1, -1)).astype(jnp.float32)
    return total.astype(final_dtype)

  return _sharding.shard_map(
      local, mesh=mesh, in_specs=tuple(specs[i] for i in present),
      out_specs=P(row_axis, n_axis))(*[args[i] for i in present])
