"""Review of knowledge distillation (``distill=kd``, docs/distillation.md): the defects found, each through the
public entry point."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from trident.errors import TridentError

from .test_distill_tasks import built, lm_config, lm_teacher  # noqa: F401  # lm_teacher: the shared fixture


def test_a_distilled_checkpoint_away_from_its_run_names_the_missing_teacher_copy(tmp_path: Path,
                                                                                  lm_teacher: Path) -> None:  # noqa: F811
    """``trident.load`` of a distilled student's checkpoint copied out of its run (without ``<run>/init/teacher.*``)
    says in one line that the teacher's copy is missing and where it is looked for, not that the checkpoint is
    "corrupt or truncated" (the ConfigError was caught with torch.load's read errors)."""
    import trident

    task = built(lm_config(tmp_path, lm_teacher), tmp_path / "run")
    import lightning

    checkpoint = {"state_dict": task.state_dict(), "hyper_parameters": dict(task.hparams),
                  "pytorch-lightning_version": lightning.__version__}
    task.on_save_checkpoint(checkpoint)
    (tmp_path / "run" / "checkpoints").mkdir()
    torch.save(checkpoint, tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert trident.load(tmp_path / "run").companions["teacher"] is not None  # in its run: the teacher is rebuilt
    (tmp_path / "alone").mkdir()
    shutil.copy(tmp_path / "run" / "checkpoints" / "last.ckpt", tmp_path / "alone" / "last.ckpt")
    with pytest.raises(TridentError) as caught:
        trident.load(tmp_path / "alone" / "last.ckpt")
    message = str(caught.value)
    assert "corrupt" not in message and "teacher.json" in message and "\n" not in message
