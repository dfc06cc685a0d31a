"""A task's teacher (``distill=kd``, trident.objectives.distillation): a frozen companion of the task
(trident.tasks.networks), built from the record a run writes of its ``distill.teacher`` source and read from the
run's copy of its weights.

A run reads the source once, through the readers ``init_from`` uses (a trident run or checkpoint, a Hugging Face
directory, a timm ViT file: trident.weights.teacher.stage_teacher), and writes ``<run>/init/teacher.json`` (the
teacher's network: its task, backbone and builder settings, its vocabulary or classes) and
``<run>/init/teacher.safetensors`` (its weights), as it copies an ``init_from`` source to ``<run>/init``: a resume,
eval.py and ``trident.load`` of the run build the teacher again from that copy (found beside the run or the
checkpoint read), wherever the source has gone. The teacher is never in the task's state dict, its checkpoints or
its exports; it is sharded and moved like the student and stays in eval mode without gradients.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tokenizers import Tokenizer
from torch import Tensor, nn

from trident.errors import ConfigError
from trident.objectives import Outputs
from trident.objectives.base import TRAIN
from trident.objectives.distillation import LABEL_OBJECTIVES, OFF, Distillation, DistillSettings, TaughtOutputs
from trident.tasks.network_builders import build_from_settings
from trident.tasks.networks import companion_path

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from trident.tasks.base import TridentTask

#: The companion's name, and where a run keeps its record and weights (relative to the run).
TEACHER = "teacher"
TEACHER_RECORD, TEACHER_WEIGHTS = "init/teacher.json", "init/teacher.safetensors"


def vocabulary_fingerprint(tokenizer: Tokenizer | None) -> str | None:
    """A hash of ``tokenizer``'s token -> id table (None without one): two tokenizers with the same size but other
    tokens or ids differ here."""
    if tokenizer is None:
        return None
    table = json.dumps(sorted(tokenizer.get_vocab(with_added_tokens=True).items()), ensure_ascii=False)
    return hashlib.sha256(table.encode()).hexdigest()


def distills(cfg: DictConfig) -> bool:
    """Whether the run of ``cfg`` distils (its ``distill`` group is not ``none``)."""
    return str((cfg.get("distill") or {}).get("name", OFF)) != OFF


def check_distill_run(task: type[TridentTask], cfg: DictConfig) -> None:
    """One line, before any work, for a distillation the run's task or objective cannot take, or bad settings."""
    import inspect

    if not distills(cfg):
        return
    if "distill" not in inspect.signature(task).parameters:
        raise ConfigError(f"distill={cfg.distill.name} is for task=lm, classify, vit and translation, not "
                          f"task={task.NAME}: drop distill")
    objective = str((cfg.task.get("objective") or {}).get("name", task.TRAINS_WITH[0]))
    if objective not in LABEL_OBJECTIVES:
        raise ConfigError(f"distill={cfg.distill.name} adds a teacher's term to the task's label loss, not to "
                          f"objective={objective}: drop distill or choose objective={task.TRAINS_WITH[0]}")
    DistillSettings.of(cfg.distill, task.NAME)


def add_teacher(task: TridentTask, distill: Mapping[str, Any] | None, *, vocab_size: int | None = None,
                class_names: Sequence[str] | None = None) -> None:
    """With ``distill`` on: build ``task``'s teacher from the run's record, after checking that it speaks the student's
    vocabulary (``vocab_size`` and the tokenizer's tokens) or classes (``class_names``), hold it as the companion
    :data:`TEACHER`, and wrap the task's objective in :class:`Distillation`. Call after ``task.objective`` is set."""
    settings = DistillSettings.of(distill, task.NAME)
    if settings is None:
        return
    record = read_record(settings.teacher)
    if record["task"] != task.NAME:
        raise ConfigError(f"distill.teacher={settings.teacher} holds a task={record['task']} model: task={task.NAME} "
                          f"distils from a {task.NAME} teacher only (the same outputs): pass a {task.NAME} run or model")
    if vocab_size is not None:
        check_vocabulary(settings.teacher, record, vocab_size, vocabulary_fingerprint(task.tokenizer))
    if class_names is not None:
        check_classes(settings.teacher, record, list(class_names))
    teacher = build_from_settings(record["builder"], {"backbone": record["backbone"], **record["settings"]})
    if teacher is None:
        raise ConfigError(f"distill.teacher={settings.teacher}: {companion_path(TEACHER_RECORD)} names no network "
                          "trident builds: run again from the source")
    task.add_companion(TEACHER, teacher, TEACHER_WEIGHTS)
    task.objective = Distillation(task.objective, settings)


def read_record(source: str) -> dict[str, Any]:
    """The run's record of its teacher (:data:`TEACHER_RECORD`), or one line."""
    path = Path(companion_path(TEACHER_RECORD))
    if not path.is_file():
        raise ConfigError(f"distill.teacher={source} has no copy at {path}: a run writes it when it starts "
                          "(trident.weights.teacher.stage_teacher); build the task inside its run directory")
    return dict(json.loads(path.read_text()))


def check_vocabulary(source: str, record: Mapping[str, Any], vocab_size: int, fingerprint: str | None) -> None:
    """One line when the teacher's vocabulary is not the student's: another size, or (where both record their
    tokenizers) other tokens or ids."""
    theirs = record.get("vocab_size")
    if theirs is not None and int(theirs) != vocab_size:
        raise ConfigError(f"distill.teacher={source} scores {theirs} tokens, the student {vocab_size}: a teacher "
                          "distils only into a student of its own tokenizer: train the student on the teacher's "
                          "tokenizer (data.tokenizer=<its tokenizer.json>)")
    if fingerprint is not None and record.get("vocabulary") not in (None, fingerprint):
        raise ConfigError(f"distill.teacher={source} has another tokenizer than the student's (the same size, other "
                          "tokens or ids): train the student on the teacher's tokenizer (data.tokenizer=<its "
                          "tokenizer.json>)")


def check_classes(source: str, record: Mapping[str, Any], class_names: list[str]) -> None:
    """One line when the teacher's classes are not the student's: another count, or other names where it records
    them."""
    count, names = record.get("num_classes"), record.get("class_names")
    if count is not None and int(count) != len(class_names):
        raise ConfigError(f"distill.teacher={source} scores {count} classes, the student {len(class_names)}: "
                          "pass a teacher trained on the student's classes")
    if names is not None and list(names) != class_names:
        differ = next((i for i, (a, b) in enumerate(zip(names, class_names, strict=True)) if a != b), 0)
        raise ConfigError(f"distill.teacher={source} has other classes than the student's (class {differ}: "
                          f"{names[differ]!r}, the student's {class_names[differ]!r}): pass a teacher trained on "
                          "the student's classes, in their order")


def taught(task: TridentTask, outputs: Outputs, stage: str, run: Callable[[nn.Module], Tensor],
           taught_logits: Tensor | None = None) -> Outputs:
    """``outputs`` of a training batch with the teacher's scores on the same inputs (``run(teacher)``, without
    gradients), where the task has a teacher; else ``outputs`` as they are. ``taught_logits``: the student's scores
    the teacher's term trains when they are not ``outputs.logits`` (a distillation-token head)."""
    teacher = task.companions.get(TEACHER)
    if teacher is None or stage != TRAIN:
        return outputs
    with torch.no_grad():
        scores = run(teacher)
    return TaughtOutputs(outputs.logits, outputs.targets, teacher=scores, taught=taught_logits)
