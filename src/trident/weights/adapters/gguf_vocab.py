"""A run's tokenizer in a GGUF file's metadata, as llama.cpp's ``convert_hf_to_gguf.py`` writes a byte-level BPE
(its ``_set_vocab_gpt2``): ``tokenizer.ggml.model=gpt2``, the pre-tokenizer's name (``tokenizer.ggml.pre``: which
split of the text the merges were learned on), the tokens in id order with their types, the merges, the special-token
ids, whether a bos/eos is added, and the chat template.

The special tokens, merges, add-bos/eos flags and template are read by llama.cpp's own reader of a Hugging Face
tokenizer directory (``gguf.SpecialVocab``), from the files the hf export writes for the run (``hf_writing``): the same
tokens and template the hf export names, read the way llama.cpp reads them.

GGUF's byte-level BPE splits the text with a regex it knows by name; a tokenizer whose split is none of those named
here, or that is no byte-level BPE (trident's ``data.tokenizer=char``: a WordLevel vocabulary), is refused.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer
from torch import nn

from trident.data.special_tokens import SEQ_PAD_TOKEN
from trident.errors import ConfigError
from trident.weights.adapters.hf_export import export_specials, run_settings
from trident.weights.adapters.hf_writing import write_json, write_tokenizer

# tokenizer.ggml.pre of a split regex (llama.cpp's names, which transformers' GGUF reader maps back to the regex):
# Llama 3's and Qwen2's, as their tokenizer.json write it in a Split before a ByteLevel without its own regex.
SPLITS = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "llama-bpe",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "qwen2",
}
# GPT-2's own split: a ByteLevel pre-tokenizer with its built-in regex (trident's data.tokenizer=bpe).
GPT2_SPLIT = "gpt-2"
# Normalizers GGUF has no key for and llama.cpp's conversion drops as well (Qwen2's NFC): ASCII text is unchanged.
DROPPED_NORMALIZERS = (None, "NFC")
# llama.cpp's token types (gguf.TokenType): an id the tokenizer lacks below the model's vocabulary is UNUSED "[PAD<id>]".
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5
# The added tokens llama.cpp's converter takes for control tokens whatever tokenizer.json says: these, and those that
# start and end as one of LOOK_SPECIAL_ENDS (does_token_look_special).
LOOK_SPECIAL = (SEQ_PAD_TOKEN, "<mask>", "<2mass>", "[@BOS@]")
LOOK_SPECIAL_ENDS = (("<|", "|>"), ("<｜", "｜>"), ("<unused", ">"))
WHAT_WORKS = ("the gguf export writes byte-level BPE tokenizers split as GPT-2's, Llama 3's or Qwen2's "
              "(llama.cpp's tokenizer.ggml.model=gpt2): train with the data group's bpe tokenizer, or init_from a "
              "Hugging Face directory whose tokenizer is one")


def pre_tokenizer_name(spec: Mapping[str, Any]) -> str | None:
    """The ``tokenizer.ggml.pre`` of a tokenizer.json's byte-level pre-tokenizer, None where GGUF names none."""
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel":
        return GPT2_SPLIT if pre.get("use_regex", True) and not pre.get("add_prefix_space") else None
    parts = pre.get("pretokenizers") or []
    if pre.get("type") != "Sequence" or len(parts) != 2:
        return None
    split, byte_level = parts
    if split.get("type") != "Split" or split.get("behavior") != "Isolated" or split.get("invert"):
        return None
    if byte_level.get("type") != "ByteLevel" or byte_level.get("use_regex", True) or byte_level.get("add_prefix_space"):
        return None
    return SPLITS.get((split.get("pattern") or {}).get("Regex"))


def require_byte_level(tokenizer: Tokenizer) -> str:
    """The pre-tokenizer name of the run's tokenizer; one line where GGUF's byte-level BPE cannot hold it."""
    spec = json.loads(tokenizer.to_str())
    model = spec["model"]
    if model["type"] != "BPE" or model.get("byte_fallback") or model.get("continuing_subword_prefix") \
            or model.get("end_of_word_suffix"):
        kind = "a character-level" if model["type"] == "WordLevel" else f"a {model['type']}"
        raise ConfigError(f"the run's tokenizer is {kind} tokenizer: {WHAT_WORKS}")
    normalizer = (spec.get("normalizer") or {}).get("type")
    if normalizer not in DROPPED_NORMALIZERS:
        raise ConfigError(f"the run's tokenizer normalizes its text ({normalizer}), which GGUF cannot state: {WHAT_WORKS}")
    name = pre_tokenizer_name(spec)
    if name is None:
        raise ConfigError(f"the run's tokenizer splits its text with a pre-tokenizer GGUF has no name for: {WHAT_WORKS}")
    return name


def looks_special(token: str) -> bool:
    """llama.cpp's ``does_token_look_special``: added tokens it makes control tokens though they are not special
    (DeepSeek's full-width <｜User｜>, Gemma's <2mass>, [@BOS@] and <unused0>...)."""
    return token in LOOK_SPECIAL or any(token.startswith(start) and token.endswith(end) for start, end in LOOK_SPECIAL_ENDS)


def token_table(tokenizer: Tokenizer, vocab_size: int) -> tuple[list[str], list[int]]:
    """Each id's token below ``vocab_size`` (the model's rows) and its llama.cpp type, as ``get_vocab_base`` lists
    them: added tokens CONTROL (special) or USER_DEFINED, the others NORMAL, ids without a token UNUSED."""
    by_id = {index: token for token, index in tokenizer.get_vocab(with_added_tokens=True).items()}
    added = tokenizer.get_added_tokens_decoder()
    if max(by_id) >= vocab_size:
        raise ConfigError(f"the run's tokenizer has {max(by_id) + 1} tokens and its model {vocab_size} rows: "
                          "a GGUF file lists one token per row (export a run whose tokenizer fits its model)")
    tokens, types = [], []
    for index in range(vocab_size):
        if index not in by_id:
            tokens.append(f"[PAD{index}]")
            types.append(UNUSED)
        else:
            token = by_id[index]
            tokens.append(token)
            if index in added:
                types.append(CONTROL if added[index].special or looks_special(token) else USER_DEFINED)
            else:
                types.append(NORMAL)
    return tokens, types


def add_vocabulary(writer: Any, net: nn.Module, tokenizer: Tokenizer, tokenizer_settings: Mapping[str, str],
                   vocab_size: int) -> None:
    """The run's tokenizer in ``writer``'s metadata (a ``gguf.GGUFWriter``): the tokens of the model's
    ``vocab_size`` rows, with the special tokens and chat template the hf export names (``export_specials``)."""
    import gguf

    pre = require_byte_level(tokenizer)
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        write_tokenizer(directory, tokenizer, export_specials(net, tokenizer, tokenizer_settings),
                        tokenizer_settings.get("chat_template"))
        # The ids of the special tokens the tokenizer does not hold as added tokens (the chat end of turn as eos).
        write_json(directory / "config.json", run_settings(net, tokenizer, None, tokenizer_settings))
        written = Tokenizer.from_file(str(directory / "tokenizer.json"))
        special = gguf.SpecialVocab(directory, load_merges=True, n_vocab=vocab_size)
    # Stated where the post-processor adds neither (SpecialVocab then says nothing): llama.cpp's default for some
    # splits (llama-bpe) adds a bos the run's tokenizer does not.
    for kind in ("bos", "eos"):
        special.add_special_token.setdefault(kind, False)
    tokens, types = token_table(written, vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special.add_to_gguf(writer, quiet=True)
