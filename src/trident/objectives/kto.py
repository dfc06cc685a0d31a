"""Kahneman-Tversky optimisation (``objective=kto``, Ethayarajh et al. 2024), as TRL's ``KTOTrainer`` computes it:
single answers, each desirable or undesirable, instead of pairs.

Each answer's implied reward is ``beta`` times its log-ratio to the reference policy (the same reference as DPO's:
trident.objectives.preference); a desirable answer's loss is ``1 - sigmoid(beta (log-ratio - z))``, an undesirable
one's ``1 - sigmoid(beta (z - log-ratio))``, weighted by ``desirable_weight`` / ``undesirable_weight``. The reference
point ``z`` estimates the KL divergence of the policy from the reference as TRL does: the batch's prompts each paired
with another row's answer (row i's prompt with row i - 1's answer, the last row's answer for the first: TRL's
rotation), the mean of the policy's minus the reference's log-probabilities of those answers, detached, averaged
over the data-parallel ranks and clamped at 0. ``loss_type=apo_zero_unpaired`` (the unpaired APO-zero of D'Oosterlinck
et al. 2024) has no reference point.

Rows: :class:`~trident.data.preference.UnpairedBatch` (TRL's unpaired format), or preference pairs
(:class:`~trident.data.preference.PreferenceBatch`), each split into its chosen answer, desirable, and its rejected
one, undesirable, as TRL's ``unpair_preference_dataset``: a batch of B pairs is 2B answers, the B chosen first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from trident.data.preference import PreferenceBatch, UnpairedBatch
from trident.data.special_tokens import IGNORE_INDEX
from trident.errors import ConfigError
from trident.objectives.base import Loss, Objective, Outputs, OutputSource
from trident.objectives.preference import KTO, answer_logps, disable_dropout, reference_policy_logps
from trident.training.token_loss import data_parallel_group

LOSS_TYPES = ("kto", "apo_zero_unpaired")
# TRL's names for what a step logs beside the loss (logged as <split>/<name>); each a mean over the answers it
# names (its weight: their count, 0 where a batch has none, which the step's and epoch's means leave out).
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl")


@dataclass(frozen=True)
class AnswerOutputs(Outputs):
    """The policy's outputs on N answers, their labels, the reference policy's log-probabilities of them and the
    batch's reference point."""

    desirable: Tensor  # (N,) bool
    reference: Tensor  # (N,)
    reference_point: Tensor  # () detached: the KL estimate (loss_type=kto), else 0


