"""Llama, Mistral, Qwen2 and Qwen3 (transformers, random weights) -> trident: the same logits, the same
greedy tokens through the KV cache; trident -> the family and back: the same tensors (issue #40)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.convert_helpers import (
    assert_hf_round_trip,
    assert_left_padded_generation_matches,
    assert_padded_logits_match,
    drop_default_settings,
    net_from,
    randomise,
)
from trident.backbone import TransformerConfig
from trident.errors import ConfigError, DataError
from trident.models import CausalLM, generate
from trident.weights import read_pretrained
from trident.weights.adapters.hf_export import to_transformers
from trident.weights.init_from import ATTENTION_SHAPE_SETTINGS

transformers = pytest.importorskip("transformers")

VOCAB = 150
# family -> the transformers config and model classes, and what its tiny config needs besides the sizes.
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
}
# (family, transformers settings, trident settings read): the settings the backbone expresses today.
READ_CASES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("llama", {}, {}),
    # Untied, silu, rms_norm_eps 1e-6, rope theta 10000, no biases: the reader's defaults, as older Hub files leave them.
    ("llama", {"defaults_dropped": True, "rms_norm_eps": 1e-6}, {"norm_eps": 1e-6, "bias": False}),
    ("llama", {"tie_word_embeddings": True, "rms_norm_eps": 1e-2, "rope_parameters": {"rope_type": "default",
                                                                                      "rope_theta": 500000.0}}, {}),
    ("llama", {"attention_bias": True, "mlp_bias": True}, {"bias": True}),  # biases on every projection
    ("mistral", {}, {}),
    ("mistral", {"sliding_window": 128}, {}),  # a window as long as the context: none
    # The backbone switches of issue 40 (model.n_kv_heads, head_dim, qk_norm, qkv_bias..., attention_window, rope scaling).
    ("llama", {"num_key_value_heads": 1}, {"n_kv_heads": 1}),  # multi-query
    ("llama", {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8}, {"n_kv_heads": 2}),  # 4 per kv head
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}, {}),
    ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 500000.0, "factor": 4.0}}, {}),
    # Dynamic NTK from max_position_embeddings=16 on: the 17 tokens and the 69 generated grow the base step by step.
    ("llama", {"max_position_embeddings": 16, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 500000.0,
                                                                  "factor": 8.0}}, {}),
    # YaRN's factor null: max_position_embeddings / original_max_position_embeddings (4), as transformers reads it.
    ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": None,
                                   "original_max_position_embeddings": 32}}, {}),
    ("llama", {"attention_bias": True}, {"qkv_bias": True, "attn_out_bias": True}),
    ("mistral", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0,
                                     "original_max_position_embeddings": 32}}, {}),
    ("mistral", {"sliding_window": 16, "num_key_value_heads": 2}, {"attention_window": 16, "n_kv_heads": 2}),  # shorter than the text
    ("qwen2", {}, {"qkv_bias": True}),  # biases on q, k, v, none on o
    ("qwen2", {"num_key_value_heads": 2, "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0},
     {"attention_window": 16, "n_kv_heads": 2, "qkv_bias": True}),
    ("qwen3", {"head_dim": 32, "num_key_value_heads": 2}, {"head_dim": 32, "n_kv_heads": 2, "qk_norm": True}),
    ("qwen3", {"attention_bias": True, "num_key_value_heads": 1}, {"qkv_bias": True, "attn_out_bias": True, "n_kv_heads": 1, "qk_norm": True}),
    # Qwen's long-context configs: YaRN over a large base, here with grouped-query attention (and Qwen3's QK-norm).
    ("qwen2", {"num_key_value_heads": 2, "rope_parameters": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0,
                                                             "original_max_position_embeddings": 32}},
     {"n_kv_heads": 2, "qkv_bias": True}),
    ("qwen3", {"head_dim": 32, "num_key_value_heads": 2,
               "rope_parameters": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 32}},
     {"head_dim": 32, "n_kv_heads": 2, "qk_norm": True}),
    # Settings a config.json leaves out ("drop", as older or hand-written files do) read as transformers' config class
    # defaults them: Qwen's max_window_layers 28 (these 2 layers: no window), Mistral's 8 key/value heads, Qwen3's
    # head_dim 128, Llama's key/value heads one per query head.
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "drop": ("max_window_layers", "layer_types")},
     {"qkv_bias": True}),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 16, "drop": ("max_window_layers", "layer_types")}, {}),
    ("mistral", {"num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 4,
                 "drop": ("num_key_value_heads", "head_dim")}, {"n_kv_heads": 8, "head_dim": 4}),
    ("qwen3", {"head_dim": 128, "drop": ("head_dim",)}, {"head_dim": 128}),
    ("llama", {"drop": ("num_key_value_heads", "head_dim")}, {"n_kv_heads": 4, "head_dim": 16}),
]
# (family, trident settings) of trident models exported and read back.
WRITE_CASES: list[tuple[str, dict[str, Any]]] = [
    ("llama", {}),
    ("llama", {"tie_embeddings": True, "norm_eps": 1e-3, "pos_encoding_options": {"base": 500000.0}}),
    ("llama", {"bias": True}),  # attention_bias and mlp_bias
    # The backbone switches of issue 40.
    ("llama", {"n_kv_heads": 1}),
    ("llama", {"n_heads": 8, "n_kv_heads": 2}),
    ("llama", {"qkv_bias": True, "attn_out_bias": True}),  # attention_bias without mlp_bias
    ("llama", {"pos_encoding_options": {"base": 500000.0, "scaling": {
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}}),
    ("mistral", {"attention_window": 16, "n_kv_heads": 2}),
    ("qwen2", {"qkv_bias": True, "attn_out_bias": False, "n_kv_heads": 2}),
    # A window in the second layer only: Qwen2's max_window_layers=1 (issue 51).
    ("qwen2", {"qkv_bias": True, "attn_out_bias": False, "layers": [None, {"attention_window": 16}]}),
    ("qwen3", {"qk_norm": True, "head_dim": 32, "n_kv_heads": 2}),
    ("qwen3", {"qk_norm": True, "bias": True, "mlp_bias": False, "attention_window": 16}),
    # Dynamic NTK: transformers' original length is max_position_embeddings (24), the context 24 x 4 = data.max_seq_len.
    ("llama", {"pos_encoding_options": {"base": 500000.0, "scaling": {
        "type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 24}}}),
    # A window longer than dynamic's original length (max_position_embeddings), shorter than the context (96).
    ("mistral", {"attention_window": 32, "pos_encoding_options": {"base": 10000.0, "scaling": {
        "type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 24}}}),
    ("mistral", {"attention_window": 16, "pos_encoding_options": {"base": 10000.0, "scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 24, "beta_fast": 16.0}}}),
]


def hf_model(family: str, path: Path, defaults_dropped: bool = False, drop: tuple[str, ...] = (),
             **settings: Any) -> torch.nn.Module:
    """A random-initialised model of ``family`` (width 64, 2 layers, 4 heads of 16), every parameter drawn
    anew (norm gains and biases too), saved in ``path`` (``defaults_dropped``: its config.json without the
    settings at their default; ``drop``: without these settings, whatever their value)."""
    config_class, model_class, needs = FAMILIES[family]
    sizes = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16, "max_position_embeddings": 128,
             "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": None, "pad_token_id": 0}
    config = getattr(transformers, config_class)(**(sizes | needs | settings))
    model = randomise(getattr(transformers, model_class)(config), seed=0).eval()
    model.save_pretrained(path)
    if defaults_dropped:
        dropped = drop_default_settings(path, type(config))
        assert {"tie_word_embeddings", "hidden_act", "rms_norm_eps", "rope_parameters", "attention_bias"} <= dropped
    if drop:
        written = json.loads((path / "config.json").read_text())
        assert set(drop) <= written.keys()
        (path / "config.json").write_text(json.dumps({key: value for key, value in written.items() if key not in drop}))
    return model


def trident_lm(settings: dict[str, Any]) -> CausalLM:
    options = {"d_model": 64, "n_heads": 4, "n_layers": 2, "d_ff": 96, "dropout": 0.0, "activation": "swiglu",
               "norm": "rmsnorm", "bias": False, "pos_encoding": "rope", "pos_encoding_options": {"base": 10000.0},
               "max_seq_len": 96, "norm_eps": 1e-5}
    settings = dict(settings)
    tie = bool(settings.pop("tie_embeddings", False))
    net = CausalLM(TransformerConfig(**(options | settings)), VOCAB, tie_embeddings=tie).eval()
    return randomise(net, seed=1)  # type: ignore[return-value]


def case_id(case: Any) -> str:
    return ",".join(f"{k}={v}" for k, v in case.items()) if isinstance(case, dict) else str(case)


@pytest.mark.parametrize(("family", "settings", "read"), READ_CASES, ids=case_id)
def test_logits_equal_those_of_transformers_with_padding(tmp_path: Path, family: str, settings: dict[str, Any],
                                                          read: dict[str, Any]) -> None:
    reference = hf_model(family, tmp_path, **settings)
    weights = read_pretrained(tmp_path)
    assert (weights.format, weights.task, weights.pos_encoding) == (f"hf-{family}", "lm", "rope")
    assert {key: weights.model[key] for key in read} == read
    assert weights.model["norm_eps"] == reference.config.rms_norm_eps
    assert weights.pos_encoding_options["base"] == reference.config.rope_parameters["rope_theta"]
    assert weights.task_options["tie_embeddings"] is reference.config.tie_word_embeddings
    net = net_from(weights)
    assert_padded_logits_match(net, reference, VOCAB)


def test_sharded_pickled_weights_are_read(tmp_path: Path) -> None:
    """pytorch_model.bin.index.json and its .bin shards (transformers 4's save_pretrained(safe_serialization=False)
    above max_shard_size; written here by hand, as transformers 5 writes safetensors only): transformers' logits."""
    from safetensors.torch import load_file

    reference = hf_model("llama", tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors").unlink()
    names = sorted(state)
    shards = {f"pytorch_model-0000{i + 1}-of-00002.bin": names[i::2] for i in range(2)}
    for shard, keys in shards.items():
        torch.save({key: state[key] for key in keys}, tmp_path / shard)
    index = {"metadata": {}, "weight_map": {key: shard for shard, keys in shards.items() for key in keys}}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    net = net_from(read_pretrained(tmp_path))
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(net(ids), reference(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_reader_default_is_that_of_the_transformers_config_class(family: str) -> None:
    """A setting config.json leaves out reads as transformers' config class defaults it (its dataclass field; the
    rope base its default_theta): the reader's defaults are those, key by key."""
    import dataclasses

    from trident.weights.adapters.llama_style import SHARED_DEFAULTS
    from trident.weights.adapters.registry import adapter_for_model_type

    adapter = adapter_for_model_type(family)
    config_class = getattr(transformers, FAMILIES[family][0])
    theirs = {field.name: field.default for field in dataclasses.fields(config_class)} | {
        "rope_theta": config_class.default_theta}
    read = SHARED_DEFAULTS | adapter.defaults  # type: ignore[union-attr]
    read_keys = read.keys() | {"max_position_embeddings", "sliding_window", "use_sliding_window", "max_window_layers"}
    assert {key: read.get(key) for key in read_keys & theirs.keys()} == {key: theirs[key] for key in read_keys & theirs.keys()}


@pytest.mark.parametrize(("family", "settings", "read"), READ_CASES, ids=case_id)
def test_greedy_generation_of_64_tokens_matches_transformers(tmp_path: Path, family: str, settings: dict[str, Any],
                                                              read: dict[str, Any]) -> None:
    reference = hf_model(family, tmp_path, **settings)
    net = net_from(read_pretrained(tmp_path))
    prompt = torch.tensor([[5, 17, 3, 42, 99]])
    expected = reference.generate(prompt, max_new_tokens=64, do_sample=False, attention_mask=torch.ones_like(prompt))
    # top_k=1 keeps only the most likely token: greedy decoding, here through the KV cache.
    with torch.no_grad():
        produced = generate(net, prompt, 64, top_k=1, use_cache=True)
    assert produced.tolist() == expected.tolist()


@pytest.mark.usefixtures("single_thread")  # tiny models: threads cost more than they save
@pytest.mark.parametrize(("family", "settings"), [
    ("llama", {}),
    ("mistral", {"sliding_window": 16, "num_key_value_heads": 2}),  # the window rolls over: 11 + 40 tokens
    ("qwen2", {}),
    ("qwen3", {"head_dim": 32, "num_key_value_heads": 2}),
    # Dynamic NTK past max_position_embeddings=16: the batch's frequencies follow its longest row's positions, as
    # transformers' do, so a shorter row is rotated otherwise than alone (only transformers' tokens are compared).
    ("llama", {"max_position_embeddings": 16, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 500000.0,
                                                                  "factor": 8.0}}),
], ids=case_id)
def test_left_padded_batch_generates_as_transformers_and_as_each_prompt_alone(tmp_path: Path, family: str,
                                                                              settings: dict[str, Any]) -> None:
    """Rope at positions counted from each row's first real token, the padding masked in the cache."""
    reference = hf_model(family, tmp_path, **settings)
    dynamic = settings.get("rope_parameters", {}).get("rope_type") == "dynamic"
    assert_left_padded_generation_matches(net_from(read_pretrained(tmp_path)), reference, VOCAB, lengths=(11, 4, 7),
                                          new_tokens=40, as_alone=not dynamic)


@pytest.mark.parametrize(("family", "settings"), WRITE_CASES, ids=case_id)
def test_trident_lm_to_the_family_and_back_is_exact(tmp_path: Path, family: str, settings: dict[str, Any]) -> None:
    net = trident_lm(settings)
    assert type(to_transformers(net)).__name__ == FAMILIES[family][1], "the settings choose the family"
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(2))
    back = assert_hf_round_trip(net, ids, tmp_path)
    assert back.format == f"hf-{family}"
    assert set(ATTENTION_SHAPE_SETTINGS) <= back.model.keys(), "each stated, resolved: init_from fixes each"
    assert back.model.get("attention_window") == net.cfg.attention_window
    assert back.pos_encoding_options == net.cfg.pos_encoding_options
    assert back.task_options["tie_embeddings"] is bool(settings.get("tie_embeddings", False))
    assert back.data_options["max_seq_len"] == net.cfg.max_seq_len


@pytest.mark.parametrize(("settings", "named"), [
    ({"norm": "layernorm"}, "model.norm=layernorm has no Llama"),
    ({"activation": "gelu"}, "model.activation=gelu has no Llama"),
    ({"embedding_norm": True}, "model.embedding_norm=True has no Llama"),
    # The backbone switches of issue 40: the family the settings name refuses the rest.
    ({"qk_norm": True, "bias": True}, "model.mlp_bias=True has no Qwen3"),
    ({"attention_window": 16, "bias": True}, "model.qkv_bias=True has no Mistral"),
    ({"qkv_bias": True, "attn_out_bias": False, "mlp_bias": True}, "model.mlp_bias=True has no Qwen2"),
    ({"norm_first": False}, "model.norm_first=False has no Llama"),
])
def test_a_setting_the_family_lacks_is_named(settings: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=f"^{named}"):
        to_transformers(trident_lm(settings))


@pytest.mark.parametrize(("family", "settings", "named"), [
    ("llama", {"hidden_act": "gelu"}, "activation 'gelu'"),
    ("llama", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                                   "long_factor": [1.0] * 8, "original_max_position_embeddings": 64}},
     "rope scaling 'longrope'"),
    ("qwen2", {"hidden_act": "relu"}, "activation 'relu'"),
])
def test_a_family_setting_trident_lacks_is_one_line(tmp_path: Path, family: str, settings: dict[str, Any], named: str) -> None:
    hf_model(family, tmp_path, **settings)
    with pytest.raises(DataError, match="which trident cannot reproduce exactly") as caught:
        read_pretrained(tmp_path)
    assert named in str(caught.value) and "\n" not in str(caught.value)


