"""Load a task's checkpoint for inference with clear errors (missing, corrupt, wrong task)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import lightning as L
from tokenizers import Tokenizer

from trident.errors import DataError

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
    except (RuntimeError, EOFError, KeyError, TypeError, ValueError, OSError) as err:
        raise DataError(
            f"cannot read checkpoint {str(path)!r} ({type(err).__name__}): it is corrupt, truncated or not a trident "
            f"{task_name} checkpoint; use another checkpoint of a task={task_name} run (last.ckpt or best-*.ckpt)"
        ) from err
    if getattr(task, "tokenizer", None) is None:
        raise DataError(f"checkpoint {str(path)!r} holds no tokenizer: it was not written by trident's {task_name} task")
    return task.eval()
