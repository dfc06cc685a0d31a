"""Callbacks that Lightning does not ship: throughput in the task's own units (tokens, images) and
MFU, metrics in train.log, a metric history file that does not depend on the logger, and what a language
model's quality costs, measured at the end of the test (:class:`ModelCosts`); and Lightning's EMA callback,
adjusted to trident's end of training (:class:`ModelEMA`), and its early stopping, adjusted to resume
(:class:`StopEarly`)."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any, ClassVar

import lightning as L
import torch
from lightning.pytorch.callbacks import EarlyStopping, EMAWeightAveraging
from lightning.pytorch.callbacks.early_stopping import EarlyStoppingReason
from lightning.pytorch.trainer.states import TrainerFn

from trident.errors import ConfigError
from trident.models.sampling import greedy_tokens_per_second, kv_cache_bytes_per_token
from trident.tracking.steps import ends_optimizer_step, training_row_step
from trident.training.finetuning import trainable_parameters
from trident.training.flops import compute_dtype, device_peak_flops

log = logging.getLogger(__name__)


class Throughput(L.Callback):
    """Logs ``throughput/<unit>_per_sec`` over a window of optimizer steps, data loading included,
    and model FLOPs utilisation: ``throughput/flops_per_sec`` and ``throughput/mfu``.

    The task names its units through ``throughput_units(batch) -> {"tokens": n, ...}`` and its
    model FLOPs through ``flops_per_batch(batch)`` (hooks every trident.tasks.base.TridentTask
    implements; trident.training.flops), summed over the micro-batches of each step; the wall-clock window
    runs from one optimizer step's end to another's, so it measures what a user waits for in training, less the
    validations that run in between (decoding a translation's validation split takes longer than many steps, and
    would read as a slow step and a low MFU: the rate is training's). Each window is one
    row, at the step it ended with (trident.tracking.steps), sent to the loggers directly: logged through the
    LightningModule, its values would repeat, stale, in every training row until the next window. An epoch's
    last window is logged when the epoch ends, however short: epochs of fewer steps than ``window`` still report.
    ``peak_flops`` is the FLOP/s of one device; null takes it from a table of GPUs or, on a CPU, measures
    it once (trident.training.flops.device_peak_flops). MFU is achieved FLOP/s over the peak of all devices.
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
        self._last_end = 0.0
        self._last_step = 0
        self._steps = 0
        self._validation_start: float | None = None
        self._paused = 0.0  # seconds of validation since the window's last step: left out at the next step's end

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        dtype = compute_dtype(str(trainer.precision))
        self._device_peak = self.peak_flops or device_peak_flops(pl_module.device, dtype)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start, self._counts, self._steps, self._paused = None, {}, 0, 0.0

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._start is not None:  # the first step includes warm-up work: timing starts after it
            counts = dict(pl_module.throughput_units(batch), flops=pl_module.flops_per_batch(batch))
            # One batch per data-parallel rank: the ranks of a tensor-parallel group share theirs.
            batches = (trainer.distributed_sampler_kwargs or {"num_replicas": 1})["num_replicas"]
            for unit, count in counts.items():
                self._counts[unit] = self._counts.get(unit, 0) + count * batches
        if not ends_optimizer_step(trainer):
            return
        now = time.perf_counter()
        if self._start is None:
            self._start, self._counts = now, {}
            return
        # A validation that ran since the last step's end is taken out here, not when it ends: the one Lightning runs
        # after an epoch's last step lies outside that epoch's last window (logged at on_train_epoch_end).
        self._start, self._paused = self._start + self._paused, 0.0
        self._steps, self._last_end, self._last_step = self._steps + 1, now, training_row_step(trainer)
        if self._steps >= self.window:
            self._log(trainer)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._validation_start = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._start is not None and self._validation_start is not None:  # a window under way: it skips the pass
            self._paused += time.perf_counter() - self._validation_start
        self._validation_start = None

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._steps:  # the window the epoch ended in; it ends at the last batch, before any validation
            self._log(trainer)

    def _log(self, trainer: L.Trainer) -> None:
        assert self._start is not None
        elapsed = self._last_end - self._start
        rates = {f"throughput/{unit}_per_sec": n / elapsed for unit, n in self._counts.items()}
        if self._device_peak:
            rates["throughput/mfu"] = rates["throughput/flops_per_sec"] / (self._device_peak * trainer.world_size)
        for logger in trainer.loggers:  # rank 0's (Lightning's loggers write on rank 0 only)
            logger.log_metrics(rates, step=self._last_step)
        self._start, self._counts, self._steps = self._last_end, {}, 0


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


class MetricHistory(L.Callback):
    """Appends the metrics of every validation and of the test to a JSON-lines file (one row:
    ``step``, ``stage`` and the values), and keeps the best validation value of ``monitor``.

    The pipeline adds it to every run (``<run dir>/metrics.jsonl``), so sweeps can be compared
    from their run directories whatever the logger (``python -m trident.report``).
    """

    # Metrics written at each stage: training values as of the validation step, then the stage's own.
    STAGE_PREFIXES: ClassVar[dict[str, tuple[str, ...]]] = {"validate": ("train/", "val/"), "test": ("test/",)}

    def __init__(self, path: Path, monitor: str, mode: str) -> None:
        if mode not in ("min", "max"):
            raise ConfigError(f"task.monitor_mode={mode} is not a direction: set it to min or max")
        self.path, self.monitor, self.mode = Path(path), monitor, mode
        self.best: float | None = None

    def _append(self, trainer: L.Trainer, stage: str) -> None:
        if not trainer.is_global_zero or trainer.sanity_checking:
            return
        prefixes = self.STAGE_PREFIXES[stage]
        values = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(prefixes) and v.numel() == 1}
        if not values:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as history:
            history.write(json.dumps({"step": trainer.global_step, "stage": stage, **values}) + "\n")
        value = values.get(self.monitor)
        if stage == "validate" and value is not None and not math.isnan(value) and self._improves(value):
            self.best = value

    def _improves(self, value: float) -> bool:
        return self.best is None or (value < self.best if self.mode == "min" else value > self.best)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._append(trainer, "validate")

    # The best value travels in checkpoints, so a resumed run reports the best of the whole run.
    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best = state_dict.get("best")

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._append(trainer, "test")


