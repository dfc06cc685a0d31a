"""Stop signals during a job: finish the step, save, and stop (what follows: :mod:`trident.launch.requeue`)."""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException

from trident.launch.requeue import JobStopped, latest_checkpoint, slurm_job, stop_outcome
from trident.tracking.steps import ends_optimizer_step
from trident.tracking.wandb_journal import WandbJournal

log = logging.getLogger(__name__)


class PreemptionCheckpoint(L.Callback):
    """SIGTERM (SLURM's scancel, requeue and preemption), SIGUSR2 (submitit's time-limit warning)
    and SIGUSR1 (an sbatch ``--signal``) all mean "stop now, come back later": finish the current
    training step, save ``<run_dir>/checkpoints/last.ckpt``, and stop with Lightning's ``SIGTERMException`` before the next
    step; :attr:`stop` then says what comes next (:mod:`trident.launch.requeue`).

    trident takes these signals over from Lightning, whose own SIGTERM handling stops at the next
    step without a checkpoint and whose SLURM auto-requeue saves from inside the signal handler,
    possibly mid-step (``SLURMEnvironment(auto_requeue=False)`` in the pipeline).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.path = run_dir / "checkpoints" / "last.ckpt"
        self.received: str | None = None
        self.stop: JobStopped | None = None
        self._trainer: L.Trainer | None = None
        self._previous: dict[int, Any] = {}

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum).name  # the work happens between steps
        if signum == signal.SIGTERM and self._trainer is not None:
            # SLURM's SIGTERM reaches every process of the job, W&B's service too, which exits at
            # once: nothing more may be sent to it (it would raise ConnectionResetError). The journal
            # keeps the rows for the next attempt.
            self._trainer.loggers = [lg for lg in self._trainer.loggers if not isinstance(lg, WandbLogger)]
            for journal in self._trainer.loggers:
                if isinstance(journal, WandbJournal):
                    journal.lost_service()

    @contextmanager
    def listening(self) -> Iterator[None]:
        """Handle the signals during a job; the process's own handlers come back after (submitit's
        among them: :func:`trident.launch.requeue.come_back_later` hands SIGUSR2 on to it)."""
        self._previous = {signum: signal.getsignal(signum) for signum in self.SIGNALS}
        self._install()
        try:
            yield
        finally:
            for signum, handler in self._previous.items():
                signal.signal(signum, handler)

    def _install(self) -> None:
        for signum in self.SIGNALS:
            signal.signal(signum, self._record)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._trainer = trainer

    # Lightning installs its own SIGTERM handler when fit starts running: take the signal back.
    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install()

    # trainer.test installs Lightning's handler again (whose SIGTERM would end the test with a
    # SIGTERMException after the current batch, past on_test_end).
    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Saved where Lightning's own step checkpoints are saved, so the run resumes exactly as
        # from those: under gradient accumulation, once the optimizer step is taken (a checkpoint
        # holds no accumulated gradient: saved mid-step, the resumed step trained on its last
        # micro-batches alone).
        if ends_optimizer_step(trainer):
            self._save_and_stop_if_signalled(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A signal during the last validation comes after the last step's on_train_batch_end. The
        # job stops at its final step all the same and leaves the test to the next attempt: the
        # signal may have ended W&B's service, which the test's results could no longer reach.
        # The final step's last.ckpt (trident.runs.attempts.FinalStepCheckpoint) was saved before that
        # validation: saved again now, with the loops past their end, an extension of the run would
        # start one step off (its next epoch's batches, its rows shifted by one).
        self._save_and_stop_if_signalled(trainer, save=not holds_step(self.path, trainer.global_step))

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A signal during the test: its results may not have reached W&B either. Training is done
        # and saved (the model now holds the tested checkpoint's weights: nothing is saved here), so
        # the next attempt resumes from the newest checkpoint and tests again.
        if self.stop is None and self._signalled(trainer):
            newest = latest_checkpoint(self.run_dir)
            self.stop = self.stopped(trainer, str(newest or ""))

    def _signalled(self, trainer: L.Trainer) -> bool:
        """Whether a rank has received a stop signal: every rank takes the same decision, even if
        only one of them got it (a collective call)."""
        return trainer.strategy.reduce_boolean_decision(self.received is not None, all=False)

    def _save_and_stop_if_signalled(self, trainer: L.Trainer, save: bool = True) -> None:
        if self.stop is None and self._signalled(trainer):
            if save:
                trainer.save_checkpoint(self.path, weights_only=False)
            self.stop = self.stopped(trainer, str(self.path))
            if trainer.is_global_zero:  # once per job, not once per DDP rank
                log.warning("%s received: saved %s at step %d and stopping", self.stop.signal, self.path, self.stop.step)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        # Stop before the next step, once the saved one is logged, its learning rate stepped and
        # its validation (if due) run, as in an uninterrupted run.
        if self.stop is not None:
            raise SIGTERMException

    def stopped(self, trainer: L.Trainer, checkpoint: str) -> JobStopped:
        """How the stop ends the job, as global rank 0 reads its signal (a collective call)."""
        name = self.received or "SIGTERM"
        mine = (name, stop_outcome(name)) if trainer.is_global_zero else None
        name, outcome = trainer.strategy.broadcast(mine, src=0)
        return JobStopped(name, trainer.global_step, checkpoint, outcome, slurm_job())

    def stopped_early(self, step: int, checkpoint: Path | None) -> JobStopped:
        """A stop that Lightning made before this callback saved (each rank reads its own signal)."""
        name = self.received or "SIGTERM"
        return JobStopped(name, step, str(checkpoint or ""), stop_outcome(name), slurm_job())


def holds_step(path: Path, step: int) -> bool:
    """Whether ``path`` is a whole-file checkpoint of optimizer step ``step`` (read memory-mapped: only its counters
    are looked at). A sharded checkpoint (a directory) or none: False."""
    if not path.is_file():
        return False
    return int(torch.load(path, map_location="cpu", mmap=True, weights_only=False).get("global_step", -1)) == step
