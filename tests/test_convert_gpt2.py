"""GPT-2 (transformers, random weights) -> trident: the same logits, the same greedy tokens, the
same tokenizer; trident -> GPT-2 and back: the same tensors (issue #24)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.convert_helpers import (
    assert_hf_round_trip,
    assert_left_padded_generation_matches,
    drop_default_settings,
    net_from,
    randomise,
)
from trident.backbone import TransformerConfig
from trident.errors import ConfigError
from trident.models import CausalLM, generate
from trident.weights import read_pretrained
from trident.weights.adapters.hf_export import to_transformers

transformers = pytest.importorskip("transformers")

VOCAB = 61


def save_gpt2(path: Path, defaults_dropped: bool = False, **settings: object) -> torch.nn.Module:
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=24, vocab_size=VOCAB,
                                     bos_token_id=0, eos_token_id=0, **settings)
    model = randomise(transformers.GPT2LMHeadModel(config), seed=0).eval()
    model.save_pretrained(path)
    if defaults_dropped:
        dropped = drop_default_settings(path, transformers.GPT2Config)
        assert {"tie_word_embeddings", "activation_function", "layer_norm_epsilon", "n_inner"} <= dropped
    return model


@pytest.mark.parametrize(("settings", "activation"), [
    ({}, "gelu_tanh"),  # gelu_new is the tanh GELU
    ({"defaults_dropped": True}, "gelu_tanh"),  # tied, gelu_new, eps 1e-5, 4x FFN: the reader's defaults
    ({"tie_word_embeddings": False, "n_inner": 48, "activation_function": "relu", "layer_norm_epsilon": 1e-2}, "relu"),
    ({"activation_function": "gelu", "layer_norm_epsilon": 1e-3}, "gelu"),
    ({"activation_function": "gelu_pytorch_tanh"}, "gelu_tanh"),
])
def test_gpt2_logits_equal_those_of_transformers(tmp_path: Path, settings: dict[str, object], activation: str) -> None:
    reference = save_gpt2(tmp_path, **settings)
    weights = read_pretrained(tmp_path)
    assert (weights.format, weights.task, weights.pos_encoding) == ("hf-gpt2", "lm", "learned")
    assert weights.model["activation"] == activation
    assert weights.model["norm_eps"] == reference.config.layer_norm_epsilon
    assert weights.task_options["tie_embeddings"] is reference.config.tie_word_embeddings
    net = net_from(weights)
    ids = torch.randint(0, VOCAB, (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(net(ids), reference(ids).logits, atol=1e-5, rtol=1e-5)


def test_gpt2_greedy_generation_matches_transformers(tmp_path: Path) -> None:
    reference = save_gpt2(tmp_path)
    net = net_from(read_pretrained(tmp_path))
    prompt = torch.tensor([[5, 17, 3, 42]])
    expected = reference.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0,
                                  attention_mask=torch.ones_like(prompt))
    # top_k=1 keeps only the most likely token: greedy decoding, here through the KV cache.
    with torch.no_grad():
        produced = generate(net, prompt, 12, top_k=1, use_cache=True)
    assert produced.tolist() == expected.tolist()


@pytest.mark.usefixtures("single_thread")  # tiny models: threads cost more than they save
def test_gpt2_left_padded_batch_generates_as_transformers_and_as_each_prompt_alone(tmp_path: Path) -> None:
    """Learned positions counted from each row's first real token: 3 prompts of 9, 3 and 6 tokens, 12 new tokens
    (within the 24 positions)."""
    reference = save_gpt2(tmp_path)
    assert_left_padded_generation_matches(net_from(read_pretrained(tmp_path)), reference, VOCAB, lengths=(9, 3, 6),
                                          new_tokens=12)


def test_gpt2_tokenizer_is_built_from_vocab_and_merges(tmp_path: Path) -> None:
    save_gpt2(tmp_path)
    # A tiny byte-level BPE: "Ġ" is the byte-level space; merges build "lo", "low", "Ġlow".
    vocab = {token: i for i, token in enumerate(["l", "o", "w", "e", "r", "Ġ", "lo", "low", "Ġlow", "er"])}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\nl o\nlo w\nĠ low\ne r\n")
    tokenizer = read_pretrained(tmp_path).tokenizer
    assert tokenizer is not None
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path)  # GPT-2's own reading of the two files
    text = "low lower lowlow"
    assert tokenizer.encode(text).ids == reference(text)["input_ids"]
    assert tokenizer.encode("low lower").tokens == ["low", "Ġlow", "er"]


def trident_lm(**settings: object) -> CausalLM:
    options = {"d_model": 32, "n_heads": 4, "n_layers": 2, "d_ff": 40, "dropout": 0.0, "activation": "gelu_tanh",
               "pos_encoding": "learned", "max_seq_len": 20, "norm_eps": 1e-3}
    tie = bool(settings.pop("tie_embeddings", True))
    net = CausalLM(TransformerConfig(**(options | settings)), VOCAB, tie_embeddings=tie).eval()
    return randomise(net, seed=1)  # type: ignore[return-value]


@pytest.mark.parametrize(("tie", "activation"), [(True, "gelu_tanh"), (False, "gelu"), (True, "relu")])
def test_trident_lm_to_gpt2_and_back_is_exact(tmp_path: Path, tie: bool, activation: str) -> None:
    net = trident_lm(tie_embeddings=tie, activation=activation)
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(2))
    back = assert_hf_round_trip(net, ids, tmp_path)
    assert back.task_options["tie_embeddings"] is tie


@pytest.mark.parametrize(("settings", "named"), [
    ({"pos_encoding": "alibi"}, "pos_encoding=alibi"),  # a rope decoder is Llama's (test_convert_llama_family.py)
    ({"norm_first": False}, "model.norm_first=False"),
    ({"activation": "swiglu"}, "model.activation=swiglu"),
    ({"norm": "rmsnorm"}, "model.norm=rmsnorm"),
])
def test_a_setting_gpt2_lacks_is_named(settings: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=f"^{named} has no GPT-2"):
        to_transformers(trident_lm(**settings))
