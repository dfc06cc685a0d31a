"""The hf export writes its directory without transformers (issue 51: trident-export starts fast) and writes what
transformers' own ``save_pretrained`` writes, byte for byte, for every family it exports (tied and untied heads,
labels, rope scalings, per-layer windows, dtypes) and every kind of tokenizer (trident's own, a WordPiece, a
ChatML BPE without post-processor, named tokens the tokenizer does not hold as special, padding and truncation),
and the directory reads in transformers with the network's logits."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

import pytest
import torch
from tokenizers import Tokenizer
from torch import nn

from tests.test_albert import trident_albert
from tests.test_bart import trident_bart
from tests.test_convert_bert import trident_bert
from tests.test_convert_clip import trident_clip
from tests.test_convert_gemma import WRITE_CASES as GEMMA_CASES
from tests.test_convert_gemma import gemma_lm
from tests.test_convert_gpt2 import trident_lm as gpt2_lm
from tests.test_convert_llama_family import WRITE_CASES as LLAMA_CASES
from tests.test_convert_llama_family import trident_lm as llama_lm
from tests.test_convert_vit import trident_vit
from tests.test_electra import trident_discriminator, trident_electra
from tests.test_export_chat import CHATML, chatml_tokenizer, llama3_style_tokenizer
from tests.test_roberta import trident_roberta
from trident.data.chat_template import DEFAULT_TEMPLATE, ChatTemplate
from trident.data.image_text import word_tokenizer
from trident.data.tokenization import train_tokenizer
from trident.models import CausalLM
from trident.weights.adapters.hf_export import end_of_turn_id, run_settings, special_tokens, to_transformers, write_hf
from trident.weights.adapters.hf_files import read_tokenizer
from trident.weights.adapters.hf_writing import CONFIG_DEFAULTS
from trident.weights.adapters.registry import ADAPTERS, adapter_for_network

transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("the hf export writes what transformers 5 writes", allow_module_level=True)

TEXT = "First Citizen: speak, speak. [CLS] [SEP] [MASK] [PAD] [UNK]"


def save_with_transformers(net: nn.Module, tokenizer: Tokenizer | None, class_names: Sequence[str] | None,
                           directory: Path, tokenizer_settings: Mapping[str, str] = MappingProxyType({})) -> None:
    """What the hf export wrote before (and the reference of what it writes): the transformers model saved by
    ``save_pretrained``, its settings that transformers leaves out written back, the tokenizer saved by
    ``PreTrainedTokenizerFast`` with its class name and chat template in tokenizer_config.json."""
    run = run_settings(net, tokenizer, class_names, tokenizer_settings)
    to_transformers(net, run).save_pretrained(directory)
    written = json.loads((directory / "config.json").read_text())
    dropped = {key: value for key, value in (adapter_for_network(net).from_trident(net)[1] | run).items()
               if key not in written}
    if dropped:
        (directory / "config.json").write_text(json.dumps(written | dropped, indent=2, sort_keys=True) + "\n")
    if tokenizer is None:
        return
    template = {"chat_template": tokenizer_settings["chat_template"]} if "chat_template" in tokenizer_settings else {}
    specials = special_tokens(net, tokenizer, tokenizer_settings)
    turn = end_of_turn_id(tokenizer, tokenizer_settings)
    if turn is not None and turn in tokenizer.get_added_tokens_decoder():
        specials["eos_token"] = tokenizer.id_to_token(turn)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, **specials, **template).save_pretrained(directory)
    config = directory / "tokenizer_config.json"
    written = json.loads(config.read_text()) | {"tokenizer_class": "PreTrainedTokenizerFast", **template}
    config.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")


def char_tokenizer(_: Path) -> Tokenizer:
    return train_tokenizer("char", [TEXT], end_of_text=True)


def wordpiece_tokenizer(tmp_path: Path) -> Tokenizer:
    """BERT's WordPiece read from a vocab.txt: its special tokens are ordinary vocabulary entries."""
    vocabulary = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "first", "speak", "##s", ",", ".")
    (tmp_path / "vocab.txt").write_text("".join(f"{entry}\n" for entry in vocabulary))
    tokenizer = read_tokenizer(tmp_path)
    assert tokenizer is not None
    return tokenizer


def padded_tokenizer(tmp_path: Path) -> Tokenizer:
    """A tokenizer that pads and truncates (as some tokenizer.json on the Hub do), from the left (not the defaults)."""
    tokenizer = char_tokenizer(tmp_path)
    tokenizer.enable_padding(pad_id=0, pad_token="<unk>", length=12, direction="left")
    tokenizer.enable_truncation(max_length=10, direction="left")
    return tokenizer


def chat(template: ChatTemplate) -> dict[str, str]:
    return {**template.special_tokens, "chat_template": template.text, "end_of_turn": template.end_marker()}