def test_an_older_config_with_rope_theta_and_rope_scaling_is_read(tmp_path: Path) -> None:
    """config.json files written before transformers 5 state rope_theta and rope_scaling (type or rope_type)."""
    hf_model("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["rope_parameters"]
    config |= {"rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 4.0}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    options = read_pretrained(tmp_path).pos_encoding_options
    assert options == {"base": 500000.0, "scaling": {"type": "linear", "factor": 4.0}}


# (rope_parameters config.json states, max_position_embeddings, the scaling trident reads, its data.max_seq_len):
# the lengths and factor transformers fills in where the file leaves them out (modeling_rope_utils).
FILLED_ROPE_CASES: list[tuple[dict[str, Any], int, dict[str, Any], int]] = [
    # dynamic starts growing at max_position_embeddings; the context trident serves is that x factor.
    ({"rope_type": "dynamic", "factor": 4.0}, 16, {"factor": 4.0, "original_max_position_embeddings": 16}, 64),
    # an original length in a dynamic dict is one transformers does not read (it warns, and uses max_position_embeddings)
    ({"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 8}, 16,
     {"factor": 4.0, "original_max_position_embeddings": 16}, 64),
    # yarn and llama3 without an original length: max_position_embeddings.
    ({"rope_type": "yarn", "factor": 4.0}, 128, {"factor": 4.0, "original_max_position_embeddings": 128}, 128),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}, 128,
     {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 128}, 128),
    # yarn's factor null: max_position_embeddings / original.
    ({"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 16, "beta_fast": 8.0}, 128,
     {"factor": 8.0, "original_max_position_embeddings": 16, "beta_fast": 8.0}, 128),
]


@pytest.mark.parametrize(("parameters", "context", "scaling", "max_seq_len"), FILLED_ROPE_CASES,
                         ids=[case_id(case[0]) for case in FILLED_ROPE_CASES])
def test_a_rope_scaling_reads_what_transformers_fills_in(tmp_path: Path, parameters: dict[str, Any], context: int,
                                                        scaling: dict[str, Any], max_seq_len: int) -> None:
    """config.json states the rope_parameters exactly as given (the lengths transformers would add left out); the
    model transformers reads from that file and trident's have the same logits, over 40 tokens (past a dynamic
    scaling's original length)."""
    hf_model("llama", tmp_path, max_position_embeddings=context)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = {"rope_theta": 500000.0, **parameters}
    (tmp_path / "config.json").write_text(json.dumps(config))
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    weights = read_pretrained(tmp_path)
    assert weights.pos_encoding_options == {"base": 500000.0, "scaling": {"type": parameters["rope_type"], **scaling}}
    assert weights.data_options["max_seq_len"] == max_seq_len
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(net_from(weights)(ids), reference(ids).logits, atol=1e-5, rtol=1e-5)


def test_a_dynamic_scaling_whose_context_is_not_its_original_length_times_factor_exports_its_logits(tmp_path: Path) -> None:
    """transformers' dynamic scaling starts at max_position_embeddings: the export writes the original length there,
    so the logits stay trident's; read back, the context is that length x factor."""
    scaling = {"type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 16}
    net = trident_lm({"pos_encoding_options": {"base": 10000.0, "scaling": scaling}})
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(2))
    hf = to_transformers(net)
    assert hf.config.max_position_embeddings == 16 and "original_max_position_embeddings" not in hf.config.rope_parameters
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, net(ids), atol=1e-5, rtol=1e-5)
    hf.save_pretrained(tmp_path)
    back = read_pretrained(tmp_path)
    assert (back.pos_encoding_options["scaling"], back.data_options["max_seq_len"]) == (scaling, 32)


CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
CORPUS = "".join(f"Line {i}: the quick brown fox jumps over the lazy dog, and then it rests.\n" for i in range(300))


def bpe_tokenizer() -> Any:
    """A byte-level BPE of the corpus with Llama's special tokens, as ``tokenizers`` builds one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator([CORPUS], trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
                                                                show_progress=False))
    return tokenizer


@pytest.mark.usefixtures("single_thread")
def test_init_from_a_llama_directory_fine_tunes_and_exports_with_its_tokenizer_and_chat_template(tmp_path: Path) -> None:
    import trident
    from tests.conftest import compose_config
    from trident.runs.pipeline import train

    tokenizer = bpe_tokenizer()
    hf_dir, corpus = tmp_path / "llama", tmp_path / "corpus.txt"
    corpus.write_text(CORPUS)
    reference = hf_model("llama", hf_dir, vocab_size=tokenizer.get_vocab_size())
    tokenizer.save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}, "chat_template": CHAT_TEMPLATE}))
    run = tmp_path / "run"
    train(compose_config(["logger=none", "test=false", "trainer.max_steps=3", "trainer.val_check_interval=3",
                          "trainer.limit_val_batches=1", "data.block_size=32", "data.batch_size=4", "print_config=false",
                          f"init_from={hf_dir}", "data=text_files", f"data.files=[{corpus}]"], output_dir=run))
    task = trident.load(run)
    assert task.tokenizer.get_vocab() == tokenizer.get_vocab(), "the source's tokenizer, none retrained"
    assert task.tokenizer_settings == {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}
    assert task.net.cfg.pos_encoding == "rope" and task.net.cfg.activation == "swiglu"
    start = reference.model.layers[0].mlp.down_proj.weight
    moved = task.net.decoder.blocks[0].ffn.fc_out.weight
    assert moved.shape == start.shape and not torch.equal(moved, start), "three steps of fine-tuning from the source"
    from trident.commands.export import export_hf

    export_hf(task, tmp_path / "exported")
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "exported")
    messages = [{"role": "user", "content": "the fox"}]
    assert exported.apply_chat_template(messages, tokenize=False) == "<|user|>the fox</s>"
    assert (exported.bos_token, exported.eos_token) == ("<s>", "</s>")
    config = transformers.AutoConfig.from_pretrained(tmp_path / "exported")
    assert (config.architectures, config.bos_token_id, config.eos_token_id) == (
        ["LlamaForCausalLM"], tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>"))
    back = read_pretrained(tmp_path / "exported")
    assert back.tokenizer_settings["chat_template"] == CHAT_TEMPLATE


@pytest.mark.usefixtures("single_thread")
def test_init_from_a_qwen3_directory_fine_tunes_and_trident_export_writes_a_qwen3_with_its_logits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3 with heads of 32 in a width of 64 (head_dim != width / heads), QK-norm, 2 key/value heads for 4 query heads
    and a window of 8: the run takes each setting from the source, fine-tunes, and trident-export --format hf writes a
    Qwen3 that transformers reads with the run's logits."""
    import trident
    from tests.conftest import compose_config
    from tests.entry_points import run_in_process
    from trident.runs.pipeline import train

    tokenizer = bpe_tokenizer()
    hf_dir, corpus, run = tmp_path / "qwen3", tmp_path / "corpus.txt", tmp_path / "run"
    corpus.write_text(CORPUS)
    reference = hf_model("qwen3", hf_dir, vocab_size=tokenizer.get_vocab_size(), head_dim=32, num_key_value_heads=2,
                         use_sliding_window=True, sliding_window=8, max_window_layers=0)
    tokenizer.save(str(hf_dir / "tokenizer.json"))
    train(compose_config(["logger=none", "test=false", "trainer.max_steps=3", "trainer.val_check_interval=3",
                          "trainer.limit_val_batches=1", "data.block_size=32", "data.batch_size=4", "print_config=false",
                          f"init_from={hf_dir}", "data=text_files", f"data.files=[{corpus}]"], output_dir=run))
    net = trident.load(run).net
    shape = {key: getattr(net.cfg, key) for key in ("head_dim", "n_kv_heads", "qk_norm", "attention_window", "qkv_bias")}
    assert shape == {"head_dim": 32, "n_kv_heads": 2, "qk_norm": True, "attention_window": 8, "qkv_bias": False}
    start = reference.model.layers[0].self_attn.q_norm.weight
    moved = net.decoder.blocks[0].self_attn.q_norm.weight
    assert moved.shape == start.shape and not torch.equal(moved, start), "three steps of fine-tuning from the source"
    exported = run_in_process("trident.commands.export", [str(run), "--format", "hf", "--out", str(tmp_path / "hf")],
                              tmp_path, monkeypatch)
    assert exported.returncode == 0, exported.stderr
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    ids = torch.randint(0, tokenizer.get_vocab_size(), (2, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, net(ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("family", "settings", "fixed"), [
    ("llama", {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8},
     {"n_kv_heads": 2, "head_dim": 8, "qk_norm": False, "qkv_bias": False, "attn_out_bias": False, "mlp_bias": False}),
    ("mistral", {"sliding_window": 16}, {"attention_window": 16, "n_kv_heads": 4, "head_dim": 16}),
    ("qwen2", {}, {"qkv_bias": True, "attn_out_bias": False, "mlp_bias": False, "bias": False}),
])
def test_init_from_fixes_the_attention_settings_a_family_directory_states(tmp_path: Path, family: str,
                                                                            settings: dict[str, Any], fixed: dict[str, Any]) -> None:
    """The run takes each from the source (architecture=llama's two key/value heads do not outlive a Llama of 4)."""
    from tests.conftest import compose_config
    from trident.weights.init_from import read_init_source, settings_fixed_by

    hf_model(family, tmp_path / family, **settings)
    cfg = compose_config(["architecture=llama", f"init_from={tmp_path / family}"], output_dir=tmp_path / "run")
    wanted = settings_fixed_by(cfg, read_init_source(str(tmp_path / family)), [])
    assert {key: wanted[f"model.{key}"] for key in fixed} == fixed


def test_a_contradicted_setting_a_source_leaves_null_is_named_by_the_value_it_stands_for(tmp_path: Path) -> None:
    """A GPT-2 states no key/value heads: one per query head, which the error line names (not its null)."""
    from tests.conftest import compose_config
    from trident.weights.init_from import settings_fixed_by

    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_head=4, n_layer=1, vocab_size=VOCAB)).save_pretrained(tmp_path)
    cfg = compose_config(["model.n_kv_heads=2"], output_dir=tmp_path / "run")
    with pytest.raises(ConfigError, match=r"^model.n_kv_heads=2 contradicts init_from=\S+, which has model.n_kv_heads=4: drop"):
        settings_fixed_by(cfg, read_pretrained(tmp_path), ["model.n_kv_heads"])


def test_a_source_of_the_other_kind_is_one_line_naming_every_family_the_task_reads(tmp_path: Path) -> None:
    """The line names the registry's families: the Llama family among the text models, ViT and timm among the images."""
    from trident.tasks.registry import TASKS
    from trident.weights.init_from import check_source_task

    hf_model("llama", tmp_path / "llama")
    transformers.ViTModel(transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=32,
                                                 image_size=8, patch_size=4)).save_pretrained(tmp_path / "vit")
    with pytest.raises(ConfigError, match=r"pass the weights of an image model \(a trident vit run, a Hugging Face directory "
                                          r"of model_type vit, a timm ViT state-dict file .*\), or train from scratch$"):
        check_source_task(TASKS["vit"], read_pretrained(tmp_path / "llama"))
    with pytest.raises(ConfigError, match=r"pass the weights of a text model \(a trident lm, mlm, classify or electra run, a "
                                          r"Hugging Face directory of model_type gpt2, bert, llama, mistral, qwen2, qwen3, "
                                          r"gemma2, gemma3_text, albert, roberta, electra, bart, t5, mt5\), or"):
        check_source_task(TASKS["lm"], read_pretrained(tmp_path / "vit"))


