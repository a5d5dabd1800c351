"""nn.Modules on the bridged ops: Attention, Int8Linear, QuantizedLinear and
the box losses. ``batch_axis`` (Attention: and ``head_axis``) or a whole
``partition_spec``, and ``mesh``, shard them as the ops under SPMD;
``use_kernel=False`` runs plain PyTorch (SDPA / F.linear) on the same weights.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_bridge import ops


def _one_of(name, **given):
  named = [k for k, v in given.items() if v is not None]
  if len(named) > 1:
    raise ValueError(f"{name}: give {' or '.join(named)}, not both")


def _leading_spec(batch_axis, partition_spec, x):
  """``partition_spec``, or ``batch_axis`` on dim 0 of ``x`` (or None)."""
  if partition_spec is not None or batch_axis is None:
    return partition_spec
  return (batch_axis,) + (None,) * (x.dim() - 1)


class Int8Linear(nn.Linear):
  """``nn.Linear`` whose forward runs the int8 kernel (see ``ops.int8_dense``).

  The float weight stays the trainable parameter; each forward quantizes it
  per output channel and the input per row. Gradients are those of the float
  layer (straight-through estimator). ``partition_spec`` is x's.
  """

  def __init__(self, in_features, out_features, bias=True, device=None,
               dtype=None, *, batch_axis=None, partition_spec=None, mesh=None,
               backend=None, use_kernel=True):
    super().__init__(in_features, out_features, bias=bias, device=device,
                     dtype=dtype)
    _one_of("Int8Linear", batch_axis=batch_axis,
            partition_spec=partition_spec)
    self.batch_axis = batch_axis
    self.partition_spec = partition_spec
    self.mesh = mesh
    self.backend = backend
    self.use_kernel = use_kernel

  @classmethod
  def from_linear(cls, linear: nn.Linear, **kwargs) -> "Int8Linear":
    """An Int8Linear sharing ``linear``'s parameters."""
    new = cls(linear.in_features, linear.out_features,
              bias=linear.bias is not None, device=linear.weight.device,
              dtype=linear.weight.dtype, **kwargs)
    new.weight = linear.weight
    new.bias = linear.bias
    return new

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    if not self.use_kernel:
      return F.linear(x, self.weight, self.bias)
    spec = _leading_spec(self.batch_axis, self.partition_spec, x)
    return ops.int8_dense(x, self.weight, self.bias, backend=self.backend,
                          partition_spec=spec, mesh=self.mesh)


class QuantizedLinear(nn.Module):
  """``nn.Linear`` over a frozen quantized weight (int8 or float8, kept as
  buffers in ``nn.Linear``'s ``[out, in]`` layout) with an optional
  trainable LoRA adapter: ``x @ dequant(w_q).T + bias + lora_scale * (x @
  lora_a) @ lora_b`` (``ops.quantized_dense``). QLoRA-style fine-tuning:
  only ``bias``, ``lora_a`` and ``lora_b`` are parameters.

  ``from_linear(linear, dtype, group_size=None, lora_rank=0)`` quantizes a
  float layer's weight per output channel (or per ``group_size`` inputs).
  LoRA starts as a no-op: ``lora_a`` random (std ``1/sqrt(in)``),
  ``lora_b`` zeros.
  """

  def __init__(self, w_q: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None = None, *, w_zero=None,
               group_size=None, lora_rank: int = 0, lora_scale: float = 1.0,
               batch_axis=None, partition_spec=None, mesh=None,
               backend=None):
    super().__init__()
    _one_of("QuantizedLinear", batch_axis=batch_axis,
            partition_spec=partition_spec)
    if w_q.dim() != 2:
      raise ValueError("QuantizedLinear: w_q must be [out_features, "
                       f"in_features], got shape {tuple(w_q.shape)}")
    self.out_features, self.in_features = w_q.shape
    self.register_buffer("w_q", w_q)
    self.register_buffer("w_scale", w_scale)
    self.register_buffer("w_zero", w_zero)
    self.bias = None if bias is None else nn.Parameter(bias)
    self.group_size = group_size
    self.lora_scale = lora_scale
    if lora_rank:
      float_dtype = w_scale.dtype
      self.lora_a = nn.Parameter(torch.randn(
          self.in_features, lora_rank, device=w_q.device, dtype=float_dtype)
          / self.in_features ** 0.5)
      self.lora_b = nn.Parameter(torch.zeros(
          lora_rank, self.out_features, device=w_q.device, dtype=float_dtype))
    else:
      self.lora_a = self.lora_b = None
    self.batch_axis = batch_axis
    self.partition_spec = partition_spec
    self.mesh = mesh
    self.backend = backend

  @classmethod
  def from_linear(cls, linear: nn.Linear, dtype=torch.int8, *,
                  group_size=None, **kwargs) -> "QuantizedLinear":
    """``linear`` with its weight quantized to ``dtype`` (symmetric, per
    output channel, or per group of ``group_size`` inputs)."""
    w_q, w_scale = ops.quantize(linear.weight.detach(), dtype, axis=1,
                                group_size=group_size)
    if group_size is None:
      w_scale = w_scale.reshape(-1)
    bias = None if linear.bias is None else linear.bias.detach().clone()
    return cls(w_q, w_scale, bias, group_size=group_size, **kwargs)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    spec = _leading_spec(self.batch_axis, self.partition_spec, x)
    lora = None if self.lora_a is None else (self.lora_a, self.lora_b)
    return ops.quantized_dense(
        x, self.w_q, self.w_scale, self.bias, w_zero=self.w_zero,
        group_size=self.group_size, lora=lora, lora_scale=self.lora_scale,
        weight_layout="nk", backend=self.backend, partition_spec=spec,
        mesh=self.mesh)


