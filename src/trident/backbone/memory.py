"""Segment-level recurrence (Transformer-XL, Dai et al. 2019): each layer attends to the hidden states that entered it
for the previous segment(s), kept without gradient, as well as to the current segment.

A causal LM with ``model.memory_length`` M reads its text in segments of S tokens (``data.max_seq_len``, which is
``data.block_size``). Layer i of segment t+1 computes its keys and values over [memory_i ; current] where memory_i is
the last M inputs of layer i (segment t's, and earlier ones' when M > S), detached; queries are the current
segment's only, and see all the memory and their own past (the causal mask shifted by the memory's length). Positions
enter as distances (rope, alibi, relative, none): the memory's keys sit at 0..m-1, the segment's tokens at m.. .
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from trident.backbone.kv_cache import KVCache, LayerKVCache
from trident.errors import ConfigError, is_int


class SegmentMemory:
    """The hidden states a recurrent stack keeps between segments, per layer.

    ``states[i]``: (B, m, D) the last m <= ``length`` inputs of layer i of the finished segments, detached.
    ``pending[i]``: the inputs of layer i of the segment in progress, call by call (a cached decoder feeds a
    segment a token at a time); :meth:`advance` counts the tokens and, once ``segment`` tokens are in, rolls the
    segment into ``states``.
    """

    def __init__(self, n_layers: int, length: int, segment: int) -> None:
        self.length = length  # M: states kept per layer
        self.segment = segment  # S: tokens per segment
        self.states: list[Tensor | None] = [None] * n_layers
        self.pending: list[list[Tensor]] = [[] for _ in range(n_layers)]
        self.filled = 0  # tokens of the segment in progress

    @property
    def held(self) -> int:
        """m: the finished segments' states held per layer (0 before the first segment ends)."""
        first = self.states[0]
        return 0 if first is None else first.size(1)

    def prefix(self, layer: int, cached: bool) -> Tensor | None:
        """The states layer ``layer`` attends to before this call's tokens: (B, m [+ p], D). Without a KV cache the
        memory and the segment's earlier tokens (their keys are recomputed); with one, the memory alone, fed once as
        the segment starts (later calls find its keys, and the segment's, in the cache)."""
        parts = [t for t in (self.states[layer],) if t is not None]
        if not cached:
            parts += self.pending[layer]
        elif self.filled:
            return None
        return torch.cat(parts, dim=1) if parts else None

    def prefix_length(self, cached: bool) -> int:
        """The length of :meth:`prefix` (the same for every layer)."""
        if cached:
            return 0 if self.filled else self.held
        return self.held + self.filled

    def record(self, layer: int, hidden: Tensor) -> None:
        """Keep (B, T, D) inputs of ``layer`` for this segment, without their gradient."""
        held = self.states[layer]
        if held is not None and held.size(0) != hidden.size(0):
            raise ValueError(f"the memory holds {held.size(0)} rows and the batch has {hidden.size(0)}: a memory "
                             "follows the same rows from segment to segment (a new batch of texts needs a new memory)")
        self.pending[layer].append(hidden.detach())

    def advance(self, tokens: int) -> bool:
        """Count ``tokens`` more of the segment; True when this ends it and it rolled into the memory."""
        self.filled += tokens
        if self.filled < self.segment:
            return False
        for i, pending in enumerate(self.pending):
            held = self.states[i]
            states = torch.cat(pending if held is None else [held, *pending], dim=1)  # (B, m + S, D)
            self.states[i] = states[:, -self.length:]
            self.pending[i] = []
        self.filled = 0
        return True

    def reorder(self, index: Tensor) -> None:
        """Select batch rows along dim 0 (the states and the segment in progress)."""
        self.states = [None if t is None else t.index_select(0, index) for t in self.states]
        self.pending = [[t.index_select(0, index) for t in pending] for pending in self.pending]


class RecurrentCache(KVCache):
    """The KV cache of a recurrent decoder: the keys and values of the segment in progress and of the memory it
    started with (at most M + S positions per layer), beside the :class:`SegmentMemory`. When a segment ends the
    memory rolls and the keys start anew from the new memory, so that decoding token by token gives each token what
    reading the text segment by segment gives it."""

    def __init__(self, n_layers: int, memory: SegmentMemory) -> None:
        super().__init__(n_layers, memory.length + memory.segment)
        self.memory = memory

    def restart(self) -> None:
        """A new segment: no keys yet (its first call feeds the memory's)."""
        self.layers = [LayerKVCache(layer.max_len) for layer in self.layers]

    def reorder(self, index: Tensor) -> None:
        super().reorder(index)
        self.memory.reorder(index)


def check_memory_config(cfg: Any, absolute: bool) -> None:
    """``model.memory_length`` composes with the stack's settings: positions as distances (not ``absolute``), softmax
    attention over the whole context. One line for what it does not compose with."""
    length = cfg.memory_length
    if not is_int(length) or length < 0:
        raise ConfigError(f"model.memory_length must be an integer >= 0 (0: no memory), got {length!r}: set e.g. "
                          "model.memory_length=256")
    if length == 0:
        return
    if absolute:
        raise ConfigError(f"model.memory_length with pos_encoding={cfg.pos_encoding}: absolute positions repeat in every "
                          "segment, so the memory and the segment would carry the same ones (Dai et al. 2019, section "
                          "3.3): use pos_encoding=rope, alibi, relative or none")
    if cfg.attention != "softmax":
        raise ConfigError(f"model.memory_length with model.attention={cfg.attention}: the memory is attended to by "
                          "softmax attention: use model.attention=softmax")
    if any(layer.attention_window is not None for layer in cfg.layer_settings):
        raise ConfigError("model.memory_length with a sliding window (model.attention_window, model.layers): the memory "
                          "extends the context a window cuts: set one of them")


def check_recurrent_stack(memory_length: int, *, causal: bool, cross_attention: bool) -> None:
    """A memory serves a decoder-only causal stack (task=lm) only."""
    if memory_length and (not causal or cross_attention):
        raise ConfigError("model.memory_length (Transformer-XL's segment recurrence) serves a decoder-only causal LM "
                          "(task=lm): set model.memory_length=0 for this stack")
