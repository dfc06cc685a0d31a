"""Positional encodings of the Transformer backbone: each formula against its paper, the
registry and its errors, and a forward + backward pass through every encoding."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from trident.backbone import (
    Decoder,
    Encoder,
    TransformerConfig,
    available_pos_encodings,
    pos_encoding_class,
)
from trident.backbone.positional import alibi_slopes, apply_rotary, relative_bucket, sinusoidal_table
from trident.errors import ConfigError

from .backbone_helpers import D_MODEL, HEAD_DIM, N_HEADS, make_cfg

pytestmark = pytest.mark.usefixtures("single_thread")

POS_ENCODINGS = available_pos_encodings()


def test_registry_lists_the_documented_encodings() -> None:
    assert set(POS_ENCODINGS) >= {"none", "sinusoidal", "learned", "rope", "alibi", "relative"}
    assert POS_ENCODINGS == sorted(POS_ENCODINGS)
    for name in POS_ENCODINGS:
        assert pos_encoding_class(name).name == name


def test_capabilities() -> None:
    assert pos_encoding_class("learned").bounded_length
    assert not any(pos_encoding_class(n).bounded_length for n in POS_ENCODINGS if n != "learned")
    assert pos_encoding_class("alibi").extrapolates
    assert not pos_encoding_class("sinusoidal").extrapolates
    assert pos_encoding_class("rope").uses_rotary
    assert not any(pos_encoding_class(n).uses_rotary for n in POS_ENCODINGS if n != "rope")
    assert [n for n in POS_ENCODINGS if pos_encoding_class(n).absolute] == ["learned", "sinusoidal"]


@pytest.mark.parametrize("pos_encoding", POS_ENCODINGS)
def test_each_encoding_uses_the_hooks_it_documents(pos_encoding: str) -> None:
    enc = Encoder(make_cfg(pos_encoding=pos_encoding)).pos_encoding
    positions = torch.arange(5)
    x = torch.randn(2, 5, D_MODEL)
    added = enc.add_to_embeddings(x, positions)
    rope = enc.rotary(positions)
    bias = enc.attention_bias(positions, positions)
    assert added.shape == x.shape
    assert (not torch.equal(added, x)) == (pos_encoding in ("sinusoidal", "learned"))
    assert (rope is not None) == (pos_encoding == "rope")
    assert (bias is not None) == (pos_encoding in ("alibi", "relative"))
    if rope is not None:
        assert rope[0].shape == rope[1].shape == (5, HEAD_DIM)
    if bias is not None:
        assert bias.shape == (1, N_HEADS, 5, 5)


# --------------------------------------------------------------------------------------------
# Sinusoidal


def paper_sinusoid(pos: int, j: int, d_model: int, base: float = 10000.0) -> float:
    """PE(pos, 2i) = sin(pos / base^(2i/d)), PE(pos, 2i+1) = cos(pos / base^(2i/d))."""
    i2 = j - (j % 2)
    angle = pos / base ** (i2 / d_model)
    return math.sin(angle) if j % 2 == 0 else math.cos(angle)


@pytest.mark.parametrize("d_model", [32, 33, 7, 2, 1])
def test_sinusoidal_table_matches_the_paper_elementwise(d_model: int) -> None:
    n_pos = 50
    table = sinusoidal_table(torch.arange(n_pos), d_model)
    assert table.shape == (n_pos, d_model)
    expected = torch.tensor(
        [[paper_sinusoid(pos, j, d_model) for j in range(d_model)] for pos in range(n_pos)], dtype=torch.float32
    )
    torch.testing.assert_close(table, expected, rtol=0, atol=2e-5)


def test_sinusoidal_table_custom_base() -> None:
    table = sinusoidal_table(torch.arange(10), 6, base=100.0)
    expected = torch.tensor([[paper_sinusoid(p, j, 6, 100.0) for j in range(6)] for p in range(10)])
    torch.testing.assert_close(table, expected, rtol=0, atol=2e-5)


@pytest.mark.parametrize("d_model", [32, 33])
def test_sinusoidal_encoding_adds_the_table_beyond_max_seq_len(d_model: int) -> None:
    cfg = TransformerConfig(d_model=d_model, n_heads=1, n_layers=1, d_ff=8, max_seq_len=8)
    enc = pos_encoding_class("sinusoidal")(cfg, causal=False)
    for positions in (torch.arange(8), torch.arange(5, 20)):  # precomputed table, then on the fly
        out = enc.add_to_embeddings(torch.zeros(1, len(positions), d_model), positions)
        expected = torch.tensor([[paper_sinusoid(int(p), j, d_model) for j in range(d_model)] for p in positions])
        torch.testing.assert_close(out[0], expected, rtol=0, atol=2e-5)


# --------------------------------------------------------------------------------------------
# Rotary


def rope_encoding(head_dim: int = HEAD_DIM, **options):
    cfg = make_cfg(d_model=head_dim * N_HEADS, pos_encoding="rope", pos_encoding_options=options)
    return pos_encoding_class("rope")(cfg, causal=True)


def rotate_at(enc, x: torch.Tensor, position: int) -> torch.Tensor:
    cos, sin = enc.rotary(torch.tensor([position]))
    return apply_rotary(x, cos, sin)  # x: (1, 1, 1, hs)


@pytest.mark.parametrize(("m", "n", "shift"), [(0, 0, 5), (3, 10, 17), (10, 3, 1), (7, 7, 40), (0, 31, 12)])
def test_rope_dot_product_depends_only_on_the_offset(m: int, n: int, shift: int) -> None:
    enc = rope_encoding()
    generator = torch.Generator().manual_seed(m * 100 + n)
    q = torch.randn(1, 1, 1, HEAD_DIM, generator=generator)
    k = torch.randn(1, 1, 1, HEAD_DIM, generator=generator)
    score = (rotate_at(enc, q, m) * rotate_at(enc, k, n)).sum()
    shifted = (rotate_at(enc, q, m + shift) * rotate_at(enc, k, n + shift)).sum()
    torch.testing.assert_close(shifted, score, rtol=1e-4, atol=1e-4)
    # ... and it does depend on the offset.
    other = (rotate_at(enc, q, m) * rotate_at(enc, k, n + 1)).sum()
    assert abs(float(other - score)) > 1e-4


def test_rope_preserves_the_norm_and_is_identity_at_zero() -> None:
    enc = rope_encoding()
    x = torch.randn(2, N_HEADS, 20, HEAD_DIM)
    cos, sin = enc.rotary(torch.arange(20))
    rotated = apply_rotary(x, cos, sin)
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))
    assert not torch.allclose(rotated[:, :, 1:], x[:, :, 1:])
    torch.testing.assert_close(rotated[:, :, 0], x[:, :, 0])


def test_rope_base_option_changes_the_frequencies() -> None:
    default, custom = rope_encoding(), rope_encoding(base=100.0)
    torch.testing.assert_close(
        default.inv_freq, torch.tensor([10000.0 ** (-2 * i / HEAD_DIM) for i in range(HEAD_DIM // 2)])
    )
    torch.testing.assert_close(
        custom.inv_freq, torch.tensor([100.0 ** (-2 * i / HEAD_DIM) for i in range(HEAD_DIM // 2)])
    )


# --------------------------------------------------------------------------------------------
# ALiBi


def reference_alibi_slopes(n: int) -> list[float]:
    """The ALiBi authors' get_slopes (github.com/ofirpress/attention_with_linear_biases)."""

    def power_of_2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + reference_alibi_slopes(2 * closest)[0::2][: n - closest]


