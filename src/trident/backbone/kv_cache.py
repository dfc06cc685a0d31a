"""Key/value cache for incremental decoding: each step computes projections for new tokens only."""

from __future__ import annotations

import torch
from torch import Tensor


class LayerKVCache:
    """Keys and values of one attention layer, preallocated to ``max_len`` on first use.

    ``memory`` holds the cross-attention keys/values of the encoder output, which do not
    change while decoding and so are projected once.
    """

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.length = 0
        self.keys: Tensor | None = None  # (B, nh, max_len, hs)
        self.values: Tensor | None = None
        self.memory: tuple[Tensor, Tensor] | None = None

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store new (B, nh, T, hs) keys/values; return all keys/values so far."""
        new_len = self.length + k.size(2)
        if new_len > self.max_len:
            raise ValueError(f"KV cache is full: {new_len} positions > max_len {self.max_len}")
        if self.keys is None or self.values is None:
            shape = (k.size(0), k.size(1), self.max_len, k.size(3))
            self.keys = torch.empty(shape, dtype=k.dtype, device=k.device)
            self.values = torch.empty(shape, dtype=v.dtype, device=v.device)
        self.keys[:, :, self.length : new_len] = k
        self.values[:, :, self.length : new_len] = v
        self.length = new_len
        return self.keys[:, :, :new_len], self.values[:, :, :new_len]

    def reorder(self, index: Tensor) -> None:
        """Select batch rows (e.g. surviving beams) along dim 0."""
        if self.keys is not None and self.values is not None:
            self.keys = self.keys.index_select(0, index)
            self.values = self.values.index_select(0, index)
        if self.memory is not None:
            self.memory = (self.memory[0].index_select(0, index), self.memory[1].index_select(0, index))


class KVCache:
    """One :class:`LayerKVCache` per block of a decoder stack."""

    def __init__(self, n_layers: int, max_len: int) -> None:
        self.layers = [LayerKVCache(max_len) for _ in range(n_layers)]

    @property
    def length(self) -> int:
        """Number of positions already cached (the offset of the next token)."""
        return self.layers[0].length

    @property
    def max_len(self) -> int:
        return self.layers[0].max_len

    def reorder(self, index: Tensor) -> None:
        for layer in self.layers:
            layer.reorder(index)
