"""Key/value cache for incremental decoding: each step computes projections for new tokens only."""

from __future__ import annotations

import torch
from torch import Tensor


class LayerKVCache:
    """Keys and values of one attention layer, preallocated to ``max_len`` on first use.

    With a sliding ``window`` the cache stores at most ``window`` positions, a ring buffer: position p
    lives in slot p % max_len, and a new position overwrites the oldest, which no later query sees.
    Keys are stored already rotated at their absolute positions, so rope stays exact; the masks
    follow the slots' positions (:meth:`key_positions`).

    ``memory`` holds the cross-attention keys/values of the encoder output, which do not
    change while decoding and so are projected once.
    """

    def __init__(self, max_len: int, window: int | None = None) -> None:
        # A window no longer than max_len rolls on forever; a shorter cache is full at max_len.
        self.rolls = window is not None and window <= max_len
        self.max_len = max_len if window is None else min(max_len, window)  # positions stored at most
        self.length = 0  # positions seen so far: the absolute position of the next one
        self.keys: Tensor | None = None  # (B, nh, max_len, hs)
        self.values: Tensor | None = None
        self.memory: tuple[Tensor, Tensor] | None = None

    def key_positions(self, new: int, device: torch.device) -> Tensor:
        """Absolute positions of the keys :meth:`append` returns for ``new`` more positions, in its order."""
        start, size = self.length, self.max_len
        if start + new <= size:  # nothing overwritten yet: slot p holds position p
            return torch.arange(start + new, device=device)
        if new == 1:  # written over the oldest: slot s holds the latest position p <= start with p % size == s
            return start - (start - torch.arange(size, device=device)) % size
        slots = torch.arange(min(start, size), device=device)  # the stored ones, then the new ones
        stored = (start - 1) - (start - 1 - slots) % size
        return torch.cat((stored, torch.arange(start, start + new, device=device)))

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store new (B, nh, T, hs) keys/values; return the keys/values the new queries attend to:
        all so far, or with a window the stored ones and the new ones (see :meth:`key_positions`)."""
        start, new = self.length, k.size(2)
        end = start + new
        if end > self.max_len and not self.rolls:
            raise ValueError(f"KV cache is full: {end} positions > max_len {self.max_len}")
        if self.keys is None or self.values is None:
            shape = (k.size(0), k.size(1), self.max_len, k.size(3))
            self.keys = torch.empty(shape, dtype=k.dtype, device=k.device)
            self.values = torch.empty(shape, dtype=v.dtype, device=v.device)
        self.length = end
        if end <= self.max_len:
            self.keys[:, :, start:end] = k
            self.values[:, :, start:end] = v
            return self.keys[:, :, :end], self.values[:, :, :end]
        if new == 1:  # one decoding step: the oldest position leaves the window
            slot = start % self.max_len
            self.keys[:, :, slot : slot + 1] = k
            self.values[:, :, slot : slot + 1] = v
            return self.keys, self.values
        # Several new positions: the early ones need stored keys that the late ones overwrite.
        stored = min(start, self.max_len)
        keys = torch.cat((self.keys[:, :, :stored], k), dim=2)  # (B, nh, stored + T, hs)
        values = torch.cat((self.values[:, :, :stored], v), dim=2)
        kept = min(new, self.max_len)
        slots = torch.arange(end - kept, end, device=k.device) % self.max_len
        self.keys.index_copy_(2, slots, k[:, :, -kept:])
        self.values.index_copy_(2, slots, v[:, :, -kept:])
        return keys, values

    def reorder(self, index: Tensor) -> None:
        """Select batch rows (e.g. surviving beams) along dim 0."""
        if self.keys is not None and self.values is not None:
            self.keys = self.keys.index_select(0, index)
            self.values = self.values.index_select(0, index)
        if self.memory is not None:
            self.memory = (self.memory[0].index_select(0, index), self.memory[1].index_select(0, index))


class KVCache:
    """One :class:`LayerKVCache` per block of a decoder stack; ``window``: every layer's, or a list of each
    layer's (Gemma's sliding layers keep their window, its global layers the whole context)."""

    def __init__(self, n_layers: int, max_len: int, window: int | None | list[int | None] = None) -> None:
        windows = window if isinstance(window, list) else [window] * n_layers
        self.layers = [LayerKVCache(max_len, layer_window) for layer_window in windows]

    @property
    def length(self) -> int:
        """Number of positions already cached (the offset of the next token)."""
        return self.layers[0].length

    @property
    def max_len(self) -> int:
        """Positions stored at most (with a window: at most the window, however long the sequence)."""
        return max(layer.max_len for layer in self.layers)

    def key_positions(self, new: int, device: torch.device) -> Tensor:
        """Absolute positions of the keys the first layer attends to after ``new`` more positions (each layer's:
        ``layers[i].key_positions``; the same for layers of the same window)."""
        return self.layers[0].key_positions(new, device)

    def reorder(self, index: Tensor) -> None:
        for layer in self.layers:
            layer.reorder(index)
