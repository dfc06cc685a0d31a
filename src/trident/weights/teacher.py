"""``distill.teacher=<source>``: the teacher of a distilling run, read once through the readers ``init_from`` uses
(a trident run or checkpoint of any size, a Hugging Face directory of a family trident reads, a timm ViT file) and
copied into the run (``<run>/init/teacher.{json,safetensors}``), from which the task builds it every time
(trident.tasks.teacher): a resume and every load of the run's checkpoints need neither the source nor the
teacher's weights in the checkpoints.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from trident.errors import ConfigError
from trident.objectives.distillation import DistillSettings
from trident.tasks.base import TridentTask
from trident.tasks.network_builders import BUILDERS
from trident.tasks.task_in_checkpoint import TASK_KEY
from trident.tasks.teacher import TEACHER_RECORD, TEACHER_WEIGHTS, distills, vocabulary_fingerprint
from trident.weights.checkpoint_files import checkpoint_of, read_checkpoint
from trident.weights.pretrained import PretrainedWeights
from trident.weights.sources import read_init_source


def stage_teacher(task: type[TridentTask], cfg: DictConfig, run_dir: Path, resumed: bool) -> None:
    """With ``distill`` on, copy its teacher into ``run_dir`` (a resumed run keeps the copy it has)."""
    if not distills(cfg):
        return
    settings = DistillSettings.of(OmegaConf.to_container(cfg.distill, resolve=True), task.NAME)  # type: ignore[arg-type]
    assert settings is not None
    record_path, weights_path = run_dir / TEACHER_RECORD, run_dir / TEACHER_WEIGHTS
    if resumed and record_path.is_file() and weights_path.is_file():
        return
    source = read_init_source(settings.teacher, settings.n_heads)
    record = teacher_record(task, cfg, source)
    from safetensors.torch import save_file

    record_path.parent.mkdir(parents=True, exist_ok=True)
    # Every rank of a DDP run writes the same files: each its own, renamed into place (never a half-written file).
    mine = f".{os.getpid()}.tmp"
    # Cloned: tied weights share one tensor, which safetensors refuses to write twice.
    save_file({key: value.detach().clone().contiguous() for key, value in source.state_dict.items()},
              str(weights_path) + mine)
    Path(str(record_path) + mine).write_text(json.dumps(record, indent=1))
    os.replace(str(weights_path) + mine, weights_path)
    os.replace(str(record_path) + mine, record_path)


def teacher_record(task: type[TridentTask], cfg: DictConfig, source: PretrainedWeights) -> dict[str, Any]:
    """What the task needs to build the teacher of ``source`` (trident.tasks.teacher): the task class whose builder
    builds it, its backbone and builder settings, its vocabulary or classes; one line for a source of another task or
    of another geometry."""
    name = f"distill.teacher={source.source}"
    if source.task != task.NAME:
        raise ConfigError(f"{name} holds a task={source.task} model: task={task.NAME} distils from a {task.NAME} "
                          f"teacher only (the same outputs): pass a {task.NAME} run or model")
    settings: dict[str, Any] = {}
    builder = f"{task.__module__}.{task.__qualname__}"
    if source.format == "trident" and not Path(source.source, "source.json").is_file():  # a run: its own settings
        checkpoint = read_checkpoint(checkpoint_of(Path(source.source)), "distill.teacher", weights=False)
        settings, builder = dict(checkpoint.get("hyper_parameters") or {}), str(checkpoint.get(TASK_KEY) or builder)
    data = {**_plain(cfg.data), **source.data_options}
    options = {**_plain(cfg.task), **source.task_options}
    backbone = dict(settings.get("backbone") or {}) or {
        **source.model, "pos_encoding": source.pos_encoding, "pos_encoding_options": source.pos_encoding_options,
        **task.backbone_geometry(data, options)}
    check_geometry(name, task, cfg, backbone, {**data, **settings})
    known = {**options, **data, "vocab_size": source.vocab_size, "num_classes": source.classes}
    takes = _builder_parameters(builder)
    missing = [key for key in takes if key not in settings and known.get(key) is None]
    if missing:
        raise ConfigError(f"{name} does not state its {missing[0]}: pass a trident run of the teacher")
    built = {key: settings[key] if key in settings else known[key] for key in takes}
    vocab_size = built.get("vocab_size", source.vocab_size)
    class_names = settings.get("class_names")
    return {"source": source.source, "task": source.task, "builder": builder, "backbone": backbone, "settings": built,
            "vocab_size": vocab_size, "vocabulary": vocabulary_fingerprint(source.tokenizer),
            "num_classes": len(class_names) if class_names else built.get("num_classes", source.classes),
            "class_names": class_names}


def check_geometry(name: str, task: type[TridentTask], cfg: DictConfig, backbone: dict[str, Any],
                   teacher: dict[str, Any]) -> None:
    """One line when the teacher cannot read the student's inputs: a context shorter than the student's sequences,
    or a patch grid that is not the one the student's images make in the teacher's patches (``teacher``: its data
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


def _builder_parameters(builder: str) -> list[str]:
    import inspect

    build = BUILDERS.get(builder)
    if build is None:
        raise ConfigError(f"distill.teacher: trident cannot build the network of {builder} alone: pass a run of "
                          "task=lm, classify, vit or translation")
    return list(inspect.signature(build).parameters)[1:]


def _plain(node: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(node, resolve=True)  # type: ignore[return-value]

