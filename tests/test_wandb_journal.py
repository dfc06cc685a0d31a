"""The W&B journal: a resumed attempt sends W&B the rows an earlier attempt logged before its
checkpoint, once, in order, ahead of its own rows (a SIGTERM can end W&B's service before it
writes them; the SLURM preemption test shows it on a real job)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger, WandbLogger
from torch import Tensor
from torch.utils.data import DataLoader

from trident.tracking.steps import ValidationRowStep
from trident.tracking.wandb_journal import WandbJournal


class FakeWandb:
    """What the journal uses of a WandbLogger: ``log_metrics`` and the run's summary."""

    def __init__(self, summary: dict[str, Any] | None = None) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []
        self.experiment = SimpleNamespace(summary=summary or {})

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append((step, dict(metrics)))


def _attempt(path: Path, resumed_step: int | None, summary: dict[str, Any] | None = None) -> tuple[WandbJournal, FakeWandb]:
    fake = FakeWandb(summary)
    return WandbJournal(path, cast(WandbLogger, fake), resumed_step), fake


def _log(journal: WandbJournal, wandb: FakeWandb, steps: range) -> None:
    """Lightning calls the journal, then the W&B logger, with the same row."""
    for step in steps:
        journal.log_metrics({"train/loss": float(step)}, step)
        wandb.log_metrics({"train/loss": float(step)}, step)


def test_a_resumed_attempt_resends_the_rows_before_its_checkpoint_once(tmp_path: Path) -> None:
    path = tmp_path / "wandb" / "history.jsonl"
    first, first_wandb = _attempt(path, None)
    _log(first, first_wandb, range(8))
    first.lost_service()  # SIGTERM at step 5's checkpoint; the killed attempt had logged to step 7
    # The next attempt resumes from step 5 (5 steps done): as Lightning does, its first row is step 5's,
    # so rows 5 to 7 are done again and not resent.
    second, second_wandb = _attempt(path, 5)
    _log(second, second_wandb, range(5, 10))
    assert [step for step, _ in second_wandb.rows] == list(range(10)), "every step once, in order"
    assert second_wandb.rows[3] == (3, {"train/loss": 3.0})
    # The journal now holds the whole history, for a third attempt.
    third, third_wandb = _attempt(path, 10)
    third.finalize("success")  # resumed after its last step (10 steps done): no row of its own
    assert [step for step, _ in third_wandb.rows] == list(range(10))


def test_rows_logged_after_the_signal_wait_for_the_next_attempt(tmp_path: Path) -> None:
    path = tmp_path / "history.jsonl"
    first, first_wandb = _attempt(path, None)
    _log(first, first_wandb, range(3))
    second, second_wandb = _attempt(path, 2)
    second.lost_service()  # stopped again before its first row: nothing can be sent
    second.log_metrics({"train/loss": 2.0}, 2)
    second.log_metrics({"train/loss": 3.0}, 3)
    assert second_wandb.rows == []
    third, third_wandb = _attempt(path, 4)
    _log(third, third_wandb, range(4, 5))
    assert [step for step, _ in third_wandb.rows] == [0, 1, 2, 3, 4]


def test_a_fresh_start_empties_the_journal(tmp_path: Path) -> None:
    path = tmp_path / "history.jsonl"
    first, first_wandb = _attempt(path, None)
    _log(first, first_wandb, range(3))
    again, again_wandb = _attempt(path, None)  # e.g. a requeued job stopped before its first checkpoint
    _log(again, again_wandb, range(2))
    assert [step for step, _ in again_wandb.rows] == [0, 1]
    assert len(path.read_text().splitlines()) == 2


def test_an_online_run_gets_only_the_steps_its_server_lacks(tmp_path: Path) -> None:
    path = tmp_path / "history.jsonl"
    first, first_wandb = _attempt(path, None)
    _log(first, first_wandb, range(6))
    # An online run resumes on the server, whose summary knows the last step that arrived.
    second, second_wandb = _attempt(path, 6, summary={"trainer/global_step": 3})
    _log(second, second_wandb, range(6, 7))
    assert [step for step, _ in second_wandb.rows] == [4, 5, 6]


def test_a_validation_redone_at_the_checkpoints_step_is_sent_once(tmp_path: Path) -> None:
    """A checkpoint of step 3 saved during its validation (a signal there): the resumed attempt runs that
    validation again, so the earlier one's row goes; one saved after it keeps it (the next row is training's)."""
    path = tmp_path / "history.jsonl"
    first, first_wandb = _attempt(path, None)
    _log(first, first_wandb, range(3))
    first.log_metrics({"val/loss": 9.0}, 3)
    redone, redone_wandb = _attempt(path, 3)
    redone.log_metrics({"val/loss": 8.0}, 3)
    assert [(step, metrics) for step, metrics in redone_wandb.rows if "val/loss" in metrics] == []
    assert [step for step, _ in redone_wandb.rows] == [0, 1, 2]
    kept, kept_wandb = _attempt(path, 3)
    kept.log_metrics({"train/loss": 3.0}, 3)
    assert kept_wandb.rows[-1] == (3, {"val/loss": 8.0})


