"""Attention masks. Convention: a boolean *allowed* mask is True where a query may attend,
and a ``key_padding_mask`` is True at padding positions (PyTorch's convention)."""

from __future__ import annotations

import torch
from torch import Tensor


def causal_mask(q_len: int, k_len: int, device: torch.device | None = None) -> Tensor:
    """(Tq, Tk) allowed mask where the queries are the *last* ``q_len`` of ``k_len`` positions.

    With a KV cache the keys include ``k_len - q_len`` earlier positions, so query i sits at
    absolute position ``k_len - q_len + i`` and may see every key up to and including it.
    """
    q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    k_pos = torch.arange(k_len, device=device)[None, :]
    return k_pos <= q_pos


def window_band(q_positions: Tensor, k_positions: Tensor, window: int, *, causal: bool) -> Tensor:
    """(Tq, Tk) allowed mask of sliding-window attention between absolute positions, in any key order
    (a rolling KV cache stores keys out of order). A causal query at i sees the keys j with
    i - window < j <= i, its last ``window`` positions itself included (transformers'
    ``sliding_window_causal_mask_function``, Mistral's); a bidirectional one sees |i - j| < window."""
    behind = q_positions[:, None] - k_positions[None, :]  # (Tq, Tk): how far each key lies before the query
    if causal:
        return (behind >= 0) & (behind < window)
    return behind.abs() < window


def document_allowed(documents: Tensor) -> Tensor:
    """(B, T) document id of each token of packed rows -> (B, 1, T, T) allowed mask: a query sees the
    keys of its own document only (block-diagonal attention; causality is added by the caller)."""
    return (documents[:, :, None] == documents[:, None, :])[:, None]


def document_positions(documents: Tensor) -> Tensor:
    """(B, T) document ids, each document one contiguous run of a row -> (B, T) position of each token
    inside its document: 0 where a document starts."""
    index = torch.arange(documents.size(1), device=documents.device).expand_as(documents)  # (B, T)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=1).values


def padding_allowed(key_padding_mask: Tensor) -> Tensor:
    """(B, Tk) True-at-padding mask -> (B, 1, 1, Tk) allowed mask, broadcast over heads and queries."""
    return ~key_padding_mask.bool()[:, None, None, :]


def build_attention_mask(
    *,
    q_len: int,
    k_len: int,
    causal: bool,
    key_padding_mask: Tensor | None = None,
    bias: Tensor | None = None,
    band: Tensor | None = None,
    documents: Tensor | None = None,
    device: torch.device | None = None,
) -> tuple[Tensor | None, bool]:
    """Combine causality, key padding and a positional score bias into one SDPA argument.

    ``band``: a (Tq, Tk) allowed mask that replaces causality (a sliding window, :func:`window_band`).
    ``documents``: (B, T) document ids of packed rows (no cache): attention stays inside each document.

    Returns ``(attn_mask, is_causal)``: ``is_causal=True`` with no mask is the fast path that
    lets SDPA pick a fused kernel; otherwise ``attn_mask`` is a boolean allowed mask or an
    additive float mask with ``-inf`` where attention is forbidden (exactly zero weight).
    """
    if causal and band is None and key_padding_mask is None and bias is None and documents is None and q_len == k_len:
        return None, True
    allowed = band
    if allowed is None and causal and q_len > 1:  # a single new query may see every cached key
        allowed = causal_mask(q_len, k_len, device)  # (Tq, Tk)
    if documents is not None:
        own = document_allowed(documents)  # (B, 1, T, T)
        allowed = own if allowed is None else allowed & own
    if key_padding_mask is not None:
        pad = padding_allowed(key_padding_mask)  # (B, 1, 1, Tk)
        allowed = pad if allowed is None else allowed & pad
    if bias is None:
        return allowed, False
    if allowed is None:
        return bias, False
    return bias.masked_fill(~allowed, float("-inf")), False
