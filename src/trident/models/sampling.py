"""Autoregressive generation: greedy, temperature, top-k and nucleus (top-p) sampling with a KV cache."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from trident.backbone import KVCache


class Generative(Protocol):
    """A model that maps token ids to next-token logits, with an optional KV cache."""

    @property
    def context_length(self) -> int: ...

    def __call__(self, ids: Tensor, *, cache: KVCache | None = None) -> Tensor: ...

    def new_cache(self, max_len: int) -> KVCache: ...


def sample_next_token(
    logits: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Pick the next token from (B, V) logits; ``temperature=0`` is greedy. Returns (B, 1)."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0 < top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens ranked before it already cover top_p; the first always stays.
        drop_sorted = cumulative - sorted_logits.softmax(dim=-1) >= top_p
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), num_samples=1, generator=generator)


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
) -> Tensor:
    """Extend ``prompt`` (B, T0) by ``max_new_tokens`` tokens; returns (B, T0 + max_new_tokens).

    With the cache each step feeds only the newest token. The context never exceeds the
    model's ``context_length``: when it is full, the cache is rebuilt from the most recent half
    of the context (without the cache, the window simply slides).
    """
    window = model.context_length
    out = prompt
    cache: KVCache | None = None
    step_input = prompt
    for _ in range(max_new_tokens):
        if use_cache:
            if cache is None or cache.length + step_input.size(1) > cache.max_len:
                cache = model.new_cache(window)
                step_input = out[:, -max(1, window // 2) :] if out.size(1) > window else out
            logits = model(step_input, cache=cache)[:, -1]
        else:
            logits = model(out[:, -window:])[:, -1]
        next_token = sample_next_token(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        out = torch.cat((out, next_token), dim=1)
        step_input = next_token
    return out
