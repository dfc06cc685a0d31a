"""A task's teacher (``distill=kd``, trident.objectives.distillation): a frozen companion of the task
(trident.tasks.networks), built from the record a run writes of its ``distill.teacher`` source and read from the
run's copy of its weights.

A run reads the source once, through the readers ``init_from`` uses (a trident run or checkpoint, a Hugging Face
directory, a timm ViT file: trident.weights.teacher.stage_teacher), and writes ``<run>/init/teacher.json`` (the
teacher's network: its task, backbone and builder settings, its vocabulary or classes) and
``<run>/init/teacher.safetensors`` (its weights), as it copies an ``init_from`` source to ``<run>/init``: a resume
builds the teacher again from that copy (found beside the run), wherever the source has gone; eval.py and
``trident.load`` read the student alone (trident.weights.checkpoints.load_task_checkpoint). The teacher is never in the task's state dict, its checkpoints or
its exports; it is sharded and moved like the student and stays in eval mode without gradients.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from tokenizers import Tokenizer
from torch import Tensor, nn

from trident.errors import ConfigError
from trident.objectives import Outputs
from trident.objectives.base import TRAIN
from trident.objectives.distillation import LABEL_OBJECTIVES, OFF, Distillation, DistillSettings, TaughtOutputs
from trident.tasks.network_builders import BUILDERS, build_from_settings
from trident.tasks.networks import companion_path

if TYPE_CHECKING:
    from omegaconf import DictConfig

#: The companion's name, and where a run keeps its record and weights (relative to the run).
TEACHER = "teacher"
TEACHER_RECORD, TEACHER_WEIGHTS = "init/teacher.json", "init/teacher.safetensors"
#: The data settings of an image teacher's pixel normalisation its record keeps.
PIXEL_STATISTICS = ("mean", "std")


class TaskWithTeacher(Protocol):
    """What the teacher's room reads of a task (trident.tasks.base.TridentTask, which imports this module)."""

    NAME: ClassVar[str]
    TRAINS_WITH: ClassVar[tuple[str, ...]]
    tokenizer: Tokenizer | None
    objective: Any
    companions: dict[str, nn.Module]

    def add_companion(self, name: str, network: nn.Module, source: str, initial_of: str | None = None) -> None: ...

    @classmethod
    def backbone_geometry(cls, data: dict[str, Any], task: dict[str, Any],
                          model: dict[str, Any] | None = None) -> dict[str, Any]: ...


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


def student_alone(settings: Mapping[str, Any]) -> dict[str, Any]:
    """What a task read from a checkpoint (its hyperparameters ``settings``) to evaluate, sample or export takes over
    them (trident.weights.checkpoints.load_task_checkpoint): a distilled run's student alone, without building its
    teacher or reading the teacher's copy (``<run>/init/teacher.*``), which serves the training loss only."""
    return {"distill": None} if settings.get("distill") is not None else {}


def check_distill_run(task: type[TaskWithTeacher], cfg: DictConfig) -> None:
    """One line, before any work, for a distillation the run's task or objective cannot take, or bad settings."""
    if not distills(cfg):
        DistillSettings.of(cfg.get("distill"), task.NAME)  # a teacher named with distillation off: one line
        return
    if "distill" not in inspect.signature(task).parameters:
        raise ConfigError(f"distill={cfg.distill.name} is for task=lm, classify, vit and translation, not "
                          f"task={task.NAME}: drop distill")
    objective = str((cfg.task.get("objective") or {}).get("name", task.TRAINS_WITH[0]))
    if objective not in LABEL_OBJECTIVES:
        raise ConfigError(f"distill={cfg.distill.name} adds a teacher's term to the task's label loss, not to "
                          f"objective={objective}: drop distill or choose objective={task.TRAINS_WITH[0]}")
    DistillSettings.of(cfg.distill, task.NAME)


def add_teacher(task: TaskWithTeacher, distill: Mapping[str, Any] | None, *, vocab_size: int | None = None,
                class_names: Sequence[str] | None = None) -> dict[str, Any] | None:
    """With ``distill`` on: build ``task``'s teacher from the run's record, after checking that it speaks the student's
    vocabulary (``vocab_size`` and the tokenizer's tokens) or classes (``class_names``), hold it as the companion
    :data:`TEACHER`, and wrap the task's objective in :class:`Distillation`. Call after ``task.objective`` is set.
    Returns the record (None with distillation off)."""
    settings = DistillSettings.of(distill, task.NAME)
    if settings is None:
        return None
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
    return record


