"""The quantized matmuls' and quantizers' arguments, checked and normalized
into the 2-D operands the references and every kernel take.

``int8_matmul``: ``(x2 [M, K], w, x_scale [M, 1] | None, w_scale [1, N] |
None, bias [1, N] | None)``. ``quantized_matmul``: ``(x2, w, x_scale [M, 1]
or [M, G] | None, w_scale [1, N] or [G, N], w_zero, bias)``; a partial last
group zero-pads x2 and w along K to G * g. Scales and bias are float32, w
keeps its dtype and layout ([K, N], or [N, K] for "nk").
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from pallas_kernels.quant import formats

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
class Int8MatmulCall:
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


def _int8_mode(x, weight_only, x_scale, w_scale, bias, out_dtype):
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


def _int8_shapes(x, w, weight_layout):
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


def int8_matmul_call(x, w, *, x_scale=None, w_scale=None, bias=None,
                out_dtype=None, weight_only=False,
                weight_layout="kn") -> Int8MatmulCall:
  """``int8_matmul``'s arguments checked (ValueError/TypeError naming the
  argument) and normalized."""
  op = "int8_matmul"
  check_bool(op, "weight_only", weight_only)
  batch, k, n = _int8_shapes(x, w, weight_layout)
  m = math.prod(batch)
  x_scale = float32_operand(
      op, "x_scale", x_scale, {(), (1,), batch + (1,)} | {(1,) * x.ndim},
      f"a scalar or x.shape[:-1] + (1,) = {batch + (1,)}")
  w_scale = channel_operand(op, "w_scale", w_scale, n, weight_layout)
  bias = float32_operand(op, "bias", bias, {(n,), (1, n)},
                         f"({n},) or (1, {n})")
  out_dtype = check_out_dtype(op, out_dtype)
  mode = _int8_mode(x, weight_only, x_scale, w_scale, bias, out_dtype)
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
  return Int8MatmulCall((x2, w, x_scale, w_scale, bias), mode, out_dtype,
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


def split_int8_kernel_refs(refs, *, has_xs, has_ws, has_b):
  """(x, w, x_scale|None, w_scale|None, bias|None, out, [scratch...]) from a
  Pallas kernel's positional refs (the operands minus the absent ones)."""
  return split_refs(refs, (has_xs, has_ws, has_b))


OP = "quantized_matmul"
# w_zero dtypes whose values w - zero (int4 w) keeps within bf16's exact
# integers
SMALL_INTEGER_ZEROS = tuple(jnp.dtype(d) for d in (jnp.int4, jnp.uint4,
                                                   jnp.int8))


def weight_format(w, op=OP) -> formats.Format:
  fmt = formats.format_of(w.dtype)
  if fmt is None:
    raise TypeError(f"{op}: w must be int8, int4, float8_e4m3fn or "
                    f"float8_e5m2, got {dtype_name(w.dtype)}")
  return fmt


def check_group_size(op, group_size):
  if group_size is None:
    return None
  if (isinstance(group_size, bool)
      or not isinstance(group_size, (int, np.integer)) or group_size <= 0):
    raise ValueError(f"{op}: group_size must be a positive int or None, got "
                     f"{group_size!r}")
  return int(group_size)


# ---------------------------------------------------------------- quantize

def quantize_args(x, dtype, axis, group_size, symmetric):
  """(format, axis | None, group_size | None) after checking."""
  op = "quantize"
  check_float_x(op, x)
  try:
    fmt = formats.format_of(jnp.dtype(dtype))
  except TypeError:
    fmt = None
  if fmt is None:
    raise TypeError(f"{op}: dtype must be one of {', '.join(formats.NAMES)} "
                    f"(jnp.int8, jnp.int4, jnp.float8_e4m3fn, "
                    f"jnp.float8_e5m2), got {dtype!r}")
  check_bool(op, "symmetric", symmetric)
  if not symmetric and not fmt.integer:
    raise ValueError(f"{op}: symmetric=False (a zero point) is for int8 and "
                     f"int4; {fmt.name} is symmetric only")
  group_size = check_group_size(op, group_size)
  if axis is None:
    if group_size is not None:
      raise ValueError(f"{op}: group_size needs an axis (groups run along "
                       "it), got axis=None")
    return fmt, None, None
  axis = normalize_axis(op, x, axis)
  return fmt, axis, group_size


# ---------------------------------------------------------- quantized_matmul

@dataclasses.dataclass(frozen=True)
class MatmulCall:
  """One ``quantized_matmul`` call, normalized."""
  operands: tuple   # (x2, w, x_scale, w_scale, w_zero, bias)
  mode: str
  out_dtype: jnp.dtype
  w_layout: str
  group_size: int | None
  batch: tuple
  k: int
  n: int
  # w_zero came as int4, uint4 or int8: integers in [-128, 127]
  integer_zero: bool = False

  @property
  def static(self) -> dict:
    return dict(mode=self.mode, out_dtype=self.out_dtype,
                w_layout=self.w_layout, group_size=self.group_size)

  @property
  def empty(self) -> bool:
    return 0 in (math.prod(self.batch), self.k, self.n)

  def result(self, out2):
    return out2.reshape(self.batch + (self.n,))


