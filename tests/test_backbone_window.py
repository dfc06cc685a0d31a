"""Sliding-window attention (issue 40, ``model.attention_window``): the band against an explicit
reference mask, the KV cache that keeps only the window, and generation past the window and the context."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from trident.backbone import Decoder, Encoder, TransformerConfig, TransformerStack, available_pos_encodings
from trident.backbone.masks import window_band
from trident.errors import ConfigError
from trident.models import CausalLM, generate

from .backbone_helpers import D_MODEL, N_HEADS, make_cfg, perturb_

pytestmark = pytest.mark.usefixtures("single_thread")

WINDOW = 3
TOL = {"rtol": 1e-5, "atol": 1e-5}


def reference_allowed(length: int, window: int, *, causal: bool) -> Tensor:
    """(T, T) allowed mask written out query by query, from the definition."""
    allowed = torch.zeros(length, length, dtype=torch.bool)
    for i in range(length):
        for j in range(length):
            allowed[i, j] = (i - window < j <= i) if causal else abs(i - j) < window
    return allowed


def reference_pass(stack: TransformerStack, x: Tensor, allowed: Tensor) -> Tensor:
    """The stack's blocks run with ``allowed`` (broadcastable to (B, nh, T, T)) as their only mask."""
    positions = torch.arange(x.size(1))
    bias = stack.pos_encoding.attention_bias(positions, positions)
    mask = allowed if bias is None else bias.masked_fill(~allowed, float("-inf"))
    h = stack.embedding_norm(stack.pos_encoding.add_to_embeddings(x, positions))
    for block in stack.blocks:
        h, _ = block(h, attn_mask=mask, rope=stack.pos_encoding.rotary(positions))
    return stack.final_norm(h)


def build(make_stack: type[TransformerStack], **overrides: object) -> TransformerStack:
    torch.manual_seed(0)
    return perturb_(make_stack(make_cfg(**overrides))).eval()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "encoder"])
@pytest.mark.parametrize("window", [1, 3, 9])
def test_band_is_the_definition(window: int, causal: bool) -> None:
    positions = torch.arange(9)
    assert torch.equal(window_band(positions, positions, window, causal=causal), reference_allowed(9, window, causal=causal))


@pytest.mark.parametrize("window", [1, 4])
def test_causal_band_is_transformers_sliding_window_mask(window: int) -> None:
    """Mistral's mask in the installed transformers: the same keys, query by query."""
    masking_utils = pytest.importorskip("transformers.masking_utils")
    allowed_by = masking_utils.sliding_window_causal_mask_function(window)
    positions = torch.arange(8)
    theirs = allowed_by(torch.tensor(0), torch.tensor(0), positions[:, None], positions[None, :])  # (Tq, Tk)
    assert torch.equal(window_band(positions, positions, window, causal=True), theirs)


@pytest.mark.parametrize("attn_impl", ["sdpa", "explicit"])
@pytest.mark.parametrize("pos_encoding", ["rope", "alibi", "sinusoidal", "relative"])
@pytest.mark.parametrize("causal", [True, False], ids=["decoder", "encoder"])
def test_windowed_stack_equals_the_reference_mask_with_padding(causal: bool, pos_encoding: str, attn_impl: str) -> None:
    stack = build(Decoder if causal else Encoder, pos_encoding=pos_encoding, attn_impl=attn_impl, attention_window=WINDOW)
    torch.manual_seed(1)
    x = torch.randn(2, 9, D_MODEL)
    padding = torch.zeros(2, 9, dtype=torch.bool)
    padding[0, :2] = True  # left padding (a decoder's batch)
    padding[1, 7:] = True  # trailing padding (an encoder's)
    allowed = reference_allowed(9, WINDOW, causal=causal)[None, None] & ~padding[:, None, None, :]
    real = ~padding[:, :, None].expand_as(x)  # a query that sees no key at all has no reference value
    windowed = stack(x, key_padding_mask=padding)
    torch.testing.assert_close(windowed[real], reference_pass(stack, x, allowed)[real], **TOL)
    # Not vacuous: the whole context gives another result.
    whole = reference_allowed(9, 9, causal=causal)[None, None] & ~padding[:, None, None, :]
    assert (windowed - reference_pass(stack, x, whole))[real].abs().max() > 1e-2


def test_explicit_weights_are_zero_outside_the_window() -> None:
    decoder = build(Decoder, pos_encoding="alibi", attn_impl="explicit", attention_window=WINDOW)
    _, weights = decoder.forward_with_attention(torch.randn(1, 8, D_MODEL))
    outside = ~reference_allowed(8, WINDOW, causal=True)
    for layer in weights:
        assert layer.shape == (1, N_HEADS, 8, 8) and torch.all(layer[..., outside] == 0)
        assert torch.all(layer[..., ~outside] > 0)


