"""The task class that wrote a trident checkpoint: the one it names (``trident_task``, written by every task since it
was added); a checkpoint of an earlier version is matched through its run's ``config_resolved.yaml``, else by which
task's constructor takes its hyperparameters.
"""

from __future__ import annotations

import inspect
import pydoc
from pathlib import Path
from typing import Any

from trident.errors import DataError
from trident.tasks.base import TridentTask
from trident.tasks.task_in_checkpoint import TASK_KEY
from trident.weights.checkpoints import RETIRED_SETTINGS
from trident.weights.run_config import run_config_of

# The task classes whose checkpoints predate TASK_KEY (every later task records itself).
EARLIER_TASKS = (
    "trident.tasks.lm.LanguageModelTask",
    "trident.tasks.mlm.MaskedLanguageModelTask",
    "trident.tasks.translation.TranslationTask",
    "trident.tasks.vit.ImageClassificationTask",
)


def task_class_of(checkpoint: dict[str, Any], path: Path) -> type[TridentTask]:
    """The task class that wrote ``checkpoint`` (read from ``path``)."""
    target = checkpoint.get(TASK_KEY) or _target_in_run_config(path) or _target_by_settings(checkpoint, path)
    try:  # pydoc's lookup, not Hydra's: exporting, chatting and sampling import Hydra nowhere else
        task_class = pydoc.locate(target)
    except pydoc.ErrorDuringImport:
        task_class = None
    if task_class is None:
        raise DataError(f"checkpoint {str(path)!r} was written by the task {target!r}, which this trident lacks: "
                        "load it with the trident version that wrote it")
    if not (isinstance(task_class, type) and issubclass(task_class, TridentTask)):
        raise DataError(f"checkpoint {str(path)!r} names {target!r}, which is not a trident task: "
                        "pass a checkpoint written by train.py")
    return task_class


def _target_in_run_config(path: Path) -> str | None:
    from omegaconf import DictConfig, OmegaConf  # an earlier version's checkpoint only

    config = run_config_of(path)
    saved = OmegaConf.load(config) if config is not None else None
    target = OmegaConf.select(saved, "task._target_") if isinstance(saved, DictConfig) else None
    return str(target) if target else None


def _target_by_settings(checkpoint: dict[str, Any], path: Path) -> str:
    """The one earlier task whose constructor takes every hyperparameter of ``checkpoint``."""
    settings = set(checkpoint.get("hyper_parameters") or {}) - RETIRED_SETTINGS
    fits = [target for target in EARLIER_TASKS
            if settings and settings <= set(inspect.signature(pydoc.locate(target).__init__).parameters)]
    if len(fits) != 1:
        raise DataError(
            f"checkpoint {str(path)!r} does not say which task wrote it, and its settings fit "
            f"{'none' if not fits else 'several'} of trident's tasks: pass a checkpoint inside its train.py run directory"
        )
    return fits[0]