class ModelCosts(L.Callback):
    """Beside the test's quality, what it costs (``callbacks.model_costs``, on in every ``task=lm`` run): the KV
    cache's bytes per token (read from a real cache's tensors) and the greedy decoding speed of one sequence
    (tokens/s, the machine's load included: compare within one sweep), which grouped-query attention trades
    (experiment=ablation_kv_heads); and the parameters that train, which a LoRA rank buys its quality with
    (experiment=ablation_lora_rank). Logged as ``test/kv_cache_bytes_per_token``, ``test/greedy_tokens_per_s``
    and ``test/trainable_params``."""

    # Tokens generated to time decoding.
    DECODE_TOKENS: ClassVar[int] = 64

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        net = pl_module.net  # asked whether it decodes with a KV cache
        if not hasattr(net, "new_cache"):
            raise ConfigError(f"callbacks.model_costs measures decoding with a KV cache, which task={pl_module.NAME}'s "
                              "network does not do: remove callbacks.model_costs (task=lm has it)")

    @torch.no_grad()
    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        net = pl_module.net
        context = net.context_length
        new_tokens = self.DECODE_TOKENS if context is None else max(1, min(self.DECODE_TOKENS, context - 1))
        prompt = torch.zeros(1, 1, dtype=torch.long, device=pl_module.device)  # (1, 1): any token will do
        greedy_tokens_per_second(net, prompt, min(8, new_tokens))  # warm-up: first calls allocate
        speed = greedy_tokens_per_second(net, prompt, new_tokens)
        pl_module.log("test/kv_cache_bytes_per_token", float(kv_cache_bytes_per_token(net, prompt)), rank_zero_only=True)
        pl_module.log("test/greedy_tokens_per_s", speed, rank_zero_only=True)
        pl_module.log("test/trainable_params", float(trainable_parameters(net)["params/trainable"]), rank_zero_only=True)



