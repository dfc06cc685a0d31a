"""Resumes at an epoch's end (trident.runs.attempts.EpochBoundaryResume), in process on real Lightning trainers: a
run stopped by SIGTERM at the end of an epoch, resumed, and stopped there again continued with the order of the
epoch before (Lightning counted the resumed epoch as never begun); an extension of a run that ended at an epoch's
end as well. Each is compared with the uninterrupted run batch for batch: the same math in the same order, exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor
from torch.utils.data import DataLoader

from trident.data.base import TridentDataModule
from trident.data.order import EpochShuffleSampler
from trident.launch.preemption import PreemptionCheckpoint
from trident.runs.attempts import EpochBoundaryResume, FinalStepCheckpoint

from .resume_helpers import SignalAtStep

EXAMPLES = 8  # an epoch: 8 examples in 4 batches of 2 under 2-batch accumulation (2 of 4 without): 2 steps


class Ordered(TridentDataModule):
    """The examples 0..7, drawn in the resumable order the data modules use."""

    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.batch_size = batch_size

    def task_inputs(self) -> dict[str, Any]:
        return {}

    def save_to(self, run_dir: Path) -> None:
        """Nothing to keep."""

    def split_loader(self, split: str, train: bool) -> DataLoader:
        sampler = EpochShuffleSampler(EXAMPLES, self.batch_size, seed=3)
        data = torch.arange(EXAMPLES, dtype=torch.float64)[:, None]
        return DataLoader(data, batch_size=self.batch_size, sampler=sampler, **self.loader_options())


class Recorded(L.LightningModule):
    """One weight fitted to the batches it is shown; ``seen``: (epoch, step, examples, loss) of each micro-batch, and
    the epoch of each ``on_train_epoch_start``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
        self.seen: list[tuple[int, int, list[float], float] | tuple[str, int]] = []

    def on_train_epoch_start(self) -> None:
        self.seen.append(("epoch start", self.current_epoch))

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = ((self.weight - batch) ** 2).mean()
        self.seen.append((self.current_epoch, self.global_step, batch.flatten().tolist(), loss.item()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)  # momentum: its state resumes too


def _fit(run_dir: Path, max_steps: int, accumulate: int, stop_after: int | None = None) -> Recorded:
    """One attempt of the run in ``run_dir``, resumed from its last.ckpt if there is one; ``stop_after``: SIGTERM
    during that step (1-based), saved and stopped at its end as a job's stop is."""
    preemption = PreemptionCheckpoint(run_dir)
    signal = [] if stop_after is None else [SignalAtStep(stop_after - 1, "SIGTERM")]
    trainer = L.Trainer(
        max_steps=max_steps, accumulate_grad_batches=accumulate, limit_val_batches=0, num_sanity_val_steps=0,
        callbacks=[*signal, preemption, FinalStepCheckpoint(), EpochBoundaryResume(),
                   ModelCheckpoint(run_dir / "checkpoints", save_top_k=0, save_last=True, enable_version_counter=False)],
        logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
    )
    task, last = Recorded(), run_dir / "checkpoints" / "last.ckpt"
    with preemption.listening():
        try:
            trainer.fit(task, Ordered(4 // accumulate), ckpt_path=last if last.exists() else None)
        except SIGTERMException:
            assert preemption.stop is not None and preemption.stop.step == stop_after
    return task


def _attempts(run_dir: Path, max_steps: list[int], accumulate: int, stops: list[int | None]) -> list[Any]:
    """What the attempts trained, their final weight, and the last checkpoint's epoch counters and logging step."""
    run_dir.mkdir()
    seen: list[Any] = []
    for steps, stop in zip(max_steps, stops, strict=True):
        task = _fit(run_dir, steps, accumulate, stop)
        # A stop at an epoch's end comes as the next epoch has begun, before its first batch: the resumed attempt
        # begins that epoch again (the uninterrupted run's single start of it).
        seen += task.seen[:-1] if stop is not None and task.seen[-1][0] == "epoch start" else task.seen
    loops = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["loops"]["fit_loop"]
    return [seen, task.weight.item(), loops["epoch_progress"], loops["epoch_loop.state_dict"]["_batches_that_stepped"]]


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("stops", [[2, 4], [2, 3]], ids=["two-epoch-ends", "epoch-end-then-mid-epoch"])
def test_stops_at_epoch_ends_resume_step_for_step(tmp_path: Path, accumulate: int, stops: list[int]) -> None:
    """Stopped after step 2 (epoch 0's last) and after step 4 (epoch 1's last: before the fix, epoch 2 drew epoch 1's
    order) or 3 (mid-epoch), then resumed to step 6: the batches, losses and weight of the uninterrupted run."""
    whole = _attempts(tmp_path / "whole", [6], accumulate, [None])
    stopped = _attempts(tmp_path / "stopped", [6, 6, 6], accumulate, [*stops, None])
    assert stopped == whole


def test_a_run_that_ended_at_an_epoch_end_extends_step_for_step_twice(tmp_path: Path) -> None:
    """A run of 2 steps (one epoch) extended to 4, then to 6 (``resume=<run> trainer.max_steps=...``): each
    attempt's final last.ckpt is saved at an epoch's last step, as a stop's is."""
    whole = _attempts(tmp_path / "whole", [6], 2, [None])
    assert _attempts(tmp_path / "extended", [2, 4, 6], 2, [None, None, None]) == whole
