"""Callbacks that Lightning does not ship: throughput in the task's own units (tokens, images) and MFU."""

from __future__ import annotations

import logging
import time
from typing import Any

import lightning as L

from trident.errors import ConfigError
from trident.training.flops import compute_dtype, device_peak_flops

log = logging.getLogger(__name__)


class Throughput(L.Callback):
    """Logs ``throughput/<unit>_per_sec`` over a window of training steps, data loading included,
    and model FLOPs utilisation: ``throughput/flops_per_sec`` and ``throughput/mfu``.

    The task names its units through ``throughput_units(batch) -> {"tokens": n, ...}`` and its
    model FLOPs through ``flops_per_batch(batch)`` (trident.training.flops); the wall-clock window
    runs from one batch end to the next, so it measures what a user waits for. ``peak_flops`` is
    the FLOP/s of one device; null takes it from a table of GPUs or, on a CPU, measures it once
    (trident.training.flops.device_peak_flops). MFU is achieved FLOP/s over the peak of all devices.
    """

    def __init__(self, window: int = 20, peak_flops: float | None = None) -> None:
        if peak_flops is not None and not (isinstance(peak_flops, (int, float)) and peak_flops > 0):
            raise ConfigError(
                f"callbacks.throughput.peak_flops must be a positive FLOP/s value or null, got {peak_flops!r}"
            )
        self.window = window
        self.peak_flops = peak_flops
        self._device_peak: float | None = None
        self._counts: dict[str, float] = {}
        self._start: float | None = None
        self._steps = 0

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        dtype = compute_dtype(str(trainer.precision))
        self._device_peak = self.peak_flops or device_peak_flops(pl_module.device, dtype)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start, self._counts, self._steps = None, {}, 0

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        if self._start is None:  # the first step includes warm-up work: start timing after it
            self._start = now
            return
        counts = dict(pl_module.throughput_units(batch), flops=pl_module.flops_per_batch(batch))
        for unit, count in counts.items():
            self._counts[unit] = self._counts.get(unit, 0) + count * trainer.world_size
        self._steps += 1
        if self._steps >= self.window:
            elapsed = now - self._start
            rates = {f"throughput/{unit}_per_sec": n / elapsed for unit, n in self._counts.items()}
            if self._device_peak:
                rates["throughput/mfu"] = rates["throughput/flops_per_sec"] / (self._device_peak * trainer.world_size)
            pl_module.log_dict(rates)
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
