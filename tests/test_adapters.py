"""The adapter registry: every Hugging Face family implements the one interface and is registered once,
for reading (by config.json's model_type) and for export (by the trident network it writes); a format its
files name (timm's ViT) implements FileAdapter and is registered once, for reading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch import nn

from trident.backbone import TransformerConfig
from trident.errors import ConfigError
from trident.weights.adapters.base import Adapter, FileAdapter
from trident.weights.adapters.registry import (
    ADAPTERS,
    FILE_ADAPTERS,
    adapter_for_model_type,
    adapter_for_network,
    file_adapter_for,
)

# FORMAT -> the settings of a network the export writes as that family (the CausalLM families: GPT-2 by its
# learned positions, Llama and its cousins by rope and their switches, llama_style.family_name).
EXPORTED_AS: dict[str, dict[str, object]] = {
    "hf-gpt2": {"pos_encoding": "learned"},
    "hf-bert": {},
    "hf-vit": {},
    "hf-clip": {},
    "hf-llama": {"pos_encoding": "rope"},
    "hf-llama-with-biases": {"pos_encoding": "rope", "bias": True},
    "hf-mistral": {"pos_encoding": "rope", "attention_window": 16},
    "hf-qwen2": {"pos_encoding": "rope", "qkv_bias": True, "attn_out_bias": False},
    "hf-qwen3": {"pos_encoding": "rope", "qk_norm": True},
    "hf-qwen3-with-window-and-biases": {"pos_encoding": "rope", "qk_norm": True, "bias": True, "attention_window": 16},
    "hf-gemma2": {"pos_encoding": "rope", "sandwich_norm": True},
    "hf-gemma3": {"pos_encoding": "rope", "sandwich_norm": True, "qk_norm": True},
    # A declared family is written as itself, whatever its settings suggest (issue 51).
    "hf-mistral-declared": {"pos_encoding": "rope", "family": "mistral"},
    # A MaskedLM is ALBERT where it has ALBERT's switches, else BERT.
    "hf-albert": {"embedding_dim": 16},
    "hf-albert-shared": {"share_layers": True},
    "hf-roberta": {"family": "roberta"},  # declared only: an undeclared MaskedLM is BERT
    "hf-electra": {"family": "electra"},  # declared only (a ReplacedTokenDetector of no family is ELECTRA's too)
    "hf-t5": {"pos_encoding": "relative", "norm": "rmsnorm"},  # an EncoderDecoder
    "hf-mt5": {"pos_encoding": "relative", "norm": "rmsnorm", "family": "mt5"},  # declared only: undeclared, T5
    "hf-bart": {"family": "bart"},  # an EncoderDecoder, declared
}


def test_the_export_finds_every_family() -> None:
    assert {adapter.FORMAT for adapter in ADAPTERS} <= set(EXPORTED_AS)


@pytest.mark.parametrize("adapter", ADAPTERS, ids=lambda adapter: adapter.FORMAT)
def test_each_adapter_implements_the_interface_and_is_read_by_its_model_type(adapter: Adapter) -> None:
    assert isinstance(adapter, Adapter)
    assert adapter_for_model_type(adapter.MODEL_TYPE) is adapter


@pytest.mark.parametrize(("exported_as", "settings"), EXPORTED_AS.items())
def test_the_export_finds_each_family_by_the_network_and_its_settings(exported_as: str, settings: dict[str, object]) -> None:
    adapter = next(adapter for adapter in ADAPTERS if exported_as.startswith(adapter.FORMAT))
    net = adapter.NETWORK.__new__(adapter.NETWORK)  # its class and settings are all the export looks up
    net.cfg = TransformerConfig(d_model=64, n_heads=4, **settings)
    assert adapter_for_network(net) is adapter


def test_one_registration_per_family() -> None:
    for field in ("FORMAT", "MODEL_TYPE"):
        values = [getattr(adapter, field) for adapter in ADAPTERS]
        assert len(set(values)) == len(values), field


def test_a_network_of_no_family_is_one_line_naming_those_written() -> None:
    assert adapter_for_model_type("marian") is None
    with pytest.raises(ConfigError, match=r"^a Linear has no Hugging Face equivalent: the hf export writes CausalLM "
                                          r"\(GPT2LMHeadModel\), MaskedLM \(BertForMaskedLM\), VisionTransformer"):
        adapter_for_network(nn.Linear(1, 1))


@pytest.mark.parametrize("adapter", FILE_ADAPTERS, ids=lambda adapter: adapter.FORMAT)
def test_each_file_adapter_implements_its_interface(adapter: FileAdapter) -> None:
    assert isinstance(adapter, FileAdapter) and not isinstance(adapter, Adapter)
    assert adapter.FORMAT not in {hf.FORMAT for hf in ADAPTERS}


def test_timm_files_are_recognised_by_their_suffix_and_timms_config(tmp_path: Path) -> None:
    """A state-dict file of a timm suffix, or a directory whose config.json names an architecture, is timm's;
    a Hugging Face directory (config.json with a model_type) and other files are not."""
    for name, recognised in [("vit.pth", True), ("vit.safetensors", True), ("vit.onnx", False)]:
        (tmp_path / name).write_bytes(b"")
        assert (file_adapter_for(tmp_path / name) is not None) is recognised, name
    for name, config, recognised in [("timm", {"architecture": "vit_tiny_patch16_224"}, True),
                                     ("hf", {"model_type": "vit"}, False), ("bare", None, False)]:
        (tmp_path / name).mkdir()
        if config is not None:
            (tmp_path / name / "config.json").write_text(json.dumps(config))
        assert (file_adapter_for(tmp_path / name) is not None) is recognised, name
