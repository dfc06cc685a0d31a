"""What the tasks whose network ends in a class head share (task=classify, task=vit): the objective they train with,
the head that trains beside a converter's adapters, and the test split's confusion matrix as a figure."""

from __future__ import annotations

from typing import ClassVar

import lightning as L
from torchmetrics.classification import MulticlassConfusionMatrix

from trident.tracking.figures import confusion_matrix_figure, publish_figure


class ClassHead:
    """Put before ``TridentTask`` in a class-head task's bases (``class X(ClassHead, TridentTask)``): its settings win."""

    TRAINS_WITH: ClassVar[tuple[str, ...]] = ("class_label",)
    HEAD: ClassVar[tuple[str, ...]] = ("head.",)  # trains under finetune=lora


def publish_confusion(task: L.LightningModule, confusion: MulticlassConfusionMatrix, class_names: list[str]) -> None:
    """The test split's confusion matrix, counted over every rank (``confusion``, reset for the next test), as a
    figure from rank 0."""
    matrix = confusion.compute()
    confusion.reset()
    if task.trainer.is_global_zero:
        publish_figure(task, "test/confusion_matrix", confusion_matrix_figure(matrix, class_names))
