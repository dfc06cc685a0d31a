"""Converters (base.py: the seam): what changes a network between loading its weights and sharding it, chosen by
the ``finetune`` config group (conf/finetune/<name>.yaml) and recorded in the task's hyperparameters by name.

To add one: a :class:`Converter` subclass in this room, an entry in :data:`CONVERTERS`, its settings keyword on the
tasks' constructors (the hyperparameter a checkpoint re-applies it from) and, if it writes an artifact, its files
in trident.weights (docs/architecture.md, "Add a converter").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from trident.converters.base import ArtifactFiles, Converter
from trident.converters.lora import LORA_KEYS, LoRA
from trident.errors import ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from trident.backbone import TransformerConfig

__all__ = ["CONVERTERS", "FINETUNE_MODES", "LORA_KEYS", "ArtifactFiles", "Converter", "LoRA", "check_run",
           "converter_settings", "converters_of", "unsplittable"]

#: Every converter by its ``finetune=`` name, which is also its task hyperparameter.
CONVERTERS: dict[str, type[Converter]] = {converter.NAME: converter for converter in (LoRA,)}
#: The ``finetune=`` options: every weight trains (``full``), or a converter changes the network.
FINETUNE_MODES = ("full", *CONVERTERS)


def converter_settings(cfg: DictConfig, backbone: TransformerConfig) -> dict[str, dict[str, Any] | None]:
    """The ``finetune`` group checked against ``backbone``: each converter's settings by its name (the task's
    keyword arguments), None for the converters it does not choose."""
    from omegaconf import OmegaConf

    finetune: dict[str, Any] = OmegaConf.to_container(cfg.get("finetune") or {"name": "full"}, resolve=True)  # type: ignore[assignment]
    mode = finetune.get("name")
    if mode not in FINETUNE_MODES:
        raise ConfigError(f"finetune={mode} is not a fine-tuning mode: choose one of {', '.join(FINETUNE_MODES)}")
    return {name: converter.check(cfg, finetune, backbone) if name == mode else None
            for name, converter in CONVERTERS.items()}


def check_run(cfg: DictConfig) -> None:
    """What the chosen converter forbids a training run (e.g. sharded checkpoints under LoRA)."""
    chosen = CONVERTERS.get(str((cfg.get("finetune") or {}).get("name", "full")))
    if chosen is not None:
        chosen.check_run(cfg)


def unsplittable(cfg: DictConfig) -> str | None:
    """The ``finetune=`` option whose converted network tensor parallelism cannot split (None: the plan splits it)."""
    chosen = CONVERTERS.get(str((cfg.get("finetune") or {}).get("name", "full")))
    return chosen.NAME if chosen is not None and not chosen.TENSOR_PARALLEL else None


def converters_of(hparams: Mapping[str, Any]) -> list[Converter]:
    """The converters a task's hyperparameters record (each under its name; None or absent: not applied)."""
    return [converter(hparams[name]) for name, converter in CONVERTERS.items() if hparams.get(name) is not None]
