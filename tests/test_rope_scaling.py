"""Rope base and long-context scalings (``pos_encoding.options.scaling``) against transformers'
own code: the inverse frequencies, and cos/sin (attention factor included) at positions past the
original context, dynamic NTK's length-following state too; the default (no scaling) bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from trident.backbone import Decoder, pos_encoding_class
from trident.errors import ConfigError

from .backbone_helpers import make_cfg, perturb_

transformers = pytest.importorskip("transformers")
ROPE_INIT_FUNCTIONS = pytest.importorskip("transformers.modeling_rope_utils").ROPE_INIT_FUNCTIONS
LlamaRotaryEmbedding = pytest.importorskip("transformers.models.llama.modeling_llama").LlamaRotaryEmbedding

HEAD_DIM, N_HEADS, BASE = 32, 2, 500000.0
EXACT = {"rtol": 0.0, "atol": 1e-6}

# Non-default parameters of each type; `original_max_position_embeddings` is chosen so that the
# interesting frequencies (llama3's three wavelength bands, yarn's ramp) fall inside a 32-wide head.
SCALINGS: dict[str, dict[str, Any]] = {
    "linear": {"type": "linear", "factor": 2.5},
    "dynamic": {"type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, "beta_fast": 24.0,
             "beta_slow": 2.0},
    "yarn_untruncated": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "beta_fast": 20,
                         "beta_slow": 1.5, "truncate": False},
    "yarn_deepseek_mscale": {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                             "mscale": 1.0, "mscale_all_dim": 0.707},
    "yarn_attention_factor": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                              "attention_factor": 1.25},
    "llama3": {"type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64, "low_freq_factor": 1.5,
               "high_freq_factor": 6.0},
}


def trident_rope(scaling: dict[str, Any] | None, base: float = BASE, max_seq_len: int = 1024):
    cfg = make_cfg(d_model=HEAD_DIM * N_HEADS, n_heads=N_HEADS, pos_encoding="rope", max_seq_len=max_seq_len,
                   pos_encoding_options={"base": base, "scaling": scaling})
    return pos_encoding_class("rope")(cfg, causal=True)


def hf_config(scaling: dict[str, Any]) -> Any:
    """The same rope as transformers states it: ``type`` is ``rope_type``, ``base`` is ``rope_theta``;
    for ``dynamic`` the original length is the config's ``max_position_embeddings``."""
    parameters = {"rope_type" if k == "type" else k: v for k, v in scaling.items()} | {"rope_theta": BASE}
    original = parameters.get("original_max_position_embeddings", 64)
    if scaling["type"] == "dynamic":
        del parameters["original_max_position_embeddings"]
    length = original if scaling["type"] == "dynamic" else int(original * scaling["factor"])
    return transformers.LlamaConfig(hidden_size=HEAD_DIM * N_HEADS, num_attention_heads=N_HEADS, head_dim=HEAD_DIM,
                                    num_key_value_heads=N_HEADS, max_position_embeddings=length,
                                    rope_parameters=parameters)


def past_the_original(scaling: dict[str, Any]) -> torch.Tensor:
    original = scaling.get("original_max_position_embeddings", 64)
    return torch.tensor([0, 1, 5, original - 1, original, original + 1, 2 * original + 7, 5 * original])


@pytest.mark.parametrize("name", SCALINGS)
def test_inverse_frequencies_equal_transformers(name: str) -> None:
    scaling = SCALINGS[name]
    expected, attention_factor = ROPE_INIT_FUNCTIONS[scaling["type"]](hf_config(scaling), None)
    enc = trident_rope(scaling)
    assert torch.equal(enc.inv_freq, expected)  # the same operations in the same order: the same bits
    assert enc.attention_factor == pytest.approx(attention_factor, abs=1e-12)


@pytest.mark.parametrize("name", SCALINGS)
def test_cos_and_sin_equal_transformers_past_the_original_length(name: str) -> None:
    scaling = SCALINGS[name]
    hf = LlamaRotaryEmbedding(hf_config(scaling))
    enc = trident_rope(scaling, max_seq_len=100_000)
    for positions in (past_the_original(scaling), torch.arange(3 * scaling.get("original_max_position_embeddings", 64))):
        cos, sin = hf(torch.zeros(1), positions[None])
        ours = enc.rotary(positions)
        torch.testing.assert_close(ours[0], cos[0], **EXACT)
        torch.testing.assert_close(ours[1], sin[0], **EXACT)


