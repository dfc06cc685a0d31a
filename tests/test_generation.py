"""Generation: KV-cache decoding equals recomputation; sampling filters behave as documented."""

from __future__ import annotations

import pytest
import torch

from trident.backbone import TransformerConfig
from trident.models import CausalLM, generate, sample_next_token


def small_lm(encoding: str, max_seq_len: int = 64) -> CausalLM:
    torch.manual_seed(0)
    cfg = TransformerConfig(
        d_model=32, n_heads=4, n_layers=2, d_ff=64, dropout=0.0, pos_encoding=encoding, max_seq_len=max_seq_len
    )
    return CausalLM(cfg, vocab_size=50).eval()


@pytest.mark.parametrize("encoding", ["none", "sinusoidal", "learned", "rope", "alibi", "relative"])
def test_greedy_tokens_same_with_and_without_cache(encoding: str) -> None:
    model = small_lm(encoding)
    prompt = torch.randint(0, 50, (2, 5))
    cached = generate(model, prompt, 40, temperature=0.0, use_cache=True)
    recomputed = generate(model, prompt, 40, temperature=0.0, use_cache=False)
    assert cached.shape == (2, 45)
    assert torch.equal(cached, recomputed)
    assert torch.equal(cached[:, :5], prompt)


def test_generation_past_the_context_window_keeps_going() -> None:
    model = small_lm("learned", max_seq_len=16)
    out = generate(model, torch.zeros(1, 3, dtype=torch.long), 50, temperature=0.0)
    assert out.shape == (1, 53)


def test_greedy_is_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 1.0]])
    assert sample_next_token(logits, temperature=0.0).flatten().tolist() == [1, 0]


def test_top_k_only_samples_the_k_best() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]]).repeat(500, 1)
    samples = sample_next_token(logits, top_k=2, generator=torch.Generator().manual_seed(0))
    assert set(samples.flatten().tolist()) == {3, 4}


def test_top_p_keeps_the_smallest_set_covering_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log().repeat(1000, 1)
    samples = sample_next_token(logits, top_p=0.75, generator=torch.Generator().manual_seed(0))
    assert set(samples.flatten().tolist()) == {0, 1}  # 0.5 < 0.75 <= 0.5 + 0.3
    samples = sample_next_token(logits, top_p=0.1, generator=torch.Generator().manual_seed(0))
    assert set(samples.flatten().tolist()) == {0}  # the most likely token always stays


def test_temperature_sharpens() -> None:
    logits = torch.tensor([[0.0, 1.0]]).repeat(2000, 1)
    gen = torch.Generator().manual_seed(0)
    cold = sample_next_token(logits, temperature=0.2, generator=gen).float().mean()
    hot = sample_next_token(logits, temperature=5.0, generator=gen).float().mean()
    assert cold > 0.95 and 0.4 < hot < 0.65
