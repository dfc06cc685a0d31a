"""Absolute encodings added to the token embeddings: the paper's sinusoids and a learned table."""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor, nn

from trident.backbone.positional.base import PositionalEncoding, StackShape, grid_coordinates, register_pos_encoding


def sinusoidal_table(positions: Tensor, d_model: int, base: float = 10000.0) -> Tensor:
    """PE(pos, 2i) = sin(pos / base^(2i/d)), PE(pos, 2i+1) = cos(pos / base^(2i/d)); (T, d_model)."""
    inv_freq = torch.exp(
        -math.log(base) * torch.arange(0, d_model, 2, device=positions.device, dtype=torch.float32) / d_model
    )  # (ceil(d/2),)
    angles = positions.float()[:, None] * inv_freq[None, :]  # (T, ceil(d/2))
    table = torch.zeros(positions.numel(), d_model, device=positions.device)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles[:, : d_model // 2])
    return table


def sinusoidal_table_2d(
    positions: Tensor, d_model: int, grid: tuple[int, int], num_prefix_tokens: int, base: float = 10000.0
) -> Tensor:
    """2-D sinusoids for image patches (as in MAE): the first half of the channels encodes the
    row, the second half the column; prefix tokens (the class token) get zeros. (T, d_model)."""
    rows, cols, is_patch = grid_coordinates(positions, grid, num_prefix_tokens)
    half = d_model // 2
    table = torch.cat((sinusoidal_table(rows, half, base), sinusoidal_table(cols, d_model - half, base)), dim=1)
    return table * is_patch[:, None]


@register_pos_encoding
class SinusoidalEncoding(PositionalEncoding):
    """Fixed sinusoids of geometrically spaced wavelengths (Vaswani et al., section 3.5); 2-D on a grid."""

    name: ClassVar[str] = "sinusoidal"
    absolute: ClassVar[bool] = True
    extrapolates: ClassVar[bool] = False

    def __init__(self, cfg: StackShape, *, causal: bool) -> None:
        super().__init__(cfg, causal=causal)
        self.d_model = cfg.d_model
        self.base = float(cfg.pos_encoding_options.get("base", 10000.0))
        # Precompute the table up to the configured length; longer sequences are computed on the fly.
        table = self._table(torch.arange(cfg.max_seq_len))
        self.register_buffer("table", table, persistent=False)

    def _table(self, positions: Tensor) -> Tensor:
        if self.grid is not None:
            return sinusoidal_table_2d(positions, self.d_model, self.grid, self.num_prefix_tokens, self.base)
        return sinusoidal_table(positions, self.d_model, self.base)

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return ("base",)

    def add_to_embeddings(self, x: Tensor, positions: Tensor) -> Tensor:
        if torch.compiler.is_compiling():
            # Traced (torch.compile, torch.export for ONNX): the positions' values are unknown, so whether the
            # table holds them cannot be asked. The sinusoids of the positions themselves: the table's values.
            pe = self._table(positions)
        elif positions.numel() and int(positions.max()) >= self.table.size(0):
            pe = self._table(positions)  # past the precomputed length
        else:
            pe = self.table[positions]
        return x + pe.to(x.dtype)  # (B, T, D) + (T, D) or (B, T, D)


@register_pos_encoding
class LearnedEncoding(PositionalEncoding):
    """A trainable vector per position (BERT, GPT-2, ViT); cannot go beyond ``max_seq_len``."""

    name: ClassVar[str] = "learned"
    absolute: ClassVar[bool] = True
    bounded_length: ClassVar[bool] = True
    extrapolates: ClassVar[bool] = False

    def __init__(self, cfg: StackShape, *, causal: bool) -> None:
        super().__init__(cfg, causal=causal)
        self.embedding = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        nn.init.normal_(self.embedding.weight, std=0.02)

    def add_to_embeddings(self, x: Tensor, positions: Tensor) -> Tensor:
        return x + self.embedding(positions).to(x.dtype)
