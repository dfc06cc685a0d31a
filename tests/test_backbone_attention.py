"""Attention of the Transformer backbone: the SDPA and explicit paths agree, masks give exactly
zero weight, the causal-mask helpers have the right shapes, and cross-attention ignores padded memory."""

from __future__ import annotations

import pytest
import torch

from trident.backbone import (
    Decoder,
    Encoder,
    MultiHeadAttention,
    available_pos_encodings,
    build_attention_mask,
    causal_mask,
)

from .backbone_helpers import D_MODEL, N_HEADS, N_LAYERS, make_cfg, perturb_

pytestmark = pytest.mark.usefixtures("single_thread")

POS_ENCODINGS = available_pos_encodings()
TOL = {"rtol": 1e-4, "atol": 1e-5}


def sdpa_explicit_pair(make_stack, pos_encoding: str, **cfg_overrides):
    """The same stack twice, attn_impl='sdpa' and 'explicit', sharing one state_dict."""
    torch.manual_seed(0)
    fast = perturb_(make_stack(make_cfg(pos_encoding=pos_encoding, attn_impl="sdpa", **cfg_overrides)))
    explicit = make_stack(make_cfg(pos_encoding=pos_encoding, attn_impl="explicit", **cfg_overrides))
    explicit.load_state_dict(fast.state_dict())
    return fast.eval(), explicit.eval()


def right_padding(batch: int, length: int, n_pad: int) -> torch.Tensor:
    """(B, T) True at padding: the first sequence ends with ``n_pad`` pads, the others have none."""
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[0, length - n_pad :] = True
    return mask


# --------------------------------------------------------------------------------------------
# MultiHeadAttention on its own


def mha_pair(*, cross: bool) -> tuple[MultiHeadAttention, MultiHeadAttention]:
    torch.manual_seed(0)
    fast = perturb_(MultiHeadAttention(D_MODEL, N_HEADS, cross=cross, impl="sdpa"))
    explicit = MultiHeadAttention(D_MODEL, N_HEADS, cross=cross, impl="explicit")
    explicit.load_state_dict(fast.state_dict())
    return fast.eval(), explicit.eval()


@pytest.mark.parametrize("mask_kind", ["none", "causal", "causal_mask_tensor", "padding", "float_bias"])
def test_mha_self_attention_sdpa_matches_explicit(mask_kind: str) -> None:
    fast, explicit = mha_pair(cross=False)
    torch.manual_seed(1)
    batch, length = 3, 7
    x = torch.randn(batch, length, D_MODEL)
    kwargs: dict = {}
    if mask_kind == "causal":
        kwargs["is_causal"] = True
    elif mask_kind == "causal_mask_tensor":
        kwargs["attn_mask"] = causal_mask(length, length)
    elif mask_kind == "padding":
        kwargs["attn_mask"] = ~right_padding(batch, length, 3)[:, None, None, :]
    elif mask_kind == "float_bias":
        bias = torch.randn(1, N_HEADS, length, length)
        kwargs["attn_mask"] = bias.masked_fill(~causal_mask(length, length), float("-inf"))
    y_fast, w_fast = fast(x, **kwargs)
    y_explicit, w_explicit = explicit(x, **kwargs)
    assert w_fast is None
    assert w_explicit is not None and w_explicit.shape == (batch, N_HEADS, length, length)
    torch.testing.assert_close(y_fast, y_explicit, **TOL)
    # Asking the SDPA module for weights takes the explicit path and gives the same output.
    y_weights, w_weights = fast(x, need_weights=True, **kwargs)
    torch.testing.assert_close(y_weights, y_fast, **TOL)
    torch.testing.assert_close(w_weights, w_explicit)


def test_mha_causal_flag_equals_causal_mask_tensor() -> None:
    fast, explicit = mha_pair(cross=False)
    x = torch.randn(2, 6, D_MODEL)
    for module in (fast, explicit):
        torch.testing.assert_close(
            module(x, is_causal=True)[0], module(x, attn_mask=causal_mask(6, 6))[0], **TOL
        )


