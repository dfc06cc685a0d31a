"""Checkpoint files: written atomically, read with ``weights_only=True`` and clear errors.

Every checkpoint trident writes holds only tensors and plain values (numbers, strings, lists,
dicts; the RNG states too), so every read, of our own files or anyone else's, uses
``torch.load(weights_only=True)``, which cannot run code hidden in a pickled file.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from pathlib import Path
from typing import Any, TypeVar

import lightning as L
import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO
from tokenizers import Tokenizer

from trident.errors import DataError

# What torch.load raises on a truncated, corrupt or foreign file.
READ_ERRORS = (RuntimeError, EOFError, KeyError, TypeError, ValueError, OSError, pickle.UnpicklingError)


def unreadable_checkpoint(path: _PATH, err: BaseException, fix: str) -> DataError:
    """The one-line error for a checkpoint file that torch.load(weights_only=True) refused."""
    reason = "corrupt or truncated"
    if isinstance(err, pickle.UnpicklingError):
        reason = "it holds pickled Python objects, not only tensors and plain values (refused by weights_only=True)"
    return DataError(f"cannot read checkpoint {str(path)!r} ({type(err).__name__}: {reason}): {fix}")


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes each checkpoint to a temporary file in the same directory, fsyncs it, then renames
    it over the target: a crash mid-write never leaves a half-written ``last.ckpt`` in place of a
    good one. (Lightning's own save stages in the system temp dir, possibly another file system,
    where the final move is a copy, and never fsyncs.) Remote paths (s3://...) use Lightning's save."""

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
            os.replace(temp_name, target)
        except BaseException:
            Path(temp_name).unlink(missing_ok=True)
            raise
        directory = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(directory)  # the rename itself survives a power loss
        finally:
            os.close(directory)

    def load_checkpoint(self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        if not get_filesystem(path).exists(path):
            raise DataError(f"checkpoint {str(path)!r} not found: pass an existing .ckpt file or resume=<run dir>")
        try:
            return super().load_checkpoint(path, map_location=map_location, weights_only=True)
        except READ_ERRORS as err:
            raise unreadable_checkpoint(
                path, err, "resume from another checkpoint of the run (checkpoints/last.ckpt or best-*.ckpt)"
            ) from err

TaskT = TypeVar("TaskT", bound=L.LightningModule)


class TokenizerInCheckpoint:
    """LightningModule mixin: the tokenizer travels inside every checkpoint, so a checkpoint
    alone can decode (it is not a hyperparameter: a BPE vocabulary is large)."""

    tokenizer: Tokenizer | None

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.tokenizer is not None:
            checkpoint["tokenizer_json"] = self.tokenizer.to_str()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if checkpoint.get("tokenizer_json"):
            self.tokenizer = Tokenizer.from_str(checkpoint["tokenizer_json"])


def load_task_checkpoint(task_class: type[TaskT], path: Path, task_name: str) -> TaskT:
    """Rebuild ``task_class`` from ``path`` on the CPU, in eval mode, with its tokenizer."""
    if not path.is_file():
        raise DataError(f"checkpoint {str(path)!r} not found: pass the path of a .ckpt file (e.g. <run dir>/checkpoints/last.ckpt)")
    try:
        task = task_class.load_from_checkpoint(path, map_location="cpu", weights_only=True)
    except READ_ERRORS as err:
        raise unreadable_checkpoint(
            path, err, f"it may not be a trident {task_name} checkpoint; use another checkpoint of a task={task_name} "
            "run (last.ckpt or best-*.ckpt)"
        ) from err
    if getattr(task, "tokenizer", None) is None:
        raise DataError(f"checkpoint {str(path)!r} holds no tokenizer: it was not written by trident's {task_name} task")
    return task.eval()
