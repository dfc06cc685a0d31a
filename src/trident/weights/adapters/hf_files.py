"""Reading a Hugging Face model directory without ``transformers``: config.json, the weights
(safetensors or a pickled ``pytorch_model.bin``, each sharded or not) and the tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from torch import Tensor

from trident.data.chat_template import chat_template_of, special_tokens_of
from trident.data.special_tokens import CLS_TOKEN, SEP_TOKEN, UNK_TOKEN
from trident.errors import ConfigError, DataError

SENTENCEPIECE_FILES = ("spiece.model", "tokenizer.model")  # T5's and ALBERT's name; Llama 2's
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
# Names of older checkpoints that transformers renames on load, in every model (its "legacy" conversion):
# the norms of Google's original BERT (bert-base-uncased on the Hub) and the models converted like it.
LEGACY_NAMES = {"LayerNorm.gamma": "LayerNorm.weight", "LayerNorm.beta": "LayerNorm.bias"}


def read_config(directory: Path) -> dict[str, Any]:
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise DataError(f"{directory}/config.json cannot be read ({type(err).__name__}): not a Hugging Face model directory") from None
    if not isinstance(config, dict):
        raise DataError(f"{directory}/config.json is not a JSON object: not a Hugging Face model directory")
    return config


def read_state_dict(directory: Path) -> dict[str, Tensor]:
    """The weights of ``directory``: the first of :data:`WEIGHT_FILES` present, named as transformers
    names them once loaded (:data:`LEGACY_NAMES`)."""
    for name in WEIGHT_FILES:
        path = directory / name
        if path.is_file():
            try:
                state = _read_weights(path)
            except Exception as err:  # safetensors and torch raise many types for a damaged file
                raise DataError(f"cannot read {path} ({type(err).__name__}): the file is damaged; download it again") from err
            return {_current_name(key): tensor for key, tensor in state.items()}
    raise DataError(f"{directory} holds no weights: expected one of {', '.join(WEIGHT_FILES)}")


def _current_name(name: str) -> str:
    for old, new in LEGACY_NAMES.items():
        name = name.replace(old, new)
    return name


def _read_weights(path: Path) -> dict[str, Tensor]:
    if path.name.endswith(".index.json"):  # sharded: the index maps each tensor to its shard file
        shards = sorted(set(json.loads(path.read_text())["weight_map"].values()))
        state: dict[str, Tensor] = {}
        for shard in shards:
            state.update(_read_weights(path.parent / shard))
        return state
    if path.suffix == ".safetensors":
        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)


def read_tokenizer(directory: Path) -> Tokenizer | None:
    """``tokenizer.json`` if present; else GPT-2's ``vocab.json`` + ``merges.txt`` (byte-level BPE)
    or BERT's ``vocab.txt`` (WordPiece), built the way those tokenizers are defined; else a SentencePiece model as
    transformers converts it."""
    if (directory / "tokenizer.json").is_file():
        return Tokenizer.from_file(str(directory / "tokenizer.json"))
    if (directory / "vocab.json").is_file() and (directory / "merges.txt").is_file():
        return _byte_level_bpe(directory)
    if (directory / "vocab.txt").is_file():
        return _wordpiece(directory)
    if any((directory / name).is_file() for name in SENTENCEPIECE_FILES):
        return _converted_sentencepiece(directory)
    return None


def _converted_sentencepiece(directory: Path) -> Tokenizer:
    """A SentencePiece model alone (the hub's google/t5-v1_1-*: ``spiece.model``, no ``tokenizer.json``) as the fast
    tokenizer transformers converts it to when it loads the directory (T5's 100 ``<extra_id_*>`` tokens included)."""
    import importlib.util

    missing = [name for name in ("transformers", "sentencepiece", "google.protobuf")
               if importlib.util.find_spec(name.partition(".")[0]) is None]
    if missing:
        raise ConfigError(f"{directory} holds its tokenizer as a SentencePiece model alone, which trident converts with "
                          f"transformers, sentencepiece and protobuf ({', '.join(missing)} not installed): pip install "
                          "'trident[sentencepiece]', or save a tokenizer.json beside it with transformers")
    import transformers  # here: the other readers need no transformers

    return transformers.AutoTokenizer.from_pretrained(directory).backend_tokenizer


def read_tokenizer_settings(directory: Path) -> dict[str, str]:
    """The chat template and special tokens of ``tokenizer_config.json`` (a token written as transformers'
    AddedToken dict gives its ``content``); the template from ``chat_template.jinja``, where transformers
    writes it since 4.43."""
    config = _tokenizer_config(directory)
    settings = special_tokens_of(directory, config)  # an older directory's special_tokens_map.json included
    if template := chat_template_of(directory, config):  # of several named templates, "default"
        settings["chat_template"] = template
    return settings


def _tokenizer_config(directory: Path) -> dict[str, Any]:
    path = directory / "tokenizer_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _byte_level_bpe(directory: Path) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE.from_file(str(directory / "vocab.json"), str(directory / "merges.txt")))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _wordpiece(directory: Path) -> Tokenizer:
    settings = _tokenizer_config(directory)
    tokenizer = Tokenizer(models.WordPiece.from_file(str(directory / "vocab.txt"), unk_token=settings.get("unk_token", UNK_TOKEN)))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=bool(settings.get("do_lower_case", True)))
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls, sep = settings.get("cls_token", CLS_TOKEN), settings.get("sep_token", SEP_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, tokenizer.token_to_id(cls)), (sep, tokenizer.token_to_id(sep))],
    )
    tokenizer.decoder = decoders.WordPiece()
    return tokenizer
