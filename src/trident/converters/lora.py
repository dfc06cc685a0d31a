"""``finetune=lora``: low-rank adapters (trident.backbone's ``LoRALinear``) as a converter.

Under LoRA the base network is frozen; the adapters and the task's head (``TridentTask.HEAD``: the classifier a
fine-tuning adds, peft's ``modules_to_save``) train. A run writes its adapter (trident.weights.lora_adapter); its
checkpoints leave the frozen base out (trident.weights.frozen_base); an export merges the adapters away.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar

from torch import nn

from trident.backbone import LORA_TARGETS, TransformerConfig, adapters_off, add_lora, is_lora_parameter, merge_lora
from trident.converters.base import Converter
from trident.errors import ConfigError, is_int, is_number

if TYPE_CHECKING:
    from omegaconf import DictConfig

#: The keys of ``finetune=lora`` that build the adapters (the task's ``lora`` hyperparameter).
LORA_KEYS = ("rank", "alpha", "dropout", "targets")


class LoRA(Converter):
    """Adapters on the ``targets`` parts of every attention and feed-forward layer; only they train."""

    NAME: ClassVar[str] = "lora"
    START_FROM: ClassVar[str | None] = "adapter"
    FREEZES_SOURCE: ClassVar[bool] = True
    SWITCHES_OFF: ClassVar[bool] = True

    @classmethod
    def check(cls, cfg: DictConfig, settings: dict[str, Any], backbone: TransformerConfig) -> dict[str, Any]:
        if not cfg.get("init_from"):  # finetune=lora, or qlora (LoRA on an NF4 base)
            raise ConfigError(f"finetune={settings.get('name', cls.NAME)} adapts a trained model and none is given: add "
                              "init_from=<a run, checkpoint or Hugging Face directory> (or use finetune=full to train "
                              "from scratch)")
        chosen = {key: settings.get(key) for key in LORA_KEYS}
        targets = chosen["targets"]
        if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
            raise ConfigError(f"finetune.targets must be a list of parts, got {targets!r}: set e.g. "
                              f"finetune.targets=[q,v] (parts: {', '.join(LORA_TARGETS)})")
        unknown = [t for t in targets if t not in LORA_TARGETS]
        if unknown:
            raise ConfigError(f"finetune.targets names {', '.join(unknown)}, which the model does not have: choose among "
                              f"{', '.join(LORA_TARGETS)} (attention query, key, value, output; the feed-forward layers)")
        width = min(_widths(backbone)[t] for t in targets)
        rank = chosen["rank"]
        if not is_int(rank) or not 0 < rank <= width:
            raise ConfigError(f"finetune.rank must be an integer from 1 to {width} (the narrowest targeted layer), "
                              f"got {rank!r}: set e.g. finetune.rank=8")
        if not is_number(chosen["alpha"]) or chosen["alpha"] <= 0:
            raise ConfigError(f"finetune.alpha must be a positive number, got {chosen['alpha']!r}: set e.g. "
                              "finetune.alpha=16")
        if not is_number(chosen["dropout"]) or not 0 <= chosen["dropout"] < 1:
            raise ConfigError(f"finetune.dropout must be in [0, 1), got {chosen['dropout']!r}: set e.g. "
                              "finetune.dropout=0.05")
        return chosen

    @classmethod
    def check_run(cls, cfg: DictConfig) -> None:
        """The run's checkpoints leave the frozen base out: sharded ones cannot, since Lightning's sharded loader
        (torch.distributed.checkpoint) reads every weight of the model from the directory. (Not part of the config
        check: eval.py still tests a sharded LoRA run saved before.)"""
        from omegaconf import DictConfig

        strategy = cfg.trainer.get("strategy")
        if isinstance(strategy, DictConfig) and strategy.get("save_distributed_checkpoint") is True:
            raise ConfigError("finetune=lora checkpoints hold only what trains (the frozen base is refilled from "
                              "init_from), which a sharded checkpoint cannot reload and which is small enough to save "
                              "whole: set trainer.strategy.save_distributed_checkpoint=false")

    def apply(self, net: nn.Module) -> None:
        add_lora(net, **self.settings)

    def trains(self, name: str) -> bool:
        return is_lora_parameter(name)

    def merge(self, net: nn.Module) -> None:
        merge_lora(net)

    def switched_off(self, net: nn.Module) -> AbstractContextManager[None]:
        """The frozen base alone: every adapter off (no second copy of the weights)."""
        return adapters_off(net)


def _widths(cfg: TransformerConfig) -> dict[str, int]:
    """The smaller side of each targeted part's weight (a rank above it adds nothing)."""
    q_rows, kv_rows = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return {"q": min(cfg.d_model, q_rows), "k": min(cfg.d_model, kv_rows), "v": min(cfg.d_model, kv_rows),
            "o": min(cfg.d_model, q_rows), "mlp": min(cfg.d_model, cfg.d_ff)}
