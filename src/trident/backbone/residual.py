"""Two layers on a residual branch, written here rather than imported from timm (importing timm
takes seconds, most of a run's start-up): stochastic depth and CaiT's LayerScale. Same
parameters, names and outputs as ``timm.layers.DropPath`` / ``LayerScale`` (tests/test_backbone_residual.py)."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class DropPath(nn.Module):
    """Stochastic depth (Huang et al. 2016): in training, zero the whole branch of a sample with
    probability ``drop_prob`` and scale the kept ones by 1 / (1 - drop_prob), so the expectation is unchanged."""

    def __init__(self, drop_prob: float) -> None:
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: Tensor) -> Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep_prob = 1.0 - self.drop_prob
        keep = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep_prob)  # (B, 1, ..., 1)
        return x * keep.div_(keep_prob) if keep_prob > 0.0 else x * keep

    def extra_repr(self) -> str:
        return f"drop_prob={self.drop_prob:.3f}"


class LayerScale(nn.Module):
    """CaiT's learned per-channel scale of a residual branch (Touvron et al. 2021), started at ``init_value``.
    The parameter is ``gamma``, as in timm, so timm ViT weights and earlier checkpoints load unchanged."""

    def __init__(self, dim: int, init_value: float) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), init_value))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma  # (..., dim) * (dim,)
