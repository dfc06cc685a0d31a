"""Information flow in the Transformer backbone: no peeking at the future in a decoder, no
influence from padding in an encoder, and KV-cached incremental decoding equal to a full pass."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trident.backbone import (
    Decoder,
    Encoder,
    KVCache,
    available_pos_encodings,
    pos_encoding_class,
)

from .backbone_helpers import D_MODEL, HEAD_DIM, N_HEADS, N_LAYERS, make_cfg, perturb_

pytestmark = pytest.mark.usefixtures("single_thread")

POS_ENCODINGS = available_pos_encodings()
CACHEABLE = [name for name in POS_ENCODINGS if pos_encoding_class(name).supports_kv_cache]
TOL = {"rtol": 1e-4, "atol": 1e-5}
UNCHANGED = {"rtol": 0.0, "atol": 1e-6}


def build(make_stack, **cfg_overrides) -> nn.Module:
    torch.manual_seed(0)
    return perturb_(make_stack(make_cfg(**cfg_overrides))).eval()


def test_every_documented_encoding_supports_the_kv_cache() -> None:
    assert set(CACHEABLE) >= {"none", "sinusoidal", "learned", "rope", "alibi", "relative"}


# --------------------------------------------------------------------------------------------
# The future and the padding cannot leak


@pytest.mark.parametrize("attn_impl", ["sdpa", "explicit"])
@pytest.mark.parametrize("pos_encoding", POS_ENCODINGS)
def test_decoder_never_looks_at_future_tokens(pos_encoding: str, attn_impl: str) -> None:
    decoder = build(Decoder, pos_encoding=pos_encoding, attn_impl=attn_impl)
    torch.manual_seed(1)
    length = 8
    x = torch.randn(2, length, D_MODEL)
    out = decoder(x)
    for t in (0, 3, length - 1):
        changed = x.clone()
        changed[:, t] = 5 * torch.randn(2, D_MODEL)
        out_changed = decoder(changed)
        torch.testing.assert_close(out_changed[:, :t], out[:, :t], **UNCHANGED)
        assert (out_changed[:, t] - out[:, t]).abs().max() > 1e-3
        if t < length - 1:  # later positions do see the change
            assert (out_changed[:, t + 1 :] - out[:, t + 1 :]).abs().amax(dim=-1).min() > 1e-4


@pytest.mark.parametrize("pos_encoding", POS_ENCODINGS)
def test_cross_attention_decoder_never_looks_at_future_tokens(pos_encoding: str) -> None:
    decoder = build(lambda cfg: Decoder(cfg, cross_attention=True), pos_encoding=pos_encoding)
    torch.manual_seed(1)
    x, memory = torch.randn(2, 7, D_MODEL), torch.randn(2, 5, D_MODEL)
    out = decoder(x, memory=memory)
    changed = x.clone()
    changed[:, 4:] = 5 * torch.randn(2, 3, D_MODEL)
    torch.testing.assert_close(decoder(changed, memory=memory)[:, :4], out[:, :4], **UNCHANGED)


@pytest.mark.parametrize("attn_impl", ["sdpa", "explicit"])
@pytest.mark.parametrize("pos_encoding", POS_ENCODINGS)
def test_encoder_ignores_padded_positions(pos_encoding: str, attn_impl: str) -> None:
    encoder = build(Encoder, pos_encoding=pos_encoding, attn_impl=attn_impl)
    torch.manual_seed(2)
    batch, length = 3, 9
    x = torch.randn(batch, length, D_MODEL)
    key_padding_mask = torch.zeros(batch, length, dtype=torch.bool)
    key_padding_mask[0, 6:] = True  # trailing padding
    key_padding_mask[1, [0, 4]] = True  # padding anywhere
    out = encoder(x, key_padding_mask=key_padding_mask)
    changed = x.clone()
    changed[key_padding_mask] = 10 * torch.randn(int(key_padding_mask.sum()), D_MODEL)
    out_changed = encoder(changed, key_padding_mask=key_padding_mask)
    real = ~key_padding_mask
    torch.testing.assert_close(out_changed[real], out[real], **UNCHANGED)
    # Not vacuous: without the mask, the same change reaches every position.
    unmasked = encoder(changed)[0, :6] - encoder(x)[0, :6]
    assert unmasked.abs().amax(dim=-1).min() > 1e-4


# --------------------------------------------------------------------------------------------
# KV cache


def decode_incrementally(decoder: nn.Module, x: torch.Tensor, chunks: list[int], cache: KVCache, **kwargs):
    assert sum(chunks) == x.size(1)
    outputs, start = [], 0
    for size in chunks:
        assert cache.length == start
        outputs.append(decoder(x[:, start : start + size], cache=cache, **kwargs))
        start += size
    assert cache.length == x.size(1)
    return torch.cat(outputs, dim=1)


SCHEDULES = {
    "one_at_a_time": [1] * 9,
    "prefill5_then_steps": [5, 1, 1, 1, 1],
    "uneven_chunks": [3, 2, 4],
    "single_chunk": [9],
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("norm_first", [True, False], ids=["pre_norm", "post_norm"])
@pytest.mark.parametrize("pos_encoding", CACHEABLE)
def test_kv_cache_decoding_matches_full_pass(pos_encoding: str, norm_first: bool, schedule: str) -> None:
    decoder = build(Decoder, pos_encoding=pos_encoding, norm_first=norm_first)
    torch.manual_seed(3)
    x = torch.randn(2, 9, D_MODEL)
    full = decoder(x)
    cache = decoder.new_cache(12)
    assert isinstance(cache, KVCache) and len(cache.layers) == N_LAYERS and cache.max_len == 12
    incremental = decode_incrementally(decoder, x, SCHEDULES[schedule], cache)
    torch.testing.assert_close(incremental, full, **TOL)
    for layer in cache.layers:
        assert layer.length == 9 and layer.memory is None
        assert layer.keys is not None and layer.keys.shape == (2, N_HEADS, 12, HEAD_DIM)


@pytest.mark.parametrize("pos_encoding", CACHEABLE)
def test_kv_cache_decoding_matches_full_pass_explicit_attention(pos_encoding: str) -> None:
    decoder = build(Decoder, pos_encoding=pos_encoding, attn_impl="explicit")
    torch.manual_seed(3)
    x = torch.randn(2, 9, D_MODEL)
    full = decoder(x)
    incremental = decode_incrementally(decoder, x, SCHEDULES["prefill5_then_steps"], decoder.new_cache(9))
    torch.testing.assert_close(incremental, full, **TOL)
    # Cached attention weights cover every key so far and never a future one.
    cache = decoder.new_cache(9)
    decoder(x[:, :5], cache=cache)
    _, weights = decoder.forward_with_attention(x[:, 5:7], cache=cache)
    for w in weights:
        assert w.shape == (2, N_HEADS, 2, 7)
        assert torch.all(w[:, :, 0, 6] == 0)
        assert torch.all(w[:, :, 1] > 0)


@pytest.mark.parametrize("schedule", ["one_at_a_time", "prefill5_then_steps"])
@pytest.mark.parametrize("norm_first", [True, False], ids=["pre_norm", "post_norm"])
@pytest.mark.parametrize("pos_encoding", CACHEABLE)
def test_kv_cache_cross_attention_decoder_matches_full_pass(pos_encoding: str, norm_first: bool, schedule: str) -> None:
    decoder = build(lambda cfg: Decoder(cfg, cross_attention=True), pos_encoding=pos_encoding, norm_first=norm_first)
    torch.manual_seed(4)
    x, memory = torch.randn(2, 9, D_MODEL), torch.randn(2, 6, D_MODEL)
    memory_padding_mask = torch.zeros(2, 6, dtype=torch.bool)
    memory_padding_mask[1, 4:] = True
    full = decoder(x, memory=memory, memory_padding_mask=memory_padding_mask)

    projections = []  # count the cross-attention K/V projections of the memory
    hooks = [
        block.cross_attn.kv_proj.register_forward_hook(lambda module, args, out: projections.append(out.shape))
        for block in decoder.blocks
    ]
    try:
        cache = decoder.new_cache(9)
        incremental = decode_incrementally(
            decoder, x, SCHEDULES[schedule], cache, memory=memory, memory_padding_mask=memory_padding_mask
        )
    finally:
        for hook in hooks:
            hook.remove()
    torch.testing.assert_close(incremental, full, **TOL)
    # The memory's keys/values are projected once per layer on the first step, then reused.
    assert projections == [torch.Size([2, 6, 2 * D_MODEL])] * N_LAYERS
    for layer in cache.layers:
        assert layer.memory is not None
        keys, values = layer.memory
        assert keys.shape == values.shape == (2, N_HEADS, 6, HEAD_DIM)


def test_kv_cache_reuses_the_stored_memory() -> None:
    decoder = build(lambda cfg: Decoder(cfg, cross_attention=True), pos_encoding="rope")
    torch.manual_seed(5)
    x, memory = torch.randn(1, 4, D_MODEL), torch.randn(1, 6, D_MODEL)
    cache = decoder.new_cache(4)
    first = decoder(x[:, :2], memory=memory, cache=cache)
    stored = [layer.memory for layer in cache.layers]
    # Later steps read the cached projections; the memory passed in is not projected again.
    second = decoder(x[:, 2:], memory=torch.zeros_like(memory), cache=cache)
    assert all(layer.memory is s for layer, s in zip(cache.layers, stored, strict=True))
    torch.testing.assert_close(torch.cat([first, second], dim=1), decoder(x, memory=memory), **TOL)


def test_kv_cache_with_right_padding_matches_full_pass() -> None:
    decoder = build(Decoder, pos_encoding="alibi")
    torch.manual_seed(6)
    x = torch.randn(2, 7, D_MODEL)
    key_padding_mask = torch.zeros(2, 7, dtype=torch.bool)
    key_padding_mask[0, 5:] = True
    full = decoder(x, key_padding_mask=key_padding_mask)
    cache = decoder.new_cache(7)
    steps = [decoder(x[:, :4], cache=cache, key_padding_mask=key_padding_mask[:, :4])]
    for t in range(4, 7):  # the padding mask covers the cached positions too
        steps.append(decoder(x[:, t : t + 1], cache=cache, key_padding_mask=key_padding_mask[:, : t + 1]))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, **TOL)


def test_kv_cache_overflow_raises() -> None:
    decoder = build(Decoder, pos_encoding="none")
    cache = decoder.new_cache(4)
    decoder(torch.randn(1, 3, D_MODEL), cache=cache)
    with pytest.raises(ValueError, match="full"):
        decoder(torch.randn(1, 2, D_MODEL), cache=cache)


def test_kv_cache_reorder_selects_batch_rows() -> None:
    decoder = build(lambda cfg: Decoder(cfg, cross_attention=True), pos_encoding="rope")
    torch.manual_seed(7)
    x, memory = torch.randn(3, 5, D_MODEL), torch.randn(3, 4, D_MODEL)
    cache = decoder.new_cache(5)
    decoder(x[:, :4], memory=memory, cache=cache)
    index = torch.tensor([2, 0, 0])
    cache.reorder(index)
    last = decoder(x[index, 4:], memory=memory[index], cache=cache)
    torch.testing.assert_close(last, decoder(x[index], memory=memory[index])[:, 4:], **TOL)
