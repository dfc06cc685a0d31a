"""``read_pretrained``: which outside format a path holds, and the adapter that reads it (``read_network``: in the
words of networks; ``read_pretrained``: as the source of the task that holds such a network)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from trident.errors import ConfigError, DataError
from trident.weights.adapters.hf_files import read_config, read_state_dict, read_tokenizer, read_tokenizer_settings
from trident.weights.adapters.outside_network import OutsideNetwork, as_source
from trident.weights.adapters.peft_reading import is_peft_adapter, merge_peft, peft_base, untie_tied_head
from trident.weights.adapters.registry import FILE_ADAPTERS, adapter_for_model_type, architectures, file_adapter_for
from trident.weights.pretrained import PretrainedWeights

# Encoder-decoders the backbone cannot express exactly (docs/weights.md, "Not converted"): model_type -> what it lacks.
NOT_EXPRESSIBLE = {
    "marian": "Marian's sinusoidal table layout (all sines, then all cosines), a plain SiLU and final_logits_bias",
}


def supported() -> str:
    """The formats ``read_pretrained`` takes, in the words of its error messages."""
    return ", or ".join([f"a Hugging Face directory of {', '.join(architectures())}",
                         *(adapter.DESCRIPTION for adapter in FILE_ADAPTERS)])


def read_pretrained(path: str | Path, *, n_heads: int | None = None) -> PretrainedWeights:
    """A Hugging Face model directory (config.json + model.safetensors | pytorch_model.bin), a timm ViT
    state-dict file (.pth/.bin/.safetensors; timm's config.json beside it, if any, gives the heads) or a
    timm directory (timm's config.json + weights). Anything else: one-line DataError naming what it is
    not and the supported architectures. ``n_heads``: the head count of a timm ViT that nothing beside
    its file states; a source that states another is one ConfigError line."""
    return as_source(read_network(path, n_heads=n_heads))


def read_network(path: str | Path, *, n_heads: int | None = None) -> OutsideNetwork:
    """What :func:`read_pretrained` reads, before the task that holds such a network says what it is as a source."""
    weights = _read(str(path), Path(path), n_heads)
    if n_heads is not None and weights.model["n_heads"] != n_heads:
        raise ConfigError(f"model.n_heads={n_heads} contradicts {path}, which has model.n_heads={weights.model['n_heads']}: "
                          "drop that override (the architecture comes from the weights)")
    return weights


def _read(source: str, path: Path, n_heads: int | None, lora: Path | None = None) -> OutsideNetwork:
    if not path.exists():
        path = _hub_snapshot(source)
    if is_peft_adapter(path):  # a peft LoRA adapter: its base's weights with the adapter merged in
        return _read(source, peft_base(path, source), n_heads, lora=path)
    if (file_adapter := file_adapter_for(path)) is not None:
        return file_adapter.read(path, source, n_heads)
    if path.is_file():
        raise DataError(f"{source} is not a model file trident reads: supported are {supported()}")
    if not (path / "config.json").is_file():
        raise DataError(f"{source} is not a model directory (no config.json): supported are {supported()}")
    config = read_config(path)
    model_type = config.get("model_type")
    adapter = adapter_for_model_type(str(model_type))
    architectures = config.get("architectures") or []
    if model_type in NOT_EXPRESSIBLE:
        from trident.tasks.registry import TASKS  # here: every task's imports load only for this refusal

        named = " or ".join(f"task={name}" for name, task in TASKS.items() if task.ENCODER_DECODER)
        raise DataError(
            f"{source} holds a {model_type} ({', '.join(architectures) or 'no architectures'}), which the backbone cannot "
            f"express exactly (it lacks {NOT_EXPRESSIBLE[model_type]}): {named} starts from a trident "
            f"checkpoint or run directory of its own; Hugging Face models trident reads are {supported()}"
        )
    if adapter is None:
        raise DataError(
            f"{source} holds a {model_type or 'model of unknown type'} ({', '.join(architectures) or 'no architectures'}), "
            f"which trident does not convert: supported are {supported()}"
        )
    base = read_state_dict(path)
    state = base if lora is None else merge_peft(lora, base, source)
    config = config if lora is None else untie_tied_head(config, base, state)
    try:
        tokenizer = read_tokenizer(path)
        weights = adapter.to_trident(config, state, tokenizer, source)
        # The stack is declared as the family it was read from: the run records it, and its export writes it back.
        weights = replace(weights, model=weights.model | {"family": adapter.FAMILY})
        return replace(weights, tokenizer_settings=read_tokenizer_settings(path)) if tokenizer is not None else weights
    except KeyError as err:  # a setting or tensor the config or weights lack (e.g. an old or edited checkpoint)
        missing, kind = err.args[0], f"a {model_type} ({', '.join(adapter.ARCHITECTURES)})"
        if "." not in str(missing):  # a config.json setting (tensor names always have a dot)
            raise DataError(f"{source}/config.json lacks {err} that {kind} has: save the model again with transformers") from err
        found = ", ".join([*sorted(state)[:2], "..."])
        raise DataError(
            f"{source} lacks {err} that {kind} has: its weights ({found}) match no layout trident reads (Hugging Face's, "
            "with or without the model's prefix; original BERT's LayerNorm.gamma/beta): save the model again with transformers"
        ) from err


def _hub_snapshot(name: str) -> Path:
    """A Hub model name (``gpt2``, ``google/vit-base-patch16-224``) downloaded by ``huggingface_hub``."""
    if name.count("/") > 1 or name.startswith((".", "/", "~")) or any(Path(name).suffix in adapter.SUFFIXES for adapter in FILE_ADAPTERS):
        raise DataError(f"{name} not found: give a Hugging Face model directory or a timm ViT state-dict file")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]))
    except Exception as err:  # offline, unknown repository, gated model: all end the same way
        raise DataError(
            f"{name} is not a local path and cannot be downloaded from the Hugging Face Hub ({type(err).__name__}; "
            "offline?): download it elsewhere and give its directory"
        ) from err
