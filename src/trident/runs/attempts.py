"""One training across its attempts: what an attempt saves at its end and keeps of the earlier ones, so that
a resumed or extended run continues step for step, on one step axis, whatever checkpoint it resumes from.

- :class:`FinalStepCheckpoint`: ``last.ckpt`` of the final step is saved as the step ends, as Lightning's
  periodic checkpoints are, never after training ended. Lightning's ``ModelCheckpoint(save_last=True)``
  otherwise writes it at train end when it saved none during the attempt (e.g. a run shorter than
  ``every_n_train_steps``), with the loops already past their end: the epoch counted as done and the
  logging step moved on, so a run extended from it (``resume=<run dir> trainer.max_steps=...``) took the
  next epoch's batches and logged every later step one too far (30 -> 40 steps: 0-29, then 31-40). A run
  that early stopping ended keeps the last.ckpt its final validation saved, for the same reason.
- :class:`EpochBoundaryResume`: a resumed attempt whose checkpoint was saved at the end of an epoch's last
  step (a stop signal's checkpoint, the final step's last.ckpt) starts its next epoch as an uninterrupted
  run does: Lightning otherwise never counts that epoch as begun, and the next such resume reads the epoch
  before again.
- :func:`keep_history_until`: a resumed attempt starts ``metrics.jsonl`` from the rows up to its
  checkpoint's step, without the earlier attempts' test rows: the file holds one training, each
  validation once and the test of the model as it ended; :func:`keep_csv_history_until` does the same for the
  CSV logs of the earlier attempts (each attempt writes its own ``csv/version_N/metrics.csv``).
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

TEST_STAGE = "test"


class FinalStepCheckpoint(L.Callback):
    """Saves ``last.ckpt`` (where the ``save_last`` checkpoint callbacks keep it) at the end of the final
    optimizer step, and stops those callbacks from writing it again once training has ended."""

    def __init__(self) -> None:
        self.saved = False

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.saved or not _final_step(trainer, batch_idx):
            return
        for path in _last_paths(trainer):  # every rank calls: the strategy decides who writes
            trainer.save_checkpoint(path, weights_only=False)
        self.saved = True

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning runs the checkpoint callbacks' hooks after the others': this comes first.
        savers = _last_savers(trainer)
        # An early stop ends training at a validation, whose checkpoint callback wrote last.ckpt of this step
        # already; a callback that saved none this attempt would write it again over it, the loops past their end.
        written = {str(c.dirpath) for c in savers if c._last_checkpoint_saved and c._last_global_step_saved == trainer.global_step}
        for callback in savers:
            if self.saved or str(callback.dirpath) in written:
                callback.save_last = False


class EpochBoundaryResume(L.Callback):
    """Counts the epoch that follows a checkpoint of an epoch's last step as begun, as an uninterrupted run does.

    Such a checkpoint holds the fit loop's epoch counters mid-epoch (``ready`` = ``started`` = e + 1,
    ``processed`` = ``completed`` = e for epoch e, 0-based). Lightning (2.6) restores it as "restarted mid-epoch
    at its last batch": it counts epoch e processed, but keeps that restart stage for the loop's next
    iteration, whose start then skips ``increment_ready`` / ``increment_started`` and ``on_train_epoch_start``
    meant for a half-run epoch. Epoch e + 1 runs with ``ready`` = e + 1 instead of e + 2, and a checkpoint of
    its (or a later epoch's) last step reads as a finished epoch: the next resume counts no epoch done, and
    Lightning's ``set_epoch`` gives the sampler the epoch before again (a stop at the end of an epoch twice
    drew epoch 6's order once more at step 15). Clearing the stage once the restored epoch is counted done
    makes the next epoch begin as usual; a mid-epoch restore (``processed`` < ``ready``) keeps it.
    """

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Runs after the fit loop's reset (which counted the restored epoch done) and before its next epoch starts.
        fit = trainer.fit_loop
        epochs = fit.epoch_progress.current
        if (fit.restarted_mid_epoch or fit.restarted_on_epoch_end) and epochs.processed == epochs.ready:
            fit.reset_restart_stage()


def _final_step(trainer: L.Trainer, batch_idx: int) -> bool:
    """Whether the batch that just ended finished the training: its optimizer step reached ``max_steps``,
    or it was the last batch of the last epoch. (An early stop is decided later, at validation.)"""
    # After a micro-batch that only accumulated, global_step has not moved yet.
    if trainer.max_steps is not None and trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps:
        return True
    epochs = trainer.max_epochs
    last_epoch = epochs is not None and epochs > 0 and trainer.current_epoch + 1 >= epochs
    return last_epoch and batch_idx + 1 >= trainer.num_training_batches


def _last_savers(trainer: L.Trainer) -> list[ModelCheckpoint]:
    return [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.save_last and c.dirpath]


def _last_paths(trainer: L.Trainer) -> list[str]:
    """``<dirpath>/last.ckpt`` of each ``save_last`` callback, once per directory."""
    paths = {os.path.join(str(c.dirpath), f"{c.CHECKPOINT_NAME_LAST}{c.FILE_EXTENSION}") for c in _last_savers(trainer)}
    return sorted(paths)


def keep_history_until(path: Path, step: int) -> None:
    """Rewrite ``metrics.jsonl`` for an attempt resuming at ``step``: rows of later steps (an earlier
    attempt went on past its last checkpoint) and test rows (of a model since trained on) go."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            break  # a line cut short by a kill: the rows before it are whole
        if row.get("step", 0) <= step and row.get("stage") != TEST_STAGE:
            kept.append(line + "\n")
    partial = path.with_suffix(".partial")
    partial.write_text("".join(kept))
    os.replace(partial, path)


def keep_csv_history_until(run_dir: Path, step: int) -> None:
    """Rewrite the CSV logs of the earlier attempts of a run resuming at ``step`` (``<run>/csv/version_*/metrics.csv``,
    ``logger=csv``): rows of later steps (an attempt killed past its last checkpoint logged them; the resumed
    attempt logs them again) and test rows go, so that the versions read together hold each step once."""
    for path in sorted(run_dir.glob("csv/version_*/metrics.csv")):
        with path.open(newline="") as rows:
            reader = csv.DictReader(rows)
            columns, kept = reader.fieldnames or [], []
            for row in reader:
                tested = any(value for name, value in row.items() if name and name.startswith(f"{TEST_STAGE}/"))
                if row.get("step") and int(float(row["step"])) <= step and not tested:
                    kept.append(row)
        partial = path.with_suffix(".partial")
        with partial.open("w", newline="") as rows:
            writer = csv.DictWriter(rows, fieldnames=columns)
            writer.writeheader()
            writer.writerows(kept)
        os.replace(partial, path)
