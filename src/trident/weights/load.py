"""``trident.load(path)``: a trident checkpoint or run directory -> the task that wrote it, with its
``net`` and ``tokenizer``, on the CPU, in eval mode.

The task class is the one the checkpoint names (:mod:`trident.weights.task_class`); a ``finetune=lora``
checkpoint's frozen base is put back from where it is found (:func:`trident.weights.sources.find_base`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

from trident.tasks.base import TridentTask
from trident.weights.checkpoints import checkpoint_of, load_task_checkpoint, read_checkpoint
from trident.weights.sources import find_base
from trident.weights.task_class import task_class_of

TaskT = TypeVar("TaskT", bound=TridentTask)


def load(path: str | Path) -> TridentTask:
    """A trident checkpoint (.ckpt) or a run directory (its best, else last checkpoint) -> the task
    with its ``net`` and ``tokenizer``, on CPU, in eval mode; whatever task wrote it."""
    checkpoint = checkpoint_of(Path(path))
    task_class = task_class_of(read_checkpoint(checkpoint, "the path", weights=False), checkpoint)
    return load_task(task_class, checkpoint)


def load_task(task_class: type[TaskT], path: Path) -> TaskT:
    """``task_class`` rebuilt from ``path`` (a checkpoint or run directory), a LoRA run's base put back."""
    return load_task_checkpoint(task_class, path, find_base)