@pytest.mark.parametrize("with_mask", [False, True])
def test_mha_cross_attention_sdpa_matches_explicit(with_mask: bool) -> None:
    fast, explicit = mha_pair(cross=True)
    torch.manual_seed(1)
    x, context = torch.randn(2, 4, D_MODEL), torch.randn(2, 9, D_MODEL)
    mask = ~right_padding(2, 9, 4)[:, None, None, :] if with_mask else None
    y_fast, _ = fast(x, context, attn_mask=mask)
    y_explicit, weights = explicit(x, context, attn_mask=mask)
    assert y_fast.shape == (2, 4, D_MODEL)
    assert weights is not None and weights.shape == (2, N_HEADS, 4, 9)
    torch.testing.assert_close(y_fast, y_explicit, **TOL)
    if with_mask:
        assert torch.all(weights[0, :, :, 5:] == 0)


def test_mha_cross_attention_without_context_raises() -> None:
    fast, _ = mha_pair(cross=True)
    with pytest.raises(ValueError, match="context"):
        fast(torch.randn(1, 3, D_MODEL))


# --------------------------------------------------------------------------------------------
# Whole stacks: attn_impl='sdpa' vs 'explicit' with one state_dict


@pytest.mark.parametrize("padded", [False, True], ids=["no_padding", "key_padding"])
@pytest.mark.parametrize("pos_encoding", POS_ENCODINGS)
def test_encoder_sdpa_matches_explicit(pos_encoding: str, padded: bool) -> None:
    fast, explicit = sdpa_explicit_pair(Encoder, pos_encoding)
    torch.manual_seed(2)
    x = torch.randn(2, 9, D_MODEL)
    key_padding_mask = right_padding(2, 9, 4) if padded else None
    y_fast = fast(x, key_padding_mask=key_padding_mask)
    y_explicit = explicit(x, key_padding_mask=key_padding_mask)
    assert y_fast.shape == x.shape
    torch.testing.assert_close(y_fast, y_explicit, **TOL)
    # forward_with_attention (explicit path even on the SDPA model) gives the same hidden states.
    hidden, weights = fast.forward_with_attention(x, key_padding_mask=key_padding_mask)
    torch.testing.assert_close(hidden, y_fast, **TOL)
    assert len(weights) == N_LAYERS


@pytest.mark.parametrize("padded", [False, True], ids=["no_padding", "key_padding"])
@pytest.mark.parametrize("pos_encoding", POS_ENCODINGS)
def test_decoder_sdpa_matches_explicit(pos_encoding: str, padded: bool) -> None:
    fast, explicit = sdpa_explicit_pair(Decoder, pos_encoding)
    torch.manual_seed(2)
    x = torch.randn(2, 9, D_MODEL)
    key_padding_mask = right_padding(2, 9, 3) if padded else None
    y_fast = fast(x, key_padding_mask=key_padding_mask)
    torch.testing.assert_close(y_fast, explicit(x, key_padding_mask=key_padding_mask), **TOL)
    hidden, _ = fast.forward_with_attention(x, key_padding_mask=key_padding_mask)
    torch.testing.assert_close(hidden, y_fast, **TOL)


@pytest.mark.parametrize("norm_first", [True, False], ids=["pre_norm", "post_norm"])
@pytest.mark.parametrize("pos_encoding", POS_ENCODINGS)
def test_cross_attention_decoder_sdpa_matches_explicit(pos_encoding: str, norm_first: bool) -> None:
    fast, explicit = sdpa_explicit_pair(
        lambda cfg: Decoder(cfg, cross_attention=True), pos_encoding, norm_first=norm_first
    )
    torch.manual_seed(3)
    x, memory = torch.randn(2, 6, D_MODEL), torch.randn(2, 8, D_MODEL)
    memory_padding_mask = right_padding(2, 8, 3)
    kwargs = {"memory": memory, "memory_padding_mask": memory_padding_mask, "key_padding_mask": right_padding(2, 6, 2)}
    torch.testing.assert_close(fast(x, **kwargs), explicit(x, **kwargs), **TOL)
    torch.testing.assert_close(fast(x, memory=memory), explicit(x, memory=memory), **TOL)