class Attention(nn.Module):
  """Multi-head (or grouped-query) self-attention on ``[B, N, dim]``.

  ``batch_axis``/``head_axis`` split q, k, v ``[B, H, N, D]`` over those mesh
  axes, as ``partition_spec=(batch_axis, head_axis, None, None)`` does. With
  ``num_kv_heads == num_heads`` one ``qkv`` Linear, so the state dict matches
  the write-up's ``TPUAttentionBlock`` attention (examples/vit.py).
  """

  def __init__(self, dim: int, num_heads: int, *, num_kv_heads=None,
               qkv_bias=False, causal=False, sm_scale=None, linear=nn.Linear,
               batch_axis=None, head_axis=None, partition_spec=None,
               mesh=None, backend=None, use_kernel=True):
    super().__init__()
    if partition_spec is not None and (batch_axis is not None or
                                       head_axis is not None):
      raise ValueError("Attention: give batch_axis/head_axis or "
                       "partition_spec, not both")
    if dim % num_heads:
      raise ValueError(f"Attention: dim ({dim}) must be divisible by "
                       f"num_heads ({num_heads})")
    num_kv_heads = num_kv_heads or num_heads
    if num_heads % num_kv_heads:
      raise ValueError(f"Attention: num_heads ({num_heads}) must be a multiple "
                       f"of num_kv_heads ({num_kv_heads})")
    self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
    self.head_dim = dim // num_heads
    self.causal = causal
    self.sm_scale = (1.0 / math.sqrt(self.head_dim) if sm_scale is None
                     else float(sm_scale))
    self.batch_axis, self.head_axis, self.mesh = batch_axis, head_axis, mesh
    self.partition_spec = partition_spec
    self.backend, self.use_kernel = backend, use_kernel
    kv_dim = num_kv_heads * self.head_dim
    if num_kv_heads == num_heads:
      self.qkv = linear(dim, 3 * dim, bias=qkv_bias)
    else:
      self.q = linear(dim, dim, bias=qkv_bias)
      self.kv = linear(dim, 2 * kv_dim, bias=qkv_bias)
    self.proj = linear(dim, dim)

  def _project(self, x):
    b, n, _ = x.shape
    if self.num_kv_heads == self.num_heads:
      qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim)
      return qkv.permute(2, 0, 3, 1, 4).unbind(0)
    q = self.q(x).reshape(b, n, self.num_heads, self.head_dim).transpose(1, 2)
    kv = self.kv(x).reshape(b, n, 2, self.num_kv_heads, self.head_dim)
    k, v = kv.permute(2, 0, 3, 1, 4).unbind(0)
    return q, k, v

  def attend(self, q, k, v):
    """``[B, H, N, D]`` attention by the kernel or by PyTorch."""
    if not self.use_kernel:
      group = self.num_heads // self.num_kv_heads
      if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
      return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal,
                                            scale=self.sm_scale)
    spec = self.partition_spec
    if self.batch_axis is not None or self.head_axis is not None:
      spec = (self.batch_axis, self.head_axis, None, None)
    return ops.flash_attention(q, k, v, causal=self.causal,
                               sm_scale=self.sm_scale, backend=self.backend,
                               partition_spec=spec, mesh=self.mesh)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 3:
      raise ValueError(f"Attention: x must be [batch, tokens, dim], got shape "
                       f"{tuple(x.shape)}")
    b, n, c = x.shape
    q, k, v = self._project(x)
    out = self.attend(q, k, v)
    return self.proj(out.transpose(1, 2).reshape(b, n, c))