# name -> (network, tokenizer, class names, tokenizer settings)
Case = tuple[Callable[[], nn.Module], Callable[[Path], Tokenizer] | None, list[str] | None, dict[str, str]]
CASES: dict[str, Case] = {
    "gpt2-tied-char": (gpt2_lm, char_tokenizer, None, {}),
    "gpt2-untied": (lambda: gpt2_lm(tie_embeddings=False), None, None, {}),
    "gpt2-bfloat16": (lambda: gpt2_lm().to(torch.bfloat16), None, None, {}),
    "gpt2-padded": (gpt2_lm, padded_tokenizer, None, {}),
    # A named token the tokenizer holds as an ordinary one ("a"): transformers makes it special.
    "gpt2-named": (gpt2_lm, char_tokenizer, None, {"bos_token": "a", "pad_token": "<unk>"}),
    "bert": (trident_bert, wordpiece_tokenizer, None, {}),
    "albert": (trident_albert, wordpiece_tokenizer, None, {}),
    "roberta": (trident_roberta, wordpiece_tokenizer, None, {}),
    "electra": (trident_electra, wordpiece_tokenizer, None, {}),
    "electra-discriminator": (trident_discriminator, wordpiece_tokenizer, None, {}),
    "vit": (trident_vit, None, None, {}),
    "bart": (trident_bart, None, None, {}),
    "vit-named": (trident_vit, None, [f"class {i}" for i in range(7)], {}),
    # task=clip's own word-level tokenizer (ends each text in <|endoftext|>), its zero-shot class names.
    "clip": (trident_clip, lambda _: word_tokenizer([TEXT]), [f"class {i}" for i in range(3)], {}),
    "llama-chatml": (lambda: llama_lm({}), lambda _: chatml_tokenizer(), None,
                     chat(ChatTemplate("chatml.jinja", CHATML, {}))),
    "llama-default-template": (lambda: llama_lm({}), lambda _: llama3_style_tokenizer(), None,
                               chat(ChatTemplate("default", DEFAULT_TEMPLATE, {}))),
    **{f"{family}-{i}": (lambda s=settings: llama_lm(s), None, None, {}) for i, (family, settings) in enumerate(LLAMA_CASES)},
    **{f"{family}-{i}": (lambda f=family, s=settings: gemma_lm(f, **dict(s)), None, None, {})
       for i, (family, settings) in enumerate(GEMMA_CASES)},
}


def test_every_family_has_its_config_defaults() -> None:
    assert {adapter.MODEL_TYPE for adapter in ADAPTERS} == set(CONFIG_DEFAULTS)


@pytest.mark.parametrize("name", list(CASES))
def test_the_hf_export_writes_what_transformers_writes(name: str, tmp_path: Path) -> None:
    build, tokenize, class_names, settings = CASES[name]
    net = build()
    tokenizer = tokenize(tmp_path) if tokenize else None
    with torch.no_grad():
        save_with_transformers(net, tokenizer, class_names, tmp_path / "transformers", settings)
        write_hf(net, tokenizer, class_names, tmp_path / "trident", settings)
    files = sorted(path.name for path in (tmp_path / "transformers").iterdir())
    assert sorted(path.name for path in (tmp_path / "trident").iterdir()) == files
    for file in files:
        theirs, ours = ((tmp_path / side / file).read_bytes() for side in ("transformers", "trident"))
        if file.endswith(".json"):  # the entries named first, where they differ
            assert json.loads(ours) == json.loads(theirs), file
        assert ours == theirs, file


@pytest.mark.parametrize("name", ["gpt2-tied-char", "gpt2-untied", "bert", "albert", "electra", "vit-named", "llama-chatml", "qwen2-9",
                                  "qwen3-11", "mistral-14", "gemma2-0", "gemma3-2"])
def test_the_written_directory_reads_in_transformers_with_the_networks_logits(name: str, tmp_path: Path) -> None:
    build, tokenize, class_names, settings = CASES[name]
    net = build()
    with torch.no_grad():
        write_hf(net, tokenize(tmp_path) if tokenize else None, class_names, tmp_path / "hf", settings)
        if type(net).__name__ == "VisionTransformer":
            pixels = torch.randn(2, 3, 24, 24, generator=torch.Generator().manual_seed(0))
            theirs = transformers.AutoModelForImageClassification.from_pretrained(tmp_path / "hf").eval()(pixels).logits
            ours = net(pixels)
        else:
            ids = torch.randint(0, 10, (2, 12), generator=torch.Generator().manual_seed(0))
            kind = transformers.AutoModelForCausalLM if isinstance(net, CausalLM) else transformers.AutoModelForMaskedLM
            theirs, ours = kind.from_pretrained(tmp_path / "hf").eval()(ids).logits, net(ids)
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)