def test_a_line_cut_short_by_a_kill_ends_the_journal(tmp_path: Path) -> None:
    path = tmp_path / "history.jsonl"
    first, first_wandb = _attempt(path, None)
    _log(first, first_wandb, range(3))
    path.write_text(path.read_text() + '{"step": 3, "metr')
    second, second_wandb = _attempt(path, 9)
    second.finalize("success")
    assert [step for step, _ in second_wandb.rows] == [0, 1, 2]


# --------------------------------------------------------------------------------------------
# The boundary as Lightning really draws it: rows logged by real trainers around a real resume


class TinyTask(L.LightningModule):
    """One weight fitted to a fixed target: a training row each step, a validation row each check."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = ((self.weight - batch) ** 2).mean()
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: Tensor, batch_idx: int) -> None:
        self.log("val/loss", ((self.weight - batch) ** 2).mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class RecordingWandb(Logger):
    """FakeWandb as a Lightning logger: what W&B is sent, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict[str, float]]] = []
        self.experiment = SimpleNamespace(summary={})

    @property
    def name(self) -> str:
        return "wandb"

    @property
    def version(self) -> str:
        return "0"

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """Only metric rows matter here."""

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        assert step is not None
        self.rows.append((step, dict(metrics)))


def _fit(journal_path: Path, max_steps: int, ckpt_dir: Path, resume: Path | None = None) -> RecordingWandb:
    """Train with the journal and a W&B stand-in as the loggers (in the pipeline's order), a checkpoint
    and a validation every 3 steps (validation rows at the step they follow, as the pipeline logs them),
    resuming from ``resume`` as the pipeline does (its global_step)."""
    resumed_step = None if resume is None else int(torch.load(resume, weights_only=True)["global_step"])
    wandb = RecordingWandb()
    journal = WandbJournal(journal_path, cast(WandbLogger, wandb), resumed_step)
    data = DataLoader(torch.full((64, 1), 0.5), batch_size=4)  # every batch alike: losses depend on the step only
    trainer = L.Trainer(
        max_steps=max_steps, val_check_interval=3, limit_val_batches=1, log_every_n_steps=1, logger=[journal, wandb],
        callbacks=[ValidationRowStep(), ModelCheckpoint(ckpt_dir, "{step}", every_n_train_steps=3, save_top_k=-1)],
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu",
    )
    trainer.fit(TinyTask(), data, data, ckpt_path=resume)
    return wandb


def test_a_real_resume_gives_wandb_the_uninterrupted_runs_rows(tmp_path: Path) -> None:
    """An attempt that went on two steps past its step-6 checkpoint, then resumed from it: W&B gets the
    rows of an uninterrupted run, each (step, metric) once, whatever step Lightning logs each at."""
    reference = _fit(tmp_path / "reference.jsonl", 10, tmp_path / "reference")
    _fit(tmp_path / "history.jsonl", 8, tmp_path / "stopped")
    resumed = _fit(tmp_path / "history.jsonl", 10, tmp_path / "resumed", resume=tmp_path / "stopped" / "step=6.ckpt")

    def rows(wandb: RecordingWandb) -> list[tuple[int, str, float]]:
        return [(step, name, round(value, 6)) for step, metrics in wandb.rows for name, value in metrics.items()
                if name != "epoch"]

    assert sorted(rows(resumed)) == sorted(rows(reference))
    assert [step for step, _ in resumed.rows] == sorted(step for step, _ in resumed.rows), "in order"
    assert (6, "val/loss") in {(step, name) for step, name, _ in rows(resumed)}, "the validation at the checkpoint's step"


def test_an_extension_from_the_final_validation_keeps_it(tmp_path: Path) -> None:
    """A 6-step run extended to 9 from its checkpoint of step 6, saved after the validation at 6 (the
    pipeline's last.ckpt): W&B gets that validation once, as an uninterrupted 9-step run has it."""
    reference = _fit(tmp_path / "reference.jsonl", 9, tmp_path / "reference")
    _fit(tmp_path / "history.jsonl", 6, tmp_path / "first")
    extended = _fit(tmp_path / "history.jsonl", 9, tmp_path / "extended", resume=tmp_path / "first" / "step=6.ckpt")
    validations = [step for step, metrics in extended.rows if "val/loss" in metrics]
    assert validations == [step for step, metrics in reference.rows if "val/loss" in metrics] == [3, 6, 9]
