"""A command's task through the task contract, never a class name: the task a checkpoint names, refused in one line
before its weights are read when it lacks the capability the command needs (``TridentTask.CAPABILITIES``, e.g.
trident-sample and trident-chat need a task that generates)."""

from __future__ import annotations

from pathlib import Path

from trident.errors import DataError
from trident.tasks.base import TridentTask
from trident.weights.checkpoints import checkpoint_of, read_checkpoint
from trident.weights.load import load_task
from trident.weights.task_class import task_class_of


def load_capable(path: Path, capability: str, command: str) -> TridentTask:
    """The task of ``path`` (a checkpoint or run directory), on the CPU in eval mode, when its class declares
    ``capability``; else one line naming the tasks that do, for ``command``."""
    checkpoint = checkpoint_of(path)
    task_class = task_class_of(read_checkpoint(checkpoint, "the checkpoint argument", weights=False), checkpoint)
    if capability not in task_class.CAPABILITIES:
        # Here only: the registry imports every task, which a command that starts fast leaves unread.
        from trident.tasks.registry import TASKS

        able = [f"task={name}" for name, task in TASKS.items() if capability in task.CAPABILITIES]
        raise DataError(f"checkpoint {str(checkpoint)!r} was written by task={task_class.NAME}, which cannot "
                        f"{capability}: {command} needs a run of {' or '.join(able)}")
    return load_task(task_class, checkpoint)