def test_each_scaling_changes_what_it_should() -> None:
    """The cases above exercise every branch: llama3's three wavelength bands, yarn's ramp and its
    attention factor, linear's division, dynamic's growth past the original length only."""
    default = trident_rope(None).inv_freq
    ratio = trident_rope(SCALINGS["llama3"]).inv_freq / default
    assert (ratio == 1).any() and torch.isclose(ratio, torch.tensor(1 / 8)).any()
    assert ((ratio > 1 / 8 + 1e-3) & (ratio < 1 - 1e-3)).any()  # the smoothed middle band
    ratio = trident_rope(SCALINGS["yarn"]).inv_freq / default
    assert ((ratio > 1 / 8 + 1e-3) & (ratio < 1 - 1e-3)).any()
    assert trident_rope(SCALINGS["yarn"]).attention_factor == pytest.approx(0.1 * torch.log(torch.tensor(8.0)).item() + 1)
    torch.testing.assert_close(trident_rope(SCALINGS["linear"]).inv_freq, default / 2.5)
    dynamic = trident_rope(SCALINGS["dynamic"])
    torch.testing.assert_close(dynamic.inv_freq, default)
    dynamic.rotary(torch.arange(200))
    assert (dynamic.inv_freq[1:] < default[1:] * 0.99).all() and dynamic.inv_freq[0] == 1


def test_dynamic_follows_the_length_as_transformers_generate_does() -> None:
    """The calls of a cached generation (a prompt, then one position at a time past the original
    length), then a shorter full pass that is still past it (transformers keeps the longest
    frequencies), then one within the original length (back to the original frequencies)."""
    scaling = SCALINGS["dynamic"]
    hf = LlamaRotaryEmbedding(hf_config(scaling))
    enc = trident_rope(scaling)
    calls = [torch.arange(40)] + [torch.tensor([p]) for p in range(40, 90)]
    calls += [torch.arange(70), torch.arange(20), torch.tensor([20]), torch.arange(66)]
    for positions in calls:
        cos, sin = hf(torch.zeros(1), positions[None])
        ours = enc.rotary(positions)
        torch.testing.assert_close(ours[0], cos[0], **EXACT)
        torch.testing.assert_close(ours[1], sin[0], **EXACT)
        assert torch.equal(enc.inv_freq, hf.inv_freq)  # a grown base computed as transformers does, bit for bit


