"""``python train.py tune=lr_find``: Lightning's learning-rate finder (``Tuner.lr_find``, the range test)
on the task as the run would train it, instead of training.

Lightning's finder looks for the rate on the module (``lr`` or ``learning_rate``); trident keeps it in
the optimizer config, which :attr:`trident.tasks.base.TridentTask.learning_rate` exposes, so the finder
works on every task, from a notebook too (``Tuner(trainer).lr_find(task)``). The finder trains
``tune.num_training`` steps at rising rates, then loads the weights and optimizer it started from (its
own temporary checkpoint, removed): the run leaves its curve and suggestion, no training state.
Every parameter group sweeps one rate (Lightning's finder): with ``task.layer_decay`` or ``task.head_lr``
the suggestion is for ``optimizer.lr`` alone.
Each point of the curve is an optimizer step's ``train/loss``, the global batch's token mean
(:class:`StepLossRecorder`), under gradient accumulation too.
"""

from __future__ import annotations

import json
import logging
import math
import shlex
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.tuner import Tuner
from lightning.pytorch.tuner import lr_finder as lightning_lr_finder
from omegaconf import DictConfig, OmegaConf

from trident.data.base import TridentDataModule
from trident.errors import ConfigError, is_int, is_number
from trident.tasks.base import TridentTask
from trident.tracking.loggers import record_summary
from trident.training.token_loss import StepLoss

if TYPE_CHECKING:
    from matplotlib.figure import Figure

log = logging.getLogger(__name__)

FIGURE_FILE = "lr_find.png"
RESULT_FILE = "lr_find.json"
SUGGESTED_LR = "lr_find/suggested_lr"
# The suggestion leaves out the curve's first 10 points and its last (Lightning's _LRFinder.suggestion).
MIN_STEPS = 20
MODES = ("exponential", "linear")


def check_tune_config(tune: Mapping[str, Any] | None, resume: Any, ckpt_path: Any) -> None:
    """``tune=lr_find``'s settings, before any work; null: the run trains."""
    if tune is None:
        return
    if tune.get("name") != "lr_find":
        raise ConfigError(f"tune.name={tune.get('name')} is not a tuner: use tune=lr_find")
    if resume or ckpt_path:
        raise ConfigError("tune=lr_find starts from the configured weights, not a checkpoint to resume: drop "
                          "resume/ckpt_path (init_from=<run dir> starts from a run's weights)")
    min_lr, max_lr = tune.get("min_lr"), tune.get("max_lr")
    if not (is_number(min_lr) and is_number(max_lr) and 0 < min_lr < max_lr):
        raise ConfigError(f"tune.min_lr and tune.max_lr must be numbers with 0 < min_lr < max_lr, got {min_lr!r} and "
                          f"{max_lr!r}: set e.g. tune.min_lr=1e-7 tune.max_lr=1")
    steps = tune.get("num_training")
    if not (is_int(steps) and steps >= MIN_STEPS):
        raise ConfigError(f"tune.num_training must be an integer >= {MIN_STEPS} (the suggestion leaves out the first 10 "
                          f"rates and the last), got {steps!r}: set e.g. tune.num_training=100")
    if tune.get("mode") not in MODES:
        raise ConfigError(f"tune.mode={tune.get('mode')} is not a finder mode: choose {' or '.join(MODES)}")
    threshold = tune.get("early_stop_threshold")
    if threshold is not None and not (is_number(threshold) and threshold > 1):
        raise ConfigError(f"tune.early_stop_threshold must be null or a number > 1, got {threshold!r}: "
                          "set e.g. tune.early_stop_threshold=4")


def check_tunable(tune: Mapping[str, Any] | None, task: TridentTask) -> None:
    """The finder trains some parameter (checked once the task is built, before the run writes anything)."""
    if tune is None:
        return
    if not any(p.requires_grad for p in task.parameters()):
        total = sum(p.numel() for p in task.parameters())
        raise ConfigError(f"tune=lr_find: every parameter of task={task.NAME}'s network is frozen ({total} of {total}), "
                          "so no rate changes its loss: run the finder on a configuration that trains (e.g. finetune=full)")