def test_alibi_slopes_for_eight_heads() -> None:
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0**-k for k in range(1, 9)]))


@pytest.mark.parametrize("n_heads", [1, 2, 3, 4, 5, 6, 7, 12, 16, 20])
def test_alibi_slopes_any_head_count(n_heads: int) -> None:
    slopes = alibi_slopes(n_heads)
    assert slopes.shape == (n_heads,)
    assert torch.all(slopes > 0) and torch.all(slopes <= 1)
    assert len(set(slopes.tolist())) == n_heads
    torch.testing.assert_close(slopes, torch.tensor(reference_alibi_slopes(n_heads)))


def test_alibi_bias_is_minus_slope_times_distance() -> None:
    enc = pos_encoding_class("alibi")(make_cfg(pos_encoding="alibi"), causal=False)
    q_pos, k_pos = torch.arange(3, 6), torch.arange(0, 6)
    bias = enc.attention_bias(q_pos, k_pos)
    assert bias.shape == (1, N_HEADS, 3, 6)
    slopes = alibi_slopes(N_HEADS)
    for h in range(N_HEADS):
        for i, qp in enumerate(q_pos.tolist()):
            for j, kp in enumerate(k_pos.tolist()):
                assert float(bias[0, h, i, j]) == pytest.approx(-float(slopes[h]) * abs(qp - kp))


# --------------------------------------------------------------------------------------------
# T5 relative buckets


