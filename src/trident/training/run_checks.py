"""Checks of the ``seed``, the ``trainer`` group and the EMA and early-stopping callbacks before any work.

Lightning checks some trainer values only when the trainer is built (after the data is prepared)
and others not at all: ``accumulate_grad_batches=0`` or ``val_check_interval=0`` end in a
ZeroDivisionError deep inside the loop, a seed that is not an integer in a ValueError from NumPy.
Each becomes one line naming the key and a valid value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging

from trident.errors import ConfigError, is_int, is_number
from trident.parallel.fsdp import check_sharding_config, shards_weights, target_class

SEED_LIMIT = 2**32  # NumPy's seeds are unsigned 32-bit integers


def check_seed(seed: Any, key: str = "seed") -> None:
    """``key``: the config key that holds the seed (named in the message)."""
    if not is_int(seed) or not 0 <= seed < SEED_LIMIT:
        raise ConfigError(f"{key} must be an integer in [0, 2**32), got {seed!r}: set e.g. {key}=1337")


def _check(ok: bool, key: str, value: Any, rule: str, example: str) -> None:
    if not ok:
        raise ConfigError(f"trainer.{key} must be {rule}, got {value!r}: set e.g. trainer.{key}={example}")


def check_trainer_config(trainer: dict[str, Any]) -> None:
    """The step, epoch, validation, logging and device counts of ``trainer`` (null where Lightning allows it)."""
    for key, minimum, rule, example in (
        ("max_steps", -1, "an integer >= -1 (-1: no step limit)", "500"),
        ("max_epochs", -1, "null or an integer >= -1 (-1: no epoch limit)", "10"),
        ("accumulate_grad_batches", 1, "an integer >= 1 (1: no accumulation)", "1"),
        ("check_val_every_n_epoch", 1, "null or an integer >= 1", "1"),
        ("log_every_n_steps", 1, "an integer >= 1", "10"),
        ("num_sanity_val_steps", -1, "an integer >= -1 (-1: the whole validation split, 0: none)", "2"),
        ("num_nodes", 1, "an integer >= 1", "1"),
    ):
        if key in trainer and not (trainer[key] is None and "null" in rule):
            value = trainer[key]
            _check(is_int(value) and value >= minimum, key, value, rule, example)
    interval = trainer.get("val_check_interval")
    if interval is not None:
        _check(
            (is_int(interval) and interval >= 1) or (isinstance(interval, float) and 0 < interval <= 1),
            "val_check_interval", interval, "an integer >= 1 (steps) or a fraction in (0, 1] of an epoch", "100",
        )
    for key in ("limit_train_batches", "limit_val_batches", "limit_test_batches"):
        value = trainer.get(key)
        if value is not None:
            _check(
                (is_int(value) and value >= 0) or (isinstance(value, float) and 0 <= value <= 1),
                key, value, "an integer >= 0 (batches) or a fraction in [0, 1]", "1.0",
            )
    clip = trainer.get("gradient_clip_val")
    if clip is not None:
        _check(is_number(clip) and clip >= 0, "gradient_clip_val", clip, "null or a number >= 0 (0 or null: no clipping)", "1.0")
    devices = trainer.get("devices")
    valid_devices = (
        devices in ("auto", -1)
        or (is_int(devices) and devices >= 1)
        or (isinstance(devices, str) and bool(devices.strip()) and devices.strip() != "0")
        or (isinstance(devices, list) and bool(devices) and all(is_int(d) and d >= 0 for d in devices))
    )
    _check(devices is None or valid_devices, "devices", devices,
           "a count >= 1, -1 or auto (all), or a list of device indices", "1")
    check_sharding_config(trainer.get("strategy"), trainer.get("precision"))


def check_ema_config(ema: Mapping[str, Any] | None, strategy: Any) -> None:
    """``callbacks.ema`` (``callbacks=ema``: Lightning's EMAWeightAveraging), null when off."""
    if ema is None:
        return
    decay = ema.get("decay")
    if not (is_number(decay) and 0 < decay < 1):
        # 1 would never move from the first weights, 0 would be no average at all.
        raise ConfigError(
            f"callbacks.ema.decay must be a number in (0, 1), got {decay!r}: set e.g. callbacks.ema.decay=0.999"
        )
    every = ema.get("update_every_n_steps", 1)
    if not (is_int(every) and every >= 1):
        raise ConfigError(
            f"callbacks.ema.update_every_n_steps must be an integer >= 1, got {every!r}: "
            "set e.g. callbacks.ema.update_every_n_steps=1"
        )
    start = ema.get("update_starting_at_step")
    if start is not None and not (is_int(start) and start >= 0):
        raise ConfigError(
            f"callbacks.ema.update_starting_at_step must be null or an integer >= 0, got {start!r}: "
            "set e.g. callbacks.ema.update_starting_at_step=null"
        )
    # The average is a deep copy of the whole model (torch's AveragedModel), which FSDP2's sharded modules refuse.
    if shards_weights(strategy):
        raise ConfigError(
            "callbacks=ema does not work with FSDP's sharded weights (the average is a deep copy of the whole model): "
            "use trainer=ddp, or leave out callbacks=ema"
        )


def check_callbacks(callbacks: Mapping[str, Any], strategy: Any) -> None:
    """``callbacks.ema``'s settings, and under FSDP, any callback that averages the weights."""
    check_ema_config(callbacks.get("ema"), strategy)
    check_averaging_callbacks(callbacks, strategy)


def check_averaging_callbacks(callbacks: Mapping[str, Any], strategy: Any) -> None:
    """Under FSDP, a callback that keeps an average of the weights (Lightning's StochasticWeightAveraging, any
    WeightAveraging added with ``+callbacks.<name>._target_=...``) is refused like ``callbacks=ema``: each holds a
    deep copy of the whole model (torch's AveragedModel), which FSDP2's sharded modules refuse."""
    if not shards_weights(strategy):
        return
    for name, callback in callbacks.items():
        kind = target_class(callback) if isinstance(callback, Mapping) else None
        if kind is not None and issubclass(kind, (WeightAveraging, StochasticWeightAveraging)):
            raise ConfigError(f"callbacks.{name} ({kind.__name__}) does not work with FSDP's sharded weights (it "
                              f"averages a deep copy of the whole model): use trainer=ddp, or remove callbacks.{name}")


def check_early_stopping(stop: Mapping[str, Any] | None, task: str, validation_metrics: tuple[str, ...]) -> None:
    """``callbacks.early_stopping`` (``callbacks=early_stopping``), null when off: it monitors a metric that
    ``task`` logs at validation (``validation_metrics``), with a patience of at least one validation."""
    if stop is None:
        return
    monitor = stop.get("monitor")
    if monitor not in validation_metrics:
        raise ConfigError(
            f"callbacks.early_stopping.monitor={monitor} is not a metric task={task} logs at validation: choose "
            f"among {', '.join(validation_metrics)} (e.g. callbacks.early_stopping.monitor={validation_metrics[0]})"
        )
    patience = stop.get("patience")
    if not (is_int(patience) and patience >= 1):
        raise ConfigError(
            f"callbacks.early_stopping.patience must be an integer >= 1 (validations without an improvement before "
            f"the stop), got {patience!r}: set e.g. callbacks.early_stopping.patience=3"
        )
    min_delta = stop.get("min_delta", 0.0)
    if not (is_number(min_delta) and min_delta >= 0):
        raise ConfigError(
            f"callbacks.early_stopping.min_delta must be a number >= 0 (the smallest change that counts as an "
            f"improvement), got {min_delta!r}: set e.g. callbacks.early_stopping.min_delta=0"
        )
    if stop.get("mode") not in ("min", "max"):
        raise ConfigError(f"callbacks.early_stopping.mode={stop.get('mode')} is not a direction: set it to min or max")
