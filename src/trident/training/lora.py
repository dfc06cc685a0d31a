"""``finetune=lora``: the settings check and what trains.

Under LoRA the base network is frozen; the adapters (:mod:`trident.backbone.lora`) and the task's
head (``TridentTask.HEAD``: the classifier a fine-tuning adds, peft's ``modules_to_save``) train.
A run writes its adapter (trident.weights.lora_adapter); its checkpoints leave the frozen base out
(trident.weights.frozen_base).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from trident.backbone import LORA_TARGETS, TransformerConfig
from trident.errors import ConfigError, is_int, is_number

if TYPE_CHECKING:  # omegaconf is imported where a config is read: a command that loads a run (sample) reads none
    from omegaconf import DictConfig

FINETUNE_MODES = ("full", "lora")
#: The keys of ``finetune=lora`` that build the adapters (the task's ``lora`` hyperparameter).
LORA_KEYS = ("rank", "alpha", "dropout", "targets")


def lora_settings(cfg: DictConfig, backbone: TransformerConfig) -> dict[str, Any] | None:
    """The ``finetune`` group checked against ``backbone``: the adapters' settings, or None for full fine-tuning."""
    from omegaconf import OmegaConf

    finetune: dict[str, Any] = OmegaConf.to_container(cfg.get("finetune") or {"name": "full"}, resolve=True)  # type: ignore[assignment]
    mode = finetune.get("name")
    if mode not in FINETUNE_MODES:
        raise ConfigError(f"finetune={mode} is not a fine-tuning mode: choose one of {', '.join(FINETUNE_MODES)}")
    if mode == "full":
        return None
    if not cfg.get("init_from"):
        raise ConfigError("finetune=lora adapts a trained model and none is given: add init_from=<a run, checkpoint or "
                          "Hugging Face directory> (or use finetune=full to train from scratch)")
    settings = {key: finetune.get(key) for key in LORA_KEYS}
    targets = settings["targets"]
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise ConfigError(f"finetune.targets must be a list of parts, got {targets!r}: set e.g. finetune.targets=[q,v] "
                          f"(parts: {', '.join(LORA_TARGETS)})")
    unknown = [t for t in targets if t not in LORA_TARGETS]
    if unknown:
        raise ConfigError(f"finetune.targets names {', '.join(unknown)}, which the model does not have: choose among "
                          f"{', '.join(LORA_TARGETS)} (attention query, key, value, output; the feed-forward layers)")
    width = min(_widths(backbone)[t] for t in targets)
    rank = settings["rank"]
    if not is_int(rank) or not 0 < rank <= width:
        raise ConfigError(f"finetune.rank must be an integer from 1 to {width} (the narrowest targeted layer), "
                          f"got {rank!r}: set e.g. finetune.rank=8")
    if not is_number(settings["alpha"]) or settings["alpha"] <= 0:
        raise ConfigError(f"finetune.alpha must be a positive number, got {settings['alpha']!r}: set e.g. finetune.alpha=16")
    if not is_number(settings["dropout"]) or not 0 <= settings["dropout"] < 1:
        raise ConfigError(f"finetune.dropout must be in [0, 1), got {settings['dropout']!r}: set e.g. finetune.dropout=0.05")
    return settings


def check_lora_checkpoints(cfg: DictConfig) -> None:
    """A training run's checkpoints under ``finetune=lora`` leave the frozen base out (trident.weights.frozen_base):
    sharded ones cannot, since Lightning's sharded loader (torch.distributed.checkpoint) reads every weight of the
    model from the directory. (Not part of the config check: eval.py still tests a sharded LoRA run saved before.)"""
    from omegaconf import DictConfig

    strategy = cfg.trainer.get("strategy")
    if ((cfg.get("finetune") or {}).get("name") == "lora" and isinstance(strategy, DictConfig)
            and strategy.get("save_distributed_checkpoint") is True):
        raise ConfigError("finetune=lora checkpoints hold only what trains (the frozen base is refilled from init_from), "
                          "which a sharded checkpoint cannot reload and which is small enough to save whole: set "
                          "trainer.strategy.save_distributed_checkpoint=false")


def _widths(cfg: TransformerConfig) -> dict[str, int]:
    """The smaller side of each targeted part's weight (a rank above it adds nothing)."""
    q_rows, kv_rows = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return {"q": min(cfg.d_model, q_rows), "k": min(cfg.d_model, kv_rows), "v": min(cfg.d_model, kv_rows),
            "o": min(cfg.d_model, q_rows), "mlp": min(cfg.d_model, cfg.d_ff)}


def trainable_parameters(net: nn.Module) -> dict[str, float]:
    """What trains, for the log and the W&B run: the count, the total, the share."""
    params = list(net.parameters())  # shared (tied) tensors once
    trainable = sum(p.numel() for p in params if p.requires_grad)
    total = sum(p.numel() for p in params)
    return {"params/trainable": trainable, "params/total": total, "params/trainable_share": trainable / total}
