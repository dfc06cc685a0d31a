"""Gemma 2, Gemma 3 (text) and Qwen2 with max_window_layers below the layer count (transformers, every parameter random)
-> trident: the same logits with right and left padding, the same greedy tokens through the KV cache past the sliding
window; -> back to transformers: the same tensors and config (issue 51, item 3)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.convert_helpers import (
    assert_hf_round_trip,
    assert_left_padded_generation_matches,
    assert_padded_logits_match,
    net_from,
    randomise,
)
from trident.backbone import TransformerConfig
from trident.errors import ConfigError
from trident.models import CausalLM, generate
from trident.weights import read_pretrained
from trident.weights.adapters.hf_export import to_transformers

transformers = pytest.importorskip("transformers")
# Tiny models: intra-op threads cost more than they save on a shared CPU (the generation tests most).
pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB, WINDOW = 150, 8
LOCAL, GLOBAL = "sliding_attention", "full_attention"
SIZES = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
         "bos_token_id": 1, "eos_token_id": None, "pad_token_id": 0}
# name -> (config class, model class, settings, the model settings trident reads). Scores scaled by 1/sqrt(24), not
# 1/sqrt(16); soft-capping at 3 (scores) and 5 (logits), small enough to bend random weights' values.
CASES: dict[str, tuple[str, str, dict[str, Any], dict[str, Any]]] = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               {"sliding_window": WINDOW, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 3.0,
                "final_logit_softcapping": 5.0},
               {"attn_scale_dim": 24, "attn_softcap": 3.0, "final_logit_softcap": 5.0, "sandwich_norm": True,
                "layers": [{"attention_window": WINDOW}, None, {"attention_window": WINDOW}, None]}),
    "gemma2-untied-no-caps": ("Gemma2Config", "Gemma2ForCausalLM",
                              {"sliding_window": WINDOW, "query_pre_attn_scalar": 16, "attn_logit_softcapping": None,
                               "final_logit_softcapping": None, "tie_word_embeddings": False,
                               "layer_types": [GLOBAL, LOCAL, LOCAL, GLOBAL]},
                              {"attn_scale_dim": None, "attn_softcap": None, "final_logit_softcap": None}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               {"sliding_window": WINDOW, "query_pre_attn_scalar": 24, "final_logit_softcapping": 5.0,
                "layer_types": [LOCAL, LOCAL, GLOBAL, LOCAL],
                "rope_parameters": {GLOBAL: {"rope_type": "default", "rope_theta": 1_000_000.0},
                                    LOCAL: {"rope_type": "default", "rope_theta": 10_000.0}}},
               {"qk_norm": True, "attn_softcap": None, "final_logit_softcap": 5.0,
                "layers": [{"attention_window": WINDOW, "pos_encoding_options": {"base": 10_000.0}}] * 2
                + [None, {"attention_window": WINDOW, "pos_encoding_options": {"base": 10_000.0}}]}),
    # Gemma 3 4B's global rope: linear scaling by 8 over base 1,000,000.
    "gemma3-linear-global-rope": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                                  {"sliding_window": WINDOW, "layer_types": [LOCAL, GLOBAL, LOCAL, GLOBAL],
                                   "rope_parameters": {GLOBAL: {"rope_type": "linear", "rope_theta": 1_000_000.0,
                                                                "factor": 8.0},
                                                       LOCAL: {"rope_type": "default", "rope_theta": 10_000.0}}},
                                  {"qk_norm": True}),
    # The first layer global, the other three sliding (transformers' layer_types from max_window_layers=1).
    "qwen2-max-window-layers": ("Qwen2Config", "Qwen2ForCausalLM",
                                {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1,
                                 "layer_types": None},
                                {"qkv_bias": True, "layers": [None] + [{"attention_window": WINDOW}] * 3}),
}


def hf_model(case: str, path: Path) -> torch.nn.Module:
    """The case's transformers model, every parameter drawn anew (Gemma's norm offsets too), saved in ``path``."""
    config_class, model_class, settings, _ = CASES[case]
    config = getattr(transformers, config_class)(**(SIZES | settings))
    model = randomise(getattr(transformers, model_class)(config), seed=0).eval()
    model.save_pretrained(path)
    return model


Source = Callable[[str], tuple[torch.nn.Module, Path]]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Source:
    """case -> its transformers model and the directory it is saved in, built once for the module's tests (read only)."""
    built: dict[str, tuple[torch.nn.Module, Path]] = {}

    def get(case: str) -> tuple[torch.nn.Module, Path]:
        if case not in built:
            path = tmp_path_factory.mktemp(case)
            built[case] = hf_model(case, path), path
        return built[case]

    return get


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_those_of_transformers_with_right_and_left_padding(source: Source, case: str) -> None:
    reference, path = source(case)
    weights = read_pretrained(path)
    read = CASES[case][3]
    assert {key: weights.model.get(key) for key in read} == read
    net = net_from(weights)
    assert_padded_logits_match(net, reference, VOCAB)  # texts of 17, 11 and 5 tokens: longer than the window of 8


