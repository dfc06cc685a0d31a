"""Review of trident-export --format gguf (issue 56, item 3) beside llama.cpp's convert_hf_to_gguf.py: each test
failed on the export as first written and passes with its fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer

from tests.test_gguf_export import checkpoint_from, hf_directory
from trident.commands.export import main

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

CONTROL = 3  # gguf.TokenType.CONTROL


def test_added_tokens_llama_cpp_takes_for_control_tokens_are_control_tokens(tmp_path: Path) -> None:
    """llama.cpp's converter (does_token_look_special) makes an added token control though its tokenizer.json says
    special=false where it looks special: DeepSeek's full-width <｜User｜> (DeepSeek-R1-Distill-Qwen marks its chat
    tokens so), Gemma's <2mass> and [@BOS@]; as user-defined tokens llama.cpp would print them in its output."""
    source = hf_directory(tmp_path / "qwen2", "qwen2")
    tokenizer = Tokenizer.from_file(str(source / "tokenizer.json"))
    looks_special = ["<｜User｜>", "<｜Assistant｜>", "<2mass>", "[@BOS@]"]
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in looks_special])
    tokenizer.save(str(source / "tokenizer.json"))
    checkpoint_from(source, tmp_path / "model.ckpt")
    main([str(tmp_path / "model.ckpt"), "--format", "gguf", "--out", str(tmp_path / "out"), "--gguf-type", "f32"])
    fields = gguf.GGUFReader(tmp_path / "out" / "model.gguf").fields
    types = dict(zip(fields["tokenizer.ggml.tokens"].contents(), fields["tokenizer.ggml.token_type"].contents()))
    assert {token: types[token] for token in looks_special} == dict.fromkeys(looks_special, CONTROL)
