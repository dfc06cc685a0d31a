"""Generation: KV-cache decoding equals recomputation; sampling filters behave as documented."""

from __future__ import annotations

import pytest
import torch

from trident.backbone import TransformerConfig
from trident.errors import ConfigError
from trident.models import CausalLM, generate, sample_next_token

from .backbone_helpers import perturb_


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


@pytest.mark.parametrize("encoding", ["none", "sinusoidal", "learned", "rope", "alibi", "relative"])
def test_past_the_window_cached_and_uncached_agree_token_for_token(encoding: str) -> None:
    """Perturbed weights: an untrained model repeats one token, which would hide wrong positions."""
    model = perturb_(small_lm(encoding, max_seq_len=12), std=0.5, seed=3)
    prompt = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(2))
    cached = generate(model, prompt, 30, temperature=0.0, use_cache=True)
    recomputed = generate(model, prompt, 30, temperature=0.0, use_cache=False)
    assert all(len(set(row[-20:].tolist())) >= 4 for row in cached), "greedy output too uniform to test positions"
    assert torch.equal(cached, recomputed)
    # The documented semantics: each token is the greedy choice over the last 12 tokens alone.
    for t in range(5, cached.size(1)):
        window = cached[:, max(0, t - 12) : t]
        assert torch.equal(model(window)[:, -1].argmax(-1), cached[:, t]), f"token {t}"
    # Sampling draws the same tokens too (one generator, the same logits).
    sampled = [generate(model, prompt, 30, use_cache=c, generator=torch.Generator().manual_seed(4)) for c in (True, False)]
    assert torch.equal(*sampled)


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


def test_top_k_keeps_exactly_k_tokens_when_logits_tie() -> None:
    logits = torch.tensor([[2.0, 2.0, 2.0, 2.0, 0.0]]).repeat(2000, 1)
    samples = sample_next_token(logits, top_k=2, generator=torch.Generator().manual_seed(0))
    assert len(set(samples.flatten().tolist())) == 2


@pytest.mark.parametrize("temperature", [0.5, 5.0])
def test_top_p_zero_is_greedy(temperature: float) -> None:
    logits = torch.randn(300, 20, generator=torch.Generator().manual_seed(0))
    samples = sample_next_token(logits, temperature=temperature, top_p=0.0, generator=torch.Generator().manual_seed(1))
    assert torch.equal(samples, logits.argmax(-1, keepdim=True))


@pytest.mark.parametrize(("option", "value"), [("top_p", 1.5), ("top_p", -0.1), ("top_k", -1)])
def test_out_of_range_filters_are_refused(option: str, value: float) -> None:
    with pytest.raises(ConfigError, match=option):
        sample_next_token(torch.zeros(1, 5), **{option: value})


@pytest.mark.parametrize("temperature", [-0.5, -1e-9, True])
def test_a_negative_temperature_is_refused_not_taken_for_greedy(temperature: float) -> None:
    with pytest.raises(ConfigError, match="temperature must be a number >= 0"):
        sample_next_token(torch.tensor([[0.0, 1.0]]), temperature=temperature)


def left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of different lengths -> (B, T0) ids left-padded with 0 and the (B, T0) padding mask."""
    longest = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat((torch.zeros(longest - len(p), dtype=torch.long), p)) for p in prompts])
    padding = torch.arange(longest)[None, :] < torch.tensor([longest - len(p) for p in prompts])[:, None]
    return ids, padding


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("encoding", ["none", "sinusoidal", "learned", "rope", "alibi", "relative"])
@pytest.mark.parametrize(("window", "context"), [(None, 64), (None, 12), (4, 64), (4, 12)])
def test_a_left_padded_batch_generates_what_each_prompt_alone_does(encoding: str, window: int | None,
                                                                   context: int) -> None:
    """Positions counted from each row's first real token, the padding never attended to: token for token what each
    prompt gives alone, with and without the cache, within the context and past it (12: the window of absolute
    encodings slides, re-encoded) and with a sliding attention window (4: the cache rolls over the padding)."""
    torch.manual_seed(0)
    cfg = TransformerConfig(d_model=32, n_heads=4, n_layers=2, d_ff=64, dropout=0.0, pos_encoding=encoding,
                            max_seq_len=context, attention_window=window)
    model = perturb_(CausalLM(cfg, vocab_size=50).eval(), std=0.5, seed=3)
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 50, (n,), generator=generator) for n in (7, 3, 5)]
    ids, padding = left_padded(prompts)
    for use_cache in (True, False):
        batched = generate(model, ids, 20, temperature=0.0, padding=padding, use_cache=use_cache)
        for row, prompt in zip(batched, prompts, strict=True):
            alone = generate(model, prompt[None], 20, temperature=0.0, use_cache=use_cache)[0]
            assert row[7:].tolist() == alone[len(prompt):].tolist(), f"use_cache={use_cache}"
    assert len(set(batched[:, 7:].flatten().tolist())) >= 4, "greedy output too uniform to test positions"


@pytest.mark.parametrize("padding", [
    torch.tensor([[False, True, False]]),  # padding after a real token
    torch.tensor([[True, True, True]]),  # no real token
    torch.tensor([[False, False]]),  # not the prompt's shape
])
def test_padding_that_is_not_left_padding_is_refused(padding: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="padding must be"):
        generate(small_lm("rope"), torch.ones(1, 3, dtype=torch.long), 2, padding=padding)


def test_until_ends_generation_once_every_row_is_done() -> None:
    """Each row's stop (a token it generates) is found by ``until``; the batch ends at the step the last row meets
    its own, returning the tokens made so far, the same as a longer generation's first ones."""
    model = perturb_(small_lm("rope"), std=0.5, seed=3)
    prompt = torch.randint(0, 50, (2, 4), generator=torch.Generator().manual_seed(1))
    full = generate(model, prompt, 30, temperature=0.0)
    stops = full[:, 4 + 3], full[:, 4 + 9]  # row 0 is done after its 4th new token, row 1 after its 10th at the latest
    ends = [int((full[row, 4:] == stops[row][row]).nonzero()[0]) for row in range(2)]

    def until(tokens: torch.Tensor) -> torch.Tensor:
        return torch.tensor([bool((tokens[row, 4:] == stops[row][row]).any()) for row in range(2)])

    stopped = generate(model, prompt, 30, temperature=0.0, until=until)
    assert stopped.size(1) == 4 + max(ends) + 1
    assert torch.equal(stopped, full[:, : stopped.size(1)])