# The untied and linear-rope cases compute through the cache as gemma2 and gemma3 do (their logits are checked above).
@pytest.mark.parametrize("case", ["gemma2", "gemma3", "qwen2-max-window-layers"])
def test_greedy_generation_past_the_window_matches_transformers(source: Source, case: str) -> None:
    """Two prompts of 11 tokens, longer than the window of 8 (the sliding layers' caches take more positions than they
    keep), then 64 tokens one by one (the issue's check), their caches rolling over many times: transformers' greedy
    tokens."""
    reference, path = source(case)
    net = net_from(read_pretrained(path))
    prompt = torch.randint(2, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
    expected = reference.generate(prompt, max_new_tokens=64, do_sample=False, attention_mask=torch.ones_like(prompt))
    with torch.no_grad():
        produced = generate(net, prompt, 64, top_k=1, use_cache=True)
    assert produced.tolist() == expected.tolist()


@pytest.mark.parametrize("case", ["gemma2", "gemma3"])
def test_left_padded_batch_generates_past_the_window_as_transformers_and_as_each_prompt_alone(source: Source,
                                                                                             case: str) -> None:
    """Sliding and global layers over a left-padded batch (prompts of 11, 3 and 6 tokens around the window of 8):
    the sliding caches roll over the padding and past it."""
    reference, path = source(case)
    assert_left_padded_generation_matches(net_from(read_pretrained(path)), reference, VOCAB, lengths=(11, 3, 6),
                                          new_tokens=24)


# The settings of config.json that say what the model computes (the rest: token ids, dtype, version...).
ARCHITECTURE_KEYS = ("model_type", "architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
                     "tie_word_embeddings", "attention_bias", "hidden_activation", "hidden_act", "query_pre_attn_scalar",
                     "sliding_window", "layer_types", "use_sliding_window", "max_window_layers", "final_logit_softcapping",
                     "attn_logit_softcapping", "rope_parameters", "vocab_size")


@pytest.mark.parametrize("case", CASES)
def test_a_directory_read_and_exported_is_the_same_tensors_and_config(source: Source, tmp_path: Path, case: str) -> None:
    _, path = source(case)
    weights = read_pretrained(path)
    assert weights.model["family"] == case.split("-")[0]
    net = net_from(weights)
    to_transformers(net).save_pretrained(tmp_path / "exported")
    theirs_config, exported = (json.loads((directory / "config.json").read_text()) for directory in (path, tmp_path / "exported"))
    assert {key: exported.get(key) for key in ARCHITECTURE_KEYS} == {key: theirs_config.get(key) for key in ARCHITECTURE_KEYS}
    theirs, ours = (load_file(str(directory / "model.safetensors")) for directory in (path, tmp_path / "exported"))
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)


def gemma_lm(family: str, **settings: Any) -> CausalLM:
    options = {"d_model": 64, "n_heads": 4, "n_kv_heads": 2, "n_layers": 4, "d_ff": 96, "dropout": 0.0,
               "activation": "geglu_tanh", "norm": "rmsnorm_offset", "sandwich_norm": True, "bias": False,
               "pos_encoding": "rope", "pos_encoding_options": {"base": 10000.0}, "max_seq_len": 96, "norm_eps": 1e-6,
               "family": family, "qk_norm": family == "gemma3"}
    tie = settings.pop("tie_embeddings", True)
    net = CausalLM(TransformerConfig(**(options | settings)), VOCAB, tie_embeddings=tie, scale_embeddings=True).eval()
    return randomise(net, seed=1)  # type: ignore[return-value]


LOCAL_LAYER = {"attention_window": 16}
WRITE_CASES: list[tuple[str, dict[str, Any]]] = [
    ("gemma2", {"attn_softcap": 20.0, "final_logit_softcap": 10.0, "attn_scale_dim": 32,
                "layers": [LOCAL_LAYER, None, LOCAL_LAYER, None]}),
    ("gemma2", {"tie_embeddings": False}),  # every layer global
    ("gemma3", {"pos_encoding_options": {"base": 1_000_000.0, "scaling": {"type": "linear", "factor": 8.0}},
                "layers": [{**LOCAL_LAYER, "pos_encoding_options": {"base": 10_000.0}}] * 3 + [None]}),
]


@pytest.mark.parametrize(("family", "settings"), WRITE_CASES)
def test_a_declared_gemma_to_transformers_and_back_is_exact(tmp_path: Path, family: str, settings: dict[str, Any]) -> None:
    net = gemma_lm(family, **settings)
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(2))
    back = assert_hf_round_trip(net, ids, tmp_path)
    assert back.format == f"hf-{family}" and back.pos_encoding_options == net.cfg.pos_encoding_options
    assert back.task_options == {"tie_embeddings": net.head.weight is net.embed.weight, "scale_embeddings": True}


def test_a_gemma3_export_states_the_sliding_window_pattern_older_transformers_read() -> None:
    """transformers 4 before layer_types (4.51, the [hf] floor) reads Gemma 3's layers from sliding_window_pattern alone
    (6 where it is absent): the export states the pattern its layer_types follow (tests/test_export_older_transformers.py
    reads it there)."""
    written = to_transformers(gemma_lm("gemma3", **WRITE_CASES[2][1])).config.to_dict()
    every = written["sliding_window_pattern"]
    assert every == 4 and written["layer_types"] == [LOCAL if (i + 1) % every else GLOBAL for i in range(4)]


