"""The input normalisation an ``init_from`` source was trained with: an image model's mean and std per channel.

A network sees pixels as its training normalised them; fed another normalisation, a frozen timm ViT trained with
0.5 / 0.5 scores 0.41 instead of 0.61. So the statistics are a property of the network an outside source holds
(trident.models.properties' ``PIXEL_MEAN`` / ``PIXEL_STD``), which the task that holds it maps onto its data's settings,
as its image size; a run may still set others (docs/weights.md). A trident run states its own (the task's
``SOURCE_DATA_SETTINGS``); here, read from a Hugging Face directory's ``preprocessor_config.json`` (``image_mean`` /
``image_std``) or timm's ``config.json`` (``pretrained_cfg``'s ``mean`` / ``std``). A source that states none leaves
the data's statistics.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from trident.errors import DataError, is_number
from trident.models.properties import CHANNELS, PIXEL_MEAN, PIXEL_STD
from trident.weights.adapters.outside_network import OutsideNetwork

# timm's keys for the statistics (its pretrained_cfg's), which error lines name them by too.
TIMM_KEYS = {PIXEL_MEAN: "mean", PIXEL_STD: "std"}
# A Hugging Face image processor's file beside the weights, and its keys for them.
HF_PREPROCESSOR_FILE = "preprocessor_config.json"
HF_PREPROCESSOR_KEYS = {PIXEL_MEAN: "image_mean", PIXEL_STD: "image_std"}


def with_outside_statistics(read: OutsideNetwork, path: Path) -> OutsideNetwork:
    """``read`` from ``path`` (a Hugging Face or timm model) with the statistics stated beside it."""
    statistics = outside_statistics(path, read.properties.get(CHANNELS))
    return dataclasses.replace(read, properties=read.properties | statistics)


def outside_statistics(path: Path, channels: int | None) -> dict[str, list[float]]:
    """The statistics stated beside a Hugging Face or timm model (``path``: its directory or weights file), by their
    property names; a single number stands for every one of ``channels``."""
    directory = path if path.is_dir() else path.parent
    preprocessor = _json(directory / HF_PREPROCESSOR_FILE)
    if preprocessor is not None:
        stated = {name: preprocessor.get(key) for name, key in HF_PREPROCESSOR_KEYS.items()}
        return _checked(stated, str(directory / HF_PREPROCESSOR_FILE), channels)
    timm = _json(directory / "config.json")
    if timm is not None and "architecture" in timm:  # timm's config.json (a Hugging Face one names no architecture)
        pretrained = timm.get("pretrained_cfg", timm)  # older timm configs hold them at the top
        stated = {name: pretrained.get(key) for name, key in TIMM_KEYS.items()}
        return _checked(stated, str(directory / "config.json"), channels)
    return {}


def _json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"{path} cannot be read ({type(err).__name__}): fix or remove it") from None
    return value if isinstance(value, dict) else None


def _checked(stated: dict[str, Any], where: str, channels: int | None = None) -> dict[str, list[float]]:
    """Both statistics as lists of floats, a positive std; {} when either is missing (nothing to follow)."""
    if any(value is None for value in stated.values()):
        return {}
    lists = {name: [value] * (channels or 1) if is_number(value) else value for name, value in stated.items()}
    # Removing a statistic from the file is a fix too: a source that states none leaves the data's statistics.
    for name, values in lists.items():
        if not (isinstance(values, list | tuple) and values and all(is_number(v) and math.isfinite(v) for v in values)):
            raise DataError(f"{where}: its {TIMM_KEYS[name]} {values!r} is not a list of numbers: fix it, or remove it")
    if any(v <= 0 for v in lists[PIXEL_STD]):
        raise DataError(f"{where}: its std {lists[PIXEL_STD]} holds a value <= 0: fix it, or remove it")
    return {name: [float(v) for v in values] for name, values in lists.items()}
