"""DeiT's hard distillation through the distillation token (Touvron et al. 2021, section 5, "hard-label
distillation"; facebookresearch/deit's ``DistillationLoss`` with ``distillation_type='hard'``): the class head learns
the labels, the distillation head the teacher's hard decision on the same images, each half of the loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from trident.objectives.base import Loss

#: The distillation term's weight: DeiT's ``--distillation-alpha`` default, equal halves as in the paper's equation.
DISTILLATION_WEIGHT = 0.5


def hard_distillation(class_logits: Tensor, distillation_logits: Tensor, targets: Tensor, teacher_logits: Tensor,
                      label_smoothing: float = 0.0, weight: float = DISTILLATION_WEIGHT) -> Loss:
    """``(1 - weight) * CE(class_logits, targets) + weight * CE(distillation_logits, argmax teacher_logits)``, each
    cross entropy a mean over the batch; returned summed over the batch with its count, and each half as a part
    (``class_loss``, ``distillation_loss``).

    ``class_logits``, ``distillation_logits``, ``teacher_logits``: (B, C). ``targets``: labels (B,), smoothed by
    ``label_smoothing``, or class probabilities (B, C) (Mixup / CutMix) under soft-target cross entropy, as DeiT's base
    criterion. The teacher's argmax is a hard label, never smoothed (DeiT's); no gradient reaches the teacher."""
    batch = targets.size(0)
    count = torch.tensor(batch, device=class_logits.device)
    if targets.shape == class_logits.shape:  # timm's SoftTargetCrossEntropy
        label_loss = torch.sum(-targets * F.log_softmax(class_logits, dim=-1), dim=-1).mean()
    else:
        label_loss = F.cross_entropy(class_logits, targets, label_smoothing=label_smoothing)
    taught = F.cross_entropy(distillation_logits, teacher_logits.detach().argmax(dim=-1))
    mean = (1 - weight) * label_loss + weight * taught
    return Loss(mean * batch, count, {"class_loss": (label_loss.detach(), count), "distillation_loss": (taught.detach(), count)})
