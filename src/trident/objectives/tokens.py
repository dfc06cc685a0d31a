"""Objectives on token ids: the next token (causal LM), the masked tokens (MLM), the target sequence (translation).

Every position that trains nothing holds one label, :data:`IGNORE_INDEX` (F.cross_entropy's default): prompt tokens
and padding of chat data, unmasked MLM positions, the padding of a translation target.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trident.data.masking import IGNORE_INDEX
from trident.objectives.base import Loss, Objective, Outputs
from trident.training.losses import label_smoothed_cross_entropy


class NextToken(Objective):
    """Cross entropy of each next token: logits (B, T, V) against targets (B, T), summed over the trained targets."""

    NAME = "next_token"

    def reduce(self, outputs: Outputs, stage: str) -> Loss:
        logits, targets = outputs.logits, outputs.targets  # (B, T, V), (B, T)
        summed = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                                 reduction="sum")
        return Loss(summed, targets.ne(IGNORE_INDEX).sum())


class MaskedTokens(Objective):
    """Cross entropy at the masked positions only: the task's network scores the N selected positions (N, V)
    against their original tokens (N,) (N may be 0: the sum is then 0)."""

    NAME = "masked_tokens"

    def reduce(self, outputs: Outputs, stage: str) -> Loss:
        summed = F.cross_entropy(outputs.logits, outputs.targets, reduction="sum")
        return Loss(summed, torch.tensor(outputs.targets.numel(), device=summed.device))


class TargetSequence(Objective):
    """Label-smoothed cross entropy of a target sequence, logits (B, T, V) against targets (B, T) (Szegedy et al.
    2016; trident.training.losses), with its plain NLL as the part ``nll_loss`` (perplexity reads it)."""

    NAME = "target_sequence"

    def __init__(self, label_smoothing: float = 0.0) -> None:
        super().__init__()
        self.label_smoothing = label_smoothing

    def reduce(self, outputs: Outputs, stage: str) -> Loss:
        loss, nll, count = label_smoothed_cross_entropy(outputs.logits, outputs.targets, epsilon=self.label_smoothing,
                                                        ignore_index=IGNORE_INDEX)
        # The function's means over the real tokens, times their count: the summed loss (0 when there is none).
        return Loss(loss * count, count, {"nll_loss": (nll, count)})
