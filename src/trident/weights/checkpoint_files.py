"""Reading trident checkpoint files: which checkpoint a path means (:func:`checkpoint_of`) and its contents
(:func:`read_checkpoint`), with ``weights_only=True`` and one-line errors. torch only, no Lightning: the commands
that read a network alone (trident.weights.network) import this, not trident.weights.checkpoints (the task's side).
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any, TypeAlias

import torch

from trident.errors import DataError
from trident.parallel.distributed_checkpoint import holds_shards, is_checkpoint, read_sharded_checkpoint

# A checkpoint's path as Lightning's checkpoint IO takes it (its _PATH, without importing Lightning).
PathLike: TypeAlias = str | Path | os.PathLike[str]

# What torch.load raises on a truncated, corrupt or foreign file.
READ_ERRORS = (RuntimeError, EOFError, KeyError, TypeError, ValueError, OSError, pickle.UnpicklingError)


def unreadable_checkpoint(path: PathLike, err: BaseException, fix: str) -> DataError:
    """The one-line error for a checkpoint file that torch.load(weights_only=True) refused."""
    reason = "corrupt or truncated"
    if isinstance(err, pickle.UnpicklingError):
        reason = "it holds pickled Python objects, not only tensors and plain values (refused by weights_only=True)"
    return DataError(f"cannot read checkpoint {str(path)!r} ({type(err).__name__}: {reason}): {fix}")


def checkpoint_of(path: Path) -> Path:
    """``path`` itself when it is a checkpoint file or a sharded checkpoint directory, else the run
    directory's best checkpoint, else its last."""
    if path.is_file() or holds_shards(path):
        return path
    if not path.is_dir():
        raise DataError(f"{str(path)!r} not found: pass a trident checkpoint (.ckpt) or a train.py run directory")
    folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    best = sorted(p for p in folder.glob("best-*.ckpt") if is_checkpoint(p))
    if len(best) > 1:  # save_top_k > 1: the one the last checkpoint's ModelCheckpoint calls best
        best = [p for p in best if p.name == _recorded_best(folder / "last.ckpt")] or best[-1:]
    if best:
        return best[0]
    if is_checkpoint(folder / "last.ckpt"):
        return folder / "last.ckpt"
    raise DataError(
        f"{str(path)!r} holds no checkpoint (no checkpoints/best-*.ckpt or last.ckpt): pass a .ckpt file or the "
        "directory of a train.py run that saved one"
    )


def _recorded_best(last: Path) -> str | None:
    if not is_checkpoint(last):
        return None
    for state in (read_checkpoint(last, "the path", weights=False).get("callbacks") or {}).values():
        if isinstance(state, dict) and state.get("best_model_path"):
            return Path(state["best_model_path"]).name
    return None


def read_checkpoint(path: Path, setting: str, weights: bool = True) -> dict[str, Any]:
    """The checkpoint file at ``path`` (named by the config key ``setting``), memory-mapped and read
    with ``weights_only=True`` (tensors and plain values: safe for a file from elsewhere). A sharded
    checkpoint directory gives the same dict, its weights gathered (``weights=False``: their shapes only).
    :func:`read_sharded_checkpoint` is the one place trident reads one outside FSDP."""
    if holds_shards(path):
        return read_sharded_checkpoint(path, setting, weights)
    if not path.is_file():
        raise DataError(f"checkpoint {str(path)!r} not found: fix {setting} (paths are relative to the directory you run from)")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except READ_ERRORS as err:
        raise unreadable_checkpoint(path, err, f"point {setting} at another one (last.ckpt or best-*.ckpt of the run)") from err
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise DataError(f"{str(path)!r} holds no model weights (state_dict): point {setting} at a checkpoint written by train.py")
    return checkpoint


