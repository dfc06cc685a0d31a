"""The one registry of outside formats: the Hugging Face adapters, read by ``read_pretrained`` (by
``config.json``'s ``model_type``) and by the hf export (by the trident network's class), and the formats
their files name (timm's ViT, open_clip's directory). A new family: one line here."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from trident.errors import ConfigError
from trident.weights.adapters import (
    hf_albert,
    hf_bart,
    hf_bert,
    hf_clip,
    hf_electra,
    hf_gemma,
    hf_gpt2,
    hf_llama,
    hf_mistral,
    hf_qwen2,
    hf_qwen3,
    hf_roberta,
    hf_t5,
    hf_vit,
    open_clip_files,
    timm_vit,
)
from trident.weights.adapters.base import Adapter, FileAdapter

ADAPTERS: tuple[Adapter, ...] = (
    hf_gpt2, hf_bert.ADAPTER, hf_vit, hf_llama.ADAPTER, hf_mistral.ADAPTER, hf_qwen2.ADAPTER, hf_qwen3.ADAPTER,
    hf_gemma.GEMMA2, hf_gemma.GEMMA3, hf_albert.ADAPTER, hf_roberta.ADAPTER, hf_electra.ADAPTER,
    hf_clip, hf_bart, hf_t5.T5, hf_t5.MT5,
)
FILE_ADAPTERS: tuple[FileAdapter, ...] = (timm_vit, open_clip_files)


def file_adapter_for(path: Path) -> FileAdapter | None:
    """The adapter whose files ``path`` (an existing file or directory) is, or None."""
    return next((adapter for adapter in FILE_ADAPTERS if adapter.recognises(path)), None)


def adapter_for_model_type(model_type: str) -> Adapter | None:
    """The adapter that reads a ``config.json`` of ``model_type``, or None where trident has none."""
    return next((adapter for adapter in ADAPTERS if adapter.MODEL_TYPE == model_type), None)


def declared_family(net: nn.Module) -> str | None:
    """The ``model.family`` ``net``'s stack declares (a ViT's is its encoder's), or None."""
    cfg = getattr(net, "cfg", None) or getattr(getattr(net, "encoder", None), "cfg", None)
    return getattr(cfg, "family", None)


def adapter_for_network(net: nn.Module) -> Adapter:
    """The adapter that writes ``net``: its declared family's (``model.family``); for a stack that declares none,
    of those whose NETWORK it is, the one that says it :meth:`~Adapter.writes` it. A network of no registered
    family is one ConfigError line."""
    family = declared_family(net)
    if family is not None:
        adapter = next(adapter for adapter in ADAPTERS if adapter.FAMILY == family)
        # A family's other networks (an encoder family's sequence classifier, ELECTRA's discriminator).
        adapter = next((variant for variant in getattr(adapter, "VARIANTS", ()) if type(net) is variant.NETWORK),
                       adapter)
        if type(net) is not adapter.NETWORK:
            raise ConfigError(f"model.family={family} is a {adapter.NETWORK.__name__} ({adapter.ARCHITECTURES[0]}), not a "
                              f"{type(net).__name__}: set model.family=null, or the family of a {type(net).__name__}")
        return adapter
    adapter = next((variant for adapter in ADAPTERS for variant in (adapter, *getattr(adapter, "VARIANTS", ()))
                    if type(net) is variant.NETWORK and variant.writes(net)), None)
    if adapter is None:
        kinds = ", ".join(f"{adapter.NETWORK.__name__} ({adapter.ARCHITECTURES[0]})" for adapter in ADAPTERS)
        raise ConfigError(f"a {type(net).__name__} has no Hugging Face equivalent: the hf export writes {kinds}")
    return adapter


def architectures() -> list[str]:
    """Every transformers class the adapters read, in registry order."""
    return [name for adapter in ADAPTERS for name in adapter.ARCHITECTURES]