def _float_array(name, value, allowed, described):
  return float32_operand(OP, name, value, allowed, described)


def _integer_or_float(dtype) -> bool:
  return is_float(dtype) or jnp.issubdtype(jnp.dtype(dtype), jnp.integer)


def _zero_array(value, allowed, described):
  return float32_operand(
      OP, "w_zero", value, allowed, described, dtype_ok=_integer_or_float,
      kind="an integer or float array")


def _shapes(x, w, weight_layout):
  check_array(OP, "x", x)
  check_array(OP, "w", w)
  fmt = weight_format(w)
  x_fmt = formats.format_of(x.dtype)
  if not is_float(x.dtype) and (x_fmt is None or x_fmt.name == "int4"):
    raise TypeError(f"{OP}: x must be bfloat16, float16, float32, int8 or "
                    f"an fp8 dtype, got {dtype_name(x.dtype)}")
  return (fmt, x_fmt) + matmul_dims(OP, x, w, weight_layout)


def _mode(x, x_fmt, fmt, weight_only, group_size, out_dtype, has_scales):
  if is_float(x.dtype):
    if weight_only:
      return "weight_only"
    if group_size is not None or fmt.name == "int4":
      what = (f"group_size={group_size}" if group_size is not None
              else "int4 w")
      raise ValueError(f"{OP}: {what} with float x needs weight_only=True "
                       "(x is not quantized to int4 or per group)")
    return "dynamic"
  if weight_only:
    raise ValueError(f"{OP}: weight_only=True needs float x (bfloat16, "
                     f"float16 or float32), got {dtype_name(x.dtype)}")
  if x_fmt.integer != fmt.integer or (fmt.integer and fmt.name != "int8"):
    raise TypeError(f"{OP}: {x_fmt.name} x needs "
                    f"{'int8' if x_fmt.integer else 'fp8'} w, got {fmt.name} "
                    "(quantized x multiplies a w of its own kind)")
  float_out = out_dtype is not None and out_dtype != jnp.int32
  if fmt.integer and not has_scales and not float_out:
    return "raw"
  return "dequant"


def matmul_call(x, w, *, x_scale=None, w_scale=None, w_zero=None,
                group_size=None, bias=None, out_dtype=None,
                weight_only=False, weight_layout="kn") -> MatmulCall:
  """``quantized_matmul``'s arguments checked (TypeError/ValueError naming
  the argument) and normalized."""
  check_bool(OP, "weight_only", weight_only)
  group_size = check_group_size(OP, group_size)
  integer_zero = False
  fmt, x_fmt, batch, k, n = _shapes(x, w, weight_layout)
  m = math.prod(batch)
  if x_scale is not None and is_float(x.dtype):
    raise ValueError(f"{OP}: x_scale is only for quantized x (int8 or fp8); "
                     "float x is quantized per row on the fly, or "
                     "weight_only=True")
  x_groups = group_size is not None and not is_float(x.dtype)
  x_shapes = {(), (1,), batch, batch + (1,), (1,) * x.ndim}
  described = f"a scalar, x.shape[:-1] = {batch} or {batch + (1,)}"
  if x_groups:
    x_shapes.add(batch + (group_count(k, group_size),))
    described += (f", or {batch + (group_count(k, group_size),)} = "
                  "x.shape[:-1] + (ceil(K / group_size),)")
  x_scale = _float_array("x_scale", x_scale, x_shapes, described)
  if group_size is None and w_zero is not None:
    w_scale, w_zero = _channel_zero_as_group(x, fmt, w_scale, w_zero,
                                             weight_only, n, weight_layout)
    if k > 0:  # asymmetric per channel: one group of all K
      group_size = k
    else:  # no products for the zero points to shift
      w_zero = None
  if group_size is None:
    w_scale = channel_operand(OP, "w_scale", w_scale, n,
                                            weight_layout)
  else:
    groups = group_count(k, group_size)
    shape = (groups, n) if weight_layout == "kn" else (n, groups)
    described = (f"{shape} = [ceil(K / group_size), N]"
                 if weight_layout == "kn" else
                 f"{shape} = [N, ceil(K / group_size)] for "
                 "weight_layout='nk'")
    if w_scale is None:
      raise ValueError(f"{OP}: group_size={group_size} needs w_scale of "
                       f"shape {shape}")
    w_scale = _float_array("w_scale", w_scale, {shape}, described)
    if w_zero is not None and not fmt.integer:
      raise ValueError(f"{OP}: w_zero is for int8 and int4 w; {fmt.name} "
                       "is symmetric")
    if w_zero is not None and x_groups:
      raise ValueError(f"{OP}: w_zero is for weight-only calls (float x); "
                       "quantized x multiplies symmetric group-scaled w")
    integer_zero = getattr(w_zero, "dtype", None) in SMALL_INTEGER_ZEROS
    w_zero = _zero_array(w_zero, {shape}, described)
    if weight_layout == "nk":
      w_scale = w_scale.T
      w_zero = None if w_zero is None else w_zero.T
  bias = _float_array("bias", bias, {(n,), (1, n)}, f"({n},) or (1, {n})")
  out_dtype = check_out_dtype(OP, out_dtype)
  mode = _mode(x, x_fmt, fmt, weight_only, group_size, out_dtype,
               any(v is not None for v in (x_scale, w_scale, bias)))
  if out_dtype == jnp.int32 and mode != "raw":
    raise ValueError(f"{OP}: out_dtype=int32 is only for int8 x and int8 w "
                     "without x_scale, w_scale or bias")
  int8_product = fmt.name == "int8" and mode != "weight_only"
  summed = k if group_size is None else group_size  # products per int32 sum
  if int8_product and summed > MAX_INT8_K:
    what = "K" if group_size is None else "group_size"
    raise ValueError(
        f"{OP}: {what}={summed} exceeds {MAX_INT8_K}, beyond which the int32 "
        "accumulator could overflow; split K or use weight_only=True")
  if out_dtype is None:
    out_dtype = default_out_dtype(mode, x.dtype)
  group_x_scale = None
  if x_groups:  # [M, G]: per row and group (ones where absent)
    groups = group_count(k, group_size)
    group_x_scale = (jnp.ones((m, groups), jnp.float32) if x_scale is None
                     else _row_group_scale(x_scale, batch, m, groups))
    x_scale = None
  x2, x_scale, bias = flatten_operands(
      x, x_scale, bias, mode=mode, m=m, k=k, n=n)
  if x_groups:
    x_scale = group_x_scale
  if group_size is None:
    w_scale = channel_scale(w_scale, n)
  else:
    x2, w = _pad_to_whole_groups(x2, w, k, group_size, weight_layout)
  return MatmulCall((x2, w, x_scale, w_scale, w_zero, bias), mode, out_dtype,
                    weight_layout, group_size, batch, k, n, integer_zero)


