"""Knowledge distillation (``distill=kd``; Hinton et al. 2015): the task's own objective (its label loss) beside a
divergence of the student's scores from a frozen teacher's on the same inputs.

    loss = (1 - weight) * label_loss + weight * T^2 * D(teacher / T, student / T)

per trained item: each trained token (lm, translation: the targets that are not IGNORE_INDEX) or each example
(classify, vit). ``T`` (``distill.temperature``) softens both distributions; the T^2 keeps the soft term's gradients
on the scale of the hard term's as T changes (Hinton et al. section 2). ``D`` (``distill.divergence``):

- ``forward_kl``: KL(teacher || student) = sum_v p_t (log p_t - log p_s), the mode-covering divergence of Hinton,
  timm's ``--kd-model-name`` and torchtune's ``ForwardKLLoss`` (which drops the teacher's entropy, a constant in the
  student's parameters: the gradients are the same, the value here is 0 when the two agree);
- ``reverse_kl``: KL(student || teacher), mode-seeking (torchtune's ``ReverseKLLoss``, MiniLLM): language models only;
- ``hard``: cross entropy towards the teacher's argmax (DeiT's hard distillation; no temperature): classifiers only.

The weight convention is torchtune's ``kd_ratio`` and Hinton's: ``weight`` on the soft term, ``1 - weight`` on the
labels (weight 1: the teacher alone). Both terms are sums over the same trained items, so the task's one reduction
(trident.training.token_loss) averages them over the optimizer step's global batch, over micro-batches and ranks.
Validation and test score the label loss alone (the teacher is not run): the number a reader compares with the
same student trained without a teacher.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from trident.data.special_tokens import IGNORE_INDEX
from trident.errors import ConfigError
from trident.objectives.base import TRAIN, Loss, Objective, Outputs, OutputSource

#: ``distill=`` options: none (no teacher) and kd (knowledge distillation).
OFF, KD = "none", "kd"
FORWARD_KL, REVERSE_KL, HARD = "forward_kl", "reverse_kl", "hard"
#: The divergences and the task kinds they fit: reverse KL for language models, DeiT's hard labels for classifiers.
DIVERGENCES: dict[str, tuple[str, ...]] = {
    FORWARD_KL: ("lm", "translation", "classify", "vit"),
    REVERSE_KL: ("lm",),
    HARD: ("classify", "vit"),
}
#: The label objectives a teacher's term is added to (each distilling task's default).
LABEL_OBJECTIVES = ("next_token", "target_sequence", "class_label")
#: The parts a distilled training step logs beside train/loss (train/<part>).
PARTS = ("label_loss", "distill_loss")


@dataclass(frozen=True)
class DistillSettings:
    """The ``distill`` group's settings (conf/distill/kd.yaml), checked."""

    teacher: str
    temperature: float
    weight: float
    divergence: str
    n_heads: int | None = None  # a timm teacher file's head count, which the file does not record

    @classmethod
    def of(cls, distill: Mapping[str, Any] | None, task: str) -> DistillSettings | None:
        """The settings of ``distill`` for a run of ``task``; None when distillation is off; one line for each bad
        value."""
        options = dict(distill or {})
        if str(options.pop("name", OFF)) == OFF:
            if options.get("teacher"):
                raise ConfigError(f"distill.teacher={options['teacher']} is set but distillation is off: add distill=kd")
            return None
        options.pop("network", None)
        known = [name for name in cls.__dataclass_fields__]
        for key in options:
            if key not in known:
                raise ConfigError(f"distill.{key} is not a setting of distill=kd: remove it; it takes {', '.join(known)}")
        teacher = options.get("teacher")
        if not teacher:
            raise ConfigError("distill=kd needs its teacher: set distill.teacher=<a trident run directory or checkpoint, "
                              "a Hugging Face model directory or a timm ViT file>")
        temperature, weight = options.get("temperature", 1.0), options.get("weight", 0.5)
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not temperature > 0:
            raise ConfigError(f"distill.temperature={temperature!r} must be a positive number (Hinton's T; 1: the plain "
                              "softmax)")
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not 0 <= weight <= 1:
            raise ConfigError(f"distill.weight={weight!r} must lie in [0, 1]: the share of the teacher's term, the "
                              "labels' being 1 - weight")
        divergence = str(options.get("divergence", FORWARD_KL))
        if divergence not in DIVERGENCES:
            raise ConfigError(f"distill.divergence={divergence} is not a divergence: choose {', '.join(DIVERGENCES)}")
        if task not in DIVERGENCES[divergence]:
            fits = [name for name, tasks in DIVERGENCES.items() if task in tasks]
            raise ConfigError(f"distill.divergence={divergence} is for task={' or task='.join(DIVERGENCES[divergence])}, "
                              f"not task={task}: choose {' or '.join(fits)}")
        n_heads = options.get("n_heads")
        return cls(str(teacher), float(temperature), float(weight), divergence,
                   None if n_heads is None else int(n_heads))


