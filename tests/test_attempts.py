"""One training across its attempts (trident.runs.attempts): the last.ckpt an attempt ends with continues it
step for step, on real Lightning trainers."""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader

from trident.runs.attempts import FinalStepCheckpoint, keep_csv_history_until, keep_history_until
from trident.tracking.steps import ValidationRowStep

from .test_wandb_journal import TinyTask


class Steps(Logger):
    """The steps of the training rows Lightning logs."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[int] = []

    @property
    def name(self) -> str:
        return "steps"

    @property
    def version(self) -> str:
        return "0"

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """Only the steps matter here."""

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if "train/loss" in metrics and step is not None:
            self.steps.append(step)


def _fit(ckpt_dir: Path, max_steps: int, *extra: L.Callback, resume: Path | None = None) -> list[int]:
    """The pipeline's checkpoint callbacks (conf/callbacks/default.yaml: last.ckpt at each validation and every
    100 steps, which this run never reaches) with a validation every 3 steps."""
    steps = Steps()
    data = DataLoader(torch.full((256, 1), 0.5), batch_size=4)
    trainer = L.Trainer(
        max_steps=max_steps, val_check_interval=3, limit_val_batches=1, log_every_n_steps=1, logger=steps,
        callbacks=[FinalStepCheckpoint(), ValidationRowStep(), *extra,
                   ModelCheckpoint(ckpt_dir, "best", monitor="val/loss", save_last=True, enable_version_counter=False),
                   ModelCheckpoint(ckpt_dir, save_top_k=0, save_last=True, every_n_train_steps=100,
                                   enable_version_counter=False)],
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu",
    )
    trainer.fit(TinyTask(), data, data, ckpt_path=resume)
    return steps.steps


def test_a_run_early_stopping_ended_extends_step_for_step(tmp_path: Path) -> None:
    """Early stopping ends the run at its validation of step 6: last.ckpt is that validation's (Lightning's
    train-end one, written over it, had the loops past their end: the extension logged 7, 8, 9)."""
    stop = EarlyStopping("val/loss", min_delta=100.0, patience=1)  # no improvement is enough: stops at 6
    assert _fit(tmp_path, 30, stop) == list(range(6))
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 6
    assert _fit(tmp_path, 9, resume=tmp_path / "last.ckpt") == [6, 7, 8]


def test_a_run_that_reached_max_steps_extends_step_for_step(tmp_path: Path) -> None:
    """7 steps (no validation, no periodic checkpoint at the end): last.ckpt of step 7 is saved as it ends."""
    assert _fit(tmp_path, 7) == list(range(7))
    assert _fit(tmp_path, 9, resume=tmp_path / "last.ckpt") == [7, 8]


def test_a_resumed_history_keeps_the_rows_up_to_its_checkpoint_without_tests(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    rows = [(3, "validate"), (6, "validate"), (6, "test"), (9, "validate")]
    path.write_text("".join(json.dumps({"step": s, "stage": t}) + "\n" for s, t in rows) + '{"step": 12, "sta')
    keep_history_until(path, 6)
    assert [(r["step"], r["stage"]) for r in map(json.loads, path.read_text().splitlines())] == rows[:2]


def test_a_resumed_runs_csv_logs_keep_each_step_once_without_tests(tmp_path: Path) -> None:
    """An attempt killed at step 9 after its checkpoint at 6 logged 7-9 to its CSV (Lightning's own writer); the
    resumed attempt logs them again in version_1: version_0 keeps the rows up to 6, without its test row."""
    from lightning.pytorch.loggers import CSVLogger

    killed = CSVLogger(save_dir=str(tmp_path), name="csv")
    for step in range(10):
        killed.log_metrics({"train/loss": 1.0 / (step + 1)}, step=step)
    killed.log_metrics({"val/loss": 0.5}, step=6)
    killed.log_metrics({"test/loss": 0.4}, step=6)
    killed.save()
    keep_csv_history_until(tmp_path, 6)
    with (tmp_path / "csv" / "version_0" / "metrics.csv").open() as rows:
        kept = list(csv.DictReader(rows))
    assert [(int(row["step"]), bool(row["val/loss"])) for row in kept] == [*((s, False) for s in range(7)), (6, True)]
    assert {"train/loss", "val/loss", "test/loss"} <= set(kept[0])  # the columns stand, for the next version's reader


def test_holds_step_reads_the_checkpoints_step_and_refuses_a_sharded_one(tmp_path: Path) -> None:
    """The preemption callback saves no second last.ckpt at train end where the final step's one stands."""
    from trident.launch.preemption import holds_step

    path = tmp_path / "last.ckpt"
    torch.save({"global_step": 7, "state_dict": {}}, path)
    assert holds_step(path, 7) and not holds_step(path, 8) and not holds_step(path, 6)
    assert not holds_step(tmp_path / "missing.ckpt", 7)
    (tmp_path / "sharded.ckpt").mkdir()
    assert not holds_step(tmp_path / "sharded.ckpt", 7)
