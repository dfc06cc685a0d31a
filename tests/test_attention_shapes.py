"""Issue 40, the attention-shape switches: grouped-query attention (``model.n_kv_heads``), a head width
apart from d_model / n_heads (``model.head_dim``), QK-norm (``model.qk_norm``) and the projection biases
(``model.qkv_bias``, ``model.attn_out_bias``, ``model.mlp_bias``), each against a reference written out
here, and the defaults that keep every existing model bit for bit."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from trident.backbone import Decoder, Encoder, MultiHeadAttention, TransformerConfig
from trident.backbone.positional import apply_rotary, build_pos_encoding
from trident.errors import ConfigError
from trident.models.causal_lm import CausalLM
from trident.models.seq2seq import EncoderDecoder
from trident.runs.pipeline import check_config

from .backbone_helpers import D_MODEL, N_HEADS, make_cfg, perturb_
from .conftest import CONF_DIR, compose_config

pytestmark = pytest.mark.usefixtures("single_thread")

# The grouped GEMMs run in another layout (another summation order): compared in float64, where that rounding
# (~1e-16) is far below the tolerance on every CPU kernel (in float32 it reaches 1.5e-6 without AVX-512).
EXACT = {"rtol": 1e-9, "atol": 1e-9}
TOL = {"rtol": 1e-5, "atol": 1e-5}
KV_HEADS = [N_HEADS, N_HEADS // 2, 1]  # multi-head, grouped-query, multi-query
IMPLS = ["sdpa", "explicit"]


def expand_kv_heads(state: dict[str, Tensor], n_heads: int, n_kv_heads: int, head_dim: int) -> dict[str, Tensor]:
    """A grouped-query state dict as the multi-head one it stands for: query head h reads key/value head
    h // (n_heads / n_kv_heads), so each key/value head's rows (and biases) are repeated for its group
    (transformers' repeat_kv), in the fused [q; k; v] and the cross-attention [k; v] layouts."""
    group, q_rows, kv_rows = n_heads // n_kv_heads, n_heads * head_dim, n_kv_heads * head_dim

    def repeat_heads(rows: Tensor) -> Tensor:  # (n_kv_heads*hs, ...) -> (n_heads*hs, ...)
        per_head = rows.reshape(n_kv_heads, head_dim, *rows.shape[1:])
        return per_head.repeat_interleave(group, dim=0).reshape(n_heads * head_dim, *rows.shape[1:])

    expanded = {}
    for name, value in state.items():
        if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            q, k, v = value.split((q_rows, kv_rows, kv_rows))
            value = torch.cat([q, repeat_heads(k), repeat_heads(v)])
        elif name.endswith(("kv_proj.weight", "kv_proj.bias")):
            k, v = value.split((kv_rows, kv_rows))
            value = torch.cat([repeat_heads(k), repeat_heads(v)])
        expanded[name] = value
    return expanded


def gqa_and_reference(make, n_kv_heads: int, **overrides) -> tuple[nn.Module, nn.Module]:
    """A perturbed grouped-query module and the multi-head module holding its repeated key/value weights,
    both in float64."""
    torch.manual_seed(0)
    grouped = perturb_(make(make_cfg(n_kv_heads=n_kv_heads, **overrides))).double().eval()
    reference = make(make_cfg(**overrides)).double().eval()
    reference.load_state_dict(expand_kv_heads(grouped.state_dict(), N_HEADS, n_kv_heads, D_MODEL // N_HEADS))
    return grouped, reference


def padding(batch: int, length: int) -> Tensor:
    """(B, T) True at padding: sequence 0 has 3 pads on the right, sequence 1 has 2 on the left."""
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[0, -3:] = True
    mask[1, :2] = True
    return mask


# --------------------------------------------------------------------------------------------
# Defaults: every existing model unchanged


def explicit_defaults(cfg: TransformerConfig) -> dict[str, object]:
    """The new keys set to the values their null/false defaults stand for."""
    return {"n_kv_heads": cfg.n_heads, "head_dim": cfg.d_model // cfg.n_heads, "qk_norm": False,
            "qkv_bias": cfg.bias, "attn_out_bias": cfg.bias, "mlp_bias": cfg.bias}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("impl", IMPLS)
def test_default_keys_give_the_same_seeded_lm_bit_for_bit(bias: bool, impl: str) -> None:
    default = make_cfg(bias=bias, attn_impl=impl, pos_encoding="rope")
    assert (default.n_kv_heads, default.head_dim) == (N_HEADS, D_MODEL // N_HEADS)
    assert (default.qkv_bias, default.attn_out_bias, default.mlp_bias) == (bias, bias, bias)
    models = []
    for overrides in ({}, explicit_defaults(default)):
        torch.manual_seed(7)
        models.append(CausalLM(make_cfg(bias=bias, attn_impl=impl, pos_encoding="rope", **overrides), 50).eval())
    before, after = (m.state_dict() for m in models)
    assert list(before) == list(after)
    for name in before:
        assert torch.equal(before[name], after[name]), name
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    assert torch.equal(models[0](ids), models[1](ids))


def test_default_keys_give_the_same_seeded_translation_model() -> None:
    """Cross-attention's q_proj / kv_proj keep their names, shapes and seeded values."""
    states = []
    for overrides in ({}, explicit_defaults(make_cfg())):
        torch.manual_seed(7)
        states.append(EncoderDecoder(make_cfg(**overrides), 40).state_dict())
    assert [(k, v.shape) for k, v in states[0].items()] == [(k, v.shape) for k, v in states[1].items()]
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert states[0]["decoder.blocks.0.cross_attn.kv_proj.weight"].shape == (2 * D_MODEL, D_MODEL)


# --------------------------------------------------------------------------------------------
# Grouped-query attention


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n_kv_heads", KV_HEADS)
def test_grouped_query_decoder_equals_multi_head_with_repeated_kv(n_kv_heads: int, impl: str) -> None:
    """Causal, rope, left and right padding: the grouped-query stack computes what the multi-head stack
    with each key/value head repeated for its query heads computes."""
    grouped, reference = gqa_and_reference(Decoder, n_kv_heads, pos_encoding="rope", attn_impl=impl)
    x = torch.randn(3, 9, D_MODEL, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    mask = padding(3, 9)
    torch.testing.assert_close(grouped(x, key_padding_mask=mask), reference(x, key_padding_mask=mask), **EXACT)
    torch.testing.assert_close(grouped(x), reference(x), **EXACT)


@pytest.mark.parametrize("n_kv_heads", KV_HEADS)
def test_grouped_query_translation_equals_multi_head_with_repeated_kv(n_kv_heads: int) -> None:
    """Encoder (bidirectional, padded) and decoder with cross-attention, whose kv_proj is grouped too."""
    grouped, reference = gqa_and_reference(lambda cfg: EncoderDecoder(cfg, 40, pad_id=0), n_kv_heads)
    generator = torch.Generator().manual_seed(2)
    src, tgt = torch.randint(1, 40, (2, 8), generator=generator), torch.randint(1, 40, (2, 6), generator=generator)
    src[0, -3:] = 0  # padded source
    assert grouped.state_dict()["decoder.blocks.0.cross_attn.kv_proj.weight"].shape == (
        2 * n_kv_heads * D_MODEL // N_HEADS, D_MODEL)
    torch.testing.assert_close(grouped(src, tgt), reference(src, tgt), **EXACT)


@pytest.mark.parametrize("n_kv_heads", KV_HEADS[1:])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "padding"])
def test_grouped_query_sdpa_and_explicit_paths_agree(n_kv_heads: int, mask_kind: str) -> None:
    torch.manual_seed(0)
    fast = perturb_(MultiHeadAttention(D_MODEL, N_HEADS, n_kv_heads=n_kv_heads, impl="sdpa")).eval()
    explicit = MultiHeadAttention(D_MODEL, N_HEADS, n_kv_heads=n_kv_heads, impl="explicit").eval()
    explicit.load_state_dict(fast.state_dict())
    x = torch.randn(3, 7, D_MODEL, generator=torch.Generator().manual_seed(1))
    kwargs = {"none": {}, "causal": {"is_causal": True},
              "padding": {"attn_mask": ~padding(3, 7)[:, None, None, :]}}[mask_kind]
    y_fast, _ = fast(x, **kwargs)
    y_explicit, weights = explicit(x, need_weights=True, **kwargs)
    torch.testing.assert_close(y_fast, y_explicit, **TOL)
    assert weights is not None and weights.shape == (3, N_HEADS, 7, 7)  # one map per query head


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n_kv_heads", KV_HEADS)
def test_grouped_query_kv_cache_decoding_matches_the_full_pass(n_kv_heads: int, impl: str) -> None:
    torch.manual_seed(0)
    decoder = perturb_(Decoder(make_cfg(n_kv_heads=n_kv_heads, pos_encoding="rope", attn_impl=impl))).eval()
    x = torch.randn(2, 9, D_MODEL, generator=torch.Generator().manual_seed(1))
    cache = decoder.new_cache(12)
    steps = [decoder(x[:, :5], cache=cache)] + [decoder(x[:, t : t + 1], cache=cache) for t in range(5, 9)]
    torch.testing.assert_close(torch.cat(steps, dim=1), decoder(x), **TOL)
    for layer in cache.layers:  # the cache stores the key/value heads only, never the repeated ones
        assert layer.keys is not None and layer.keys.shape == (2, n_kv_heads, 12, D_MODEL // N_HEADS)
        assert layer.values is not None and layer.values.shape == layer.keys.shape


def cache_bytes(n_kv_heads: int) -> int:
    decoder = Decoder(make_cfg(n_kv_heads=n_kv_heads)).eval()
    cache = decoder.new_cache(16)
    decoder(torch.randn(2, 10, D_MODEL), cache=cache)
    return sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)


def test_cache_bytes_fall_exactly_by_the_group_size() -> None:
    full = cache_bytes(N_HEADS)
    assert full > 0
    for n_kv_heads in KV_HEADS[1:]:
        assert cache_bytes(n_kv_heads) * (N_HEADS // n_kv_heads) == full


# --------------------------------------------------------------------------------------------
# A hand-written reference: head width, grouped query heads, QK-norm before rope


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def reference_self_attention(module: MultiHeadAttention, x: Tensor, rope: tuple[Tensor, Tensor] | None,
                             n_heads: int, n_kv_heads: int, head_dim: int, eps: float) -> Tensor:
    """Causal self-attention written head by head from the module's weights: [q; k; v] rows of the fused
    projection, RMS QK-norm (when the module has one), then rope, query head h reading key/value head
    h // (n_heads / n_kv_heads), scores scaled by 1/sqrt(head_dim)."""
    batch, length, _ = x.shape
    qkv = x @ module.qkv_proj.weight.T + (module.qkv_proj.bias if module.qkv_proj.bias is not None else 0)
    q = qkv[..., : n_heads * head_dim].reshape(batch, length, n_heads, head_dim)
    k = qkv[..., n_heads * head_dim : (n_heads + n_kv_heads) * head_dim].reshape(batch, length, n_kv_heads, head_dim)
    v = qkv[..., (n_heads + n_kv_heads) * head_dim :].reshape(batch, length, n_kv_heads, head_dim)
    if isinstance(module.q_norm, nn.RMSNorm):
        q, k = rms_norm(q, module.q_norm.weight, eps), rms_norm(k, module.k_norm.weight, eps)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, hs)
    if rope is not None:
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    heads = []
    for h in range(n_heads):
        kv = h // (n_heads // n_kv_heads)
        scores = (q[:, h] @ k[:, kv].transpose(-2, -1)) / math.sqrt(head_dim)
        heads.append(torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v[:, kv])
    y = torch.cat(heads, dim=-1)  # (B, T, n_heads*hs), head-major as the out projection reads it
    return y @ module.out_proj.weight.T + (module.out_proj.bias if module.out_proj.bias is not None else 0)


SHAPES = [  # (d_model, n_heads, n_kv_heads, head_dim): the width apart from d_model / n_heads, and with GQA
    (32, 4, 4, 12),
    (30, 4, 2, 8),  # d_model not divisible by n_heads: fine with head_dim set
    (32, 4, 1, 6),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize(("d_model", "n_heads", "n_kv_heads", "head_dim"), SHAPES)
def test_attention_equals_the_hand_written_reference(d_model: int, n_heads: int, n_kv_heads: int, head_dim: int,
                                                     qk_norm: bool, impl: str) -> None:
    cfg = make_cfg(d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, qk_norm=qk_norm,
                   norm="rmsnorm", attn_impl=impl, pos_encoding="rope")
    torch.manual_seed(0)
    decoder = perturb_(Decoder(cfg)).eval()
    attention = decoder.blocks[0].self_attn
    assert attention.qkv_proj.weight.shape == ((n_heads + 2 * n_kv_heads) * head_dim, d_model)
    assert attention.out_proj.weight.shape == (d_model, n_heads * head_dim)
    assert isinstance(attention.q_norm, nn.Identity) != qk_norm
    if qk_norm:
        assert attention.q_norm.weight.shape == attention.k_norm.weight.shape == (head_dim,)
    x = torch.randn(2, 7, d_model, generator=torch.Generator().manual_seed(1))
    rope = build_pos_encoding(cfg, causal=True).rotary(torch.arange(7))
    assert rope is not None and rope[0].shape[-1] == head_dim
    out, _ = attention(x, is_causal=True, rope=rope)
    expected = reference_self_attention(attention, x, rope, n_heads, n_kv_heads, head_dim, cfg.norm_eps)
    torch.testing.assert_close(out, expected, **TOL)


@pytest.mark.parametrize("stack", [Encoder, Decoder])
def test_a_head_width_apart_from_d_model_runs_in_every_stack(stack: type[nn.Module]) -> None:
    cfg = make_cfg(d_model=30, n_heads=4, head_dim=10, n_kv_heads=2, qk_norm=True, pos_encoding="rope")
    out = stack(cfg).eval()(torch.randn(2, 5, 30), key_padding_mask=padding(2, 5))
    assert out.shape == (2, 5, 30) and torch.isfinite(out).all()


def test_translation_with_qk_norm_and_a_head_width_apart_from_d_model() -> None:
    """Cross-attention reads head_dim, groups its keys/values and normalises its queries and keys; the
    norms of every attention get gradients."""
    cfg = make_cfg(d_model=30, n_heads=4, head_dim=10, n_kv_heads=2, qk_norm=True, norm="rmsnorm")
    torch.manual_seed(0)
    model = perturb_(EncoderDecoder(cfg, 40, pad_id=0))
    cross = model.decoder.blocks[0].cross_attn
    assert cross.q_proj.weight.shape == (40, 30) and cross.kv_proj.weight.shape == (40, 30)
    assert cross.out_proj.weight.shape == (30, 40)
    src, tgt = torch.randint(1, 40, (2, 8)), torch.randint(1, 40, (2, 6))
    model(src, tgt).logsumexp(-1).sum().backward()
    norms = {n: p for n, p in model.named_parameters() if n.endswith(("q_norm.weight", "k_norm.weight"))}
    assert len(norms) == 2 * (2 + 2 + 2)  # encoder self, decoder self and decoder cross, 2 layers each
    for name, parameter in norms.items():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name


def test_qk_norm_applies_to_cross_attention_queries_and_keys() -> None:
    """The cross-attention's q_norm and k_norm change its output (they are not built and left unused)."""
    torch.manual_seed(0)
    attention = perturb_(MultiHeadAttention(D_MODEL, N_HEADS, cross=True, qk_norm=nn.RMSNorm)).eval()
    x, memory = torch.randn(2, 3, D_MODEL), torch.randn(2, 5, D_MODEL)
    before, _ = attention(x, memory)
    for norm in (attention.q_norm, attention.k_norm):
        with torch.no_grad():
            norm.weight.mul_(2.0)
        after, _ = attention(x, memory)
        assert not torch.allclose(before, after)
        before = after


def test_qk_norm_uses_the_configured_norm_and_eps() -> None:
    attention = Decoder(make_cfg(qk_norm=True, norm_eps=1e-3)).blocks[0].self_attn
    assert isinstance(attention.q_norm, nn.LayerNorm) and attention.q_norm.eps == 1e-3
    attention = Decoder(make_cfg(qk_norm=True, norm="rmsnorm", norm_eps=1e-3)).blocks[0].self_attn
    assert isinstance(attention.k_norm, nn.RMSNorm) and attention.k_norm.eps == 1e-3


# --------------------------------------------------------------------------------------------
# Biases


@pytest.mark.parametrize(("bias", "qkv_bias", "attn_out_bias", "mlp_bias"),
                         list(itertools.product([True, False], [None, True, False], [None, True, False], [None, False])))
def test_each_bias_flag_governs_its_layers(bias: bool, qkv_bias: bool | None, attn_out_bias: bool | None,
                                           mlp_bias: bool | None) -> None:
    cfg = make_cfg(bias=bias, qkv_bias=qkv_bias, attn_out_bias=attn_out_bias, mlp_bias=mlp_bias)
    expected = {"qkv": bias if qkv_bias is None else qkv_bias, "out": bias if attn_out_bias is None else attn_out_bias,
                "mlp": bias if mlp_bias is None else mlp_bias}
    assert (cfg.qkv_bias, cfg.attn_out_bias, cfg.mlp_bias) == (expected["qkv"], expected["out"], expected["mlp"])
    block = EncoderDecoder(cfg, 20).decoder.blocks[0]
    layers = {"qkv": [block.self_attn.qkv_proj, block.cross_attn.q_proj, block.cross_attn.kv_proj],
              "out": [block.self_attn.out_proj, block.cross_attn.out_proj], "mlp": [block.ffn.fc_in, block.ffn.fc_out]}
    for kind, linears in layers.items():
        for linear in linears:
            assert (linear.bias is not None) == expected[kind], kind
    assert (block.ffn_norm.bias is not None) == bias  # model.bias still governs the norms


# --------------------------------------------------------------------------------------------
# Config: resolved values and bad values


def test_resolved_values_read_as_ints() -> None:
    cfg = make_cfg(n_kv_heads=2, head_dim=16)
    assert (cfg.n_kv_heads, cfg.head_dim) == (2, 16)
    cfg = make_cfg(d_model=30, n_heads=4, head_dim=8)  # d_model need not divide by n_heads with head_dim set
    assert (cfg.n_kv_heads, cfg.head_dim) == (4, 8)


@pytest.mark.parametrize(("overrides", "words"), [
    ({"n_kv_heads": 3}, ["model.n_heads=4 is not divisible by model.n_kv_heads=3", "1, 2, 4"]),
    ({"n_heads": 6, "n_kv_heads": 4}, ["model.n_heads=6 is not divisible by model.n_kv_heads=4", "1, 2, 3, 6"]),
    ({"n_kv_heads": 0}, ["model.n_kv_heads must be a positive integer or null, got 0"]),
    ({"n_kv_heads": -2}, ["model.n_kv_heads must be a positive integer or null, got -2"]),
    ({"n_kv_heads": 2.0}, ["model.n_kv_heads must be a positive integer or null, got 2.0"]),
    ({"n_kv_heads": True}, ["model.n_kv_heads must be a positive integer or null, got True"]),
    ({"head_dim": 0}, ["model.head_dim must be a positive integer or null, got 0"]),
    ({"head_dim": -8}, ["model.head_dim must be a positive integer or null, got -8"]),
    ({"head_dim": "8"}, ["model.head_dim must be a positive integer or null, got '8'"]),
    ({"qk_norm": "yes"}, ["model.qk_norm must be true or false, got 'yes'"]),
    ({"qk_norm": None}, ["model.qk_norm must be true or false, got None"]),
    ({"qkv_bias": "no"}, ["model.qkv_bias must be true, false or null (follow model.bias), got 'no'"]),
    ({"attn_out_bias": 0}, ["model.attn_out_bias must be true, false or null"]),
    ({"mlp_bias": 1}, ["model.mlp_bias must be true, false or null"]),
    ({"head_dim": 7, "pos_encoding": "rope"}, ["needs a head size divisible by 2, got model.head_dim=7: change model.head_dim"]),
    ({"d_model": 28, "n_heads": 4, "pos_encoding": "rope"}, ["got d_model/n_heads=7: change model.d_model or model.n_heads"]),
])
def test_bad_values_are_one_clear_line(overrides: dict[str, object], words: list[str]) -> None:
    with pytest.raises(ConfigError) as excinfo:
        make_cfg(**overrides)
    message = str(excinfo.value)
    assert "\n" not in message
    for word in words:
        assert word in message


def test_the_width_check_still_holds_without_head_dim() -> None:
    with pytest.raises(ConfigError, match="model.d_model=30 is not divisible by model.n_heads=4"):
        make_cfg(d_model=30, n_heads=4)


# --------------------------------------------------------------------------------------------
# architecture=llama: one switch over any size


SIZES = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml") if not p.name.startswith("_"))


@pytest.mark.parametrize("size", SIZES)
def test_the_llama_switch_composes_with_every_size(size: str, tmp_path: Path) -> None:
    cfg = compose_config([f"model={size}", "architecture=llama"], output_dir=tmp_path)
    backbone = check_config(cfg)
    assert (backbone.norm, backbone.activation, backbone.pos_encoding, backbone.norm_first) == ("rmsnorm", "swiglu", "rope", True)
    assert not (backbone.bias or backbone.qkv_bias or backbone.attn_out_bias or backbone.mlp_bias)
    assert 1 < backbone.n_kv_heads < backbone.n_heads and backbone.n_heads % backbone.n_kv_heads == 0
    sized = compose_config([f"model={size}"], output_dir=tmp_path).model  # the size keeps its shape
    assert (backbone.d_model, backbone.n_heads, backbone.n_layers, backbone.d_ff) == (
        sized.d_model, sized.n_heads, sized.n_layers, sized.d_ff)
    assert cfg.task.tie_embeddings is False


def test_the_llama_lm_has_no_bias_and_a_head_of_its_own(tmp_path: Path) -> None:
    cfg = compose_config(["architecture=llama", "model=nano"], output_dir=tmp_path)
    model = CausalLM(check_config(cfg), 30, tie_embeddings=cfg.task.tie_embeddings)
    assert model.head.weight is not model.embed.weight
    assert not [name for name, _ in model.named_parameters() if name.endswith("bias")]
    assert all(not isinstance(m, nn.LayerNorm) for m in model.modules())
    attention = model.decoder.blocks[0].self_attn
    assert attention.qkv_proj.weight.shape == ((4 + 2 * 2) * 16, 64)  # nano: 4 query heads, 2 key/value heads of 16


def test_the_default_architecture_is_gpt_style_and_the_command_line_wins(tmp_path: Path) -> None:
    default = compose_config([], output_dir=tmp_path)
    assert (default.model.norm, default.model.n_kv_heads, default.task.tie_embeddings) == ("layernorm", None, True)
    cfg = compose_config(["architecture=llama", "model.n_kv_heads=1", "task.tie_embeddings=true", "pos_encoding=alibi"],
                         output_dir=tmp_path)
    assert (cfg.model.n_kv_heads, cfg.task.tie_embeddings, cfg.pos_encoding.name) == (1, True, "alibi")
    translation = compose_config(["architecture=llama", "task=translation"], output_dir=tmp_path)
    assert translation.task.tie_embeddings == "all" and translation.model.norm == "rmsnorm"  # only the LM unties
    check_config(translation)


@pytest.mark.parametrize(("overrides", "setting"), [
    ({"n_kv_heads": 2}, "model.n_kv_heads=2"),
    ({"head_dim": 16}, "model.head_dim=16"),
    ({"qk_norm": True}, "model.qk_norm=True"),
    ({"qkv_bias": False}, "model.qkv_bias=False"),
    ({"attn_out_bias": False}, "model.attn_out_bias=False"),
    ({"mlp_bias": False}, "model.mlp_bias=False"),
])
def test_gpt2_export_refuses_the_attention_shapes_it_cannot_hold(overrides: dict[str, object], setting: str) -> None:
    """GPT-2, BERT and ViT (one shared check) have a head per query head of width d_model / n_heads, no QK-norm
    and biases everywhere: anything else is one line, not a checkpoint with wrongly split tensors."""
    from trident.weights.adapters.hf_gpt2 import from_trident

    from_trident(CausalLM(make_cfg(pos_encoding="learned"), 20))  # the defaults export
    with pytest.raises(ConfigError, match=rf"^{setting} has no GPT-2 \(hf export\) equivalent: "):
        from_trident(CausalLM(make_cfg(pos_encoding="learned", **overrides), 20))


def test_a_source_without_the_attention_shape_keys_fixes_their_defaults(tmp_path: Path) -> None:
    """A source that does not state the keys (a trident run from before them, GPT-2, BERT, ViT) has one key/value head
    per query head of width d_model / n_heads, no QK-norm and biases as model.bias: init_from fixes these defaults, so
    architecture=llama's two key/value heads do not outlive the source's architecture."""
    from trident.weights.init_from import settings_fixed_by
    from trident.weights.pretrained import PretrainedWeights

    cfg = compose_config(["architecture=llama"], output_dir=tmp_path)
    source = PretrainedWeights(source="earlier", format="trident", task="lm", model={"norm": "layernorm", "bias": True},
                               pos_encoding="rope", task_options={}, data_options={}, state_dict={}, tokenizer=None)
    fixed = settings_fixed_by(cfg, source, [])
    assert (fixed["model.n_kv_heads"], fixed["model.head_dim"], fixed["model.qk_norm"]) == (None, None, False)
    assert (fixed["model.qkv_bias"], fixed["model.attn_out_bias"], fixed["model.mlp_bias"]) == (None, None, None)
    grouped = PretrainedWeights(**{**vars(source), "model": {**source.model, "n_kv_heads": 2}})
    assert settings_fixed_by(cfg, grouped, [])["model.n_kv_heads"] == 2  # a source that states a key keeps it
