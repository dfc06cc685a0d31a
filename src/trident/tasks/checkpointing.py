"""What a task keeps in its checkpoints besides weights and hyperparameters."""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer


class TokenizerInCheckpoint:
    """LightningModule mixin: the tokenizer travels inside every checkpoint, so a checkpoint
    alone can decode (it is not a hyperparameter: a BPE vocabulary is large)."""

    tokenizer: Tokenizer | None

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.tokenizer is not None:
            checkpoint["tokenizer_json"] = self.tokenizer.to_str()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if checkpoint.get("tokenizer_json"):
            self.tokenizer = Tokenizer.from_str(checkpoint["tokenizer_json"])