def reference_t5_bucket(relative: int, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
    """Scalar transcription of T5's _relative_position_bucket (Mesh TensorFlow / HF)."""
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        if relative > 0:
            bucket += num_buckets
        n = abs(relative)
    else:
        n = max(-relative, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return bucket + n
    large = max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact))
    return bucket + min(large, num_buckets - 1)


def buckets(values, *, bidirectional: bool, num_buckets: int = 32, max_distance: int = 128) -> list[int]:
    rel = torch.tensor(values)
    ids = relative_bucket(rel, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
    return ids.tolist()


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(("num_buckets", "max_distance"), [(32, 128), (16, 64), (8, 20)])
def test_relative_bucket_matches_t5(bidirectional: bool, num_buckets: int, max_distance: int) -> None:
    values = list(range(-300, 301))
    got = buckets(values, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
    expected = [reference_t5_bucket(v, bidirectional, num_buckets, max_distance) for v in values]
    assert got == expected
    assert min(got) >= 0 and max(got) <= num_buckets - 1


def test_relative_bucket_unidirectional() -> None:
    # Keys in the future (relative > 0) are not distinguished from the query itself.
    assert buckets([0, 1, 5, 1000], bidirectional=False) == [0, 0, 0, 0]
    # Small past offsets map to exact, distinct buckets 0..15 (max_exact = 32 // 2).
    assert buckets([-d for d in range(16)], bidirectional=False) == list(range(16))
    # Larger ones share logarithmic buckets that never decrease, and saturate at num_buckets - 1.
    far = buckets([-d for d in range(16, 400)], bidirectional=False)
    assert all(a <= b for a, b in itertools.pairwise(far))
    assert all(b >= 16 for b in far)
    assert buckets([-128, -129, -1000, -10**6], bidirectional=False) == [31, 31, 31, 31]
    assert buckets([-100], bidirectional=False) == [30]  # 16 + int(log(100/16) / log(8) * 16)


def test_relative_bucket_bidirectional() -> None:
    # Half of the buckets for each direction; max_exact = 16 // 2 = 8.
    assert buckets(list(range(0, -8, -1)), bidirectional=True) == list(range(8))
    assert buckets(list(range(1, 8)), bidirectional=True) == list(range(17, 24))
    # Same distance, opposite directions: different buckets, 16 apart.
    for d in (1, 3, 7, 20, 100):
        before, after = buckets([-d, d], bidirectional=True)
        assert after == before + 16
    # Saturation: past keys at num_buckets/2 - 1, future keys at num_buckets - 1.
    assert buckets([-128, -10**6], bidirectional=True) == [15, 15]
    assert buckets([128, 10**6], bidirectional=True) == [31, 31]


@pytest.mark.parametrize("causal", [True, False])
def test_relative_encoding_bias_uses_the_right_direction(causal: bool) -> None:
    cfg = make_cfg(pos_encoding="relative", pos_encoding_options={"num_buckets": 8, "max_distance": 16})
    enc = pos_encoding_class("relative")(cfg, causal=causal)
    positions = torch.arange(6)
    bias = enc.attention_bias(positions, positions)
    assert bias.shape == (1, N_HEADS, 6, 6)
    rel = positions[None, :] - positions[:, None]
    ids = relative_bucket(rel, bidirectional=not causal, num_buckets=8, max_distance=16)
    torch.testing.assert_close(bias[0], enc.bias.weight[ids].permute(2, 0, 1))
    assert enc.bias.weight.shape == (8, N_HEADS)


# --------------------------------------------------------------------------------------------
# Every encoding trains


@pytest.mark.parametrize("kind", ["encoder", "decoder", "cross_decoder"])
@pytest.mark.parametrize("pos_encoding", POS_ENCODINGS)
def test_forward_and_backward_are_finite(pos_encoding: str, kind: str) -> None:
    torch.manual_seed(0)
    cfg = make_cfg(pos_encoding=pos_encoding, dropout=0.1, attn_dropout=0.1)
    if kind == "encoder":
        stack = Encoder(cfg)
    else:
        stack = Decoder(cfg, cross_attention=kind == "cross_decoder")
    stack.train()
    x = torch.randn(2, 10, D_MODEL, requires_grad=True)
    key_padding_mask = torch.zeros(2, 10, dtype=torch.bool)
    key_padding_mask[0, 7:] = True
    kwargs: dict = {"key_padding_mask": key_padding_mask}
    if kind == "cross_decoder":
        kwargs["memory"] = torch.randn(2, 6, D_MODEL, requires_grad=True)
        kwargs["memory_padding_mask"] = torch.tensor([[False] * 4 + [True] * 2, [False] * 6])
    out = stack(x, **kwargs)
    assert out.shape == x.shape
    loss = (out * torch.randn_like(out)).sum() + out.square().mean()
    assert torch.isfinite(loss)
    loss.backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    if kind == "cross_decoder":
        memory_grad = kwargs["memory"].grad
        assert memory_grad is not None and torch.isfinite(memory_grad).all()
        assert torch.all(memory_grad[0, 4:] == 0)  # padded memory gets no gradient
    for name, p in stack.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(p.grad).all(), f"{name} has a non-finite gradient"
    for name, p in stack.pos_encoding.named_parameters():
        assert p.grad.abs().sum() > 0, f"positional parameter {name} gets no signal"


# --------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize("make_stack", [Encoder, Decoder], ids=["encoder", "decoder"])
def test_learned_encoding_rejects_sequences_longer_than_max_seq_len(make_stack) -> None:
    stack = make_stack(make_cfg(pos_encoding="learned", max_seq_len=8)).eval()
    assert stack(torch.randn(1, 8, D_MODEL)).shape == (1, 8, D_MODEL)  # exactly max_seq_len is fine
    with pytest.raises(ConfigError, match="max_seq_len") as excinfo:
        stack(torch.randn(1, 9, D_MODEL))
    assert "9" in str(excinfo.value) and "8" in str(excinfo.value)


def test_learned_encoding_rejects_cached_decoding_past_max_seq_len() -> None:
    decoder = Decoder(make_cfg(pos_encoding="learned", max_seq_len=8)).eval()
    cache = decoder.new_cache(16)
    decoder(torch.randn(1, 6, D_MODEL), cache=cache)
    decoder(torch.randn(1, 2, D_MODEL), cache=cache)
    with pytest.raises(ConfigError, match="max_seq_len"):
        decoder(torch.randn(1, 1, D_MODEL), cache=cache)


@pytest.mark.parametrize("pos_encoding", [n for n in POS_ENCODINGS if not pos_encoding_class(n).bounded_length])
def test_unbounded_encodings_accept_sequences_longer_than_max_seq_len(pos_encoding: str) -> None:
    stack = Decoder(make_cfg(pos_encoding=pos_encoding, max_seq_len=8)).eval()
    out = stack(torch.randn(1, 20, D_MODEL))
    assert out.shape == (1, 20, D_MODEL) and torch.isfinite(out).all()


def test_unknown_encoding_lists_the_choices() -> None:
    with pytest.raises(ConfigError, match="unknown positional encoding") as excinfo:
        make_cfg(pos_encoding="wavelet")
    message = str(excinfo.value)
    assert "wavelet" in message
    for name in POS_ENCODINGS:
        assert name in message
    with pytest.raises(ConfigError):
        pos_encoding_class("Sinusoidal")


@pytest.mark.parametrize("pos_encoding", POS_ENCODINGS)
def test_unknown_pos_encoding_option_raises(pos_encoding: str) -> None:
    with pytest.raises(ConfigError, match="bogus") as excinfo:
        Encoder(make_cfg(pos_encoding=pos_encoding, pos_encoding_options={"bogus": 1}))
    assert pos_encoding in str(excinfo.value)


def test_known_pos_encoding_options_are_accepted() -> None:
    Encoder(make_cfg(pos_encoding="sinusoidal", pos_encoding_options={"base": 500.0}))
    Encoder(make_cfg(pos_encoding="rope", pos_encoding_options={"base": 500.0}))
    Encoder(make_cfg(pos_encoding="relative", pos_encoding_options={"num_buckets": 16, "max_distance": 64}))
    with pytest.raises(ConfigError):  # an option of another encoding
        Encoder(make_cfg(pos_encoding="alibi", pos_encoding_options={"base": 500.0}))


@pytest.mark.parametrize(
    ("make_stack", "options"),
    [
        (Encoder, {"num_buckets": 32, "max_distance": 8}),
        (Decoder, {"num_buckets": 32, "max_distance": 16}),
        (Encoder, {"num_buckets": 2}),
    ],
    ids=["encoder_max_distance_8", "decoder_max_distance_16", "encoder_2_buckets"],
)
def test_relative_encoding_rejects_inconsistent_bucket_options(make_stack, options: dict) -> None:
    with pytest.raises(ConfigError):
        stack = make_stack(make_cfg(pos_encoding="relative", pos_encoding_options=options))
        stack(torch.randn(1, 40, D_MODEL))
