"""The write-up's ViT block on the bridge's modules (used by the demo).

``ViTBlock`` is ``TPUAttentionBlock``: pre-norm attention and MLP with
residuals, x + attn(norm1(x)), then + mlp(norm2(.)); ``linear`` picks the
Linear class (``nn.Linear`` or ``torch_bridge.Int8Linear``).
"""
from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F

from torch_bridge.modules import Attention


class Mlp(nn.Module):
  def __init__(self, dim, hidden, linear=nn.Linear):
    super().__init__()
    self.fc1 = linear(dim, hidden)
    self.fc2 = linear(hidden, dim)

  def forward(self, x):
    return self.fc2(F.gelu(self.fc1(x)))


class ViTBlock(nn.Module):
  """The write-up's TPUAttentionBlock: x + attn(norm1(x)), + mlp(norm2(.))."""

  def __init__(self, dim: int, num_heads: int, *, mlp_ratio=4.0,
               linear=nn.Linear, **attention_kwargs):
    super().__init__()
    self.norm1 = nn.LayerNorm(dim)
    self.norm2 = nn.LayerNorm(dim)
    self.attn = Attention(dim, num_heads, linear=linear, **attention_kwargs)
    self.mlp = Mlp(dim, int(dim * mlp_ratio), linear=linear)

  def forward(self, x):
    x = x + self.attn(self.norm1(x))
    return x + self.mlp(self.norm2(x))
