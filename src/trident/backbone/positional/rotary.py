"""Rotary position embedding (RoFormer, Su et al. 2021).

Queries and keys are rotated pairwise by an angle proportional to their position, so the
dot product q_m . k_n depends on the positions only through the offset m - n.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from trident.backbone.masks import document_positions
from trident.backbone.positional.base import PositionalEncoding, StackShape, grid_coordinates, register_pos_encoding
from trident.backbone.positional.rope_scaling import check_scaling, scaled_frequencies
from trident.errors import ConfigError


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, direction: int) -> Tensor:
    """``x`` (..., hs) rotated by +angle (``direction`` 1) or -angle (-1: the backward, the rotation's transpose) in
    three passes and no copy: out = x * cos, then in place on its halves out1 -= x2 * sin1, out2 += x1 * sin1 (the
    tables' two halves are equal; signs flipped for -angle). cos, sin: (..., hs) broadcastable to ``x``."""
    half = x.size(-1) // 2
    out = x * cos
    sin_half = sin[..., :half]
    out[..., :half].addcmul_(x[..., half:], sin_half, value=-direction)
    out[..., half:].addcmul_(x[..., :half], sin_half, value=direction)
    return out


class _Rotation(torch.autograd.Function):
    """Rope's rotation with its backward written out. Eager autograd through ``x * cos + rotate_half(x) * sin``
    copies the halves into new tensors (``cat``) forward and backward and keeps a product per term; here each
    direction is three passes into one output. Kept lean (the ``ctx`` form, slices rather than reshaped views): a
    Function's Python cost per call is what small models on a CPU feel, and a first version with ``setup_context``
    and ``empty_like`` was slower than the cat form on (4, 4, 32, 64) queries."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, 1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, -1), None, None


def _rotate_traced(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The same rotation as pure functions of ``x``, for torch.compile and torch.export: the compiler fuses
    these into one kernel (a Function's in-place writes would only hide them from it)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos1, sin1 = cos[..., : x1.size(-1)], sin[..., : x1.size(-1)]
    return torch.cat((x1 * cos1 - x2 * sin1, x2 * cos1 + x1 * sin1), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` (B, nh, T, hs) by the angles whose cos/sin are (T, hs), or (B, 1, T, hs) for packed rows: the
    two halves of each head as (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) (GPT-NeoX's and transformers' layout).
    cos and sin are cast to ``x``'s dtype first, as transformers does."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if torch.compiler.is_compiling():
        return _rotate_traced(x, cos, sin)
    # The Function gives no gradient to the tables, and its ctx form has no rule for torch.func's transforms (grad,
    # vmap, jacrev): tables that train, or a transform, take the plain functions, which autograd differentiates.
    if (x.requires_grad and torch.is_grad_enabled() and not (cos.requires_grad or sin.requires_grad)
            and not torch._C._are_functorch_transforms_active()):
        return _Rotation.apply(x, cos, sin)
    return _rotate(x, cos, sin, 1)  # no graph to record (decoding, evaluation): no Function's call either


@register_pos_encoding
class RotaryEncoding(PositionalEncoding):
    """1-D rope, optionally with a long-context scaling (``options.scaling``, :mod:`rope_scaling`); on an
    image grid, axial 2-D rope: half of the rotated pairs turn with the row, the other half with the
    column, and prefix tokens (the class token) are not rotated."""

    name: ClassVar[str] = "rope"
    uses_rotary: ClassVar[bool] = True
    extrapolates: ClassVar[bool] = False

    def __init__(self, cfg: StackShape, *, causal: bool) -> None:
        super().__init__(cfg, causal=causal)
        self.base = float(cfg.pos_encoding_options.get("base", 10000.0))
        self.scaling = check_scaling(cfg.pos_encoding_options.get("scaling"))
        if self.scaling is not None and cfg.grid is not None:
            raise ConfigError(
                "pos_encoding.options.scaling stretches a 1-D context; a 2-D rope on an image grid (ViT) "
                "takes none: set pos_encoding.options.scaling=null"
            )
        # One frequency per rotated pair (hs/2 pairs); on a grid, rows and columns get hs/4 each.
        n_freq = cfg.head_dim // 2 if cfg.grid is None else cfg.head_dim // 4
        self.rotated = 2 * n_freq
        #: Multiplies cos and sin (YaRN's temperature on the attention logits); 1 otherwise.
        self.attention_factor = 1.0
        if self.scaling is None:
            inv_freq = self.base ** (-torch.arange(n_freq, dtype=torch.float32) / n_freq)
        else:
            inv_freq, self.attention_factor = scaled_frequencies(self.scaling, self.base, self.rotated)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.follows_length = self.scaling is not None and self.scaling["type"] == "dynamic"
        if self.follows_length:
            # Dynamic NTK state, as transformers keeps it: the frequencies follow the longest sequence
            # since the length last fell below the original one, where they return to the original ones.
            self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)
            self.longest = int(self.scaling["original_max_position_embeddings"])

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return ("base", "scaling")

    def rotary(self, positions: Tensor, documents: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if self.follows_length and documents is not None:
            return self._per_document(documents)
        if self.follows_length:
            self._follow_length(int(positions.max()) + 1, positions.device)
        if self.grid is None:
            angles = positions.float()[..., None] * self.inv_freq  # (T, hs/2), or (B, T, hs/2) for per-row positions
        else:
            rows, cols, is_patch = grid_coordinates(positions, self.grid, self.num_prefix_tokens)
            # (T, 2) coordinates times the frequencies: rows' pairs, then columns' pairs, (T, hs/2)
            angles = (torch.stack((rows, cols), dim=1).float()[..., None] * self.inv_freq).flatten(1)
            angles = angles * is_patch[:, None]  # (T, hs/2); zero angle = identity for prefix tokens
        if positions.dim() == 2:  # each row its own positions (left-padded prompts): (B, 1, T, hs), broadcast over heads
            angles = angles[:, None]
        return self._cos_sin(angles, self.attention_factor)

    @staticmethod
    def _cos_sin(angles: Tensor, factor: float) -> tuple[Tensor, Tensor]:
        """(cos, sin) of (..., hs/2) ``angles``, each (..., hs) with its two halves equal (one angle per rotated pair),
        times ``factor``: cos and sin write the doubled table themselves, no copy of the angles first."""
        doubled = angles[..., None, :].expand(*angles.shape[:-1], 2, angles.size(-1))  # (..., 2, hs/2), a view
        cos, sin = doubled.cos().flatten(-2), doubled.sin().flatten(-2)  # (..., hs)
        if factor == 1.0:  # x * 1.0 is x: no pass over the tables
            return cos, sin
        return cos * factor, sin * factor

    def _per_document(self, documents: Tensor) -> tuple[Tensor, Tensor]:
        """Dynamic NTK over rows packed with several documents (``documents``: (B, T) ids): each document is
        rotated as if it ran alone, from position 0 with the frequencies of its own length (those of a fresh
        model: the original ones up to the original length), never the row's. Leaves the length-following
        state of generation alone. Returns (cos, sin), each (B, 1, T, hs), broadcast over the heads."""
        assert self.scaling is not None
        positions = document_positions(documents)  # (B, T), 0 where a document starts
        lengths = positions + document_positions(documents.flip(1)).flip(1) + 1  # (B, T): each token's document length
        original = int(self.scaling["original_max_position_embeddings"])
        seen, which = lengths.clamp(min=original).unique(return_inverse=True)  # (U,), (B, T)
        # One set of frequencies per distinct length, computed as a fresh model computes it alone (the same bits).
        freqs = torch.stack([self.original_inv_freq if n == original else
                             scaled_frequencies(self.scaling, self.base, self.rotated, n, documents.device)[0]
                             for n in seen.tolist()])  # (U, hs/2)
        angles = positions.float()[..., None] * freqs[which]  # (B, T, hs/2)
        return self._cos_sin(angles[:, None], 1.0)  # (B, 1, T, hs) each

    def _follow_length(self, length: int, device: torch.device) -> None:
        """Dynamic NTK: recompute the frequencies for a sequence longer than any since the last reset,
        back to the original ones below the original length (transformers' ``dynamic_rope_update``).
        Keys already in a KV cache keep the angles they were rotated with."""
        assert self.scaling is not None
        original = int(self.scaling["original_max_position_embeddings"])
        if length > self.longest:
            self.inv_freq, _ = scaled_frequencies(self.scaling, self.base, self.rotated, length, device)
            self.longest = length
        elif length < original < self.longest:
            self.inv_freq = self.original_inv_freq
            self.longest = original
