"""Weights in and out, one room: trident checkpoints and runs (``checkpoints``, ``load``: ``trident.load``),
``init_from`` (``init_from``: what a source fixes in the config; ``transfer``: its weights into the built
task, with the weights table) and outside formats both ways (``adapters``: Hugging Face, timm).

``read_pretrained(path)`` reads a Hugging Face model directory (GPT-2, BERT, ViT) or a timm ViT
state-dict file into a :class:`PretrainedWeights`, in trident's names and settings.
"""

from typing import Any

__all__ = ["PretrainedWeights", "read_pretrained", "supported"]


def __getattr__(name: str) -> Any:
    """The public names, imported on first use: safetensors and the adapters load only when a source needs them."""
    if name == "PretrainedWeights":
        from trident.weights.pretrained import PretrainedWeights

        return PretrainedWeights
    if name in ("read_pretrained", "supported"):
        from trident.weights.adapters import reading

        return getattr(reading, name)
    raise AttributeError(f"module 'trident.weights' has no attribute {name!r}")
