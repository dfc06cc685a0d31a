"""read_pretrained on what it cannot read: one DataError line naming what the input is not and the
supported architectures; offline, a Hub name fails saying it cannot be downloaded."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from trident.errors import DataError
from trident.weights import read_pretrained

SUPPORTED = ("GPT2LMHeadModel", "BertForMaskedLM", "ViTForImageClassification", "timm ViT")


def message(path: object) -> str:
    with pytest.raises(DataError) as info:
        read_pretrained(path)  # type: ignore[arg-type]
    text = str(info.value)
    assert "\n" not in text
    return text


def test_a_directory_that_is_not_a_model_is_named(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    text = message(tmp_path)
    assert "is not a model directory (no config.json)" in text and all(name in text for name in SUPPORTED)


def test_an_unsupported_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    # (Gemma 2 was the example until trident read it, issue 51.)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "phi3", "architectures": ["Phi3ForCausalLM"]}))
    text = message(tmp_path)
    assert "holds a phi3 (Phi3ForCausalLM), which trident does not convert" in text
    assert all(name in text for name in SUPPORTED)


def test_a_model_directory_without_weights_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 8}))
    assert "holds no weights: expected one of model.safetensors" in message(tmp_path)


def test_weights_that_lack_a_tensor_are_named(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, n_positions=8, vocab_size=11)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["transformer.ln_f.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    assert "lacks 'ln_f.weight' that a gpt2 (GPT2LMHeadModel, GPT2Model) has" in message(tmp_path)


def test_a_config_that_lacks_a_setting_is_named(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, n_positions=8, vocab_size=11)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    settings = json.loads((tmp_path / "config.json").read_text())
    del settings["n_head"]
    (tmp_path / "config.json").write_text(json.dumps(settings))
    assert message(tmp_path) == (f"{tmp_path}/config.json lacks 'n_head' that a gpt2 (GPT2LMHeadModel, GPT2Model) has: "
                                 "save the model again with transformers")


def test_the_supported_formats_are_one_list_hugging_face_then_the_formats_files_name(tmp_path: Path) -> None:
    """The end of every "supported are" line: the Hugging Face architectures of the registry, then each format
    its files name (FILE_ADAPTERS' DESCRIPTION), as one list."""
    (tmp_path / "weights.npz").write_text("")
    assert re.search(r"supported are a Hugging Face directory of GPT2LMHeadModel, [A-Za-z0-9, ]+, or a timm ViT "
                     r"state-dict file \(\.pth/\.pt/\.bin/\.safetensors\) or directory \(timm's config\.json \+ "
                     r"weights\), or an open_clip model directory \(open_clip_config\.json beside "
                     r"open_clip_model\.safetensors or open_clip_pytorch_model\.bin\)$", message(tmp_path / "weights.npz"))


def test_a_file_of_another_kind_is_refused(tmp_path: Path) -> None:
    (tmp_path / "weights.npz").write_text("")
    assert "is not a model file trident reads" in message(tmp_path / "weights.npz")
    (tmp_path / "junk.pth").write_text("not a checkpoint")
    assert "cannot read pretrained weights" in message(tmp_path / "junk.pth")


def test_a_hub_name_offline_fails_in_one_line() -> None:
    # conftest sets HF_HUB_OFFLINE=1: huggingface_hub refuses before any network access.
    assert "cannot be downloaded from the Hugging Face Hub" in message("openai-community/gpt2-tiny-not-here")
