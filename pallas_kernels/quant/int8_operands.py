"""The int8 ops' arguments, checked and normalized into the 2-D operands the
reference and every kernel take: ``(x2 [M, K], w, x_scale [M, 1] | None,
w_scale [1, N] | None, bias [1, N] | None)`` (float32 scales and bias; w [K, N]
or [N, K] for "nk"), with static ``mode``, ``out_dtype`` and ``w_layout``.
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

MAX_INT8_K = (2**31 - 1) // (128 * 128)  # 131071: (-128)**2 * K fits int32
FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
WEIGHT_LAYOUTS = ("kn", "nk")
MODES = ("raw", "dequant", "dynamic", "weight_only")


def is_float(dtype) -> bool:
  return any(jnp.dtype(dtype) == jnp.dtype(d) for d in FLOAT_DTYPES)


def dtype_name(dtype) -> str:
  return jnp.dtype(dtype).name


def check_array(op, name, value):
  if not hasattr(value, "shape") or not hasattr(value, "dtype"):
    raise TypeError(f"{op}: {name} must be an array, got "
                    f"{type(value).__name__}")


def check_bool(op, name, value):
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{op}: {name} must be a bool (True or False), got "
                    f"{value!r}")


def check_float_x(op, x):
  """TypeError unless x is a bfloat16, float16 or float32 array."""
  check_array(op, "x", x)
  if not is_float(x.dtype):
    raise TypeError(f"{op}: x must be bfloat16, float16 or float32, got "
                    f"{dtype_name(x.dtype)}")


def normalize_axis(op, x, axis):
  """``axis`` (an int in [-x.ndim, x.ndim)) as a non-negative int."""
  if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
    raise TypeError(f"{op}: axis must be an int or None, got {axis!r}")
  if not -x.ndim <= axis < x.ndim:
    raise ValueError(f"{op}: axis={axis} is out of range for x of rank "
                     f"{x.ndim}")
  return int(axis) % x.ndim


def quantize_axis(x, axis):
  """``quantize_int8``'s x checked and ``axis`` as a non-negative int or
  None."""
  check_float_x("quantize_int8", x)
  return None if axis is None else normalize_axis("quantize_int8", x, axis)


@dataclasses.dataclass(frozen=True)
class MatmulCall:
  """One ``int8_matmul`` call, normalized."""
  operands: tuple   # (x2, w, x_scale, w_scale, bias)
  mode: str         # one of MODES
  out_dtype: jnp.dtype
  w_layout: str
  batch: tuple      # x's leading dimensions
  k: int
  n: int

  @property
  def static(self) -> dict:
    return dict(mode=self.mode, out_dtype=self.out_dtype,
                w_layout=self.w_layout)

  @property
  def empty(self) -> bool:
    return 0 in (math.prod(self.batch), self.k, self.n)

  def result(self, out2):
    """The [M, N] result reshaped to x's leading dimensions + (N,)."""
    return out2.reshape(self.batch + (self.n,))


def float32_operand(op, name, value, allowed_shapes, described, *,
                    dtype_ok=is_float, kind="a float array"):
  """``value`` (None passes through) checked as an array of ``kind`` (dtypes
  that ``dtype_ok`` accepts) with a shape in ``allowed_shapes``, as float32."""
  if value is None:
    return None
  check_array(op, name, value)
  value = jnp.asarray(value)
  if not dtype_ok(value.dtype):
    raise TypeError(f"{op}: {name} must be {kind}, got "
                    f"{dtype_name(value.dtype)}")
  if value.shape not in allowed_shapes:
    raise ValueError(f"{op}: {name} has shape {value.shape}; expected "
                     f"{described}")
  return value.astype(jnp.float32)


def _mode(x, weight_only, x_scale, w_scale, bias, out_dtype):
  if is_float(x.dtype):
    if x_scale is not None:
      raise ValueError("int8_matmul: x_scale is only for int8 x; float x is "
                       "quantized per row on the fly (or weight_only=True)")
    return "weight_only" if weight_only else "dynamic"
  if weight_only:
    raise ValueError("int8_matmul: weight_only=True needs float x (bfloat16, "
                     f"float16 or float32), got {dtype_name(x.dtype)}")
  float_out = out_dtype is not None and out_dtype != jnp.int32
  if x_scale is None and w_scale is None and bias is None and not float_out:
    return "raw"
  return "dequant"


