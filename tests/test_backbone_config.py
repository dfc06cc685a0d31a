"""TransformerConfig validation and the architecture variants it selects."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from trident.backbone import ACTIVATIONS, NORMS, Decoder, Encoder, FeedForward, MultiHeadAttention, make_norm
from trident.errors import ConfigError, TridentError

from .backbone_helpers import D_FF, D_MODEL, N_HEADS, N_LAYERS, make_cfg

pytestmark = pytest.mark.usefixtures("single_thread")


def test_small_config_is_valid() -> None:
    cfg = make_cfg()
    assert cfg.head_dim == D_MODEL // N_HEADS == 8


def test_config_error_is_a_trident_value_error() -> None:
    assert issubclass(ConfigError, TridentError) and issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(("d_model", "n_heads"), [(30, 4), (32, 5), (10, 3), (512, 7)])
def test_d_model_not_divisible_by_n_heads(d_model: int, n_heads: int) -> None:
    with pytest.raises(ConfigError) as excinfo:
        make_cfg(d_model=d_model, n_heads=n_heads)
    message = str(excinfo.value)
    assert "divisible" in message
    assert f"d_model={d_model}" in message
    assert f"n_heads={n_heads}" in message


@pytest.mark.parametrize("field", ["d_model", "n_heads", "n_layers", "d_ff", "max_seq_len"])
@pytest.mark.parametrize("value", [0, -4, 2.0, True, "32", None])
def test_sizes_must_be_positive_integers(field: str, value) -> None:
    with pytest.raises(ConfigError, match=field):
        make_cfg(**{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("activation", "tanh"),
        ("activation", "ReLU"),
        ("norm", "batchnorm"),
        ("norm", "LayerNorm"),
        ("attn_impl", "flash"),
        ("attn_impl", ""),
    ],
)
def test_invalid_choice_raises_and_lists_the_choices(field: str, value: str) -> None:
    choices = {
        "activation": ("relu", "gelu", "swiglu"),
        "norm": ("layernorm", "rmsnorm"),
        "attn_impl": ("sdpa", "explicit"),
    }[field]
    with pytest.raises(ConfigError, match=field) as excinfo:
        make_cfg(**{field: value})
    for choice in choices:
        assert choice in str(excinfo.value)


@pytest.mark.parametrize("field", ["dropout", "attn_dropout"])
@pytest.mark.parametrize("value", [-0.1, 1.0, 1.5, float("nan")])
def test_invalid_dropout_raises(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=field):
        make_cfg(**{field: value})


@pytest.mark.parametrize("field", ["dropout", "attn_dropout"])
@pytest.mark.parametrize("value", [0.0, 0.1, 0.99])
def test_valid_dropout_is_accepted(field: str, value: float) -> None:
    assert getattr(make_cfg(**{field: value}), field) == value


@pytest.mark.parametrize(("d_model", "n_heads"), [(12, 4), (28, 4), (5, 1)])
def test_rope_needs_an_even_head_dim(d_model: int, n_heads: int) -> None:
    with pytest.raises(ConfigError, match="head size divisible by 2") as excinfo:
        make_cfg(d_model=d_model, n_heads=n_heads, pos_encoding="rope")
    assert str(d_model // n_heads) in str(excinfo.value)
    # Other encodings are fine with an odd head size.
    for pos_encoding in ("none", "sinusoidal", "alibi", "relative", "learned"):
        Encoder(make_cfg(d_model=d_model, n_heads=n_heads, pos_encoding=pos_encoding))


ARCHITECTURES = list(itertools.product(["relu", "gelu", "swiglu"], ["layernorm", "rmsnorm"], [True, False]))


@pytest.mark.parametrize(
    ("activation", "norm", "norm_first"),
    ARCHITECTURES,
    ids=[f"{a}-{n}-{'pre' if f else 'post'}" for a, n, f in ARCHITECTURES],
)
def test_each_architecture_builds_and_runs(activation: str, norm: str, norm_first: bool) -> None:
    torch.manual_seed(0)
    cfg = make_cfg(activation=activation, norm=norm, norm_first=norm_first)
    x = torch.randn(2, 6, D_MODEL)
    memory = torch.randn(2, 4, D_MODEL)
    for stack in (Encoder(cfg), Decoder(cfg), Decoder(cfg, cross_attention=True)):
        stack.eval()
        out = stack(x, memory=memory) if stack.blocks[0].cross_attn is not None else stack(x)
        assert out.shape == x.shape and torch.isfinite(out).all()
        assert len(stack.blocks) == N_LAYERS
        norm_type = nn.RMSNorm if norm == "rmsnorm" else nn.LayerNorm
        assert isinstance(stack.blocks[0].ffn_norm, norm_type)
        ffn = stack.blocks[0].ffn
        assert ffn.fc_in.out_features == (2 * D_FF if activation == "swiglu" else D_FF)
        assert ffn.fc_out.in_features == D_FF
        # A (non-final) norm of a post-norm stack normalises the output of every block.
        if not norm_first and norm == "layernorm":
            torch.testing.assert_close(out.mean(-1), torch.zeros(2, 6), atol=1e-5, rtol=0)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_pre_norm_has_a_final_norm_and_post_norm_does_not(norm: str) -> None:
    pre = Encoder(make_cfg(norm=norm, norm_first=True))
    post = Decoder(make_cfg(norm=norm, norm_first=False))
    assert isinstance(post.final_norm, nn.Identity)
    assert not isinstance(pre.final_norm, nn.Identity)
    assert isinstance(pre.final_norm, nn.RMSNorm if norm == "rmsnorm" else nn.LayerNorm)
    assert not any(name.startswith("final_norm") for name, _ in post.named_parameters())


def test_feed_forward_activations() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, D_MODEL)
    for activation, fn in (("relu", torch.relu), ("gelu", nn.functional.gelu)):
        ffn = FeedForward(D_MODEL, D_FF, activation=activation)
        torch.testing.assert_close(ffn(x), ffn.fc_out(fn(ffn.fc_in(x))))
    ffn = FeedForward(D_MODEL, D_FF, activation="swiglu")
    gate, value = ffn.fc_in(x).chunk(2, dim=-1)
    torch.testing.assert_close(ffn(x), ffn.fc_out(nn.functional.silu(gate) * value))


def test_bias_false_removes_linear_biases() -> None:
    stack = Decoder(make_cfg(bias=False), cross_attention=True)
    linears = [m for m in stack.modules() if isinstance(m, nn.Linear)]
    assert linears and all(m.bias is None for m in linears)
    assert make_norm("layernorm", D_MODEL, bias=False).bias is None


@pytest.mark.parametrize("value", [None, "0.1"])
def test_non_numeric_dropout_raises_config_error(value) -> None:
    with pytest.raises(ConfigError, match="dropout"):
        make_cfg(dropout=value)


def test_parts_chosen_by_name_fail_loudly_on_an_unknown_name() -> None:
    with pytest.raises(ConfigError, match=r"model.norm='batchnorm' is not supported: choose one of layernorm, rmsnorm"):
        make_norm("batchnorm", D_MODEL)
    with pytest.raises(ConfigError, match=r"model.activation='tanh' is not supported \(did you mean gelu_tanh\?\): choose one of relu, gelu, gelu_tanh, swiglu"):
        FeedForward(D_MODEL, D_FF, activation="tanh")
    with pytest.raises(ConfigError, match=r"model.attn_impl='flash' is not supported: choose one of sdpa, explicit"):
        MultiHeadAttention(D_MODEL, 4, impl="flash")
    with pytest.raises(ConfigError, match=r"model.norm='rmsnrom' is not supported \(did you mean rmsnorm\?\)"):
        make_cfg(norm="rmsnrom")


def test_the_config_checks_names_against_the_tables_that_build_the_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(NORMS, "scalenorm", lambda d_model, bias, eps: torch.nn.Identity())
    monkeypatch.setitem(ACTIVATIONS, "tanh", torch.tanh)
    cfg = make_cfg(norm="scalenorm", activation="tanh")
    block = Encoder(cfg).blocks[0]
    assert isinstance(block.ffn_norm, torch.nn.Identity) and block.ffn.act is torch.tanh