def test_dynamic_cached_keys_keep_the_angles_they_were_rotated_with() -> None:
    """Within the original length a cached pass equals a full one; past it the full pass rotates
    every key with the grown base, the cache keeps the older angles (transformers' behaviour)."""
    scaling = {"type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8}
    cfg = make_cfg(pos_encoding="rope", pos_encoding_options={"scaling": scaling})
    torch.manual_seed(0)
    decoder = perturb_(Decoder(cfg)).eval()
    x = torch.randn(1, 14, cfg.d_model)
    within = decoder(x[:, :8])  # before the longer calls: a later pass of length 8 would keep their base
    cache = decoder.new_cache(cfg.max_seq_len)
    steps = torch.cat([decoder(x[:, :4], cache=cache)] + [decoder(x[:, t : t + 1], cache=cache) for t in range(4, 14)],
                      dim=1)
    torch.testing.assert_close(steps[:, :8], within, rtol=1e-4, atol=1e-5)
    assert (steps[:, 12] - decoder(x[:, :13])[:, 12]).abs().max() > 1e-3


def test_no_scaling_keeps_the_default_tables_bit_for_bit() -> None:
    """``scaling: null`` (the shipped rope.yaml) is today's rope exactly, at any base."""
    for base in (10000.0, BASE):
        n_freq = HEAD_DIM // 2
        inv_freq = base ** (-torch.arange(n_freq, dtype=torch.float32) / n_freq)
        positions = torch.arange(300)
        angles = positions.float()[:, None] * inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        for enc in (trident_rope(None, base=base), trident_rope(None, base=base)):
            assert torch.equal(enc.inv_freq, inv_freq)
            cos, sin = enc.rotary(positions)
            assert torch.equal(cos, angles.cos()) and torch.equal(sin, angles.sin())
    cfg = make_cfg(d_model=HEAD_DIM * N_HEADS, n_heads=N_HEADS, pos_encoding="rope")  # no options at all
    assert torch.equal(pos_encoding_class("rope")(cfg, causal=True).inv_freq, trident_rope(None, base=10000.0).inv_freq)


def test_a_vit_grid_takes_no_scaling() -> None:
    cfg = make_cfg(pos_encoding="rope", grid=(4, 4), num_prefix_tokens=1,
                   pos_encoding_options={"scaling": SCALINGS["linear"]})
    with pytest.raises(ConfigError, match=r"2-D rope .* takes none: set pos_encoding.options.scaling=null"):
        pos_encoding_class("rope")(cfg, causal=False)


@pytest.mark.parametrize(
    ("scaling", "message"),
    [
        ({"type": "longrope", "factor": 2.0}, r"'longrope' is not a rope scaling: choose one of linear, dynamic, yarn"),
        ({"factor": 2.0}, r"type=None is not a rope scaling"),
        ({"type": "linear", "factor": 2.0, "beta_fast": 3}, r"linear has no key\(s\) \['beta_fast'\]: it takes type, factor$"),
        ({"type": "yarn", "original_max_position_embeddings": 8}, r"needs the key\(s\) \['factor'\]: it takes type, factor, o"),
        ({"type": "dynamic", "factor": 2.0}, r"needs the key\(s\) \['original_max_position_embeddings'\]"),
        ({"type": "linear", "factor": 0.5}, r"factor=0.5 is below 1"),
        ({"type": "linear", "factor": "8"}, r"factor='8' is not a number"),
        ({"type": "dynamic", "factor": 2, "original_max_position_embeddings": 0}, r"is not a positive integer: give"),
        ({"type": "llama3", "factor": 8, "original_max_position_embeddings": None, "low_freq_factor": 1,
          "high_freq_factor": 4}, r"original_max_position_embeddings=None is not a positive integer"),
        ({"type": "llama3", "factor": 8, "original_max_position_embeddings": 64, "low_freq_factor": 4,
          "high_freq_factor": 1}, r"0 < low_freq_factor < high_freq_factor, got 4 and 1"),
        ({"type": "llama3", "factor": 8, "original_max_position_embeddings": 64, "low_freq_factor": 0,
          "high_freq_factor": 4}, r"0 < low_freq_factor < high_freq_factor, got 0 and 4"),  # a wavelength L / 0
        ({"type": "yarn", "factor": 8, "original_max_position_embeddings": 64, "beta_fast": 1, "beta_slow": 2},
         r"beta_fast >= beta_slow"),
        ({"type": "yarn", "factor": 8, "original_max_position_embeddings": 64, "truncate": 1}, r"not true or false"),
        ({"type": "yarn", "factor": 8, "original_max_position_embeddings": 64, "attention_factor": -1.0},
         r"attention_factor=-1.0 is negative"),
        ("linear", r"is not a mapping"),
    ],
)
def test_bad_scalings_are_one_line(scaling: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as error:
        trident_rope(scaling)
    assert "\n" not in str(error.value) and ": " in str(error.value), "one line: the problem, then the fix"


def test_optional_yarn_keys_set_to_null_read_as_their_defaults() -> None:
    """transformers reads a null ``beta_fast`` (etc.) as its default; so does trident."""
    spelled = {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096}
    nulls = spelled | {"beta_fast": None, "beta_slow": None, "attention_factor": None, "mscale": None}
    torch.testing.assert_close(trident_rope(nulls).inv_freq, trident_rope(spelled).inv_freq, rtol=0, atol=0)


def test_dynamic_rotates_each_packed_document_as_transformers_does_it_alone() -> None:
    """Conversations packed into one row (data=chat, positions restart per document) get the logits transformers
    gives each alone: dynamic NTK follows the document's length (6: the original frequencies; 12 and 20: grown
    past the original 8), never the row's 40, which would grow every document's base."""
    from tests.convert_helpers import randomise
    from trident.backbone import TransformerConfig
    from trident.models import CausalLM
    from trident.weights.adapters.hf_export import to_transformers

    scaling = {"type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 8}
    cfg = TransformerConfig(d_model=32, n_heads=2, n_layers=2, d_ff=48, dropout=0.0, activation="swiglu", norm="rmsnorm",
                            bias=False, pos_encoding="rope", max_seq_len=64,
                            pos_encoding_options={"base": 10000.0, "scaling": scaling})
    net = randomise(CausalLM(cfg, 50), seed=3).eval()
    reference = to_transformers(net)
    lengths = {0: 12, 1: 6, 2: 20}  # document id -> its tokens, in row order; then 2 tokens of padding (-1)
    documents = torch.cat([torch.full((n,), doc) for doc, n in lengths.items()] + [torch.full((2,), -1)])[None]  # (1, 40)
    row = torch.randint(0, 50, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        packed = net(row, documents=documents)  # (1, 40, 50)
        # Alone, shortest first: transformers' length-following state then starts each as a fresh model would.
        for doc in sorted(lengths, key=lengths.get):  # type: ignore[arg-type]
            own = documents[0] == doc
            torch.testing.assert_close(packed[0, own], reference(row[:, own]).logits[0], rtol=1e-4, atol=1e-5)