class _BoxLoss(nn.Module):
  """``1 - <kind>(pred, target)`` for boxes ``[..., 4]`` ("xyxy": x1, y1, x2,
  y2; "cxcywh": centre, width, height), reduced by "none" (``[...]``),
  "mean" or "sum" (a scalar): ``ops.<kind>_loss``; subclasses set ``kind``.
  ``partition_spec`` is the (broadcast) boxes'.
  """
  kind: str

  def __init__(self, reduction: str = "mean", eps: float = ops._EPS, *,
               box_format: str = "xyxy", batch_axis=None, partition_spec=None,
               mesh=None, backend=None):
    super().__init__()
    name = type(self).__name__
    if reduction not in ops._REDUCTIONS:
      raise ValueError(f"{name}: reduction must be 'none', 'mean' or 'sum', "
                       f"got {reduction!r}")
    if box_format not in ("xyxy", "cxcywh"):
      raise ValueError(f"{name}: box_format must be 'xyxy' or 'cxcywh', "
                       f"got {box_format!r}")
    _one_of(name, batch_axis=batch_axis, partition_spec=partition_spec)
    self.reduction, self.eps, self.box_format = reduction, eps, box_format
    self.batch_axis, self.partition_spec = batch_axis, partition_spec
    self.mesh, self.backend = mesh, backend

  def forward(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if self.partition_spec is None and self.batch_axis is not None:
      full = torch.broadcast_shapes(pred.shape, target.shape)
      spec = (self.batch_axis,) + (None,) * (len(full) - 1)
    else:
      spec = self.partition_spec
    loss = getattr(ops, f"{self.kind}_loss")
    return loss(pred, target, reduction=self.reduction, eps=self.eps,
                box_format=self.box_format, backend=self.backend,
                partition_spec=spec, mesh=self.mesh)

  def extra_repr(self) -> str:
    return (f"reduction={self.reduction!r}, eps={self.eps}, "
            f"box_format={self.box_format!r}")


class IoULoss(_BoxLoss):
  """``1 - inter / (union + eps)`` (``ops.iou_loss``); arguments as
  ``GIoULoss``."""
  kind = "iou"


class GIoULoss(_BoxLoss):
  """``1 - GIoU(pred, target)`` (``ops.giou_loss``, torchvision's
  ``generalized_box_iou_loss``) for boxes ``[..., 4]`` in ``box_format``
  "xyxy" or "cxcywh", reduced by "none", "mean" (default) or "sum".
  ``batch_axis`` (dim 0 of the boxes) or a whole ``partition_spec`` shard
  it; a mean or sum spans every shard and never counts padding."""
  kind = "giou"


class DIoULoss(_BoxLoss):
  """``1 - DIoU(pred, target)`` (``ops.diou_loss``, torchvision's
  ``distance_box_iou_loss``); arguments as ``GIoULoss``."""
  kind = "diou"


class CIoULoss(_BoxLoss):
  """``1 - CIoU(pred, target)`` (``ops.ciou_loss``, torchvision's
  ``complete_box_iou_loss``); arguments as ``GIoULoss``."""
  kind = "ciou"


__all__ = ["Attention", "Int8Linear", "QuantizedLinear", "IoULoss",
           "GIoULoss", "DIoULoss", "CIoULoss"]
