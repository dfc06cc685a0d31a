"""The W&B journal: a resumed attempt sends W&B the rows an earlier attempt logged before its
checkpoint, once, in order, ahead of its own rows (a SIGTERM can end W&B's service before it
writes them; the SLURM preemption test shows it on a real job)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from lightning.pytorch.loggers import WandbLogger

from trident.training.wandb_journal import WandbJournal


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
    # The next attempt resumes from step 5: rows 6 and 7 are done again, so they are not resent.
    second, second_wandb = _attempt(path, 5)
    _log(second, second_wandb, range(6, 10))
    assert [step for step, _ in second_wandb.rows] == list(range(10)), "every step once, in order"
    assert second_wandb.rows[3] == (3, {"train/loss": 3.0})
    # The journal now holds the whole history, for a third attempt.
    third, third_wandb = _attempt(path, 9)
    third.finalize("success")  # resumed at its last step: no row of its own
    assert [step for step, _ in third_wandb.rows] == list(range(10))


def test_rows_logged_after_the_signal_wait_for_the_next_attempt(tmp_path: Path) -> None:
    path = tmp_path / "history.jsonl"
    first, first_wandb = _attempt(path, None)
    _log(first, first_wandb, range(3))
    second, second_wandb = _attempt(path, 2)
    second.lost_service()  # stopped again before its first row: nothing can be sent
    second.log_metrics({"train/loss": 3.0}, 3)
    assert second_wandb.rows == []
    third, third_wandb = _attempt(path, 3)
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
    second, second_wandb = _attempt(path, 5, summary={"trainer/global_step": 3})
    _log(second, second_wandb, range(6, 7))
    assert [step for step, _ in second_wandb.rows] == [4, 5, 6]


def test_a_line_cut_short_by_a_kill_ends_the_journal(tmp_path: Path) -> None:
    path = tmp_path / "history.jsonl"
    first, first_wandb = _attempt(path, None)
    _log(first, first_wandb, range(3))
    path.write_text(path.read_text() + '{"step": 3, "metr')
    second, second_wandb = _attempt(path, 9)
    second.finalize("success")
    assert [step for step, _ in second_wandb.rows] == [0, 1, 2]