@dataclass(frozen=True)
class TaughtOutputs(Outputs):
    """A training batch's outputs with the teacher's scores on the same inputs (shaped as ``logits``).

    ``taught``: the scores the teacher's term trains when they are not ``logits`` (a DeiT student's distillation-token
    head, whose class head ``logits`` learns from the labels); None: ``logits`` learn from both."""

    teacher: Tensor
    taught: Tensor | None = None


def divergence(student: Tensor, teacher: Tensor, temperature: float, kind: str) -> Tensor:
    """Per item (``...``) the divergence of the student's scores (..., V) from the teacher's, in float32 at least,
    times T^2 (``hard``: the cross entropy towards the teacher's argmax, untempered)."""
    dtype = torch.promote_types(student.dtype, torch.float32)
    student, teacher = student.to(dtype), teacher.to(dtype)
    if kind == HARD:
        return F.cross_entropy(student.flatten(0, -2), teacher.argmax(-1).flatten(), reduction="none").view(
            student.shape[:-1])
    log_s, log_t = F.log_softmax(student / temperature, -1), F.log_softmax(teacher / temperature, -1)
    if kind == REVERSE_KL:
        log_s, log_t = log_t, log_s  # KL(student || teacher)
    return (log_t.exp() * (log_t - log_s)).sum(-1) * temperature**2


def trained_items(outputs: Outputs) -> Tensor:
    """Which items of ``outputs`` train (shaped as its logits less the last axis): the targets that are not
    IGNORE_INDEX, or every item where the targets are class probabilities (Mixup's)."""
    targets, items = outputs.targets, outputs.logits.shape[:-1]
    if targets.shape == items and not targets.is_floating_point():
        return targets.ne(IGNORE_INDEX)
    return torch.ones(items, dtype=torch.bool, device=targets.device)


class Distillation(Objective):
    """The task's label objective ``label`` and the teacher's term, as the module docstring says. The task hands the
    teacher's scores in :class:`TaughtOutputs` in training (its ``outputs``; trident.tasks.teacher)."""

    NAME = KD

    def __init__(self, label: Objective, settings: DistillSettings) -> None:
        super().__init__()
        self.label, self.settings = label, settings
        self.PARTS = label.PARTS  # validation logs the label objective's parts, as without a teacher

    def forward(self, source: OutputSource, batch: Any, stage: str) -> tuple[Loss, Outputs]:
        loss, outputs = self.label(source, batch, stage)
        if stage != TRAIN or not isinstance(outputs, TaughtOutputs):
            return loss, outputs
        return self.combine(loss, outputs), outputs

    def combine(self, label: Loss, outputs: TaughtOutputs) -> Loss:
        """The weighted sum of ``label`` (the label objective's loss of ``outputs``) and the teacher's term, summed
        over the same trained items, with both terms as parts."""
        trained = trained_items(outputs)
        student = outputs.logits if outputs.taught is None else outputs.taught
        # A teacher's embedding padded past the shared tokenizer (trident.tasks.teacher.check_vocabulary): its
        # first V scores are the tokens', V the student's.
        teacher = outputs.teacher[..., : student.size(-1)]
        per_item = divergence(student[trained], teacher[trained], self.settings.temperature,
                              self.settings.divergence)  # (N,)
        distilled, count = per_item.sum(), trained.sum()
        weight = self.settings.weight
        mean = count.clamp(min=1)  # a micro-batch with no trained item: 0, not 0/0
        parts = {**label.parts, "label_loss": (label.summed.detach() / mean, count),
                 "distill_loss": (distilled.detach() / mean, count)}
        return Loss((1 - weight) * label.summed + weight * distilled, label.count, parts)

    def reduce(self, outputs: Outputs, stage: str) -> Loss:
        label = self.label.reduce(outputs, stage)
        return self.combine(label, outputs) if stage == TRAIN and isinstance(outputs, TaughtOutputs) else label
