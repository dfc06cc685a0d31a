"""Callbacks that Lightning does not ship: throughput in the task's own units (tokens, images)."""

from __future__ import annotations

import logging
import time
from typing import Any

import lightning as L

log = logging.getLogger(__name__)


class Throughput(L.Callback):
    """Logs ``throughput/<unit>_per_sec`` over a window of training steps, data loading included.

    The task names its units through ``throughput_units(batch) -> {"tokens": n, ...}``; the
    wall-clock window runs from one batch end to the next, so it measures what a user waits for.
    """

    def __init__(self, window: int = 20) -> None:
        self.window = window
        self._counts: dict[str, int] = {}
        self._start: float | None = None
        self._steps = 0

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start, self._counts, self._steps = None, {}, 0

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        if self._start is None:  # the first step includes warm-up work: start timing after it
            self._start = now
            return
        for unit, count in pl_module.throughput_units(batch).items():
            self._counts[unit] = self._counts.get(unit, 0) + count * trainer.world_size
        self._steps += 1
        if self._steps >= self.window:
            elapsed = now - self._start
            pl_module.log_dict({f"throughput/{unit}_per_sec": n / elapsed for unit, n in self._counts.items()})
            self._start, self._counts, self._steps = now, {}, 0


class MetricsToLog(L.Callback):
    """Writes validation and test metrics to Python logging, so ``train.log`` records them too."""

    def _write(self, trainer: L.Trainer, prefix: str) -> None:
        if not trainer.is_global_zero or trainer.sanity_checking:
            return
        values = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(prefix)}
        if values:
            text = "  ".join(f"{k}={v:.4g}" for k, v in sorted(values.items()))
            log.info("step %d  %s", trainer.global_step, text)

    # The *_end hooks run after the epoch's metrics are reduced (the *_epoch_end hooks run before).
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write(trainer, "val/")

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write(trainer, "test/")
