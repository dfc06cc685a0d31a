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
from trident.converters.nf4 import NF4_KEYS, NF4Base
from trident.errors import ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from trident.backbone import TransformerConfig

__all__ = ["CONVERTERS", "FINETUNE_MODES", "LORA_KEYS", "NF4_KEYS", "ArtifactFiles", "Converter", "LoRA", "NF4Base",
           "check_run", "chosen_converters", "converter_settings", "converters_of", "unsplittable"]

#: Every converter by its name, which is also its task hyperparameter, in the order a network is converted (a
#: checkpoint's converters are applied in this order and merged in the reverse): LoRA's adapters wrap the linears
#: before the NF4 base quantizes their weights, so a merge dequantizes before it adds the adapters.
CONVERTERS: dict[str, type[Converter]] = {converter.NAME: converter for converter in (LoRA, NF4Base)}
#: The ``finetune=`` options and the converters each composes (as torchtitan's ``model.converters`` list): every
#: weight trains (``full``), LoRA's adapters, or them on a base stored in NF4 (QLoRA).
FINETUNE_MODES: dict[str, tuple[type[Converter], ...]] = {"full": (), "lora": (LoRA,), "qlora": (LoRA, NF4Base)}


def converter_settings(cfg: DictConfig, backbone: TransformerConfig) -> dict[str, dict[str, Any] | None]:
    """The ``finetune`` group checked against ``backbone``: each converter's settings by its name (the task's
    keyword arguments), None for the converters it does not choose."""
    from omegaconf import OmegaConf

    finetune: dict[str, Any] = OmegaConf.to_container(cfg.get("finetune") or {"name": "full"}, resolve=True)  # type: ignore[assignment]
    mode = finetune.get("name")
    if mode not in FINETUNE_MODES:
        raise ConfigError(f"finetune={mode} is not a fine-tuning mode: choose one of {', '.join(FINETUNE_MODES)}")
    chosen = FINETUNE_MODES[mode]
    return {name: converter.check(cfg, finetune, backbone) if converter in chosen else None
            for name, converter in CONVERTERS.items()}


def chosen_converters(cfg: DictConfig) -> tuple[type[Converter], ...]:
    """The converters the config's ``finetune=`` option composes (none for ``full`` or an unknown option)."""
    return FINETUNE_MODES.get(str((cfg.get("finetune") or {}).get("name", "full")), ())


def check_run(cfg: DictConfig) -> None:
    """What the chosen converters forbid a training run (e.g. sharded checkpoints under LoRA)."""
    for converter in chosen_converters(cfg):
        converter.check_run(cfg)


def unsplittable(cfg: DictConfig) -> str | None:
    """The ``finetune=`` option whose converted network tensor parallelism cannot split (None: the plan splits it)."""
    chosen = chosen_converters(cfg)
    return str(cfg.finetune.name) if any(not converter.TENSOR_PARALLEL for converter in chosen) else None


def converters_of(hparams: Mapping[str, Any]) -> list[Converter]:
    """The converters a task's hyperparameters record (each under its name; None or absent: not applied)."""
    return [converter(hparams[name]) for name, converter in CONVERTERS.items() if hparams.get(name) is not None]
