"""``read_pretrained``: which outside format a path holds, and the adapter that reads it."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from trident.convert import hf_bert, hf_gpt2, hf_vit
from trident.convert.hf_files import read_config, read_state_dict, read_tokenizer
from trident.convert.timm_vit import from_timm, read_timm_file
from trident.convert.weights import PretrainedWeights
from trident.errors import DataError

# Hugging Face config.json "model_type" -> the adapter module (from_hf, to_hf, ARCHITECTURES).
HF_ADAPTERS: dict[str, ModuleType] = {"gpt2": hf_gpt2, "bert": hf_bert, "vit": hf_vit}
TIMM_SUFFIXES = (".pth", ".pt", ".bin", ".safetensors")


def supported() -> str:
    """The formats ``read_pretrained`` takes, in the words of its error messages."""
    names = ", ".join(f"{arch}" for adapter in HF_ADAPTERS.values() for arch in adapter.ARCHITECTURES)
    return f"a Hugging Face directory of {names}, or a timm ViT state-dict file ({'/'.join(TIMM_SUFFIXES)})"


def read_pretrained(path: str | Path) -> PretrainedWeights:
    """A Hugging Face model directory (config.json + model.safetensors | pytorch_model.bin) or a timm ViT
    state-dict file (.pth/.bin/.safetensors). Anything else: one-line DataError naming what it is not and
    the supported architectures."""
    source = str(path)
    path = Path(path)
    if not path.exists():
        path = _hub_snapshot(source)
    if path.is_file():
        if path.suffix not in TIMM_SUFFIXES:
            raise DataError(f"{source} is not a model file trident reads: supported are {supported()}")
        return from_timm(read_timm_file(path), source)
    if not (path / "config.json").is_file():
        raise DataError(f"{source} is not a model directory (no config.json): supported are {supported()}")
    config = read_config(path)
    model_type = config.get("model_type")
    adapter = HF_ADAPTERS.get(str(model_type))
    architectures = config.get("architectures") or []
    if adapter is None:
        raise DataError(
            f"{source} holds a {model_type or 'model of unknown type'} ({', '.join(architectures) or 'no architectures'}), "
            f"which trident does not convert: supported are {supported()}"
        )
    return adapter.from_hf(config, read_state_dict(path), read_tokenizer(path), source)


def _hub_snapshot(name: str) -> Path:
    """A Hub model name (``gpt2``, ``google/vit-base-patch16-224``) downloaded by ``huggingface_hub``."""
    if name.count("/") > 1 or name.startswith((".", "/", "~")) or Path(name).suffix in TIMM_SUFFIXES:
        raise DataError(f"{name} not found: give a Hugging Face model directory or a timm ViT state-dict file")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]))
    except Exception as err:  # offline, unknown repository, gated model: all end the same way
        raise DataError(
            f"{name} is not a local path and cannot be downloaded from the Hugging Face Hub ({type(err).__name__}; "
            "offline?): download it elsewhere and give its directory"
        ) from err
