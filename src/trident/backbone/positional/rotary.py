"""Rotary position embedding (RoFormer, Su et al. 2021).

Queries and keys are rotated pairwise by an angle proportional to their position, so the
dot product q_m . k_n depends on the positions only through the offset m - n.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from trident.backbone.positional.base import PositionalEncoding, register_pos_encoding

if TYPE_CHECKING:
    from trident.backbone.config import TransformerConfig


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` (B, nh, T, hs) by the angles whose cos/sin are (T, hs)."""
    return x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)


@register_pos_encoding
class RotaryEncoding(PositionalEncoding):
    name: ClassVar[str] = "rope"
    uses_rotary: ClassVar[bool] = True
    extrapolates: ClassVar[bool] = False

    def __init__(self, cfg: TransformerConfig, *, causal: bool) -> None:
        super().__init__(cfg, causal=causal)
        base = float(cfg.pos_encoding_options.get("base", 10000.0))
        hs = cfg.head_dim
        inv_freq = base ** (-torch.arange(0, hs, 2, dtype=torch.float32) / hs)  # (hs/2,)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return ("base",)

    def rotary(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # (T, hs/2)
        angles = torch.cat((angles, angles), dim=-1)  # (T, hs): one angle per rotated pair
        return angles.cos(), angles.sin()
