"""Autoregressive generation: greedy, temperature, top-k and nucleus (top-p) sampling with a KV cache."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from trident.backbone import KVCache
from trident.errors import ConfigError, is_int, is_number


class Generative(Protocol):
    """A model that maps token ids to next-token logits, with an optional KV cache, a padding mask and per-row
    positions (:meth:`trident.models.CausalLM.forward`)."""

    @property
    def context_length(self) -> int | None: ...

    def __call__(self, ids: Tensor, *, cache: KVCache | None = None, key_padding_mask: Tensor | None = None,
                 positions: Tensor | None = None) -> Tensor: ...

    def new_cache(self, max_len: int) -> KVCache: ...


def check_filters(top_k: int | None, top_p: float | None, temperature: float = 1.0) -> None:
    """Refuse sampling settings that mean nothing (before any work when a task is built with them)."""
    if not is_number(temperature) or temperature < 0:  # a negative one would silently mean greedy
        raise ConfigError(f"temperature must be a number >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (not is_int(top_k) or top_k < 0):
        raise ConfigError(f"top_k must be an integer >= 0 (0 or None: no top-k filter), got {top_k!r}")
    if top_p is not None and (not is_number(top_p) or not 0 <= top_p <= 1):
        raise ConfigError(f"top_p must be a number in [0, 1] (0: greedy, 1 or None: no nucleus filter), got {top_p!r}")


def sample_next_token(
    logits: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Pick the next token from (B, V) logits. Returns (B, 1).

    ``temperature=0`` is greedy. ``top_k`` keeps exactly the k most likely tokens (ties at the
    k-th place are broken by ``torch.topk``, not all kept). ``top_p`` keeps the smallest set of
    most likely tokens whose probability reaches ``top_p``; the most likely token always stays,
    so ``top_p=0`` is greedy too. ``None`` (or ``top_k=0``, ``top_p=1``) turns a filter off.
    """
    check_filters(top_k, top_p, temperature)
    if temperature == 0 or top_p == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None and top_k > 0:
        best = torch.topk(logits, min(top_k, logits.size(-1)))  # (B, k)
        logits = torch.full_like(logits, float("-inf")).scatter(-1, best.indices, best.values)
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens ranked before it already cover top_p; the first always stays.
        drop_sorted = cumulative - sorted_logits.softmax(dim=-1) >= top_p
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), num_samples=1, generator=generator)


def row_positions(padding: Tensor) -> Tensor:
    """(B, T) True at left padding -> (B, T) each token's position counted from its row's first real token, 0 on the
    padding (transformers' ``generate`` derives ``position_ids`` from ``attention_mask`` so)."""
    return ((~padding).long().cumsum(dim=1) - 1).clamp(min=0)


def check_left_padding(prompt: Tensor, padding: Tensor) -> None:
    """Refuse a padding mask that is not (B, T0) left padding with a real token in every row: padding after a real
    token would sit inside the sequence that generation extends."""
    if padding.shape != prompt.shape or padding.dtype != torch.bool:
        raise ValueError(f"padding must be a bool tensor of the prompt's shape {tuple(prompt.shape)}, got "
                         f"{padding.dtype} {tuple(padding.shape)}")
    if bool(padding[:, -1].any()) or bool((padding[:, 1:] & ~padding[:, :-1]).any()):
        raise ValueError("padding must be left padding (True before each row's first real token, none after it) "
                         "with a real token in every row: pad prompts on the left to generate from them as a batch")


