"""The class-label objective: one class per sequence (classify) or image (vit)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trident.objectives.base import TRAIN, Loss, Objective, Outputs


class ClassLabel(Objective):
    """Cross entropy of class logits (B, C). Training smooths hard labels (B,) by ``label_smoothing``, or reads
    class probabilities (B, C) (Mixup / CutMix mix pairs of images and their smoothed one-hot labels) with timm's
    soft-target cross entropy, as DeiT: which one follows from the targets' shape, never from a setting that could
    disagree with them. Validation and test score the hard labels unsmoothed: the loss a reader compares across
    settings."""

    NAME = "class_label"

    def __init__(self, label_smoothing: float = 0.0) -> None:
        # Here, not at the top: trident.objectives loads with every task, timm (and the W&B it imports) with those
        # that classify only.
        from timm.loss import SoftTargetCrossEntropy

        super().__init__()
        self.hard_loss = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
        self.soft_loss = SoftTargetCrossEntropy()

    def reduce(self, outputs: Outputs, stage: str) -> Loss:
        logits, targets = outputs.logits, outputs.targets  # (B, C), (B,) labels or (B, C) probabilities
        count = torch.tensor(targets.size(0), device=logits.device)
        if stage == TRAIN:
            train_loss = self.soft_loss if targets.shape == logits.shape else self.hard_loss
            # The criterion's mean over the batch, times its size: the summed loss.
            return Loss(train_loss(logits, targets) * targets.size(0), count)
        return Loss(F.cross_entropy(logits, targets, reduction="sum"), count)
