"""Equal compute: a training budget in model FLOPs that sets each run's number of steps (issue #28).

Models of different sizes trained for the same number of steps get different compute; scaling studies
compare them at equal compute instead. With ``budget.flops`` set (``budget=equal_compute``, or any
number), a run trains ``max(1, floor(budget.flops / FLOPs per step))`` steps, where the FLOPs of one
step are the task's own count (``flops_per_batch``, :mod:`trident.training.flops`, the numbers the
Throughput callback logs) on the first training batch, times the batches of one optimizer step
(``accumulate_grad_batches``) and the processes (``devices x num_nodes``). So every run spends the
budget to within one step's FLOPs. A task whose batches vary in length (translation) is counted on
its first batch.

The step count replaces ``trainer.max_steps``, which must be -1 then (a number there would say
the opposite); validation runs ``budget.validations`` times, every ``steps // validations`` optimizer
steps (also under gradient accumulation: trident.tracking.steps counts ``val_check_interval`` so), and a warmup given as a fraction (``scheduler.warmup_steps=0.1``) follows the steps. The run's
config records ``budget.flops_per_step`` and ``budget.steps``; the report says from the jobs'
configs whether its settings were compared at equal compute or at equal steps.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from trident.errors import ConfigError, is_int, is_number
from trident.runs.compose import device_count

log = logging.getLogger(__name__)


def check_budget(cfg: DictConfig) -> float | None:
    """The FLOP budget (None: train ``trainer.max_steps``), checked before any work."""
    budget = cfg.get("budget") or {}
    flops = budget.get("flops")
    if flops is None:
        return None
    if not is_number(flops) or not math.isfinite(flops) or flops <= 0:
        raise ConfigError(f"budget.flops must be a positive number of training FLOPs, got {flops!r}: "
                          "set e.g. budget.flops=1e12 (null: train trainer.max_steps steps)")
    if cfg.trainer.max_steps != -1:
        raise ConfigError(f"trainer.max_steps={cfg.trainer.max_steps} and budget.flops={flops:g} both set the "
                          "length of training: set trainer.max_steps=-1 to train on the budget, or budget.flops=null")
    validations = budget.get("validations")
    if not is_int(validations) or validations < 1:
        raise ConfigError(f"budget.validations must be an integer >= 1, got {validations!r}: set e.g. budget.validations=6")
    if device_count(cfg.trainer.devices) is None:
        raise ConfigError(f"budget.flops needs the number of processes: set trainer.devices to a number, "
                          f"not {cfg.trainer.devices!r}")
    return float(flops)


def apply_flops_budget(cfg: DictConfig, flops_per_batch: int) -> None:
    """Set ``trainer.max_steps`` and the validation interval from ``budget.flops``, given the FLOPs
    of one training batch of one process; record them in the config. Nothing without a budget."""
    flops = check_budget(cfg)
    if flops is None:
        return
    per_step = flops_per_batch * cfg.trainer.accumulate_grad_batches * device_count(cfg.trainer.devices) * cfg.trainer.num_nodes
    steps = max(1, math.floor(flops / per_step))
    with open_dict(cfg):
        cfg.trainer.max_steps = steps
        cfg.trainer.val_check_interval = max(1, steps // cfg.budget.validations)
        cfg.trainer.check_val_every_n_epoch = None  # the interval counts steps across epochs
        cfg.budget.flops_per_step = per_step
        cfg.budget.steps = steps
    log.info("FLOP budget %.4g: %d steps of %.4g FLOPs (%.4g FLOPs in all), validating every %d steps",
             flops, steps, per_step, steps * per_step, cfg.trainer.val_check_interval)


def first_batch_flops(task: Any, datamodule: Any) -> int:
    """The task's model FLOPs (``flops_per_batch``) for the first batch of a fresh training loader
    (not ``train_dataloader()``, which would use up a resumed run's position)."""
    return int(task.flops_per_batch(next(iter(datamodule.split_loader("train", train=True)))))


def comparison_basis(job_dirs: Sequence[Path]) -> str | None:
    """One sentence for a sweep's report: equal compute (the FLOP budget), equal steps, or neither,
    from the configs Hydra saved in the job directories (None when none has one)."""
    budgets, steps = set(), set()
    for config_file in (job_dir / ".hydra" / "config.yaml" for job_dir in job_dirs):
        if config_file.is_file():
            config = OmegaConf.load(config_file)
            budgets.add(OmegaConf.select(config, "budget.flops"))
            steps.add(OmegaConf.select(config, "trainer.max_steps"))
    if not budgets:
        return None
    if budgets == {None}:
        if len(steps) == 1:
            return f"Equal steps: every job trained {steps.pop()} steps (trainer.max_steps)."
        return f"Unequal training: the jobs trained {', '.join(map(str, sorted(steps)))} steps (trainer.max_steps)."
    if len(budgets) == 1:
        return (f"Equal compute: every job trained on {budgets.pop():.4g} model FLOPs (budget.flops; its steps are "
                "budget.steps in its config_resolved.yaml).")
    return f"Unequal training: FLOP budgets {', '.join(map(str, budgets))} (budget.flops)."


def check_training_batches(cfg: DictConfig, train_loader: Any) -> None:
    """Refuse, in one line, a train split that gives a process no training batch (its loaders drop
    the last, partial batch): Lightning would train 0 steps and end as if the run had succeeded.

    With ``trainer.max_epochs`` null (every task's default but vit's) Lightning runs epochs until
    ``trainer.max_steps``, so one batch per epoch is enough to reach it; with an epoch limit the run
    ends at whichever comes first, as Lightning documents. ``max_steps=0`` or
    ``limit_train_batches=0`` ask for no training and are left alone.
    """
    trainer = cfg.trainer
    limit = trainer.get("limit_train_batches", 1.0)
    if trainer.get("max_steps") == 0 or limit in (0, None):
        return
    processes = (device_count(trainer.devices) or 1) * int(trainer.get("num_nodes") or 1)
    # Samplers deal whole batches to the processes: floor(examples / (batch x processes)) each.
    batches = len(train_loader) // processes
    limited = min(batches, int(limit)) if isinstance(limit, int) else int(batches * float(limit))
    if limited > 0:
        return
    examples, batch_size = len(train_loader.dataset), train_loader.batch_size
    what = f"{examples} training examples" + (
        f" (blocks of data.block_size={cfg.data.block_size} tokens)" if cfg.data.get("block_size") else "")
    if batches > 0:
        raise ConfigError(f"the train split gives no training batch: trainer.limit_train_batches={limit} of its {batches} "
                          f"batches is none: raise trainer.limit_train_batches")
    if batch_size is None:  # batches of a token budget (translation)
        raise ConfigError(f"the train split gives no training batch: {what} on {processes} process(es) fill no batch of "
                          f"data.max_tokens={cfg.data.get('max_tokens')}: lower data.max_tokens or train on more data")
    most = examples // processes
    fix = f"set data.batch_size to at most {most}, or train on more data" if most > 0 else "train on more data"
    raise ConfigError(f"the train split gives no training batch: {what} for batches of data.batch_size={batch_size} on "
                      f"{processes} process(es) (the last, partial batch is dropped): {fix}")