def _channel_zero_as_group(x, fmt, w_scale, w_zero, weight_only, n,
                           weight_layout):
  """Per-channel (w_scale, w_zero) of asymmetric w, checked, as the tables
  of one group along K: [1, N] ("kn") or [N, 1] ("nk"); w_zero keeps its
  dtype."""
  if not fmt.integer:
    raise ValueError(f"{OP}: w_zero is for int8 and int4 w; {fmt.name} is "
                     "symmetric")
  if not (weight_only and is_float(x.dtype)):
    raise ValueError(f"{OP}: w_zero is for weight-only calls (float x, "
                     "weight_only=True); a quantized or dynamically "
                     "quantized x multiplies symmetric w")
  if w_scale is None:
    raise ValueError(f"{OP}: w_zero needs w_scale (x ~= (w - w_zero) * "
                     "w_scale)")
  table = (1, n) if weight_layout == "kn" else (n, 1)
  tables = []
  for name, value in (("w_scale", w_scale), ("w_zero", w_zero)):
    ok = is_float if name == "w_scale" else _integer_or_float
    kind = ("a float array" if name == "w_scale" else
            "an integer or float array")
    channel_operand(OP, name, value, n, weight_layout,
                                  dtype_ok=ok, kind=kind)  # checks only
    value = jnp.asarray(value)
    tables.append(jnp.broadcast_to(value.reshape(1, -1), (1, n))
                  .reshape(table))
  return tuple(tables)


def group_count(k: int, group_size: int) -> int:
  """Groups along a K of ``k``: the last one holds the remainder."""
  return -(-k // group_size)


def _pad_to_whole_groups(x2, w, k, group_size, weight_layout):
  """x2 [M, K] and w zero-padded along K to whole groups: a partial last
  group then adds only zero products (a copy of w per call; a model pads
  its weights once instead)."""
  pad = group_count(k, group_size) * group_size - k
  if pad == 0:
    return x2, w
  x2 = jnp.pad(x2, ((0, 0), (0, pad)))
  k_axis = 0 if weight_layout == "kn" else 1
  widths = [(0, 0), (0, 0)]
  widths[k_axis] = (0, pad)
  return x2, jnp.pad(w, widths)


def _row_group_scale(x_scale, batch, m, groups):
  """A scalar, per-row or per-row-and-group x_scale as [M, groups]."""
  if x_scale.ndim == len(batch) + 1 and x_scale.size == m * groups:
    return x_scale.reshape(m, groups)
  rows = (x_scale.reshape(1, 1) if x_scale.size == 1 else
          x_scale.reshape(m, 1))
  return jnp.broadcast_to(rows, (m, groups))


def split_kernel_refs(refs, *, has_xs, has_ws, has_zero, has_b):
  """(x, w, x_scale, w_scale, w_zero, bias, out, [scratch...]) from a Pallas
  kernel's positional refs (absent operands are None)."""
  return split_refs(refs, (has_xs, has_ws, has_zero, has_b))
