"""Optimizer parameter groups and learning-rate schedules (warmup + cosine, the paper's inverse sqrt)."""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from trident.errors import ConfigError, choose, is_int, is_number

log = logging.getLogger(__name__)


def parameter_groups(model: nn.Module, weight_decay: float, no_decay_names: set[str] = frozenset()) -> list[dict[str, Any]]:
    """Decay matrices only: biases, norm gains (all < 2-D) and the names in ``no_decay_names``
    (e.g. positional tables) are left alone, as in GPT-2 / timm."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim < 2 or name in no_decay_names else decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


# optimizer.name: name -> torch optimizer class (its other keys are that class's arguments).
OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW,
    "adam": torch.optim.Adam,
    "sgd": torch.optim.SGD,
}


def _number(cfg: dict[str, Any], group: str, key: str, default: float) -> float:
    value = cfg.get(key, default)
    if not is_number(value):
        raise ConfigError(f"{group}.{key} must be a number, got {value!r}: set e.g. {group}.{key}={default}")
    return float(value)


def optimizer_by_name(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with the optimizer chosen by ``name``: a run saved before that choice existed names
    its class by ``_target_`` (``torch.optim.AdamW``), which maps to its name here, so
    ``eval.py`` still scores its checkpoints."""
    target = cfg.get("_target_")
    if "name" in cfg or target is None:
        return cfg
    names = {f"torch.optim.{cls.__name__}": name for name, cls in OPTIMIZERS.items()}
    return {**{k: v for k, v in cfg.items() if k != "_target_"}, "name": names.get(target, target)}


def check_optimizer_config(cfg: dict[str, Any]) -> None:
    """Fail in one line on values no optimizer accepts (checked before any work, and when building)."""
    choose(OPTIMIZERS, cfg.get("name"), "optimizer.name")
    lr = _number(cfg, "optimizer", "lr", 1e-3)
    if lr <= 0:
        raise ConfigError(f"optimizer.lr must be positive, got {cfg.get('lr')!r}: set e.g. optimizer.lr=1e-3")
    weight_decay = _number(cfg, "optimizer", "weight_decay", 0.0)
    if weight_decay < 0:
        raise ConfigError(f"optimizer.weight_decay must be >= 0, got {weight_decay}: set e.g. optimizer.weight_decay=0.1 (0 = off)")


def check_scheduler_config(cfg: dict[str, Any]) -> None:
    choose(SCHEDULES, cfg.get("name"), "scheduler.name")
    warmup = cfg.get("warmup_steps", 0)
    if not ((is_int(warmup) and warmup >= 0) or (isinstance(warmup, float) and 0 < warmup < 1)):
        raise ConfigError(f"scheduler.warmup_steps must be an integer >= 0 (steps) or a fraction in (0, 1) of the "
                          f"run's steps, got {warmup!r}: set e.g. scheduler.warmup_steps=100 (0 = no warmup)")


def kernel_options(optimizer_class: type, fused: bool) -> dict[str, bool]:
    """One fused kernel for all parameters when asked and the optimizer has one, else the
    multi-tensor (foreach) kernels; both beat PyTorch's per-parameter loop on a CPU, where it is
    the default (docs/benchmarks.md). A device without fused kernels fails at construction."""
    accepted = inspect.signature(optimizer_class).parameters
    if fused and "fused" in accepted:
        return {"fused": True}
    return {"foreach": True} if "foreach" in accepted else {}


def fused_allowed(optimizer_cfg: dict[str, Any], precision: str, gradient_clip_val: float | None) -> dict[str, Any]:
    """``optimizer_cfg`` with ``fused`` turned off (foreach instead) where gradients cannot be clipped before its
    step: under 16-mixed a fused optimizer unscales the GradScaler's gradients inside its step, after clipping.
    bf16-mixed has no scaler: TridentTask.configure_gradient_clipping clips before the fused step."""
    if optimizer_cfg.get("fused") and precision in ("16", "16-mixed") and gradient_clip_val:
        log.info("optimizer.fused: using foreach kernels, as a fused optimizer unscales fp16 gradients only in its "
                 "step, after gradient clipping, under precision=%s", precision)
        return {**optimizer_cfg, "fused": False}
    return optimizer_cfg


