"""Objectives: what turns a task's outputs into the loss it trains on (base.py: the seam), chosen by the
``objective`` config group (conf/objective/<name>.yaml, its ``task.objective.name``), each task's default first in
its ``TRAINS_WITH``."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from trident.errors import ConfigError, choose
from trident.objectives.base import TRAIN, Loss, Objective, Outputs, OutputSource
from trident.objectives.contrastive import Contrastive, PairedFeatures
from trident.objectives.kto import KahnemanTversky
from trident.objectives.labels import ClassLabel
from trident.objectives.preference import DirectPreference, OddsRatioPreference
from trident.objectives.tokens import MaskedTokens, NextToken, TargetSequence

__all__ = ["OBJECTIVES", "TRAIN", "ClassLabel", "Contrastive", "DirectPreference", "KahnemanTversky", "Loss", "MaskedTokens",
           "NextToken", "Objective", "OddsRatioPreference", "OutputSource", "Outputs", "PairedFeatures", "TargetSequence",
           "build_objective", "objective_name"]

#: Every objective by its ``objective=`` name.
OBJECTIVES: dict[str, type[Objective]] = {objective.NAME: objective for objective in (
    NextToken, MaskedTokens, TargetSequence, ClassLabel, DirectPreference, OddsRatioPreference, KahnemanTversky, Contrastive,
)}


def objective_name(choice: Mapping[str, Any] | None, task: str, fits: Sequence[str]) -> str:
    """The objective ``choice`` (the ``task.objective`` settings; None: the task's default, ``fits[0]``) names, one
    that ``task``'s outputs fit (``fits``), else one clear line."""
    name = str((choice or {}).get("name", fits[0]))
    choose(OBJECTIVES, name, "objective")
    if name not in fits:
        raise ConfigError(f"objective={name} does not fit task={task}, whose outputs it cannot train on: "
                          f"choose {' or '.join(fits)}")
    return name


def build_objective(choice: Mapping[str, Any] | None, task: str, fits: Sequence[str], **settings: Any) -> Objective:
    """The objective of ``choice`` (see :func:`objective_name`) with its settings: those of ``choice`` beside its
    name, over the task's ``settings`` that it takes (e.g. ``label_smoothing``, a task setting that runs, presets and
    checkpoints name ``task.label_smoothing``)."""
    name = objective_name(choice, task, fits)
    objective = OBJECTIVES[name]
    takes = [p for p in inspect.signature(objective.__init__).parameters if p != "self"]
    options = {key: value for key, value in (choice or {}).items() if key != "name"}
    for key in options:
        if key not in takes:
            raise ConfigError(f"task.objective.{key} is not a setting of objective={name}: remove it"
                              + (f"; it takes {', '.join(takes)}" if takes else "; it takes none"))
    return objective(**{**{key: value for key, value in settings.items() if key in takes}, **options})
