"""The class-label objective: one class per sequence (classify) or image (vit)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from timm.loss import SoftTargetCrossEntropy
from torch import nn

from trident.objectives.base import TRAIN, Loss, Objective, Outputs


class ClassLabel(Objective):
    """Cross entropy of class logits (B, C). Training smooths hard labels (B,) by ``label_smoothing``, or, with
    ``soft_targets`` (Mixup / CutMix mix pairs of images and their smoothed one-hot labels), reads class
    probabilities (B, C) (timm's soft-target cross entropy, as DeiT). Validation and test score the hard labels
    unsmoothed: the loss a reader compares across settings."""

    NAME = "class_label"

    def __init__(self, label_smoothing: float = 0.0, soft_targets: bool = False) -> None:
        super().__init__()
        self.train_loss: nn.Module = (SoftTargetCrossEntropy() if soft_targets
                                      else nn.CrossEntropyLoss(label_smoothing=label_smoothing))

    def reduce(self, outputs: Outputs, stage: str) -> Loss:
        logits, targets = outputs.logits, outputs.targets
        count = torch.tensor(targets.size(0), device=logits.device)
        if stage == TRAIN:
            # The criterion's mean over the batch, times its size: the summed loss.
            return Loss(self.train_loss(logits, targets) * targets.size(0), count)
        return Loss(F.cross_entropy(logits, targets, reduction="sum"), count)
