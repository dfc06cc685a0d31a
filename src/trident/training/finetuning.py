"""Fine-tuning options of a pre-trained backbone: a frozen backbone (for some steps or for good),
layer-wise learning-rate decay and a learning rate of the head's own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from trident.errors import ConfigError, is_int, is_number

FROZEN_FOR_GOOD = -1  # freeze_backbone_steps: the backbone never trains (a linear probe)


def check_finetuning(freeze_backbone_steps: Any, layer_decay: Any, head_lr: Any) -> None:
    if not is_int(freeze_backbone_steps) or freeze_backbone_steps < FROZEN_FOR_GOOD:
        raise ConfigError(f"task.freeze_backbone_steps must be an integer >= -1 (0: never frozen, -1: frozen for good), "
                          f"got {freeze_backbone_steps!r}: set e.g. task.freeze_backbone_steps=100")
    if not is_number(layer_decay) or not 0 < layer_decay <= 1:
        raise ConfigError(f"task.layer_decay must be in (0, 1] (1: no decay), got {layer_decay!r}: set e.g. task.layer_decay=0.75")
    if head_lr is not None and (not is_number(head_lr) or head_lr <= 0):
        raise ConfigError(f"task.head_lr must be a positive number or null (the optimizer's lr), got {head_lr!r}: "
                          "set e.g. task.head_lr=1e-3")


def layerwise_groups(
    model: nn.Module,
    layer_of: Callable[[str], int],
    top_layer: int,
    *,
    lr: float,
    weight_decay: float,
    layer_decay: float,
    head_lr: float | None,
    head_prefix: str = "head.",
    no_decay_names: set[str] = frozenset(),
    frozen_names: set[str] = frozenset(),
) -> list[dict[str, Any]]:
    """One optimizer group per (depth, decayed or not): the parameters at depth ``d`` get
    ``lr * layer_decay ** (top_layer - d)`` (Clark et al. 2020, ELECTRA), the head ``head_lr``
    (default ``lr``); matrices are weight-decayed, biases, norm gains and ``no_decay_names`` not.
    ``frozen_names`` (frozen for good) are left out; parameters frozen for some steps are in, as
    they only lack gradients until then (whatever their ``requires_grad`` is now)."""
    groups: dict[tuple[str, bool], dict[str, Any]] = {}
    for name, param in model.named_parameters():
        if name in frozen_names:
            continue
        if name.startswith(head_prefix):
            key, group_lr = "head", head_lr if head_lr is not None else lr
        else:
            depth = layer_of(name)
            key, group_lr = f"layer_{depth}", lr * layer_decay ** (top_layer - depth)
        decayed = param.ndim >= 2 and name not in no_decay_names
        group = groups.setdefault((key, decayed), {"params": [], "lr": group_lr, "weight_decay": weight_decay if decayed else 0.0,
                                                   "name": f"{key}{'' if decayed else '_no_decay'}"})
        group["params"].append(param)
    return list(groups.values())


def trainable_parameters(net: nn.Module) -> dict[str, float]:
    """What trains, for the log and the W&B run: the count, the total, the share."""
    params = list(net.parameters())  # shared (tied) tensors once
    trainable = sum(p.numel() for p in params if p.requires_grad)
    total = sum(p.numel() for p in params)
    return {"params/trainable": trainable, "params/total": total, "params/trainable_share": trainable / total}
