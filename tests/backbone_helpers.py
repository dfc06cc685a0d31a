"""Small backbone configurations and helpers shared by the backbone tests."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trident.backbone import TransformerConfig

D_MODEL, N_HEADS, N_LAYERS, D_FF = 32, 4, 2, 64
HEAD_DIM = D_MODEL // N_HEADS


def make_cfg(**overrides: Any) -> TransformerConfig:
    """A 2-layer, width-32 config without dropout, so outputs can be compared exactly."""
    options: dict[str, Any] = {
        "d_model": D_MODEL,
        "n_heads": N_HEADS,
        "n_layers": N_LAYERS,
        "d_ff": D_FF,
        "dropout": 0.0,
        "max_seq_len": 64,
    }
    options.update(overrides)
    return TransformerConfig(**options)


def perturb_(module: nn.Module, std: float = 0.3, seed: int = 0) -> nn.Module:
    """Add noise to every parameter. The GPT-2 init (std 0.02) makes attention almost uniform,
    which would let a wrong mask or a wrong position go unnoticed."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * std)
    return module
