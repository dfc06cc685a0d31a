"""Encodings that bias the attention scores by the query-key distance: ALiBi and T5 buckets."""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor, nn

from trident.backbone.positional.base import PositionalEncoding, StackShape, register_pos_encoding
from trident.errors import ConfigError


def alibi_slopes(n_heads: int) -> Tensor:
    """Per-head slopes of Press et al. (2022): a geometric sequence starting at 2^(-8/n)."""

    def power_of_two_slopes(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_heads).is_integer():
        return torch.tensor(power_of_two_slopes(n_heads))
    # Not a power of two: the closest lower power's slopes, then every other slope of twice as many.
    closest = 2 ** math.floor(math.log2(n_heads))
    extra = power_of_two_slopes(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(power_of_two_slopes(closest) + extra)


class DistanceBias(PositionalEncoding):
    """An encoding that biases the attention scores by the query-key distance along one axis (``attention_bias``):
    image patches on a 2-D grid have no one such distance."""

    supports_grid: ClassVar[bool] = False


@register_pos_encoding
class AlibiEncoding(DistanceBias):
    """Linear distance penalty -slope_h * |i - j|; needs no parameters and extrapolates."""

    name: ClassVar[str] = "alibi"

    def __init__(self, cfg: StackShape, *, causal: bool) -> None:
        super().__init__(cfg, causal=causal)
        self.register_buffer("slopes", alibi_slopes(cfg.n_heads), persistent=False)

    def attention_bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor:
        distance = (q_positions[:, None] - k_positions[None, :]).abs().float()  # (Tq, Tk)
        return (-self.slopes[:, None, None] * distance).unsqueeze(0)  # (1, nh, Tq, Tk)


def relative_bucket(relative: Tensor, *, bidirectional: bool, num_buckets: int, max_distance: int) -> Tensor:
    """Map key-minus-query offsets to buckets: exact for small offsets, logarithmic up to max_distance."""
    bucket = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2  # half of the buckets for keys after the query
        bucket += (relative > 0).long() * num_buckets
        distance = relative.abs()
    else:
        distance = (-relative).clamp(min=0)  # only keys in the past are distinguished
    max_exact = num_buckets // 2
    log_ratio = torch.log(distance.clamp(min=max_exact).float() / max_exact) / math.log(max_distance / max_exact)
    large = (max_exact + (log_ratio * (num_buckets - max_exact)).long()).clamp(max=num_buckets - 1)
    return bucket + torch.where(distance < max_exact, distance, large)


@register_pos_encoding
class RelativeEncoding(DistanceBias):
    """T5's learned bias per head and per bucket of the query-key offset (Raffel et al. 2020)."""

    name: ClassVar[str] = "relative"

    def __init__(self, cfg: StackShape, *, causal: bool) -> None:
        super().__init__(cfg, causal=causal)
        self.num_buckets = int(cfg.pos_encoding_options.get("num_buckets", 32))
        self.max_distance = int(cfg.pos_encoding_options.get("max_distance", 128))
        # Below these the log-spaced buckets collapse (division by log(<=1)) or overlap directions.
        if self.num_buckets < 4 or self.max_distance < self.num_buckets:
            raise ConfigError(
                f"pos_encoding=relative needs num_buckets >= 4 and max_distance >= num_buckets, got "
                f"num_buckets={self.num_buckets}, max_distance={self.max_distance}: fix pos_encoding.options"
            )
        self.bias = nn.Embedding(self.num_buckets, cfg.n_heads)
        nn.init.normal_(self.bias.weight, std=0.02)

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return ("num_buckets", "max_distance")

    def attention_bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor:
        relative = k_positions[None, :] - q_positions[:, None]  # (Tq, Tk)
        buckets = relative_bucket(
            relative, bidirectional=not self.causal, num_buckets=self.num_buckets, max_distance=self.max_distance
        )
        return self.bias(buckets).permute(2, 0, 1).unsqueeze(0)  # (1, nh, Tq, Tk)