def build_optimizer(
    model: nn.Module, cfg: dict[str, Any], no_decay_names: set[str] = frozenset(), groups: list[dict[str, Any]] | None = None
) -> torch.optim.Optimizer:
    """``cfg`` holds ``name`` (a key of :data:`OPTIMIZERS`), ``lr``, ``weight_decay``, ``fused``
    (see :func:`kernel_options`) and the optimizer's other arguments. ``groups``: parameter groups
    of the task's own (e.g. per-layer learning rates) instead of :func:`parameter_groups`."""
    check_optimizer_config(cfg)
    options = dict(cfg)
    optimizer_class = OPTIMIZERS[options.pop("name")]
    fused = options.pop("fused", False)
    if not isinstance(fused, bool):
        raise ConfigError(f"optimizer.fused must be true or false, got {fused!r}: set optimizer.fused=true or false")
    options.update(kernel_options(optimizer_class, fused))
    weight_decay = float(options.pop("weight_decay", 0.0))
    groups = groups if groups is not None else parameter_groups(model, weight_decay, set(no_decay_names))
    try:
        return optimizer_class(groups, **options)
    except TypeError as err:  # a key the optimizer does not take
        raise ConfigError(f"optimizer={cfg['name']}: {err}: remove that optimizer.* key") from None


def warmup_cosine(warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1) -> Callable[[int], float]:
    """Linear warmup to the peak, then cosine decay to ``min_lr_ratio`` x peak at ``total_steps``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def inverse_sqrt(warmup_steps: int) -> Callable[[int], float]:
    """The paper's schedule (section 5.3): lr ~ min(step^-0.5, step * warmup^-1.5), normalised
    so the peak, reached at ``warmup_steps``, equals the optimizer's lr.

    The paper's own peak is d_model^-0.5 * warmup^-0.5 (7e-4 for d_model=512, warmup=4000).
    """

    def factor(step: int) -> float:
        step = step + 1
        return min(step / warmup_steps, math.sqrt(warmup_steps / step))

    return factor


def constant() -> Callable[[int], float]:
    return lambda step: 1.0


def _warmup(cfg: dict[str, Any], total_steps: int) -> int:
    """Warmup steps: ``warmup_steps`` as given, or a fraction of ``total_steps`` (a run whose steps
    follow from a FLOP budget, trident.runs.budget)."""
    warmup = cfg.get("warmup_steps", 0)
    return max(1, round(warmup * total_steps) if isinstance(warmup, float) else int(warmup))


# scheduler.name: name -> (scheduler config, total steps) -> the lr factor of each step.
SCHEDULES: dict[str, Callable[[dict[str, Any], int], Callable[[int], float]]] = {
    "cosine": lambda cfg, total_steps: warmup_cosine(_warmup(cfg, total_steps), total_steps,
                                                     float(cfg.get("min_lr_ratio", 0.1))),
    "inverse_sqrt": lambda cfg, total_steps: inverse_sqrt(_warmup(cfg, total_steps)),
    "constant": lambda cfg, total_steps: constant(),
}


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: dict[str, Any], total_steps: int) -> LambdaLR:
    """``cfg.name``: a key of :data:`SCHEDULES`; stepped every optimizer step."""
    check_scheduler_config(cfg)
    return LambdaLR(optimizer, SCHEDULES[cfg["name"]](cfg, total_steps))


def positional_parameter_names(model: nn.Module) -> set[str]:
    """Learned position tables and relative-position biases: kept out of weight decay."""
    return {name for name, _ in model.named_parameters() if ".pos_encoding." in f".{name}"}


def optimizers_for(
    model: nn.Module,
    optimizer_cfg: dict[str, Any],
    scheduler_cfg: dict[str, Any],
    total_steps: int,
    no_decay_names: set[str] = frozenset(),
    groups: list[dict[str, Any]] | None = None,
) -> OptimizerLRSchedulerConfig:
    """What ``LightningModule.configure_optimizers`` returns: the optimizer and a per-step schedule."""
    optimizer = build_optimizer(model, optimizer_cfg, no_decay_names, groups)
    scheduler = build_scheduler(optimizer, scheduler_cfg, total_steps)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
