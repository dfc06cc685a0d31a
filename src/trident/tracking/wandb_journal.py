"""A copy of every row logged to W&B, kept in the run directory, that a resumed attempt sends again.

Why: SLURM's SIGTERM (a preemption, a requeue, ``scancel``) reaches every process of a job, W&B's
service process too, which exits at once without writing the rows it still buffers (it flushes
the run's ``.wandb`` file only every 15 s), so a stopped attempt's W&B run can lack its last rows,
or all of them. The next attempt resumes from a checkpoint at some step: it first sends the rows
logged before that step again, then its own, so its W&B run holds the whole history: the newest
attempt's file is the one to upload (``python -m trident.tracking.wandb_files sync <dir>``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import Logger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only

JOURNAL = "history.jsonl"
STEP = "trainer/global_step"  # where WandbLogger puts Lightning's step
TEST_PREFIX = "test/"
VALIDATION_PREFIX = "val/"


class WandbJournal(Logger):
    """Keeps each row that Lightning logs (``{"step", "metrics"}`` per line) and resends them.

    ``resumed_step``: the step of the checkpoint this attempt resumes from (None: a fresh start,
    which empties the journal). Rows after it came from an attempt that went on past its last
    checkpoint and are logged again, so they are dropped (at its step: training rows; its validation,
    which :class:`trident.tracking.steps.ValidationRowStep` logs at that step, stays), and so are test rows: this attempt trains
    on or tests again, and its test is the run's one; the rest wait for this attempt's first
    row and are sent before it, minus those the W&B run already has (an online run that resumes
    on the server knows its last step). Lightning calls the loggers in order: this one must come
    before ``wandb_logger``. Only logged metrics are kept, not tables or text.
    """

    def __init__(self, path: Path, wandb_logger: WandbLogger, resumed_step: int | None) -> None:
        super().__init__()
        self.path = path
        self._wandb: WandbLogger | None = wandb_logger
        self._pending: list[dict[str, Any]] | None = None
        if rank_zero_only.rank == 0:  # type: ignore[attr-defined]
            kept = [] if resumed_step is None else [r for r in self._read() if _before_checkpoint(r, resumed_step)]
            self._pending = kept
            self._rewrite(kept)

    @property
    def name(self) -> str:
        return "wandb_journal"

    @property
    def version(self) -> str:
        return self.path.parent.name

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """The W&B logger records the config; the journal keeps only metric rows."""

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if step is None:  # Lightning gives every row a step: such a row cannot be placed again
            return
        if self._pending is not None:
            # A validation the checkpoint interrupted is run again at its step: its earlier rows go.
            again = _validation_row(metrics)
            self._settle([row for row in self._pending if row["step"] < step or (row["step"] == step and not again)])
        with self.path.open("a") as journal:
            journal.write(json.dumps({"step": step, "metrics": dict(metrics)}) + "\n")

    @rank_zero_only
    def finalize(self, status: str) -> None:
        """An attempt that resumed at its last step logs no row: the history is sent now."""
        if self._pending is not None:
            self._settle(self._pending)

    def lost_service(self) -> None:
        """W&B's service has ended (SIGTERM): rows are still kept, for the next attempt to send."""
        self._wandb = None

    def _settle(self, rows: list[dict[str, Any]]) -> None:
        """Keep ``rows`` as the journal's start and send them to W&B (once per attempt)."""
        self._rewrite(rows)
        self._pending = None
        if self._wandb is None:
            return  # they stay in the journal for the next attempt
        last = self._wandb.experiment.summary.get(STEP)
        for row in rows:
            if last is None or row["step"] > last:
                self._wandb.log_metrics(row["metrics"], step=row["step"])

    def _read(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        rows = []
        for line in self.path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line cut short by a kill: the rows before it are whole
        return rows

    def _rewrite(self, rows: list[dict[str, Any]]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(".partial")
        partial.write_text("".join(json.dumps(row) + "\n" for row in rows))
        os.replace(partial, self.path)


def _test_row(row: dict[str, Any]) -> bool:
    return any(str(key).startswith(TEST_PREFIX) for key in row["metrics"])


def _validation_row(metrics: Mapping[str, Any]) -> bool:
    return any(str(key).startswith(VALIDATION_PREFIX) for key in metrics)


def _before_checkpoint(row: dict[str, Any], resumed_step: int) -> bool:
    """Whether an earlier attempt logged ``row`` before the checkpoint of ``resumed_step`` (trident.tracking.steps):
    training rows at step ``s`` are the ``(s+1)``-th optimizer step's (after a checkpoint at ``s``), a validation
    at ``s`` follows ``s`` steps (before it, or redone by the resumed attempt); test rows are of a model since
    trained on."""
    if _test_row(row):
        return False
    return row["step"] < resumed_step or (row["step"] == resumed_step and _validation_row(row["metrics"]))
