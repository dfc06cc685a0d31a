"""Load a task's checkpoint for inference with clear errors (missing, corrupt, wrong task), and
check before resuming or testing that a checkpoint fits the model the config builds."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, TypeVar

import lightning as L
import torch
from tokenizers import Tokenizer
from torch import nn

from trident.errors import ConfigError, DataError

# What torch.load raises on a file that is truncated, damaged or no checkpoint at all.
UNREADABLE = (RuntimeError, EOFError, pickle.UnpicklingError, OSError, ValueError)

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
        # Our own checkpoints hold plain hyperparameters and a tokenizer string, and loading
        # them fully is what resuming needs; only pass files you trust.
        task = task_class.load_from_checkpoint(path, map_location="cpu", weights_only=False)
    except (*UNREADABLE, KeyError, TypeError) as err:
        raise DataError(
            f"cannot read checkpoint {str(path)!r} ({type(err).__name__}): it is corrupt, truncated or not a trident "
            f"{task_name} checkpoint; use another checkpoint of a task={task_name} run (last.ckpt or best-*.ckpt)"
        ) from err
    if getattr(task, "tokenizer", None) is None:
        raise DataError(f"checkpoint {str(path)!r} holds no tokenizer: it was not written by trident's {task_name} task")
    return task.eval()


def read_checkpoint(path: Path, setting: str) -> dict[str, Any]:
    """The checkpoint file at ``path`` (named by the config key ``setting``), memory-mapped and read
    with ``weights_only=True`` (tensors and plain values: safe for a file from elsewhere)."""
    if not path.is_file():
        raise DataError(f"checkpoint {str(path)!r} not found: fix {setting} (paths are relative to the directory you run from)")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except UNREADABLE as err:
        raise DataError(
            f"cannot read checkpoint {str(path)!r} ({type(err).__name__}): it is corrupt, truncated or not a checkpoint; "
            f"point {setting} at another one (last.ckpt or best-*.ckpt of the run)"
        ) from err
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise DataError(f"{str(path)!r} holds no model weights (state_dict): point {setting} at a checkpoint written by train.py")
    return checkpoint


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
    missing, unexpected = sorted(expected.keys() - saved.keys()), sorted(saved.keys() - expected.keys())
    if missing or unexpected:
        detail = f"it lacks {missing[0]}" if missing else f"it has {unexpected[0]}, unknown here"
        raise ConfigError(f"checkpoint {str(path)!r} does not fit this model (another architecture): {detail}; {fix}")


def _is_vocabulary(name: str, saved: torch.Tensor, expected: torch.Tensor) -> bool:
    """A token table or output projection that differs in its number of rows (tokens) only."""
    return (
        name.rsplit(".", 1)[-1] == "weight" and saved.ndim == 2 and saved.shape[1] == expected.shape[1]
        and any(part in name for part in ("embed", "head"))
    )
