"""The interface every positional encoding implements, and the registry that names them.

A Transformer is permutation-invariant without position information. Encodings inject it
in one of three places, so each one overrides exactly one hook:

* ``add_to_embeddings``: absolute vectors added to the token embeddings (sinusoidal, learned);
* ``rotary``: a rotation of queries and keys inside every attention layer (rope);
* ``attention_bias``: an additive bias on the attention scores (alibi, relative).
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor, nn

from trident.errors import ConfigError


class StackShape(Protocol):
    """What an encoding reads of the stack's :class:`trident.backbone.TransformerConfig`. A protocol,
    not that class: the config checks ``pos_encoding`` against this registry, so imports go one way."""

    d_model: int
    n_heads: int
    max_seq_len: int
    pos_encoding: str
    pos_encoding_options: dict[str, Any]
    grid: tuple[int, int] | None
    num_prefix_tokens: int

    @property
    def head_dim(self) -> int: ...


_REGISTRY: dict[str, type[PositionalEncoding]] = {}


class PositionalEncoding(nn.Module):
    """Base class: no position information at all (the ``none`` encoding)."""

    name: ClassVar[str] = "none"
    #: True when the encoding has a hard maximum length (a learned table).
    bounded_length: ClassVar[bool] = False
    #: True when positions are added to the embeddings: a hidden state depends on its absolute position,
    #: not only on distances (a sliding window then still cannot roll past ``max_seq_len``).
    absolute: ClassVar[bool] = False
    #: True when incremental decoding with a KV cache gives the same result as a full pass.
    supports_kv_cache: ClassVar[bool] = True
    #: True when quality holds on sequences longer than those seen in training.
    extrapolates: ClassVar[bool] = True
    #: True when queries and keys are rotated (needs an even head size).
    uses_rotary: ClassVar[bool] = False
    #: True when the encoding can place image patches on a 2-D grid (``StackShape.grid``).
    supports_grid: ClassVar[bool] = True
    #: True when the encoding is defined for keys on both sides of a query (bidirectional encoders).
    supports_bidirectional: ClassVar[bool] = True

    def __init__(self, cfg: StackShape, *, causal: bool) -> None:
        super().__init__()
        self.causal = causal
        self.max_len: int | None = cfg.max_seq_len if self.bounded_length else None
        self.grid = cfg.grid
        self.num_prefix_tokens = cfg.num_prefix_tokens
        unknown = set(cfg.pos_encoding_options) - set(self.option_names())
        if unknown:
            raise ConfigError(
                f"pos_encoding={self.name} has no option(s) {sorted(unknown)}; "
                f"it accepts {sorted(self.option_names()) or 'none'}"
            )

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """Names accepted in ``StackShape.pos_encoding_options``."""
        return ()

    def check_length(self, length: int) -> None:
        """Fail clearly when a sequence is longer than the encoding can represent."""
        if self.max_len is not None and length > self.max_len:
            raise ConfigError(
                f"sequence length {length} exceeds the {self.name} positional encoding's maximum "
                f"{self.max_len}: raise data.max_seq_len or shorten the sequence (data.block_size)"
            )

    def add_to_embeddings(self, x: Tensor, positions: Tensor) -> Tensor:
        """``x``: (B, T, D) embeddings; ``positions``: (T,) absolute positions, or (B, T) for rows packed
        with several documents (each restarting at 0)."""
        return x

    def rotary(self, positions: Tensor, documents: Tensor | None = None) -> tuple[Tensor, Tensor] | None:
        """(cos, sin), each (T, head_dim), for rotating queries/keys at ``positions`` (T,); at per-row positions (B, T)
        (left-padded prompts), (B, 1, T, head_dim) each. ``documents``: (B, T) document ids of packed rows, for a rope
        that depends on the length (dynamic NTK: then (B, 1, T, head_dim) each)."""
        return None

    def attention_bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor | None:
        """Additive score bias of shape (1, n_heads, Tq, Tk), or None."""
        return None


def register_pos_encoding(cls: type[PositionalEncoding]) -> type[PositionalEncoding]:
    """Class decorator adding an encoding to the registry under ``cls.name``."""
    _REGISTRY[cls.name] = cls
    return cls


register_pos_encoding(PositionalEncoding)


def available_pos_encodings() -> list[str]:
    return sorted(_REGISTRY)


def pos_encoding_class(name: str) -> type[PositionalEncoding]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(
            f"unknown positional encoding {name!r}: choose one of {', '.join(available_pos_encodings())}"
        ) from None


def build_pos_encoding(cfg: StackShape, *, causal: bool) -> PositionalEncoding:
    spec = pos_encoding_class(cfg.pos_encoding)
    if not causal and not spec.supports_bidirectional:
        raise ConfigError(
            f"pos_encoding={cfg.pos_encoding} only describes keys before the query and cannot serve a "
            f"bidirectional encoder: choose one of {', '.join(bidirectional_pos_encodings())}"
        )
    return spec(cfg, causal=causal)


def bidirectional_pos_encodings() -> list[str]:
    """Names of the encodings an encoder (attention to both sides) can use."""
    return [name for name in available_pos_encodings() if _REGISTRY[name].supports_bidirectional]


def grid_coordinates(positions: Tensor, grid: tuple[int, int], num_prefix_tokens: int) -> tuple[Tensor, Tensor, Tensor]:
    """(row, col, is_patch) of each position: prefix tokens (e.g. the class token) come first and
    have no place on the grid; patch i after them sits at row i // cols, column i % cols."""
    patch_index = positions - num_prefix_tokens
    is_patch = patch_index >= 0
    patch_index = patch_index.clamp(min=0)
    return patch_index // grid[1], patch_index % grid[1], is_patch


def positions_from(offset: int, length: int, device: torch.device) -> Tensor:
    """Absolute positions ``offset .. offset+length-1`` as a (length,) long tensor."""
    return torch.arange(offset, offset + length, device=device)
