"""Checkpoint files: written atomically, read with ``weights_only=True`` and clear errors
(trident.weights.checkpoint_files, which imports no Lightning), rebuilt as their task, and checked against the
model the config builds before resuming or testing.

Every checkpoint trident writes holds only tensors and plain values (numbers, strings, lists,
dicts; the RNG states too), so every read, of our own files or anyone else's, uses
``torch.load(weights_only=True)``, which cannot run code hidden in a pickled file.
"""

from __future__ import annotations

import inspect
import io
import os
import tempfile
from pathlib import Path
from typing import Any, TypeVar

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch import nn

from trident.converters.weight_only import left_out as quantized_weights
from trident.errors import ConfigError, DataError, TridentError
from trident.parallel.distributed_checkpoint import read_sharded_checkpoint, replace_checkpoint
from trident.tasks.base import TridentTask
from trident.tasks.frozen_base import FROZEN_BASE_KEY, BaseFinder, reading
from trident.tasks.networks import companions_beside
from trident.tasks.teacher import student_alone
from trident.weights.checkpoint_files import READ_ERRORS, checkpoint_of, read_checkpoint, unreadable_checkpoint

__all__ = ["READ_ERRORS", "RETIRED_SETTINGS", "AtomicCheckpointIO", "check_checkpoint_fits", "checkpoint_of",
           "load_task_checkpoint", "read_checkpoint", "unreadable_checkpoint"]

class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes each checkpoint to a temporary file in the same directory, fsyncs it, then renames
    it over the target (a file, or the sharded checkpoint directory of a run that went back to
    files): a crash mid-write never leaves a half-written ``last.ckpt`` in place of a good one.
    (Lightning's own save stages in the system temp dir, possibly another file system, where the
    final move is a copy, and never fsyncs.) Remote paths (s3://...) use Lightning's save."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if not isinstance(get_filesystem(path), LocalFileSystem):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, temp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        try:
            with os.fdopen(handle, "wb") as file:
                torch.save(checkpoint, file)
                file.flush()
                os.fsync(file.fileno())
            replace_checkpoint(Path(temp_name), target)  # a sharded checkpoint of its name too
        except BaseException:
            Path(temp_name).unlink(missing_ok=True)
            raise

    def load_checkpoint(self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        if not get_filesystem(path).exists(path):
            raise DataError(f"checkpoint {str(path)!r} not found: pass an existing .ckpt file or resume=<run dir>")
        if Path(path).is_dir():  # a sharded checkpoint tested in one process (eval.py): its weights gathered
            return read_sharded_checkpoint(Path(path), "ckpt_path")
        try:
            return super().load_checkpoint(path, map_location=map_location, weights_only=True)
        except READ_ERRORS as err:
            raise unreadable_checkpoint(
                path, err, "resume from another checkpoint of the run (checkpoints/last.ckpt or best-*.ckpt)"
            ) from err

TaskT = TypeVar("TaskT", bound=TridentTask)

# Hyperparameters that checkpoints of earlier versions hold and today's tasks no longer take
# (vit's timm file, now init_from=): Lightning leaves them out when it rebuilds the task.
RETIRED_SETTINGS = frozenset({"pretrained"})


def load_task_checkpoint(task_class: type[TaskT], path: Path, find_base: BaseFinder | None = None) -> TaskT:
    """Rebuild ``task_class`` from ``path`` (a checkpoint or a run directory: :func:`checkpoint_of`) on the
    CPU, in eval mode, with its tokenizer (text tasks); a distilled run's student alone (no teacher). ``find_base`` finds a ``finetune=lora`` checkpoint's
    frozen base (trident.weights.sources'; this module sits below the readers of sources): without it such a
    checkpoint is refused in one line."""
    path = checkpoint_of(path)
    task_name = task_class.NAME
    # Another task's checkpoint has settings this task's constructor does not take.
    settings = read_checkpoint(path, "the checkpoint argument", weights=False).get("hyper_parameters") or {}
    foreign = sorted(set(settings) - set(inspect.signature(task_class.__init__).parameters) - RETIRED_SETTINGS)
    if foreign:
        raise DataError(
            f"checkpoint {str(path)!r} is not a trident {task_name} checkpoint (it has the setting {foreign[0]!r}): "
            f"use a checkpoint of a task={task_name} run (last.ckpt or best-*.ckpt)"
        )
    student = student_alone(settings)  # a distilled run's student, without its teacher
    try:
        # Lightning rebuilds a task from a file: a sharded checkpoint comes as one, in memory, its weights gathered.
        source = path if path.is_file() else _in_memory(read_checkpoint(path, "the checkpoint argument"))
        # A finetune=lora checkpoint's base is found (trident.tasks.frozen_base); a companion the run recorded
        # relative to itself (DPO's reference), in the folders that hold the checkpoint, wherever the run is now.
        with reading(path, find_base), companions_beside(*path.resolve().parents):
            task = task_class.load_from_checkpoint(source, map_location="cpu", weights_only=True, **student)
    except TridentError:
        raise  # the task's own one line (e.g. a companion's copy not beside the checkpoint), not "corrupt"
    except READ_ERRORS as err:
        raise unreadable_checkpoint(
            path, err, f"it may not be a trident {task_name} checkpoint; use another checkpoint of a task={task_name} "
            "run (last.ckpt or best-*.ckpt)"
        ) from err
    if task.NEEDS_TOKENIZER and task.tokenizer is None:
        raise DataError(f"checkpoint {str(path)!r} holds no tokenizer: it was not written by trident's {task_name} task")
    return task.eval()


def _in_memory(checkpoint: dict[str, Any]) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    return buffer


def check_checkpoint_fits(checkpoint: dict[str, Any], module: nn.Module, path: Path) -> None:
    """Fail in one line when the saved weights are not those of ``module``: another model size,
    vocabulary or architecture (Lightning would stop with a long size-mismatch traceback)."""
    saved: dict[str, torch.Tensor] = checkpoint["state_dict"]
    expected = module.state_dict()
    fix = "use the model and data settings of the run that wrote it (its config_resolved.yaml)"
    for name, tensor in expected.items():
        if name in saved and saved[name].shape != tensor.shape:
            kind = "vocabulary" if _is_vocabulary(name, saved[name], tensor) else "model size"
            raise ConfigError(
                f"checkpoint {str(path)!r} does not fit this model (another {kind}): {name} is "
                f"{tuple(saved[name].shape)} there, {tuple(tensor.shape)} here; {fix}"
            )
    # A finetune=lora checkpoint leaves out its frozen base, which reading it refills (weights.frozen_base).
    left_out = {f"net.{name}" for name in (checkpoint.get(FROZEN_BASE_KEY) or {}).get("tensors", [])}
    left_out |= quantized_weights(checkpoint, "net.")  # trident-quantize's layers: in its record, put back on reading
    missing = sorted(expected.keys() - saved.keys() - left_out)
    unexpected = sorted(saved.keys() - expected.keys())
    if missing or unexpected:
        detail = f"it lacks {missing[0]}" if missing else f"it has {unexpected[0]}, unknown here"
        raise ConfigError(f"checkpoint {str(path)!r} does not fit this model (another architecture): {detail}; {fix}")


def _is_vocabulary(name: str, saved: torch.Tensor, expected: torch.Tensor) -> bool:
    """A token table or output projection that differs in its number of rows (tokens) only."""
    return (
        name.rsplit(".", 1)[-1] == "weight" and saved.ndim == 2 and saved.shape[1] == expected.shape[1]
        and any(part in name for part in ("embed", "head"))
    )