def test_a_source_that_states_the_value_a_null_stands_for_agrees_with_the_null(tmp_path: Path) -> None:
    """A trident run saves n_kv_heads=4 and head_dim=16 resolved, biases as bools; model=tiny leaves them null."""
    from tests.conftest import compose_config
    from trident.weights.init_from import settings_fixed_by
    from trident.weights.pretrained import PretrainedWeights

    cfg = compose_config(["model=tiny"], output_dir=tmp_path)
    sizes = {key: cfg.model[key] for key in ("d_model", "n_heads", "bias")}
    resolved = TransformerConfig(**sizes)
    model = sizes | {key: getattr(resolved, key) for key in ATTENTION_SHAPE_SETTINGS}
    source = PretrainedWeights(source="run", format="trident", task="lm", model=model, pos_encoding=cfg.pos_encoding.name,
                               pos_encoding_options=dict(cfg.pos_encoding.options), task_options={}, data_options={},
                               state_dict={}, tokenizer=None)
    assert settings_fixed_by(cfg, source, ["model"])["model.n_kv_heads"] == cfg.model.n_heads
    with pytest.raises(ConfigError, match=r"^model.n_kv_heads=None contradicts init_from=run, which has model.n_kv_heads=2"):
        settings_fixed_by(cfg, PretrainedWeights(**{**vars(source), "model": model | {"n_kv_heads": 2}}), ["model"])
