"""What a training run records as it ends: how much of the network trained, the W&B run's end (one run
per job, preempted or failed as the job was), the best checkpoint, and an early stop."""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from trident.converters.nf4 import nf4_bytes
from trident.runs.sweeps import STOPPED_EARLY_BEST, STOPPED_EARLY_STEP
from trident.tasks.base import TridentTask
from trident.tracking.loggers import record_summary
from trident.training.callbacks import StopEarly
from trident.training.finetuning import trainable_parameters

log = logging.getLogger(__name__)


def report_trainable(task: TridentTask, loggers: list[Any]) -> None:
    """The log line and the run's hyperparameters say how much of the network trains (finetune=lora: a fraction)."""
    counts = trainable_parameters(task.net)
    log.info("Trainable parameters: %d of %d (%.2f%%)", counts["params/trainable"], counts["params/total"],
             100 * counts["params/trainable_share"])
    stored, values = nf4_bytes(task.net)
    if values:  # finetune=qlora: what the quantized base takes, its block scales included
        counts.update({"params/nf4_bytes": stored, "params/nf4_bits_per_value": 8 * stored / values})
        log.info("NF4 base: %d weights in %d bytes (%.3f bits a weight, block scales included)", values, stored,
                 8 * stored / values)
    for logger in loggers:
        logger.log_hyperparams(counts)
    record_summary(loggers, counts)


def finish_wandb(succeeded: bool, signalled: bool) -> None:
    """Exactly one W&B run per job, also when a multirun reuses the process; a failed job shows as
    failed, a stopped one as preempted (a requeued or resumed job continues the same run)."""
    wandb = sys.modules.get("wandb")  # imported by the W&B logger only: without it, no W&B run
    if wandb is None or wandb.run is None:
        return
    try:
        if signalled and not succeeded:
            wandb.mark_preempting()
        wandb.finish(exit_code=0 if succeeded else 1)
        # finish() returns before W&B's service has written the run's files; teardown waits for
        # it, so the offline run on disk is complete when train() returns (a reader may follow).
        wandb.teardown()
    except (ConnectionError, OSError):
        if not signalled:
            raise
        # SLURM's SIGTERM ended W&B's service with the job: the run keeps what it wrote until then.
        log.warning("W&B's service process ended with the signal: the W&B run holds the steps logged before it")
        with contextlib.suppress(ConnectionError, OSError):
            wandb.teardown()


def best_checkpoint(trainer: L.Trainer) -> str | None:
    checkpoint = trainer.checkpoint_callback
    if isinstance(checkpoint, ModelCheckpoint) and checkpoint.best_model_path:
        return checkpoint.best_model_path
    return None


def early_stop_record(trainer: L.Trainer) -> dict[str, float]:
    """``callbacks=early_stopping``: the step the run stopped at and the best value it monitored; empty if it did not stop."""
    stop = trainer.early_stopping_callback
    if not isinstance(stop, StopEarly) or stop.stopped_step is None:
        return {}
    return {STOPPED_EARLY_STEP: float(stop.stopped_step), STOPPED_EARLY_BEST: float(stop.best_score)}
