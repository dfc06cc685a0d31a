"""The one step axis of every record a run writes: the optimizer step.

A row at step ``s`` describes the weights after ``s`` optimizer steps:

- a training row (``train/*``, the learning rate, throughput) at ``s`` is the ``(s+1)``-th optimizer step's,
  taken from those weights: steps 0 .. N-1 for an N-step run (Lightning's ``_batches_that_stepped`` before it
  counts the step), once per optimizer step whatever ``trainer.accumulate_grad_batches``;
- a validation, a test or a checkpoint at ``s`` follows ``s`` optimizer steps (``trainer.global_step``):
  the same number in W&B's ``trainer/global_step``, ``metrics.jsonl``, the CSV logs and the checkpoint names.

Lightning counts differently in two places, which this module corrects:

- it validates after an optimizer step *before* counting the step for its loggers, so its validation rows
  went to the loggers at ``s - 1`` (:class:`ValidationRowStep`);
- it counts an integer ``val_check_interval`` in micro-batches, so ``accumulate_grad_batches=2`` validated
  twice as often as ``conf/task/*.yaml`` and the FLOP budget (``budget.validations``) say
  (:class:`OptimizerStepValidation`: the interval counts optimizer steps).
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loops.fetchers import _DataFetcher
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop


def training_row_step(trainer: L.Trainer) -> int:
    """The step of a training row logged now (in a training hook): the optimizer step under way or just taken."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def ends_optimizer_step(trainer: L.Trainer) -> bool:
    """True in ``on_train_batch_end`` of the micro-batch whose optimizer step was just taken (always without
    accumulation; with it, the last micro-batch of each step, an epoch's shorter last one included)."""
    return not trainer.fit_loop._should_accumulate()


class OptimizerStepValidation(_TrainingEpochLoop):
    """Lightning's training epoch loop, with an integer ``val_check_interval`` counted in optimizer steps:
    validation follows every ``val_check_interval``-th optimizer step, never a micro-batch in the middle of one;
    across epochs with ``check_val_every_n_epoch=null``, else (``task=vit``'s 1) within each epoch, as Lightning
    counts its batches there. A fractional interval (a share of an epoch) and every other rule (early
    stopping's, an iterable dataset's end) are Lightning's."""

    def _should_check_val_fx(self, data_fetcher: _DataFetcher) -> bool:
        trainer = self.trainer
        if trainer.accumulate_grad_batches == 1 or not isinstance(trainer.val_check_interval, int) \
                or trainer.val_check_batch == float("inf"):
            return super()._should_check_val_fx(data_fetcher)
        if not self._should_check_val_epoch():
            return False
        if trainer.should_stop and trainer.fit_loop._can_stop_early:
            return True  # Lightning's: validate when stopping early (e.g. early stopping)
        if self._should_accumulate():
            return False
        # The epoch's optimizer steps so far: its micro-batches over the accumulation, its last window short.
        steps = self.global_step if trainer.check_val_every_n_epoch is None else \
            math.ceil((self.batch_idx + 1) / trainer.accumulate_grad_batches)
        return steps % trainer.val_check_interval == 0


def count_validation_in_optimizer_steps(trainer: L.Trainer) -> None:
    """Give ``trainer`` the loop of :class:`OptimizerStepValidation` (before it fits)."""
    loop = trainer.fit_loop.epoch_loop
    trainer.fit_loop.epoch_loop = OptimizerStepValidation(trainer, min_steps=loop.min_steps, max_steps=loop.max_steps)


class ValidationRowStep(L.Callback):
    """Validation rows at ``trainer.global_step``, the step ``metrics.jsonl`` and the checkpoint names give.

    Lightning sends a validation's metrics to the loggers (after ``on_validation_epoch_end``) at its counter of
    optimizer steps, which it raises only once the validation is over; the counter is raised for that moment and
    put back in ``on_validation_end``, before any checkpoint (ModelCheckpoint runs last) saves it as Lightning
    would."""

    def __init__(self) -> None:
        self._raised = False

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        loop = trainer.fit_loop.epoch_loop
        self._raised = not trainer.sanity_checking and trainer.global_step == loop._batches_that_stepped + 1
        if self._raised:
            loop._batches_that_stepped += 1

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._raised:
            trainer.fit_loop.epoch_loop._batches_that_stepped -= 1
            self._raised = False


class StepLearningRateMonitor(LearningRateMonitor):
    """Lightning's learning-rate monitor with one row per optimizer step: its own logs once per micro-batch,
    so ``accumulate_grad_batches=2`` gave every step two rows."""

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx % trainer.accumulate_grad_batches == 0:  # the first micro-batch of an optimizer step
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
