"""Small building blocks of a Transformer block: normalisation, feed-forward, token embedding."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trident.backbone.parallel_plan import Columns, ParallelPlan, Rows
from trident.errors import choose


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: the gain is 1 + weight (weight starts at 0), computed in float32 and cast back, as
    transformers' ``GemmaRMSNorm`` does (its checkpoints store the offset, not the gain)."""

    def __init__(self, d_model: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(d_model))

    def forward(self, x: Tensor) -> Tensor:
        # torch's rms_norm on the float32 input and gain: the same operations (bit for bit on a CPU, where it is
        # composite), and one fused kernel each way on a GPU instead of square, mean, rsqrt and two products.
        return F.rms_norm(x.float(), (x.size(-1),), 1.0 + self.weight.float(), self.eps).type_as(x)  # (..., D)


# model.norm: name -> (d_model, bias, eps) -> module. ``layernorm`` is the paper's; ``rmsnorm`` has no
# mean centring and no bias (Zhang & Sennrich 2019); ``rmsnorm_offset`` is Gemma's RMSNorm with gain 1 + weight.
NORMS: dict[str, Callable[[int, bool, float], nn.Module]] = {
    "layernorm": lambda d_model, bias, eps: nn.LayerNorm(d_model, eps=eps, bias=bias),
    "rmsnorm": lambda d_model, bias, eps: nn.RMSNorm(d_model, eps=eps),
    "rmsnorm_offset": lambda d_model, bias, eps: OffsetRMSNorm(d_model, eps),
}
# model.activation: name -> nonlinearity of the feed-forward hidden layer. ``gelu_tanh`` is GELU's tanh
# approximation (GPT-2's ``gelu_new``, needed to reproduce its weights exactly). ``swiglu`` applies its
# silu to a gate that multiplies a second (linear) half of the hidden layer (GATED_ACTIVATIONS); ``geglu_tanh``
# the tanh GELU (Gemma's GeGLU, transformers' gelu_pytorch_tanh).
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": partial(F.gelu, approximate="tanh"),
    "swiglu": F.silu,
    "geglu_tanh": partial(F.gelu, approximate="tanh"),
    # OpenAI CLIP's x * sigmoid(1.702 x) (transformers' quick_gelu), needed to reproduce its weights exactly.
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}
GATED_ACTIVATIONS = ("swiglu", "geglu_tanh")


def make_norm(name: str, d_model: int, *, bias: bool = True, eps: float = 1e-5) -> nn.Module:
    """The normalisation layer ``name`` (a key of :data:`NORMS`)."""
    return choose(NORMS, name, "model.norm")(d_model, bias, eps)


class FeedForward(nn.Module):
    """Position-wise feed-forward network: Linear -> activation -> Linear.

    ``swiglu`` (Shazeer 2020) gates the hidden layer: silu(x W1) * (x W3), with W1 and W3
    fused into one projection of width 2 * d_ff.
    """

    def __init__(self, d_model: int, d_ff: int, *, activation: str = "relu", bias: bool = True) -> None:
        super().__init__()
        self.activation = activation
        self.act = choose(ACTIVATIONS, activation, "model.activation")
        self.gated = activation in GATED_ACTIVATIONS
        hidden_out = 2 * d_ff if self.gated else d_ff
        self.fc_in = nn.Linear(d_model, hidden_out, bias=bias)
        self.fc_out = nn.Linear(d_ff, d_model, bias=bias)

    def parallel_plan(self) -> ParallelPlan:
        """Megatron-LM's: ``fc_in`` split by hidden units (a gated one's [gate; value] part by part: each rank's
        units need both halves), ``fc_out`` by its input."""
        hidden = self.fc_out.in_features
        return {"fc_in": Columns(parts=(hidden, hidden) if self.gated else ()), "fc_out": Rows()}

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc_in(x)  # (B, T, d_ff) or, gated, (B, T, 2*d_ff)
        if self.gated:
            gate, value = h.chunk(2, dim=-1)  # (B, T, d_ff) each
            h = self.act(gate) * value
        else:
            h = self.act(h)
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
        embeddings = super().forward(ids)  # (B, T) -> (B, T, D)
        return embeddings if self.scale == 1.0 else embeddings * self.scale  # x * 1.0 is x: no op per decoding step
