"""What an objective is: the seam between a task, which turns a batch into its networks' outputs, and the loss
those outputs are trained on.

A task owns its data shapes, its metrics and the networks it holds; it answers :meth:`OutputSource.outputs` for a
batch. An :class:`Objective` asks for those outputs and returns the summed loss over the trained items (tokens,
sequences or images) and their count: the task hands both to the one loss reduction
(trident.training.token_loss: summed losses over the trained items of the optimizer step's global batch), and
keeps the outputs for its metrics. An objective that needs another network's outputs on the same batch (a frozen
reference policy for preference tuning, a teacher for distillation) asks the task again: :meth:`Objective.forward`
receives the task and the batch, not only the outputs (the task that holds such a network lets ``outputs`` name it).

A task with a vocabulary head and ``task.loss_chunk`` > 0 hands over the head and the hidden states it scores
(:class:`trident.backbone.vocabulary_head.VocabularyHead`) instead of the logits: :attr:`Outputs.scores` is then the
head, which the token objectives score chunk by chunk (trident.training.chunked_loss), never holding the whole
batch's logits; anything that reads :attr:`Outputs.logits` (a metric, a preference objective's sequence
log-probabilities, distillation) gets them whole, computed on first use, as a network's forward returns them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar, Protocol

from torch import Tensor, nn

from trident.backbone import VocabularyHead

# The stage of a batch, as Lightning's hooks name them: "train", "val" or "test".
TRAIN = "train"


@dataclass(frozen=True)
class Outputs:
    """What a network made of a batch, beside what it should have made."""

    # The network's scores: logits (..., V) per token, (B, C) per sequence or image; or a vocabulary head and the
    # hidden states (..., D) it scores, whose logits are computed where they are read (task.loss_chunk).
    scores: Tensor | VocabularyHead
    # The truth the scores are trained towards: label ids shaped as ``logits`` less its last axis (IGNORE_INDEX where
    # nothing trains), or class probabilities shaped as ``logits`` (soft targets, e.g. Mixup's).
    targets: Tensor

    @cached_property
    def logits(self) -> Tensor:
        """The logits, (..., V) or (B, C): a head's computed whole on first use (kept while the outputs live)."""
        return self.scores.logits() if isinstance(self.scores, VocabularyHead) else self.scores


@dataclass(frozen=True)
class Loss:
    """One batch's loss: ``summed`` over its ``count`` trained items (a sum over none is 0, never 0/0)."""

    summed: Tensor  # () with its graph
    count: Tensor  # () the trained items: the weight of this batch in the global token mean
    # Parts of the loss the task may log beside it, each its mean over its weight (e.g. the plain NLL of a
    # label-smoothed loss): name -> (mean, weight).
    parts: Mapping[str, tuple[Tensor, Tensor]] = field(default_factory=dict)


class OutputSource(Protocol):
    """What an objective asks of a task: the outputs of its trained network on a batch of a stage, its frozen
    companions by name (e.g. a reference policy), and a context in which its networks run as they were loaded, their
    converters switched off (None where they cannot be: trident.tasks.networks.switched_off)."""

    companions: dict[str, nn.Module]

    def outputs(self, batch: Any, stage: str) -> Outputs: ...

    def switched_off(self) -> AbstractContextManager[None] | None: ...


class Objective(nn.Module, ABC):
    """A loss on a task's outputs, chosen by the ``objective`` config group (``task.objective.name``).

    A module of the task (``task.objective``), so that what it holds (a criterion) moves with it; it holds no
    parameter or buffer, so checkpoints and state dicts are the task's networks' alone.
    """

    #: The ``objective=`` option (its yaml's ``name``).
    NAME: ClassVar[str]
    #: The parts of its loss (:attr:`Loss.parts`) a task logs per split beside the loss (``val/<part>``).
    PARTS: ClassVar[tuple[str, ...]] = ()

    def forward(self, source: OutputSource, batch: Any, stage: str) -> tuple[Loss, Outputs]:
        """The loss of ``batch`` (``stage``: train, val or test) and the outputs it was computed on, which the task
        reuses for its metrics (no second forward)."""
        outputs = source.outputs(batch, stage)
        return self.reduce(outputs, stage), outputs

    def copies_initial(self, switchable: bool) -> bool:
        """Whether the objective needs a frozen copy of the trained network's initial weights (a companion of the
        task), given whether the task's converters can be switched off instead (``switchable``). Most need none."""
        return False

    def start(self, task: Any) -> None:
        """Called when training starts (the task's ``on_fit_start``), at the initial weights: what the objective
        prepares from them (DPO's reference policy). Most objectives prepare nothing."""

    @abstractmethod
    def reduce(self, outputs: Outputs, stage: str) -> Loss:
        """The summed loss of ``outputs`` and the count of items it trains."""
