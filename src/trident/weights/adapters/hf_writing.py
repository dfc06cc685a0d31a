"""The files of a Hugging Face directory written without ``transformers`` (issue 51: ``trident-export --format hf``
starts without transformers, whose import with its model classes took more time than torch's): what
``save_pretrained`` of transformers 5 writes for the adapter's config, state dict and the run's tokenizer, byte for
byte (``tests/test_hf_writing.py`` holds every family and kind of tokenizer to the installed transformers' own files).

- ``config.json``: the adapter's settings and the run's (special-token ids, labels) over what the family's config class
  writes whatever the settings (:data:`CONFIG_DEFAULTS`, :data:`DERIVED`, its sub-configs' :data:`SUB_CONFIG_DEFAULTS`), with the architecture, ``model_type``, the
  weights' dtype and the installed transformers' version, as ``save_pretrained`` stamps them.
- ``generation_config.json`` for a network that generates: the config's generation entries
  (``GenerationConfig.from_model_config``).
- ``model.safetensors``: the state dict, a tied tensor once (under its first name; transformers ties the others again).
- ``tokenizer.json`` / ``tokenizer_config.json`` / ``chat_template.jinja``: what ``PreTrainedTokenizerFast`` makes of
  the run's tokenizer and named tokens (a named token the tokenizer does not hold as special becomes one; a tokenizer
  without a post-processor gets the one that adds nothing).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from importlib.metadata import version
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, processors
from torch import Tensor

# model_type -> the entries its transformers config class writes beyond the adapter's settings, whatever they are
# (its class defaults that differ from PretrainedConfig's, or that PretrainedConfig lacks), as transformers 5 writes
# them. A new family's: tests/test_hf_writing.py names what transformers wrote that is missing here.
CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt2": {"add_cross_attention": False, "bos_token_id": 50256, "eos_token_id": 50256, "initializer_range": 0.02,
             "pad_token_id": None, "reorder_and_upcast_attn": False, "scale_attn_by_inverse_layer_idx": False,
             "scale_attn_weights": True, "summary_activation": None, "summary_first_dropout": 0.1,
             "summary_proj_to_labels": True, "summary_type": "cls_index", "summary_use_proj": True, "use_cache": True},
    "bert": {"add_cross_attention": False, "bos_token_id": None, "classifier_dropout": None, "eos_token_id": None,
             "initializer_range": 0.02, "is_decoder": False, "pad_token_id": 0, "use_cache": True},
    "vit": {"encoder_stride": 16, "initializer_range": 0.02, "pooler_act": "tanh"},
    "llama": {"bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.02, "pad_token_id": None,
              "pretraining_tp": 1, "use_cache": True},
    "mistral": {"bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.02, "pad_token_id": None,
                "use_cache": True},
    "qwen2": {"bos_token_id": None, "eos_token_id": None, "initializer_range": 0.02, "pad_token_id": None,
              "use_cache": True},
    "qwen3": {"bos_token_id": None, "eos_token_id": None, "initializer_range": 0.02, "pad_token_id": None,
              "use_cache": True},
    "gemma2": {"bos_token_id": 2, "eos_token_id": 1, "initializer_range": 0.02, "pad_token_id": 0,
               "use_bidirectional_attention": None, "use_cache": True},
    "gemma3_text": {"bos_token_id": 2, "eos_token_id": 1, "initializer_range": 0.02, "pad_token_id": 0,
                    "use_bidirectional_attention": False, "use_cache": True},
    "clip": {"initializer_factor": 1.0},
    "roberta": {"add_cross_attention": False, "bos_token_id": 0, "classifier_dropout": None, "eos_token_id": 2,
                "initializer_range": 0.02, "is_decoder": False, "pad_token_id": 1, "use_cache": True},
    # T5's: transformers 5 writes tie_word_embeddings true whatever it reads; the export writes the head's own (hf_t5).
    "t5": {"classifier_dropout": 0.0, "decoder_start_token_id": 0, "eos_token_id": 1, "initializer_factor": 1.0,
           "is_decoder": False, "pad_token_id": 0, "use_cache": True},
    # mT5's: its class writes tie_word_embeddings true whatever the head; the export writes false beside its lm_head.
    "mt5": {"bos_token_id": None, "classifier_dropout": 0.0, "decoder_start_token_id": 0, "eos_token_id": 1,
            "initializer_factor": 1.0, "is_decoder": False, "pad_token_id": 0, "use_cache": True},
    "albert": {"bos_token_id": 2, "classifier_dropout_prob": 0.1, "eos_token_id": 3, "initializer_range": 0.02,
               "pad_token_id": 0},
    "electra": {"add_cross_attention": False, "bos_token_id": None, "classifier_dropout": None, "eos_token_id": None,
                "initializer_range": 0.02, "is_decoder": False, "pad_token_id": 0, "summary_activation": "gelu",
                "summary_last_dropout": 0.1, "summary_type": "first", "summary_use_proj": True, "use_cache": True},
    "bart": {"activation_dropout": 0.0, "bos_token_id": 0, "classifier_dropout": 0.0, "decoder_layerdrop": 0.0,
             "encoder_layerdrop": 0.0, "eos_token_id": 2, "forced_eos_token_id": 2, "init_std": 0.02, "is_decoder": False,
             "is_encoder_decoder": True, "pad_token_id": 1, "use_cache": True,
             # BartConfig's three labels (its classification head's default), written as PretrainedConfig's two are not.
             "id2label": {i: f"LABEL_{i}" for i in range(3)}, "label2id": {f"LABEL_{i}": i for i in range(3)}},
}
# model_type -> its sub-configs (CLIP's towers) -> the entries each one's config class writes beyond the adapter's
# settings; save_pretrained stamps each with the weights' dtype too.
SUB_CONFIG_DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {
    "clip": {"text_config": {"initializer_factor": 1.0, "initializer_range": 0.02, "model_type": "clip_text_model"},
             "vision_config": {"initializer_factor": 1.0, "initializer_range": 0.02, "model_type": "clip_vision_model"}},
}
# PretrainedConfig's label count: its LABEL_0, LABEL_1 are not written, another count's LABEL_i are.
DEFAULT_LABELS = 2
# The entries a config class derives from the settings (model_type -> settings -> entries).
DERIVED: dict[str, Callable[[Mapping[str, Any]], dict[str, Any]]] = {
    "vit": lambda settings: {"pooler_output_size": settings.get("pooler_output_size") or settings["hidden_size"]},
    "gemma3_text": lambda settings: {"_sliding_window_pattern": settings.get("sliding_window_pattern", 6)},
    "t5": lambda settings: t5_activation(settings["feed_forward_proj"]),
    "mt5": lambda settings: t5_activation(settings["feed_forward_proj"]),
}
# The config entries GenerationConfig.from_model_config takes where set (the others are its own defaults, not written).
GENERATION_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "decoder_start_token_id",
                   "forced_eos_token_id")
# BART's forced <s> (hf_bart.with_run), which transformers 5 keeps in generation_config.json alone, not in config.json.
GENERATION_ONLY = ("forced_bos_token_id",)
# transformers' model_max_length of a tokenizer that states none (its VERY_LARGE_INTEGER).
MODEL_MAX_LENGTH = int(1e30)
# The class name transformers 4 knows the tokenizer by (5 names it TokenizersBackend and reads this name too).
TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def t5_activation(projection: str) -> dict[str, Any]:
    """What T5Config and MT5Config derive from ``feed_forward_proj``: whether it is gated, and its activation."""
    return {"is_gated_act": projection.startswith("gated-"),
            "dense_act_fn": "gelu_new" if projection == "gated-gelu" else projection.split("-")[-1]}


def write_json(path: Path, content: Mapping[str, Any]) -> None:
    """``content`` as transformers writes its JSON files (sorted keys, two-space indent, a final newline); the keys as
    strings, sorted as strings (labels ``"10"`` before ``"2"``), as a file read back and written again sorts them."""
    path.write_text(json.dumps(json.loads(json.dumps(content)), indent=2, sort_keys=True) + "\n")


def config_json(model_type: str, architecture: str, settings: Mapping[str, Any], run: Mapping[str, Any],
                dtype: str) -> dict[str, Any]:
    """What ``save_pretrained`` writes as ``config.json`` for the adapter's ``settings`` and the run's entries."""
    derived = DERIVED[model_type](settings) if model_type in DERIVED else {}
    labels = settings.get("num_labels", DEFAULT_LABELS)
    if labels != DEFAULT_LABELS and "id2label" not in run:
        derived |= {"id2label": {i: f"LABEL_{i}" for i in range(labels)},
                    "label2id": {f"LABEL_{i}": i for i in range(labels)}}
    nested = {key: {**defaults, **settings[key], "dtype": dtype} for key, defaults in SUB_CONFIG_DEFAULTS.get(model_type, {}).items()}
    return {**CONFIG_DEFAULTS[model_type], **derived, **settings, **nested, **run, "architectures": [architecture],
            "model_type": model_type, "dtype": dtype, "transformers_version": version("transformers")}


def generation_config_json(config: Mapping[str, Any]) -> dict[str, Any]:
    """What ``save_pretrained`` writes as ``generation_config.json`` for a generating model of ``config``."""
    taken = {key: config[key] for key in GENERATION_KEYS if config.get(key) is not None}
    if config.get("forced_bos_token_id") is not None:
        taken["forced_bos_token_id"] = config["forced_bos_token_id"]
    return {"_from_model_config": True, **taken, "transformers_version": config["transformers_version"]}


def write_weights(state: Mapping[str, Tensor], path: Path) -> None:
    """``state`` as ``model.safetensors``: each tensor under several names (a tied head) under the first alone, each
    its own contiguous copy (safetensors stores no shared memory)."""
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    kept = {}
    for name, tensor in state.items():
        alias = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
        if alias not in seen:
            seen.add(alias)
            kept[name] = tensor.detach().clone().contiguous()
    save_file(kept, str(path), metadata={"format": "pt"})


def write_model(directory: Path, model_type: str, architecture: str, settings: Mapping[str, Any],
                run: Mapping[str, Any], state: Mapping[str, Tensor], generates: bool) -> None:
    """``config.json``, ``generation_config.json`` (a model that ``generates``) and ``model.safetensors``."""
    dtype = next(tensor.dtype for tensor in state.values() if tensor.is_floating_point())
    config = config_json(model_type, architecture, settings, run, str(dtype).removeprefix("torch."))
    write_json(directory / "config.json", {key: value for key, value in config.items() if key not in GENERATION_ONLY})
    if generates:
        write_json(directory / "generation_config.json", generation_config_json(config))
    write_weights(state, directory / "model.safetensors")


def write_tokenizer(directory: Path, tokenizer: Tokenizer, specials: Mapping[str, str],
                    chat_template: str | None) -> None:
    """``tokenizer.json``, ``tokenizer_config.json`` and (a chat run) ``chat_template.jinja`` of the run's
    ``tokenizer`` with the named tokens ``specials`` (attribute -> token) and the run's chat template."""
    backend = Tokenizer.from_str(tokenizer.to_str())  # a copy: the run's tokenizer stays as it is
    named, entries = dict(specials), {}
    if (truncation := backend.truncation) is not None:  # kept, and stated to transformers as its own settings
        entries |= {"max_length": truncation["max_length"], "truncation_side": truncation["direction"],
                    "stride": truncation["stride"], "truncation_strategy": truncation["strategy"]}
    if (padding := backend.padding) is not None:
        named.setdefault("pad_token", padding["pad_token"])
        entries = {"pad_token_type_id": padding["pad_type_id"], "padding_side": padding["direction"],
                   "max_length": padding["length"], "pad_to_multiple_of": padding["pad_to_multiple_of"]} | entries
    held = {token.content for token in backend.get_added_tokens_decoder().values()}
    missing = list(dict.fromkeys(token for token in named.values() if token not in held))
    if missing:  # transformers makes every named token special
        backend.add_tokens([AddedToken(token, special=True) for token in missing])
    if backend.post_processor is None:  # transformers sets the post-processor of add_bos_token=add_eos_token=False
        backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    backend.save(str(directory / "tokenizer.json"))
    template = {} if chat_template is None else {"chat_template": chat_template}
    # transformers 5 keeps the template in chat_template.jinja only; transformers before 4.43 reads it in
    # tokenizer_config.json only: both.
    write_json(directory / "tokenizer_config.json", {**named, **entries, **template, "backend": "tokenizers",
                                                     "model_max_length": MODEL_MAX_LENGTH,
                                                     "tokenizer_class": TOKENIZER_CLASS})
    if chat_template is not None:
        (directory / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