class ModelEMA(EMAWeightAveraging):
    """Lightning's exponential moving average of the weights (``callbacks=ema``). Validation runs on
    the average, and every checkpoint holds it as ``state_dict`` (what testing, eval.py and sampling
    load) with the raw weights as ``current_model_state`` (what resuming continues from).

    Two of Lightning's hooks change so that this stays true around the end of training:

    - when training ends the model takes the average by a swap, not a copy, so the raw weights are
      still at hand for a ``last.ckpt`` that ModelCheckpoint writes after that point;
    - a checkpoint loaded for testing keeps its average in the model (Lightning's callback would load
      the raw weights when it was used for fitting before, as trident's run does before its test).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # True once training ended: the model holds the average, the average model the raw weights.
        self._swapped = False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Lightning's average is a deep copy of the whole task: a task's frozen companions (a teacher, a reference
        # policy: trident.tasks.networks) never change, so the copy shares them instead of holding a second one.
        companions = pl_module.companions  # every trident task has them (trident.tasks.networks), often none
        if not companions:
            super().setup(trainer, pl_module, stage)
            return
        pl_module.companions = {}
        try:
            super().setup(trainer, pl_module, stage)
        finally:
            pl_module.companions = companions
        if self._average_model is not None:
            self._average_model.module.companions = companions

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._swap_models(pl_module)
        self._swapped = True

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        if self._swapped and "current_model_state" in checkpoint:
            raw, average = checkpoint["state_dict"], checkpoint["current_model_state"]
            checkpoint["state_dict"], checkpoint["current_model_state"] = average, raw

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            super().on_load_checkpoint(trainer, pl_module, checkpoint)


class StopEarly(EarlyStopping):
    """Lightning's early stopping (``callbacks=early_stopping``): the run stops when the monitored
    validation metric has not improved by more than ``min_delta`` in ``patience`` validations.

    Three changes make it a run's record and let ``resume=<run dir>`` continue correctly:

    - it keeps the step it stopped at, ``stopped_step`` (in its checkpointed state), which the run's final
      metrics hold (``status.json``, the sweep report);
    - resuming the checkpoint of its stop does not train again (Lightning's callback would train on
      until the next validation): the run ends at the step it stopped at, as a finished run does;
    - the patience is the configured one, not the checkpoint's: ``resume=<run dir>
      callbacks.early_stopping.patience=10`` trains on from the stop, the validations without an
      improvement so far counted.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stopped_step: int | None = None

    def _run_early_stopping_check(self, trainer: L.Trainer) -> None:
        super()._run_early_stopping_check(trainer)
        if self.stopping_reason_message is not None and self.stopped_step is None:  # set once it stops (every rank)
            self.stopped_step = trainer.global_step
            if trainer.is_global_zero:
                log.warning("Stopped early at step %d: %s", self.stopped_step, self._summary())

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.stopped_step is None:
            return
        if self.stopping_reason != EarlyStoppingReason.PATIENCE_EXHAUSTED or self.wait_count < self.patience:
            # A resume with a larger patience (or after a non-finite value): training goes on.
            self.stopped_step, self.stopping_reason, self.stopping_reason_message = None, EarlyStoppingReason.NOT_STOPPED, None
            return
        trainer.should_stop = True
        if trainer.is_global_zero:
            log.warning("The run stopped early at step %d (%s): it does not train again; to train on, resume with a "
                        "larger callbacks.early_stopping.patience or with callbacks=default", self.stopped_step,
                        self._summary())

    def _summary(self) -> str:
        return f"{self.monitor} best {float(self.best_score):.6g} (patience {self.patience}, min_delta {abs(self.min_delta)})"

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "stopped_step": self.stopped_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        patience = self.patience
        super().load_state_dict(state_dict)
        self.patience = patience  # the configured one (Lightning would restore the checkpoint's)
        self.stopped_step = state_dict.get("stopped_step")