@torch.no_grad()
def generate(
    model: Generative,
    prompt: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    padding: Tensor | None = None,
    until: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """Extend ``prompt`` (B, T0) by ``max_new_tokens`` tokens; returns (B, T0 + max_new_tokens).

    Every token is predicted from at most the last ``context_length`` tokens (a sliding window,
    for every positional encoding): exactly what a fresh forward pass over that window gives. The
    KV cache serves while the sequence fits in the window, each step feeding only the newest
    token; past it, each step re-encodes the window, since shifting the window changes every
    position and so every cached key (with or without the cache, the same tokens come out).
    A model with ``attention_window`` and relative positions (rope, alibi, relative, none) has no
    ``context_length``: its cache keeps the last ``attention_window`` positions and rolls on, and
    each token is what a pass over the whole sequence gives (without the cache: that pass).

    ``padding``: (B, T0) True at the left padding of a batch of prompts of different lengths. No token attends to
    the padding and positions count from each row's first real token (as transformers' ``generate`` does), so each
    row continues as its prompt alone would (greedy: the same tokens). ``context_length`` counts the padding while
    it lies inside the window: a padded row may be re-encoded before it fills the window alone (the same tokens
    again; its positions then count from its first token inside the window).
    ``until``: called after each step with the (B, T0 + n) tokens so far, returns (B,) True for the rows that
    are done (a stop string, EOS); generation ends once every row is, returning the n tokens made so far.
    """
    check_filters(top_k, top_p, temperature)  # before the first forward
    context = model.context_length
    batch, prompt_len = prompt.shape
    total = prompt_len + max_new_tokens
    if padding is not None:
        check_left_padding(prompt, padding)
    # Without padding the model gets no mask at all: its fused causal attention, bit for bit as before.
    padded = padding is not None and bool(padding.any())
    out = prompt.new_empty(batch, total)  # filled in place: no copy of the whole sequence per step
    out[:, :prompt_len] = prompt
    pad = torch.zeros(batch, total, dtype=torch.bool, device=prompt.device)  # (B, T0 + n) True at padding
    if padded:
        pad[:, :prompt_len] = padding
    all_positions = row_positions(pad)  # (B, T0 + n)
    cache = model.new_cache(total if context is None else min(total, context)) if use_cache else None
    step_input = prompt
    for length in range(prompt_len, total):
        if cache is not None and (context is None or length <= context):
            first = length - step_input.size(1)  # the positions already cached
            masks = {"key_padding_mask": pad[:, :length], "positions": all_positions[:, first:length]} if padded else {}
            logits = model(step_input, cache=cache, **masks)[:, -1]
        else:
            first = 0 if context is None else max(0, length - context)
            window = pad[:, first:length]
            masks = {"key_padding_mask": window, "positions": row_positions(window)} if padded else {}
            logits = model(out[:, first:length], **masks)[:, -1]
        out[:, length : length + 1] = sample_next_token(
            logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator
        )
        step_input = out[:, length : length + 1]
        if until is not None and bool(until(out[:, : length + 1]).all()):
            return out[:, : length + 1]
    return out


def cache_bytes(cache: KVCache) -> int:
    """Bytes of the distinct storages that hold a KV cache's keys and values (every layer)."""
    storages: dict[int, int] = {}
    for layer in cache.layers:
        for tensor in (layer.keys, layer.values):
            if tensor is not None:
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@torch.no_grad()
def kv_cache_bytes_per_token(model: Generative, prompt: Tensor) -> int:
    """Bytes a KV cache keeps per position of one sequence, read from a real cache's tensors after
    ``prompt`` (1, T) went through it (2 * layers * n_kv_heads * head_dim * dtype bytes, if the cache is right)."""
    cache = model.new_cache(prompt.size(1))
    model(prompt, cache=cache)
    # Layer by layer: a sliding layer stores fewer positions than a global one (model.layers).
    per_position = 0
    for i, layer in enumerate(cache.layers):
        total = sum(tensor.untyped_storage().nbytes() for tensor in (layer.keys, layer.values) if tensor is not None)
        if total % layer.max_len:
            raise AssertionError(f"layer {i}'s KV cache of {layer.max_len} positions holds {total} bytes, not a whole "
                                 "number per position")
        per_position += total // layer.max_len
    return per_position


def greedy_tokens_per_second(model: Generative, prompt: Tensor, new_tokens: int) -> float:
    """Speed of greedy generation of ``new_tokens`` after ``prompt`` with the KV cache (one timed run:
    the caller warms up and repeats where it needs a stable number)."""
    start = time.perf_counter()
    out = generate(model, prompt, new_tokens, temperature=0.0)
    if out.is_cuda:
        torch.cuda.synchronize(out.device)
    return new_tokens / (time.perf_counter() - start)
