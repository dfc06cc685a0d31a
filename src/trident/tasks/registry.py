"""Every task by its ``task=`` name (its class's ``NAME``), for code that meets a task by name only: the
task an ``init_from`` source was trained for."""

from __future__ import annotations

from trident.tasks.base import TridentTask
from trident.tasks.classify import SequenceClassificationTask
from trident.tasks.clip import ContrastiveImageTextTask
from trident.tasks.electra import ElectraTask
from trident.tasks.lm import LanguageModelTask
from trident.tasks.mlm import MaskedLanguageModelTask
from trident.tasks.translation import TranslationTask
from trident.tasks.vit import ImageClassificationTask

TASKS: dict[str, type[TridentTask]] = {task.NAME: task for task in (
    LanguageModelTask, MaskedLanguageModelTask, TranslationTask, ImageClassificationTask, SequenceClassificationTask,
    ContrastiveImageTextTask, ElectraTask,
)}