def test_left_padded_decoder_explicit_path_is_finite_and_matches_sdpa() -> None:
    fast, explicit = sdpa_explicit_pair(Decoder, "none")
    torch.manual_seed(4)
    x = torch.randn(2, 6, D_MODEL)
    key_padding_mask = torch.zeros(2, 6, dtype=torch.bool)
    key_padding_mask[0, :2] = True  # left padding, as in batched generation
    y_fast = fast(x, key_padding_mask=key_padding_mask)
    # The SDPA path is right: the real tokens' outputs equal those of the unpadded sequence.
    torch.testing.assert_close(y_fast[0, 2:], fast(x[:1, 2:])[0], **TOL)
    y_explicit = explicit(x, key_padding_mask=key_padding_mask)
    assert torch.isfinite(y_explicit[0, 2:]).all()
    torch.testing.assert_close(y_explicit[:, 2:], y_fast[:, 2:], **TOL)


# --------------------------------------------------------------------------------------------
# Masked positions get exactly zero weight


@pytest.mark.parametrize("padded", [False, True], ids=["no_padding", "key_padding"])
@pytest.mark.parametrize("pos_encoding", POS_ENCODINGS)
def test_decoder_weights_are_exactly_zero_above_the_diagonal(pos_encoding: str, padded: bool) -> None:
    fast, _ = sdpa_explicit_pair(Decoder, pos_encoding)
    torch.manual_seed(5)
    batch, length = 2, 8
    x = torch.randn(batch, length, D_MODEL)
    key_padding_mask = right_padding(batch, length, 3) if padded else None
    _, weights = fast.forward_with_attention(x, key_padding_mask=key_padding_mask)
    assert len(weights) == N_LAYERS
    future = torch.ones(length, length, dtype=torch.bool).triu(diagonal=1)
    for w in weights:
        assert w.shape == (batch, N_HEADS, length, length)
        assert torch.all(w[..., future] == 0), "a query attends to a future key"
        assert torch.all(w[..., ~future] > 0) or padded  # unmasked scores are finite
        if padded:
            assert torch.all(w[0, :, :, length - 3 :] == 0), "a query attends to a padded key"
        torch.testing.assert_close(w.sum(-1), torch.ones(batch, N_HEADS, length))


@pytest.mark.parametrize("pos_encoding", POS_ENCODINGS)
def test_encoder_weights_are_exactly_zero_at_padded_keys(pos_encoding: str) -> None:
    fast, _ = sdpa_explicit_pair(Encoder, pos_encoding)
    torch.manual_seed(6)
    batch, length = 3, 7
    x = torch.randn(batch, length, D_MODEL)
    key_padding_mask = torch.zeros(batch, length, dtype=torch.bool)
    key_padding_mask[0, 4:] = True
    key_padding_mask[1, 1] = True  # padding need not be at the end
    key_padding_mask[1, 5] = True
    _, weights = fast.forward_with_attention(x, key_padding_mask=key_padding_mask)
    assert len(weights) == N_LAYERS
    expanded = key_padding_mask[:, None, None, :].expand(batch, N_HEADS, length, length)
    for w in weights:
        assert w.shape == (batch, N_HEADS, length, length)
        assert torch.all(w[expanded] == 0)
        assert torch.all(w[~expanded] > 0)
        torch.testing.assert_close(w.sum(-1), torch.ones(batch, N_HEADS, length))


def test_encoder_without_padding_attends_in_both_directions() -> None:
    fast, _ = sdpa_explicit_pair(Encoder, "none")
    _, weights = fast.forward_with_attention(torch.randn(1, 5, D_MODEL))
    future = torch.ones(5, 5, dtype=torch.bool).triu(diagonal=1)
    assert torch.all(weights[0][..., future] > 0)


# --------------------------------------------------------------------------------------------
# Mask helpers


def test_causal_mask_square_is_lower_triangular() -> None:
    mask = causal_mask(5, 5)
    assert mask.shape == (5, 5) and mask.dtype == torch.bool
    assert torch.equal(mask, torch.ones(5, 5, dtype=torch.bool).tril())


@pytest.mark.parametrize(("q_len", "k_len"), [(1, 1), (1, 6), (3, 7), (4, 4), (2, 9)])
def test_causal_mask_with_cache_offset(q_len: int, k_len: int) -> None:
    """Queries are the last ``q_len`` of ``k_len`` positions: query i sits at k_len - q_len + i."""
    mask = causal_mask(q_len, k_len)
    assert mask.shape == (q_len, k_len)
    assert torch.equal(mask, causal_mask(k_len, k_len)[k_len - q_len :])
    offset = k_len - q_len
    for i in range(q_len):
        for j in range(k_len):
            assert bool(mask[i, j]) == (j <= offset + i)