def mismatched(inputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """inputs, targets (N, T) of N answers after their prompts (targets IGNORE_INDEX off the answers) -> the N
    sequences of row i's prompt followed by row i - 1's answer (row 0: row N - 1's), padded on the right, as TRL's
    ``KL_completion_ids``: inputs and targets (N, T')."""
    positions = torch.arange(targets.size(1), device=targets.device)
    answered = targets.ne(IGNORE_INDEX)
    prompts = torch.where(answered, positions, targets.size(1)).amin(dim=1) + 1  # (N,) the prompt's tokens
    ends = torch.where(answered, positions, -1).amax(dim=1) + 2  # (N,) the sequence's tokens
    rows = [(inputs[i, : prompts[i]], inputs[i - 1, prompts[i - 1] : ends[i - 1]]) for i in range(inputs.size(0))]
    longest = max(len(prompt) + len(answer) for prompt, answer in rows)
    kl_inputs = inputs.new_zeros(len(rows), longest)
    kl_targets = torch.full_like(kl_inputs, IGNORE_INDEX)
    for i, (prompt, answer) in enumerate(rows):
        kl_inputs[i, : len(prompt) + len(answer)] = torch.cat([prompt, answer])
        kl_targets[i, len(prompt) - 1 : len(prompt) + len(answer) - 1] = answer
    return kl_inputs, kl_targets


class KahnemanTversky(Objective):
    """KTO on desirable and undesirable answers; ``beta`` scales the implied reward."""

    NAME = KTO
    PARTS = METRICS

    def __init__(self, beta: float = 0.1, loss_type: str = "kto", desirable_weight: float = 1.0,
                 undesirable_weight: float = 1.0, disable_dropout: bool = True) -> None:
        super().__init__()
        if loss_type not in LOSS_TYPES:
            raise ConfigError(f"task.objective.loss_type={loss_type!r} is not a KTO loss: choose one of {', '.join(LOSS_TYPES)}")
        if not beta > 0:
            raise ConfigError(f"task.objective.beta={beta} must be positive (TRL's default is 0.1)")
        for name, weight in (("desirable_weight", desirable_weight), ("undesirable_weight", undesirable_weight)):
            if not weight > 0:
                raise ConfigError(f"task.objective.{name}={weight} must be positive (TRL's default is 1.0)")
        self.beta, self.loss_type = float(beta), loss_type
        self.desirable_weight, self.undesirable_weight = float(desirable_weight), float(undesirable_weight)
        self.disable_dropout = bool(disable_dropout)

    def start(self, task: Any) -> None:
        """With ``disable_dropout`` (TRL's default) the policy trains without dropout, as the reference is scored."""
        if self.disable_dropout:
            disable_dropout(task.net)

    def copies_initial(self, switchable: bool) -> bool:
        """The reference policy is a frozen copy of the initial weights unless the converters switch off."""
        return not switchable

    def forward(self, source: OutputSource, batch: Any, stage: str) -> tuple[Loss, Outputs]:
        if isinstance(batch, PreferenceBatch):  # B pairs -> 2B answers: the chosen desirable, the rejected not
            desirable = torch.arange(batch.inputs.size(0), device=batch.inputs.device) < batch.inputs.size(0) // 2
            inputs, targets = batch.inputs, batch.targets
        elif isinstance(batch, UnpairedBatch):
            inputs, targets, desirable = batch
        else:
            raise ConfigError("objective=kto trains on answers labelled desirable or not (or pairs): use data=preference")
        reference = reference_policy_logps(source, inputs, targets)  # (N,)
        reference_point = torch.zeros((), device=inputs.device)
        if self.loss_type == "kto":
            kl_inputs, kl_targets = mismatched(inputs, targets)
            with torch.no_grad():  # the reference point is detached (TRL's): no graph for its forward
                kl = answer_logps(source.outputs((kl_inputs, kl_targets), stage).logits, kl_targets)[0]
            reference_point = mean_over_ranks(kl - reference_policy_logps(source, kl_inputs, kl_targets), source)
        outputs = source.outputs((inputs, targets), stage)
        answers = AnswerOutputs(outputs.logits, outputs.targets, desirable, reference, reference_point)
        return self.reduce(answers, stage), answers

    def reduce(self, outputs: Outputs, stage: str) -> Loss:
        """TRL's ``KTOTrainer`` loss and metrics, summed over the N answers (each metric a mean over its answers)."""
        assert isinstance(outputs, AnswerOutputs), "KahnemanTversky.forward makes its outputs"
        logps = answer_logps(outputs.logits, outputs.targets)[0]  # (N,)
        desirable = outputs.desirable
        ratios = logps - outputs.reference.to(logps.dtype)
        z = outputs.reference_point.to(logps.dtype)
        if self.loss_type == "kto":
            losses = torch.where(desirable, 1 - torch.sigmoid(self.beta * (ratios - z)),
                                 1 - torch.sigmoid(self.beta * (z - ratios)))
        else:  # apo_zero_unpaired: the desirable answers' likelihood up, the undesirable ones' down, no reference point
            losses = torch.where(desirable, 1 - torch.sigmoid(self.beta * ratios), torch.sigmoid(self.beta * ratios))
        weights = torch.where(desirable, self.desirable_weight, self.undesirable_weight).to(losses.dtype)
        answers = torch.tensor(losses.numel(), device=losses.device)
        rewards = self.beta * ratios.detach()
        chosen, rejected = desirable.sum(), (~desirable).sum()

        def mean(values: Tensor, where: Tensor, count: Tensor) -> Tensor:
            return torch.where(where, values, 0).sum() / count.clamp(min=1)

        means = {"rewards/chosen": (mean(rewards, desirable, chosen), chosen),
                 "rewards/rejected": (mean(rewards, ~desirable, rejected), rejected),
                 "logps/chosen": (mean(logps.detach(), desirable, chosen), chosen),
                 "logps/rejected": (mean(logps.detach(), ~desirable, rejected), rejected)}
        both = answers if bool(chosen) and bool(rejected) else answers.new_zeros(())  # TRL: only where both are
        means["rewards/margins"] = (means["rewards/chosen"][0] - means["rewards/rejected"][0], both)
        means["kl"] = (z.detach(), answers)
        return Loss((weights * losses).sum(), answers, means)


def mean_over_ranks(values: Tensor, source: Any) -> Tensor:
    """The mean of ``values`` (N,) over the data-parallel ranks' batches, clamped at 0 (TRL gathers each rank's
    mean and averages them: the same for batches of one size)."""
    total = torch.stack([values.sum(), values.new_tensor(values.numel())])
    group = data_parallel_group(source)
    if group is not None:
        dist.all_reduce(total, group=group)
    return (total[0] / total[1]).clamp(min=0).detach()