SCHEDULES = {
    "one_at_a_time": [1] * 13,
    "prefill_longer_than_the_window": [6, 1, 1, 1, 1, 1, 1, 1],
    "chunks_across_the_ring": [2, 5, 1, 4, 1],
    "single_chunk": [13],
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("pos_encoding", available_pos_encodings())
def test_cache_keeps_the_window_and_decodes_past_it_exactly(pos_encoding: str, schedule: str) -> None:
    decoder = build(Decoder, pos_encoding=pos_encoding, attention_window=4)
    torch.manual_seed(3)
    x = torch.randn(2, 13, D_MODEL)
    padding = torch.zeros(2, 13, dtype=torch.bool)
    padding[1, :3] = True  # a left-padded row: its padding leaves the window as decoding goes on
    full = decoder(x, key_padding_mask=padding)
    cache = decoder.new_cache(4 if schedule == "one_at_a_time" else 64)  # a window as long as the cache rolls too
    assert cache.max_len == 4
    start = 0
    for size in SCHEDULES[schedule]:
        step = decoder(x[:, start : start + size], cache=cache, key_padding_mask=padding[:, : start + size])
        real = ~padding[:, start : start + size]
        torch.testing.assert_close(step[real], full[:, start : start + size][real], **TOL)
        start += size
        for layer in cache.layers:  # memory stays flat past the window
            assert layer.keys is not None and layer.keys.size(2) == 4 and layer.length == start


def test_cache_positions_follow_the_ring() -> None:
    """After 6 positions in a 4-slot ring, slots 0..3 hold positions 4, 5, 2, 3."""
    cache = Decoder(make_cfg(attention_window=4)).new_cache(64)
    for layer in cache.layers:
        layer.length = 6
    assert cache.key_positions(1, torch.device("cpu")).tolist() == [4, 5, 6, 3]
    assert cache.key_positions(3, torch.device("cpu")).tolist() == [4, 5, 2, 3, 6, 7, 8]


def test_a_cache_shorter_than_the_window_fills_up() -> None:
    decoder = build(Decoder, attention_window=8)
    cache = decoder.new_cache(5)
    decoder(torch.randn(1, 5, D_MODEL), cache=cache)
    with pytest.raises(ValueError, match="KV cache is full"):
        decoder(torch.randn(1, 1, D_MODEL), cache=cache)


def windowed_lm(pos_encoding: str) -> CausalLM:
    torch.manual_seed(0)
    cfg = TransformerConfig(d_model=32, n_heads=4, n_layers=2, d_ff=64, dropout=0.0, pos_encoding=pos_encoding,
                            max_seq_len=12, attention_window=4)
    # Perturbed weights: an untrained model repeats one token, which would hide wrong positions.
    return perturb_(CausalLM(cfg, vocab_size=50).eval(), std=0.5, seed=3)


@pytest.mark.parametrize("pos_encoding", ["rope", "alibi", "none", "relative"])
def test_generation_rolls_past_the_context_as_one_pass(pos_encoding: str) -> None:
    """Relative positions: no context limit; 40 tokens past max_seq_len=12 equal a pass over the whole sequence."""
    model = windowed_lm(pos_encoding)
    assert model.context_length is None
    prompt = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(2))
    fed: list[int] = []
    hook = model.register_forward_pre_hook(lambda _, args: fed.append(args[0].size(1)))
    cached = generate(model, prompt, 40, temperature=0.0)
    hook.remove()
    assert fed == [5] + [1] * 39, "the cache serves every step, past the context too"
    assert all(len(set(row[-20:].tolist())) >= 4 for row in cached), "greedy output too uniform to test positions"
    assert torch.equal(cached, generate(model, prompt, 40, temperature=0.0, use_cache=False))
    logits = model(cached)  # one windowed pass over all 45 tokens
    assert torch.equal(logits[:, 4:-1].argmax(-1), cached[:, 5:])


@pytest.mark.parametrize("pos_encoding", ["learned", "sinusoidal"])
def test_absolute_positions_keep_the_context(pos_encoding: str) -> None:
    model = windowed_lm(pos_encoding)
    assert model.context_length == 12
    prompt = torch.randint(0, 50, (1, 5), generator=torch.Generator().manual_seed(2))
    cached = generate(model, prompt, 20, temperature=0.0)
    assert torch.equal(cached, generate(model, prompt, 20, temperature=0.0, use_cache=False))


@pytest.mark.parametrize(("window", "message"), [
    (0, "model.attention_window must be a positive integer or null, got 0"),
    (2.5, "model.attention_window must be a positive integer or null, got 2.5"),
    (True, "model.attention_window must be a positive integer or null, got True"),
    (65, "model.attention_window=65 is larger than the context data.max_seq_len=64"),
])
def test_bad_windows_are_refused(window: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        make_cfg(attention_window=window)
    assert make_cfg(attention_window=64).attention_window == 64  # the whole context is a window too