def test_build_attention_mask_fast_path_and_offsets() -> None:
    assert build_attention_mask(q_len=6, k_len=6, causal=True) == (None, True)
    assert build_attention_mask(q_len=6, k_len=6, causal=False) == (None, False)
    # A single new query may see every cached key: no mask needed.
    assert build_attention_mask(q_len=1, k_len=6, causal=True) == (None, False)
    mask, is_causal = build_attention_mask(q_len=3, k_len=8, causal=True)
    assert not is_causal
    assert mask is not None and mask.shape == (3, 8)
    assert torch.equal(mask, causal_mask(8, 8)[5:])


def test_build_attention_mask_with_padding() -> None:
    key_padding_mask = right_padding(2, 8, 3)
    mask, is_causal = build_attention_mask(q_len=8, k_len=8, causal=False, key_padding_mask=key_padding_mask)
    assert not is_causal and mask is not None and mask.dtype == torch.bool
    assert mask.shape == (2, 1, 1, 8)
    assert torch.equal(mask[:, 0, 0], ~key_padding_mask)
    mask, _ = build_attention_mask(q_len=3, k_len=8, causal=True, key_padding_mask=key_padding_mask)
    assert mask is not None and mask.shape == (2, 1, 3, 8)
    expected = causal_mask(3, 8)[None, None] & ~key_padding_mask[:, None, None, :]
    assert torch.equal(mask, expected)


def test_build_attention_mask_with_bias() -> None:
    bias = torch.randn(1, N_HEADS, 3, 8)
    mask, is_causal = build_attention_mask(q_len=3, k_len=8, causal=False, bias=bias)
    assert not is_causal and mask is bias
    key_padding_mask = right_padding(2, 8, 2)
    mask, _ = build_attention_mask(q_len=3, k_len=8, causal=True, key_padding_mask=key_padding_mask, bias=bias)
    assert mask is not None and mask.is_floating_point() and mask.shape == (2, N_HEADS, 3, 8)
    allowed = (causal_mask(3, 8)[None, None] & ~key_padding_mask[:, None, None, :]).expand_as(mask)
    assert torch.all(mask[~allowed] == float("-inf"))
    torch.testing.assert_close(mask[allowed], bias.expand_as(mask)[allowed])


# --------------------------------------------------------------------------------------------
# Cross-attention decoder


@pytest.mark.parametrize("attn_impl", ["sdpa", "explicit"])
@pytest.mark.parametrize("pos_encoding", POS_ENCODINGS)
def test_cross_attention_ignores_padded_memory(pos_encoding: str, attn_impl: str) -> None:
    torch.manual_seed(0)
    decoder = perturb_(Decoder(make_cfg(pos_encoding=pos_encoding, attn_impl=attn_impl), cross_attention=True)).eval()
    assert all(block.cross_attn is not None for block in decoder.blocks)
    torch.manual_seed(7)
    x, memory = torch.randn(2, 5, D_MODEL), torch.randn(2, 8, D_MODEL)
    memory_padding_mask = right_padding(2, 8, 3)  # sequence 0: memory positions 5, 6, 7 are padding
    out = decoder(x, memory=memory, memory_padding_mask=memory_padding_mask)
    assert out.shape == (2, 5, D_MODEL) and torch.isfinite(out).all()

    changed = memory.clone()
    changed[0, 5:] = 100 * torch.randn(3, D_MODEL)
    out_changed = decoder(x, memory=changed, memory_padding_mask=memory_padding_mask)
    torch.testing.assert_close(out_changed, out, rtol=0, atol=1e-6)

    # Not vacuous: a real memory position does matter, and so does the padding itself.
    changed = memory.clone()
    changed[0, 2] = 100 * torch.randn(D_MODEL)
    out_real = decoder(x, memory=changed, memory_padding_mask=memory_padding_mask)
    assert (out_real[0] - out[0]).abs().max() > 1e-3
    torch.testing.assert_close(out_real[1], out[1], rtol=0, atol=1e-6)
    assert (decoder(x, memory=memory)[0] - out[0]).abs().max() > 1e-3


