"""Objectives on token ids: the next token (causal LM), the masked tokens (MLM), the target sequence (translation).

Every position that trains nothing holds one label, :data:`IGNORE_INDEX` (F.cross_entropy's default): prompt tokens
and padding of chat data, unmasked MLM positions, the padding of a translation target.

Each scores either whole logits or, where the task hands over its vocabulary head (``task.loss_chunk`` > 0,
:class:`~trident.backbone.vocabulary_head.VocabularyHead`), the head's hidden states chunk by chunk
(trident.training.chunked_loss): the same loss and gradients without the whole batch's logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trident.backbone import VocabularyHead
from trident.data.masking import IGNORE_INDEX
from trident.objectives.base import Loss, Objective, Outputs
from trident.training.chunked_loss import chunked_cross_entropy
from trident.training.losses import label_smoothed_cross_entropy


class NextToken(Objective):
    """Cross entropy of each next token: logits (B, T, V) against targets (B, T), summed over the trained targets."""

    NAME = "next_token"

    def reduce(self, outputs: Outputs, stage: str) -> Loss:
        if isinstance(outputs.scores, VocabularyHead):
            summed, _, count = chunked_cross_entropy(outputs.scores, outputs.targets, ignore_index=IGNORE_INDEX)
            return Loss(summed, count)
        logits, targets = outputs.logits, outputs.targets  # (B, T, V), (B, T)
        summed = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                                 reduction="sum")
        return Loss(summed, targets.ne(IGNORE_INDEX).sum())


class MaskedTokens(Objective):
    """Cross entropy at the masked positions only: the task's network scores the N selected positions (N, V)
    against their original tokens (N,) (N may be 0: the sum is then 0)."""

    NAME = "masked_tokens"

    def reduce(self, outputs: Outputs, stage: str) -> Loss:
        if isinstance(outputs.scores, VocabularyHead):
            summed = chunked_cross_entropy(outputs.scores, outputs.targets, ignore_index=IGNORE_INDEX)[0]
            return Loss(summed, torch.tensor(outputs.targets.numel(), device=summed.device))
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
        if isinstance(outputs.scores, VocabularyHead):
            summed, nll_summed, count = chunked_cross_entropy(outputs.scores, outputs.targets, ignore_index=IGNORE_INDEX,
                                                              label_smoothing=self.label_smoothing)
            return Loss(summed, count, {"nll_loss": (nll_summed / count.clamp(min=1), count)})
        loss, nll, count = label_smoothed_cross_entropy(outputs.logits, outputs.targets, epsilon=self.label_smoothing,
                                                        ignore_index=IGNORE_INDEX)
        # The function's means over the real tokens, times their count: the summed loss (0 when there is none).
        return Loss(loss * count, count, {"nll_loss": (nll, count)})
