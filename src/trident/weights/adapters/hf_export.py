"""A trident model as a Hugging Face directory: the adapter of its family gives the config and the state dict, and
:func:`write_hf` writes them (with the run's tokenizer) as ``save_pretrained`` of transformers does, without importing
transformers (``hf_writing``: the export then takes about as long as importing torch). :func:`to_transformers` builds the
``transformers`` model itself (tests compare trident with it) and checks that every tensor found its place.

What the weights do not say comes from the run (:func:`run_settings`): the special-token ids of its
own tokenizer and its class names. Hugging Face's config defaults (GPT-2's ``bos/eos_token_id=50256``,
BERT's ``pad_token_id=0``, ViT's ``LABEL_0``...) describe Hugging Face's published models, not the run.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from safetensors.torch import save_file
from tokenizers import Tokenizer
from torch import nn

from trident.extras import require_package
from trident.weights.adapters.hf_writing import write_model, write_tokenizer
from trident.weights.adapters.registry import adapter_for_network

# The special tokens whose ids a Hugging Face config holds (``<name>_id``); each adapter's SPECIAL_TOKENS says which it has.
CONFIG_TOKENS = ("bos_token", "eos_token", "pad_token")
# The key of a run's tokenizer_settings (data=chat records it) whose text ends an answer: ``<|im_end|>``, trident's
# default template's blank line.
END_OF_TURN = "end_of_turn"
# How answers end and what follows the end of turn (the next turn, a newline, the end of the text): the end of turn's
# token must stay whole between them to be the eos of the export (end_of_turn_id).
ANSWER_ENDS, TURN_STARTS = ("It jumps", "It jumps.", "It jumps?", "42", "It jumps!\n"), ("", "USER", "\n", " <")


def end_of_turn_id(tokenizer: Tokenizer, tokenizer_settings: Mapping[str, str]) -> int | None:
    """The id of the token that ends an answer of the run's chat template, None where the run recorded none, the
    text is several tokens (trident's default blank line under a character tokenizer) or its token is not what
    the run's answers end in: a text marker can merge with the answer's last characters (Llama 3's and Qwen's
    pre-tokenizers make "It jumps.\n\n" end in ".\n\n", not in the "\n\n" token), so it must stay one token after
    every :data:`ANSWER_ENDS` and before every :data:`TURN_STARTS` (an added token, <|im_end|>, always does)."""
    text = tokenizer_settings.get(END_OF_TURN)
    ids = tokenizer.encode(text, add_special_tokens=False).ids if text else []
    if len(ids) != 1:
        return None
    in_context = all(ids[0] in tokenizer.encode(f"{end}{text}{start}", add_special_tokens=False).ids
                     for end in ANSWER_ENDS for start in TURN_STARTS)
    return ids[0] if in_context else None


def special_tokens(net: nn.Module, tokenizer: Tokenizer, tokenizer_settings: Mapping[str, str]) -> dict[str, str]:
    """Tokenizer attribute -> token of the run's tokenizer: those its source's tokenizer_config.json named
    (``tokenizer_settings``), else the family's (SPECIAL_TOKENS), where the vocabulary has them."""
    named = {name: token for name, token in tokenizer_settings.items() if name.endswith("_token")}
    tokens = dict(adapter_for_network(net).SPECIAL_TOKENS) | named
    return {name: token for name, token in tokens.items() if tokenizer.token_to_id(token) is not None}


def run_settings(net: nn.Module, tokenizer: Tokenizer | None, class_names: Sequence[str] | None,
                 tokenizer_settings: Mapping[str, str] = MappingProxyType({})) -> dict[str, Any]:
    """The config entries of ``net``'s run: each special-token id the family's config holds, the id of that
    token in the run's own tokenizer (None where it lacks the token; :func:`special_tokens`), the end of a chat
    run's answers as its ``eos_token_id`` (where generate stops), and ``id2label`` / ``label2id``."""
    settings: dict[str, Any] = {}
    if tokenizer is not None:
        specials = special_tokens(net, tokenizer, tokenizer_settings)
        settings |= {f"{name}_id": tokenizer.token_to_id(specials[name]) if name in specials else None for name in CONFIG_TOKENS}
        if (turn := end_of_turn_id(tokenizer, tokenizer_settings)) is not None:
            settings["eos_token_id"] = turn
    if class_names:
        settings |= {"id2label": dict(enumerate(class_names)), "label2id": {name: i for i, name in enumerate(class_names)}}
    return settings


def fitted(adapter: Any, net: nn.Module, run: Mapping[str, Any]) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """The adapter's architecture, config and state dict of ``net`` with the ``run``'s entries in the config, and what
    follows from them in the weights (an adapter's ``with_run``: RoBERTa's positions start past the run's padding id)."""
    architecture, settings, state = adapter.from_trident(net)
    settings |= run
    if (with_run := getattr(adapter, "with_run", None)) is not None:
        settings, state = with_run(settings, state)
    return architecture, settings, state


def to_transformers(net: nn.Module, run: dict[str, Any] | None = None) -> Any:
    """``net`` as the ``transformers`` model of :data:`~trident.weights.adapters.registry.ADAPTERS` (eval mode), with the same weights;
    ``run``: further config entries (:func:`run_settings`)."""
    require_package("transformers")
    import transformers

    architecture, settings, state = fitted(adapter_for_network(net), net, run or {})
    model_class = getattr(transformers, architecture)
    # The adapters write the checkpoint names Hugging Face publishes; transformers renames them to its
    # modules' (which change between versions) in from_pretrained, so the model is read from a directory.
    with tempfile.TemporaryDirectory() as scratch:
        model_class.config_class(architectures=[architecture], **settings).save_pretrained(scratch)
        # safetensors stores no shared tensors: each tied name gets its own copy, and transformers ties them again.
        save_file({name: tensor.detach().clone().contiguous() for name, tensor in state.items()},
                  str(Path(scratch) / "model.safetensors"), metadata={"format": "pt"})
        model, info = model_class.from_pretrained(scratch, output_loading_info=True)
    unplaced = {kind: names for kind, names in info.items() if names and kind in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if unplaced:
        raise RuntimeError(f"the {architecture} adapter does not fit transformers {transformers.__version__}: {unplaced}")
    return model.eval()


def write_hf(net: nn.Module, tokenizer: Tokenizer | None, class_names: Sequence[str] | None, directory: Path,
             tokenizer_settings: Mapping[str, str] = MappingProxyType({})) -> None:
    """The Hugging Face directory of ``net`` and, for text models, of its tokenizer (``AutoTokenizer`` reads it) with
    the special tokens and chat template its source had (``tokenizer_settings``: ``PretrainedWeights``'), as
    ``save_pretrained`` of the installed transformers writes it, without importing transformers (``hf_writing``)."""
    require_package("transformers")  # the version the files name is the installed one's, which reads them
    adapter = adapter_for_network(net)
    run = run_settings(net, tokenizer, class_names, tokenizer_settings)
    architecture, settings, state = fitted(adapter, net, run)
    run = {key: settings[key] for key in run}  # as the adapter fitted them (RoBERTa's padding id)
    directory.mkdir(parents=True, exist_ok=True)
    # transformers writes generation_config.json for the classes that generate (its GenerationMixin): the causal LM heads
    # and the encoder-decoders.
    generates = architecture.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration"))
    write_model(directory, adapter.MODEL_TYPE, architecture, settings, run, state, generates)
    if tokenizer is not None:
        # An end of turn of several tokens is not written as generation_config's stop_strings: with them, every
        # generate call without tokenizer= (pipeline("text-generation") too) raises, and generate(tokenizer=...) raises
        # for a vocabulary without "abcdef" (transformers' StopStringCriteria). The user passes it (docs/weights.md).
        write_tokenizer(directory, tokenizer, export_specials(net, tokenizer, tokenizer_settings),
                        tokenizer_settings.get("chat_template"))


def export_specials(net: nn.Module, tokenizer: Tokenizer, tokenizer_settings: Mapping[str, str]) -> dict[str, str]:
    """The named tokens an export's tokenizer gets (:func:`special_tokens`), a chat run's end of turn its eos where
    that is an added token (<|im_end|>): the hf and gguf exports name the same."""
    turn = end_of_turn_id(tokenizer, tokenizer_settings)
    specials = special_tokens(net, tokenizer, tokenizer_settings)
    if turn is not None and turn in tokenizer.get_added_tokens_decoder():  # a special token (<|im_end|>): the eos
        specials["eos_token"] = tokenizer.id_to_token(turn)
    return specials