def read_record(source: str) -> dict[str, Any]:
    """The run's record of its teacher (:data:`TEACHER_RECORD`), or one line."""
    path = Path(companion_path(TEACHER_RECORD))
    if not path.is_file():
        raise ConfigError(f"distill.teacher={source} has no copy at {path}: a distilled run keeps its teacher in "
                          f"<run>/{TEACHER_RECORD} and {TEACHER_WEIGHTS}, written when it starts: load the run's "
                          "checkpoints inside their run directory (or copy its init/ folder beside them)")
    return dict(json.loads(path.read_text()))


def check_vocabulary(source: str, record: Mapping[str, Any], vocab_size: int, fingerprint: str | None) -> None:
    """One line when the teacher's vocabulary is not the student's: another size, or (where both record their
    tokenizers) other tokens or ids."""
    theirs = record.get("vocab_size")
    # The student's own tokenizer, the teacher's embedding padded past it (Qwen2's 151936 rows for its 151665 tokens):
    # the extra rows score no token, and the teacher's term reads the student's vocab_size first scores alone.
    padded = fingerprint is not None and record.get("vocabulary") == fingerprint
    if theirs is not None and int(theirs) != vocab_size and not (padded and int(theirs) > vocab_size):
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


def taught(task: TaskWithTeacher, outputs: Outputs, stage: str, run: Callable[[nn.Module], Tensor],
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


def teacher_flops(task: TaskWithTeacher, forward: Callable[[nn.Module], int]) -> int:
    """The FLOPs of the teacher's forward on a training batch (``forward(teacher)``: the task's count of its network,
    forward only), or 0 without a teacher: each training step runs it (:func:`taught`), so the step's model FLOPs
    (trident.training.flops) hold it beside the student's forward and backward."""
    teacher = task.companions.get(TEACHER)
    return 0 if teacher is None else forward(teacher)


def teacher_record(task: type[TaskWithTeacher], cfg: DictConfig, source: Any, settings: Mapping[str, Any] | None = None,
                   builder: str | None = None) -> dict[str, Any]:
    """What ``task`` needs to build the teacher read from ``source`` (a trident.weights.pretrained.PretrainedWeights; a
    trident run's own hyperparameters ``settings`` and task class ``builder`` beside it): the builder, the backbone and
    builder settings, the vocabulary or classes. One line for a source of another task or geometry."""
    name = f"distill.teacher={source.source}"
    if source.task != task.NAME:
        raise ConfigError(f"{name} holds a task={source.task} model: task={task.NAME} distils from a {task.NAME} "
                          f"teacher only (the same outputs): pass a {task.NAME} run or model")
    settings, builder = dict(settings or {}), builder or f"{task.__module__}.{task.__qualname__}"
    data, options = {**_plain(cfg.data), **source.data_options}, {**_plain(cfg.task), **source.task_options}
    # A trident run records its whole backbone; an outside file its model, its geometry following from its data.
    backbone = dict(settings.get("backbone") or {}) or {
        **source.model, "pos_encoding": source.pos_encoding, "pos_encoding_options": source.pos_encoding_options,
        **task.backbone_geometry(data, options, source.model)}  # a DeiT teacher file: its distillation token
    check_geometry(name, task, cfg, backbone, {**data, **settings})
    # A token table's rows past the tokenizer are the teacher's own (an outside one's vocab_size counts them), never the
    # student's task.embedding_rows; None (one row per token) is a value.
    known = {**options, **data, "vocab_size": source.vocab_size, "num_classes": source.classes,
             "embedding_rows": source.task_options.get("embedding_rows")}
    takes = builder_parameters(builder)
    missing = [key for key in takes if key not in settings and known.get(key) is None and key != "embedding_rows"]
    if missing:
        raise ConfigError(f"{name} does not state its {missing[0]}: pass a trident run of the teacher")
    built = {key: settings[key] if key in settings else known[key] for key in takes}
    class_names = settings.get("class_names")
    # An image teacher's pixel statistics (its timm config.json's, its Hugging Face preprocessor's, a trident run's
    # data.mean/std): what its inputs are normalised to (pixels_for_teacher); None where the source states none.
    statistics = {key: source.data_options.get(key) for key in PIXEL_STATISTICS}
    return {**statistics, "source": source.source, "task": source.task, "builder": builder, "backbone": backbone, "settings": built,
            "vocab_size": built.get("vocab_size", source.vocab_size), "vocabulary": vocabulary_fingerprint(source.tokenizer),
            "num_classes": len(class_names) if class_names else built.get("num_classes", source.classes),
            "class_names": class_names}


def pixels_for_teacher(record: Mapping[str, Any] | None, in_channels: int, mean: Sequence[float],
                       std: Sequence[float]) -> tuple[list[float], list[float]] | None:
    """The statistics (mean, std per channel) an image teacher of ``record`` must see its inputs normalised to, where
    they are not the student's ``mean`` / ``std`` (timm's DistillationTeacher.normalize_input); None: the teacher reads
    the student's inputs as they are (the same statistics, or a source that states none, taken as the data's, as
    ``init_from`` takes it). One line for a teacher of other channels than the student's ``in_channels``."""
    if record is None:
        return None
    theirs = record["settings"].get("in_channels")
    if theirs is not None and int(theirs) != in_channels:
        raise ConfigError(f"distill.teacher={record['source']} reads images of {theirs} channels, the student "
                          f"{in_channels} (data.in_channels): pass a teacher of the student's channels")
    if record.get("mean") is None or record.get("std") is None:
        return None
    statistics = [float(v) for v in record["mean"]], [float(v) for v in record["std"]]
    return None if statistics == (list(mean), list(std)) else statistics


def renormalised(images: Tensor, student: tuple[Sequence[float], Sequence[float]],
                 teacher: tuple[Sequence[float], Sequence[float]]) -> Tensor:
    """``images`` (B, C, H, W) normalised by the ``student``'s (mean, std), normalised by the ``teacher``'s instead."""
    def column(values: Sequence[float]) -> Tensor:
        return torch.tensor(values, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)

    pixels = images * column(student[1]) + column(student[0])
    return (pixels - column(teacher[0])) / column(teacher[1])


def check_geometry(name: str, task: type[TaskWithTeacher], cfg: DictConfig, backbone: Mapping[str, Any],
                   teacher: Mapping[str, Any]) -> None:
    """One line when the teacher cannot read the student's inputs: a context shorter than the student's sequences,
    or a patch grid other than the one the student's images make in the teacher's patches (``teacher``: its data
    settings)."""
    student = task.backbone_geometry(_plain(cfg.data), _plain(cfg.task))
    if student.get("grid") is None:
        if int(backbone["max_seq_len"]) < int(student["max_seq_len"]):
            raise ConfigError(f"{name} reads {backbone['max_seq_len']} positions at most, the student's sequences are "
                              f"{student['max_seq_len']} long: lower data.max_seq_len to {backbone['max_seq_len']}")
        return
    patches = {**_plain(cfg.data), "patch_size": teacher.get("patch_size", cfg.data.get("patch_size"))}
    wanted = task.backbone_geometry(patches, _plain(cfg.task))["grid"]
    if list(backbone.get("grid") or []) != list(wanted):
        raise ConfigError(f"{name} reads images of another size than the student's data.image_size="
                          f"{cfg.data.get('image_size')} (its patch grid {backbone.get('grid')}, not {wanted}): pass a "
                          "teacher trained at the student's image size")


def builder_parameters(builder: str) -> list[str]:
    """The settings the network builder of the task class ``builder`` takes beside the backbone."""
    build = BUILDERS.get(builder)
    if build is None:
        raise ConfigError(f"distill.teacher: trident cannot build the network of {builder} alone: pass a run of "
                          "task=lm, classify, vit or translation")
    return list(inspect.signature(build).parameters)[1:]


def _plain(node: DictConfig) -> dict[str, Any]:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node, resolve=True)  # type: ignore[return-value]
