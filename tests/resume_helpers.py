"""Test-only pieces that train.py loads by ``_target_``: a real signal at a chosen step or stage,
a language model whose loss turns NaN at a chosen step, and slow steps."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import lightning as L
import psutil
import torch
from torch import Tensor

from trident.tasks.lm import LanguageModelTask


class SignalAtStep(L.Callback):
    """Sends ``signal_name`` (e.g. SIGKILL, SIGTERM) to this very process when training is about
    to run optimizer step ``step`` (0-based ``global_step``); under DDP on every rank, or only on
    global rank ``rank``."""

    def __init__(self, step: int, signal_name: str, rank: int | None = None) -> None:
        self.step = step
        self.signum = signal.Signals[signal_name]
        self.rank = rank

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step and self.rank in (None, trainer.global_rank):
            os.kill(os.getpid(), self.signum)


class NaNLossLanguageModel(LanguageModelTask):
    """The LM task, but the loss of the training step with ``global_step == nan_at_step`` is NaN: of each of its
    micro-batches, or with ``nan_micro_batch`` of that one alone (0: the first of the step)."""

    def __init__(self, *args: Any, nan_at_step: int, nan_micro_batch: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.nan_at_step = nan_at_step
        self.nan_micro_batch = nan_micro_batch

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        micro_batch = batch_idx % self.trainer.accumulate_grad_batches
        chosen = self.nan_micro_batch is None or micro_batch == self.nan_micro_batch
        return loss * torch.nan if self.global_step == self.nan_at_step and chosen else loss


class SlowSteps(L.Callback):
    """Sleeps ``seconds`` after every training step, so that a test can signal a job mid-run."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        time.sleep(self.seconds)


class SignalInStage(L.Callback):
    """Sends ``signal_name`` while the validation after optimizer step ``step`` runs
    (``stage="validate"``) or while the test runs (``stage="test"``): first to W&B's service (with
    ``to_wandb_service``), then to this process, as SLURM sends SIGTERM to every process of a job."""

    def __init__(self, stage: str, step: int = 0, signal_name: str = "SIGTERM", to_wandb_service: bool = True) -> None:
        self.stage = stage
        self.step = step
        self.signum = signal.Signals[signal_name]
        self.to_wandb_service = to_wandb_service

    def on_validation_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self.stage == "validate" and not trainer.sanity_checking and trainer.global_step == self.step and batch_idx == 0:
            self._send()

    def on_test_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self.stage == "test" and batch_idx == 0:
            self._send()

    def _send(self) -> None:
        if self.to_wandb_service:
            services = [p for p in psutil.Process().children(recursive=True) if _is_wandb(p)]
            assert services, "the run has a W&B service"
            for service in services:
                service.send_signal(self.signum)
            psutil.wait_procs(services, timeout=10)
        os.kill(os.getpid(), self.signum)


def _is_wandb(process: psutil.Process) -> bool:
    try:
        return "wandb" in " ".join(process.cmdline())
    except psutil.Error:  # ended meanwhile (another child), or not ours to read
        return False
