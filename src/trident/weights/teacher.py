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

from trident.objectives.distillation import DistillSettings
from trident.tasks.base import TridentTask
from trident.tasks.task_in_checkpoint import TASK_KEY
from trident.tasks.teacher import TEACHER_RECORD, TEACHER_WEIGHTS, distills, teacher_record
from trident.weights.checkpoint_files import checkpoint_of, read_checkpoint
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
    source = read_init_source(settings.teacher, settings.n_heads, "distill.teacher")
    run: dict[str, Any] = {}  # a trident run's own hyperparameters and the task class that built it
    if source.format == "trident" and not Path(source.source, "source.json").is_file():
        checkpoint = read_checkpoint(checkpoint_of(Path(source.source)), "distill.teacher", weights=False)
        run = {"settings": dict(checkpoint.get("hyper_parameters") or {}), "builder": checkpoint.get(TASK_KEY)}
    record = teacher_record(task, cfg, source, **run)
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
