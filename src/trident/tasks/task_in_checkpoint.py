"""What a task keeps in its checkpoints besides weights and hyperparameters."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer
from torch import nn

from trident.converters.weight_only import restore_quantized
from trident.tasks.frozen_base import NET, FrozenBase, drop_base, refill_base

if TYPE_CHECKING:
    from trident.backbone import TransformerConfig

#: The checkpoint key naming the task class that wrote it (``trident.load`` rebuilds it from that).
TASK_KEY = "trident_task"


class TaskInCheckpoint:
    """LightningModule mixin: every checkpoint names the task class that wrote it, so a checkpoint
    alone is enough to rebuild the task (``trident.load``, ``init_from=``), and a text task's
    checkpoint holds its tokenizer, so it alone can decode (it is not a hyperparameter: a BPE
    vocabulary is large). A ``finetune=lora`` run's checkpoints leave out its frozen base and record where it
    comes from; reading one refills it (trident.tasks.frozen_base)."""

    tokenizer: Tokenizer | None
    tokenizer_settings: dict[str, str]  # chat template and special tokens of an outside tokenizer (init_from)
    net: nn.Module
    backbone_config: TransformerConfig
    #: finetune=lora from init_from: the frozen base its checkpoints leave out (set by the pipeline or a read); None:
    #: the checkpoints hold every weight.
    frozen_base: FrozenBase | None = None

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[TASK_KEY] = f"{type(self).__module__}.{type(self).__qualname__}"
        if self.tokenizer is not None:
            checkpoint["tokenizer_json"] = self.tokenizer.to_str()
        if self.tokenizer_settings:
            checkpoint["tokenizer_settings"] = self.tokenizer_settings
        if self.frozen_base is not None:
            drop_base(checkpoint, self.frozen_base)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Before Lightning loads the weights: a LoRA checkpoint's base comes back from the network or its source.
        trainer = getattr(self, "_trainer", None)
        path = Path(trainer.ckpt_path) if trainer is not None and trainer.ckpt_path else None
        # A timm file records no head count: it is read again with the heads the run read it with (the network's).
        heads = self.backbone_config.n_heads
        self.frozen_base = refill_base(checkpoint, self.net, self.frozen_base, path, heads)
        restore_quantized(checkpoint, self.net, NET)  # a trident-quantize checkpoint's int8/int4 layers
        if checkpoint.get("tokenizer_json"):
            self.tokenizer = Tokenizer.from_str(checkpoint["tokenizer_json"])
        # A resumed run keeps what it set from its data and source (a checkpoint written before runs recorded their
        # chat template has none); a task rebuilt from the checkpoint alone has nothing set, so it reads them all.
        self.tokenizer_settings = dict(checkpoint.get("tokenizer_settings") or {}) | self.tokenizer_settings