def command_with_rate(lr: float) -> str:
    """This run's command line with ``tune=...`` replaced by ``optimizer.lr=<lr>``."""
    overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    keys = [o.partition("=")[0].lstrip("+~") for o in overrides]
    kept = [o for o, key in zip(overrides, keys, strict=True) if key != "optimizer.lr" and key.split(".")[0] != "tune"]
    return shlex.join(["python", "train.py", *kept, f"optimizer.lr={lr:.3g}"])


class StepLossRecorder(lightning_lr_finder._LRCallback):
    """Lightning's finder callback, recording each optimizer step's ``train/loss`` (the summed token losses of
    its global batch over their count, :class:`trident.training.token_loss.StepLoss`). Lightning's records
    what the step's last micro-batch's ``training_step`` returned, divided by ``accumulate_grad_batches``:
    under the global token loss that is one micro-batch's summed loss times a scale, so with accumulation 2
    the curve held about half the loss, of one micro-batch."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = cast(TridentTask, pl_module).step_loss.last_step.get(StepLoss.LOSS)
        # A step without a trained token has no loss: Lightning's NaN point, as for an empty output.
        step = {"loss": torch.tensor(loss)} if loss is not None else {}
        super().on_train_batch_end(trainer, pl_module, step, batch, batch_idx)


@contextmanager
def step_loss_curve() -> Iterator[None]:
    """Lightning's finder with :class:`StepLossRecorder`: ``Tuner.lr_find`` builds its callback by this name."""
    lightning_callback = lightning_lr_finder._LRCallback
    lightning_lr_finder._LRCallback = StepLossRecorder  # type: ignore[misc]
    try:
        yield
    finally:
        lightning_lr_finder._LRCallback = lightning_callback  # type: ignore[misc]


def find_learning_rate(cfg: DictConfig, trainer: L.Trainer, task: TridentTask, datamodule: TridentDataModule) -> dict[str, float]:
    """Run Lightning's finder with ``cfg.tune``; write the curve and the suggestion into the run directory
    (and W&B); returns ``{"lr_find/suggested_lr": rate}``, the job's final metrics."""
    tune: dict[str, Any] = OmegaConf.to_container(cfg.tune, resolve=True)  # type: ignore[assignment]
    with step_loss_curve():
        finder = Tuner(trainer).lr_find(
            task, datamodule=datamodule, min_lr=tune["min_lr"], max_lr=tune["max_lr"], num_training=tune["num_training"],
            mode=tune["mode"], early_stop_threshold=tune["early_stop_threshold"], attr_name="learning_rate",
        )
    lr = finder.suggestion() if finder is not None else None
    if lr is None or not math.isfinite(lr):
        raise ConfigError(f"tune=lr_find: the loss was finite at too few rates for a suggestion (of {tune['num_training']} "
                          "steps): raise tune.num_training or lower tune.max_lr")
    command = command_with_rate(lr)
    if trainer.is_global_zero:
        run_dir = Path(trainer.default_root_dir)
        figure = finder_figure(finder.results, finder.mode, lr)
        figure.savefig(run_dir / FIGURE_FILE, dpi=110)
        (run_dir / RESULT_FILE).write_text(json.dumps({"suggested_lr": lr, "command": command, **tune, **finder.results}, indent=1) + "\n")
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_image(key="lr_find/curve", images=[str(run_dir / FIGURE_FILE)])
        record_summary(trainer.loggers, {SUGGESTED_LR: lr})
        log.info("Suggested learning rate %.3g (%s, %s); train with it:\n%s", lr, run_dir / FIGURE_FILE, run_dir / RESULT_FILE, command)
    return {SUGGESTED_LR: lr}


def finder_figure(results: dict[str, list[float]], mode: str, lr: float) -> Figure:
    """The smoothed training loss against the rate, the suggestion (the steepest descent) marked."""
    from matplotlib.figure import Figure  # only the finder draws: train.py starts without matplotlib

    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    ax.plot(results["lr"], results["loss"])
    ax.axvline(lr, color="tab:red", linestyle="--", label=f"suggested optimizer.lr={lr:.3g}")
    ax.set(xlabel="learning rate", ylabel="training loss (smoothed)", xscale="log" if mode == "exponential" else "linear")
    ax.legend()
    fig.tight_layout()
    return fig