def check_out_dtype(op, out_dtype):
  """``out_dtype`` (None, int32 or a float dtype) as a jnp.dtype or None."""
  if out_dtype is None:
    return None
  try:
    out_dtype = jnp.dtype(out_dtype)
  except TypeError as e:
    raise TypeError(f"{op}: out_dtype={out_dtype!r} is no dtype") from e
  if out_dtype != jnp.int32 and not is_float(out_dtype):
    raise TypeError(f"{op}: out_dtype must be int32 or a float dtype, got "
                    f"{out_dtype.name}")
  return out_dtype


def matmul_dims(op, x, w, weight_layout):
  """(batch, K, N) of x [..., K] times w [K, N] ("kn") or [N, K] ("nk"),
  after checking their ranks, the layout and that the K dimensions agree."""
  if x.ndim < 1:
    raise ValueError(f"{op}: x must have at least one dimension [..., K]")
  if weight_layout not in WEIGHT_LAYOUTS:
    raise ValueError(f"{op}: weight_layout must be 'kn' (w [K, N]) or 'nk' "
                     f"(w [N, K]), got {weight_layout!r}")
  if w.ndim != 2:
    dims = "[K, N]" if weight_layout == "kn" else "[N, K]"
    raise ValueError(f"{op}: w must be 2-D {dims}, got shape {w.shape}")
  k_axis = 0 if weight_layout == "kn" else 1
  if x.shape[-1] != w.shape[k_axis]:
    raise ValueError(f"{op}: x's last dimension ({x.shape[-1]}) must equal "
                     f"K, w's {'first' if k_axis == 0 else 'second'} "
                     f"dimension for weight_layout={weight_layout!r} "
                     f"(w.shape = {w.shape})")
  return x.shape[:-1], w.shape[k_axis], w.shape[1 - k_axis]


def _shapes(x, w, weight_layout):
  """(batch, K, N) after checking x's and w's dtypes and shapes."""
  check_array("int8_matmul", "x", x)
  check_array("int8_matmul", "w", w)
  if jnp.dtype(x.dtype) != jnp.int8 and not is_float(x.dtype):
    raise TypeError(f"int8_matmul: x must be int8, bfloat16, float16 or "
                    f"float32, got {dtype_name(x.dtype)}")
  if jnp.dtype(w.dtype) != jnp.int8:
    raise TypeError(f"int8_matmul: w must be int8, got {dtype_name(w.dtype)}")
  return matmul_dims("int8_matmul", x, w, weight_layout)


def default_out_dtype(mode, x_dtype):
  """int32 for raw, bfloat16 for dequant, else x's dtype."""
  return jnp.dtype(jnp.int32 if mode == "raw" else
                   jnp.bfloat16 if mode == "dequant" else x_dtype)


def flatten_operands(x, x_scale, bias, *, mode, m, k, n):
  """(x2 [M, K], x_scale [M, 1] | None, bias [1, N] | None) from x
  [..., K], a scalar or per-row x_scale and a [N] or [1, N] bias; float16
  x of a weight-only call becomes float32."""
  x2 = x.reshape(m, k)
  if mode == "weight_only" and x2.dtype == jnp.float16:
    x2 = x2.astype(jnp.float32)
  if x_scale is not None:
    x_scale = (jnp.broadcast_to(x_scale.reshape(1, 1), (m, 1))
               if x_scale.size == 1 else x_scale.reshape(m, 1))
  if bias is not None:
    bias = bias.reshape(1, n)
  return x2, x_scale, bias


