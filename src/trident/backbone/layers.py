"""Small building blocks of a Transformer block: normalisation, feed-forward, token embedding."""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor, nn


def make_norm(name: str, d_model: int, *, bias: bool = True, eps: float = 1e-5) -> nn.Module:
    """``layernorm`` (the paper) or ``rmsnorm`` (no mean centring, no bias; Zhang & Sennrich 2019)."""
    if name == "rmsnorm":
        return nn.RMSNorm(d_model, eps=eps)
    return nn.LayerNorm(d_model, eps=eps, bias=bias)


class FeedForward(nn.Module):
    """Position-wise feed-forward network: Linear -> activation -> Linear.

    ``swiglu`` (Shazeer 2020) gates the hidden layer: silu(x W1) * (x W3), with W1 and W3
    fused into one projection of width 2 * d_ff.
    """

    def __init__(self, d_model: int, d_ff: int, *, activation: str = "relu", bias: bool = True) -> None:
        super().__init__()
        self.activation = activation
        hidden_out = 2 * d_ff if activation == "swiglu" else d_ff
        self.fc_in = nn.Linear(d_model, hidden_out, bias=bias)
        self.fc_out = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc_in(x)  # (B, T, d_ff) or (B, T, 2*d_ff)
        if self.activation == "swiglu":
            gate, value = h.chunk(2, dim=-1)
            h = F.silu(gate) * value
        elif self.activation == "gelu":
            h = F.gelu(h)
        else:
            h = F.relu(h)
        return self.fc_out(h)


class TokenEmbedding(nn.Embedding):
    """Token embedding; ``scale=True`` multiplies by sqrt(d_model) as in the paper (section 3.4).

    With scaling the table starts at std d_model^-0.5 so the scaled output has unit variance;
    without it, at std 0.02 (GPT-2).
    """

    def __init__(self, vocab_size: int, d_model: int, *, scale: bool = False) -> None:
        super().__init__(vocab_size, d_model)
        self.scale = math.sqrt(d_model) if scale else 1.0
        nn.init.normal_(self.weight, std=d_model**-0.5 if scale else 0.02)

    def forward(self, ids: Tensor) -> Tensor:
        return super().forward(ids) * self.scale  # (B, T) -> (B, T, D)
