"""Per-layer overrides of a stack's settings (``model.layers``): what a family varies from layer to layer.

Gemma 2 and 3 alternate sliding-window and global layers, Gemma 3 rotates them with two rope bases, Qwen2's
``max_window_layers`` keeps its first layers global: one stack, layers that differ. ``model.layers`` is a list
of one entry per layer, each null (the stack's settings) or a mapping of the keys of :data:`LAYER_KEYS`; an
unknown key fails naming the keys there are (as x-transformers refuses an unknown layer kwarg).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trident.errors import ConfigError, did_you_mean, is_int

# model.layers[i] key -> what it overrides in layer i.
LAYER_KEYS = {
    "attention_window": "the layer's sliding window (null: the whole context), instead of model.attention_window",
    "rope": "whether the layer rotates its queries and keys (false: no position information in it; pos_encoding=rope)",
    "pos_encoding_options": "the layer's rope options (base, scaling), instead of pos_encoding.options (pos_encoding=rope)",
}


@dataclass(frozen=True)
class LayerSettings:
    """What one layer of a stack uses, the stack's settings with its overrides applied."""

    attention_window: int | None  # None: the whole context
    rope: bool  # whether the layer rotates queries and keys (a rope stack only)
    pos_encoding_options: dict[str, Any]  # the rope options of this layer


def layer_settings(layers: list[Any] | None, n_layers: int, attention_window: int | None, pos_encoding: str,
                   pos_encoding_options: dict[str, Any]) -> list[LayerSettings]:
    """Every layer's :class:`LayerSettings`: ``layers`` (``model.layers``: None, or one entry per layer, null or a
    mapping of :data:`LAYER_KEYS`) over the stack's ``attention_window`` and rope options; bad input is one line."""
    stack = LayerSettings(attention_window, pos_encoding == "rope", dict(pos_encoding_options))
    if layers is None:
        return [stack] * n_layers
    # A Sequence, not only a list: Hydra's ListConfig where a config is built from the composed one.
    if not isinstance(layers, Sequence) or isinstance(layers, str) or len(layers) != n_layers:
        raise ConfigError(f"model.layers must be a list of one entry per layer ({n_layers}, model.n_layers), got "
                          f"{layers!r}: give null or a mapping for each layer, or model.layers=null for identical layers")
    return [_one_layer(i, entry, stack, pos_encoding) for i, entry in enumerate(layers)]


def _one_layer(i: int, entry: Any, stack: LayerSettings, pos_encoding: str) -> LayerSettings:
    if entry is None:
        return stack
    if not hasattr(entry, "items"):
        raise ConfigError(f"model.layers[{i}] must be null or a mapping of {', '.join(LAYER_KEYS)}, got {entry!r}")
    for key in entry:
        if key not in LAYER_KEYS:
            raise ConfigError(f"model.layers[{i}].{key} is not a per-layer setting{did_you_mean(str(key), list(LAYER_KEYS))}: "
                              f"a layer takes {', '.join(LAYER_KEYS)} (docs/architecture.md)")
    window = entry.get("attention_window", stack.attention_window)
    if window is not None and (not is_int(window) or window <= 0):
        raise ConfigError(f"model.layers[{i}].attention_window must be a positive integer or null, got {window!r}")
    rope = entry.get("rope", stack.rope)
    if not isinstance(rope, bool):
        raise ConfigError(f"model.layers[{i}].rope must be true or false, got {rope!r}")
    if ("rope" in entry or "pos_encoding_options" in entry) and pos_encoding != "rope":
        raise ConfigError(f"model.layers[{i}] sets rope or pos_encoding_options, which only a rope stack has "
                          f"(pos_encoding={pos_encoding}): use pos_encoding=rope, or drop them")
    options = entry.get("pos_encoding_options", stack.pos_encoding_options)
    if not hasattr(options, "items"):
        raise ConfigError(f"model.layers[{i}].pos_encoding_options must be a mapping (e.g. {{base: 10000}}), got {options!r}")
    return LayerSettings(window, rope, dict(options))