def test_cross_attention_decoder_needs_memory() -> None:
    decoder = Decoder(make_cfg(), cross_attention=True)
    with pytest.raises(ValueError, match="context"):
        decoder(torch.randn(1, 3, D_MODEL))


def test_decoder_without_cross_attention_has_none() -> None:
    decoder = Decoder(make_cfg())
    assert all(block.cross_attn is None and block.cross_attn_norm is None for block in decoder.blocks)


# --------------------------------------------------------------------------------------------
# Queries that may see no key: outputs AND gradients agree between the two paths


@pytest.mark.parametrize("pos_encoding", ["none", "alibi", "relative"])
def test_fully_masked_queries_give_the_same_gradients_on_both_paths(pos_encoding: str) -> None:
    """Left padding makes the padded queries of a causal stack see no key at all. With a float
    bias (ALiBi, relative) the mask is additive; the explicit path must not send NaN through the
    backward of those rows: q, k, v and the bias table get the gradients SDPA gives them."""
    fast, explicit = sdpa_explicit_pair(Decoder, pos_encoding)
    torch.manual_seed(5)
    x = torch.randn(2, 6, D_MODEL)
    key_padding_mask = torch.zeros(2, 6, dtype=torch.bool)
    key_padding_mask[0, :2] = True  # the first two queries of sequence 0 see only padding
    outputs, grads = [], []
    for stack in (fast, explicit):
        inputs = x.clone().requires_grad_(True)
        y = stack(inputs, key_padding_mask=key_padding_mask)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        outputs.append(y.detach())
        grads.append({"input": inputs.grad, **{n: p.grad for n, p in stack.named_parameters() if p.grad is not None}})
    torch.testing.assert_close(outputs[1], outputs[0], **TOL)
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[1].items():
        assert torch.isfinite(grad).all(), f"non-finite gradient of {name} on the explicit path"
        torch.testing.assert_close(grad, grads[0][name], **TOL, msg=f"gradient of {name}")
    if pos_encoding == "relative":
        assert any("pos_encoding" in name and grad.abs().sum() > 0 for name, grad in grads[1].items())


def test_explicit_attention_with_an_all_masked_float_row_has_sdpa_gradients() -> None:
    """The attention function alone, with leaf q, k, v and a learnable float bias."""
    torch.manual_seed(6)
    fast, explicit = mha_pair(cross=False)
    q, k, v = (torch.randn(2, N_HEADS, 5, D_MODEL // N_HEADS) for _ in range(3))
    table = torch.randn(N_HEADS, 5, 5)
    allowed = torch.ones(2, 1, 5, 5, dtype=torch.bool)
    allowed[0, :, 1] = False  # query 1 of sequence 0 may see nothing
    allowed[1, :, :, 3] = False  # and one key is masked for every query of sequence 1
    results = []
    for module, attend in ((fast, lambda *a: fast._sdpa(*a)[0]), (explicit, lambda *a: explicit._explicit(*a)[0])):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, table)]
        mask = leaves[3].masked_fill(~allowed, float("-inf"))  # (B, nh, Tq, Tk) additive float mask
        y = attend(*leaves[:3], mask, False, 0.0)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        results.append((y.detach(), [t.grad for t in leaves]))
    (y_fast, g_fast), (y_explicit, g_explicit) = results
    torch.testing.assert_close(y_explicit, y_fast, **TOL)
    assert torch.equal(y_explicit[0, :, 1], torch.zeros_like(y_explicit[0, :, 1]))
    for name, a, b in zip("qkv", g_explicit, g_fast):
        assert torch.isfinite(a).all(), f"NaN in the gradient of {name}"
        torch.testing.assert_close(a, b, **TOL)
    torch.testing.assert_close(g_explicit[3], g_fast[3], **TOL)


@pytest.mark.parametrize("method", ["forward", "forward_with_attention"])
def test_a_misspelt_stack_input_is_refused_not_dropped(method: str) -> None:
    """A stack reads its optional inputs by name (StackInputs): an unknown one must fail, or a padding mask passed as
    ``padding_mask`` would be ignored and the padded positions attended to without a word."""
    decoder = Decoder(make_cfg())
    with pytest.raises(TypeError, match=r"unexpected inputs \['padding_mask'\]"):
        getattr(decoder, method)(torch.randn(1, 3, D_MODEL), padding_mask=torch.zeros(1, 3, dtype=torch.bool))
