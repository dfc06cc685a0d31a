"""trident: one Transformer backbone, three tasks, one configurable training pipeline."""

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``trident.load``, imported on first use: ``import trident`` stays light (no torch, no Lightning)."""
    if name == "load":
        from trident.weights.load import load

        return load
    raise AttributeError(f"module 'trident' has no attribute {name!r}")