@pytest.mark.parametrize(("family", "settings", "named"), [
    ("gemma3", {"attn_softcap": 20.0}, r"model.attn_softcap=20.0 has no Gemma 3 \(hf export\) equivalent"),
    ("gemma2", {"sandwich_norm": False}, r"model.sandwich_norm=False has no Gemma 2"),
    ("gemma2", {"layers": [{"attention_window": 8}, {"attention_window": 16}, None, None]}, r"model.layers=.* has no Gemma 2"),
    ("gemma2", {"layers": [{"pos_encoding_options": {"base": 5.0}}, None, None, None]}, r"model.layers=.* has no Gemma 2"),
    ("llama", {}, r"model.norm=rmsnorm_offset has no Llama"),
])
def test_a_setting_the_gemma_family_lacks_is_one_line(family: str, settings: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=f"^{named}"):
        to_transformers(gemma_lm(family, **settings))


@pytest.mark.parametrize(("family", "config_class"), [("gemma2", "Gemma2Config"), ("gemma3", "Gemma3TextConfig")])
def test_every_reader_default_is_that_of_the_transformers_config_class(family: str, config_class: str) -> None:
    """A setting config.json leaves out reads as transformers' config class defaults it (its dataclass field)."""
    import dataclasses

    from trident.weights.adapters.hf_gemma import GEMMA2, GEMMA3, SHARED_DEFAULTS

    adapter = {"gemma2": GEMMA2, "gemma3": GEMMA3}[family]
    theirs = {field.name: field.default for field in dataclasses.fields(getattr(transformers, config_class))}
    read = SHARED_DEFAULTS | adapter.defaults
    if family == "gemma3":  # its rope bases are default_theta's, per layer type
        assert getattr(transformers, config_class).default_theta == {"global": 1_000_000.0, "local": 10_000.0}
        read = {key: value for key, value in read.items() if key != "rope_theta"}
    assert {key: read[key] for key in read.keys() & theirs.keys()} == {key: theirs[key] for key in read.keys() & theirs.keys()}
    assert read.keys() - theirs.keys() <= {"rope_theta"}


@pytest.mark.parametrize("case", ["gemma3", "qwen2-max-window-layers"])
def test_init_from_a_directory_fixes_its_family_and_layers_in_the_run_config(source: Source, tmp_path: Path,
                                                                            case: str) -> None:
    """init_from=<directory>: the composed run config takes the family, its per-layer settings and its switches from the
    source, and the network it builds loads the source's tensors strictly, with transformers' logits."""
    from tests.conftest import compose_config
    from trident.runs.pipeline import check_config
    from trident.weights.init_from import apply_settings, read_init_source, settings_fixed_by

    reference, path = source(case)
    cfg = compose_config([f"init_from={path}", "model=nano", "data.block_size=64"], output_dir=tmp_path / "run")
    read = read_init_source(str(path))
    apply_settings(cfg, settings_fixed_by(cfg, read, []))
    backbone = check_config(cfg)
    assert (backbone.family, backbone.layers) == (case.split("-")[0], CASES[case][3]["layers"])
    net = CausalLM(backbone, VOCAB, tie_embeddings=cfg.task.tie_embeddings, scale_embeddings=cfg.task.scale_embeddings)
    net.load_state_dict(read.state_dict, strict=True)
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(net.eval()(ids), reference(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("kinds", "stated"), [
    ("SSSF", {"sliding_window_pattern": 4}), ("SFSF", {"sliding_window_pattern": 2}), ("SSSS", {"sliding_window_pattern": 5}),
    ("FFFF", {"sliding_window_pattern": 1}), ("FSSF", {}), ("SFFS", {}),
])
def test_the_sliding_window_pattern_names_every_nth_layer_global_counting_from_one(kinds: str, stated: dict) -> None:
    """transformers 4.x makes layer i global when (i + 1) % n == 0: the pattern written must say so (none for
    layer kinds no n gives)."""
    from trident.weights.adapters.hf_gemma import FULL, SLIDING, sliding_window_pattern

    assert sliding_window_pattern([FULL if kind == "F" else SLIDING for kind in kinds]) == stated


def test_a_gemma3_file_without_layer_types_reads_its_sliding_window_pattern_counting_from_one() -> None:
    """Older Gemma 3 files state only sliding_window_pattern n: layer i is global when (i + 1) % n == 0."""
    from transformers import Gemma3TextConfig

    from trident.weights.adapters.hf_gemma import GEMMA3, model_settings

    config = Gemma3TextConfig(**SIZES, sliding_window=WINDOW).to_dict()
    config.pop("layer_types", None)
    config["sliding_window_pattern"] = 2
    settings, _ = model_settings(GEMMA3, config, "gemma3-dir")
    assert [(entry or {}).get("attention_window") for entry in settings["layers"]] == [WINDOW, None, WINDOW, None]