def channel_shapes(n, weight_layout):
  """(shapes, description) of a per-output-channel operand (w_scale,
  w_zero) of w [K, N] ("kn") or [N, K] ("nk"): a scalar, [N], or w's shape
  with K kept as 1, what quantizing w along K returns ([1, N] for "kn",
  [N, 1] for "nk"; "nk" also takes [1, N]). A [N, 1] table for "kn" (or
  [1, K] for "nk") would be one value per K row, not per channel."""
  shapes = {(), (1,), (1, 1), (n,), (1, n)}
  if weight_layout == "nk":
    shapes.add((n, 1))
    return shapes, (f"a scalar, ({n},), ({n}, 1) or (1, {n}) (per output "
                    "channel: quantize w [N, K] along axis=1)")
  return shapes, (f"a scalar, ({n},) or (1, {n}) (per output channel: "
                  "quantize w [K, N] along axis=0)")


def channel_operand(op, name, value, n, weight_layout, **kwargs):
  """A per-channel ``value`` (``channel_shapes``) checked by
  ``float32_operand`` and as float32 [1, N] (None passes through)."""
  shapes, described = channel_shapes(n, weight_layout)
  value = float32_operand(op, name, value, shapes, described, **kwargs)
  return channel_scale(value, n)


def channel_scale(w_scale, n):
  """A scalar, [N], [1, N] or [N, 1] w_scale as [1, N] (None passes
  through)."""
  if w_scale is None:
    return None
  return jnp.broadcast_to(w_scale.reshape(1, -1), (1, n))


def matmul_call(x, w, *, x_scale=None, w_scale=None, bias=None,
                out_dtype=None, weight_only=False,
                weight_layout="kn") -> MatmulCall:
  """``int8_matmul``'s arguments checked (ValueError/TypeError naming the
  argument) and normalized."""
  op = "int8_matmul"
  check_bool(op, "weight_only", weight_only)
  batch, k, n = _shapes(x, w, weight_layout)
  m = math.prod(batch)
  x_scale = float32_operand(
      op, "x_scale", x_scale, {(), (1,), batch + (1,)} | {(1,) * x.ndim},
      f"a scalar or x.shape[:-1] + (1,) = {batch + (1,)}")
  w_scale = channel_operand(op, "w_scale", w_scale, n, weight_layout)
  bias = float32_operand(op, "bias", bias, {(n,), (1, n)},
                         f"({n},) or (1, {n})")
  out_dtype = check_out_dtype(op, out_dtype)
  mode = _mode(x, weight_only, x_scale, w_scale, bias, out_dtype)
  if out_dtype == jnp.int32 and mode != "raw":
    raise ValueError("int8_matmul: out_dtype=int32 is only for the raw mode "
                     "(int8 x, no x_scale, w_scale or bias)")
  if mode != "weight_only" and k > MAX_INT8_K:
    raise ValueError(
        f"int8_matmul: K={k} exceeds {MAX_INT8_K}, beyond which the int32 "
        "accumulator could overflow ((2**31 - 1) // 128**2); split K and add "
        "the (scaled) partial results, or use weight_only=True")
  if out_dtype is None:
    out_dtype = default_out_dtype(mode, x.dtype)
  x2, x_scale, bias = flatten_operands(x, x_scale, bias, mode=mode, m=m, k=k,
                                       n=n)
  return MatmulCall((x2, w, x_scale, w_scale, bias), mode, out_dtype,
                    weight_layout, batch, k, n)


def split_refs(refs, present):
  """(x, w, *optional, out, [scratch...]) from a Pallas kernel's positional
  refs: x and w, then one ref per true flag of ``present`` (None for a false
  one), the output, and whatever follows."""
  refs = list(refs)
  x_ref, w_ref = refs.pop(0), refs.pop(0)
  optional = [refs.pop(0) if has else None for has in present]
  o_ref = refs.pop(0)
  return (x_ref, w_ref, *optional, o_ref, refs)


def split_kernel_refs(refs, *, has_xs, has_ws, has_b):
  """(x, w, x_scale|None, w_scale|None, bias|None, out, [scratch...]) from a
  Pallas kernel's positional refs (the operands minus the absent ones)."""
  return split_refs(refs, (has_xs, has_ws, has_b))
