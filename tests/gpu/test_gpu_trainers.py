"""``python train.py`` on one GPU for every task: ``trainer=gpu`` and ``trainer=ddp trainer.devices=1``
with the default W&B logger (offline), exit status 0 and no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trident.tracking.wandb_files import find_offline_runs

from ..conftest import ROOT
from .runs import TASK_RUNS

# Eager (compile=false): the presets' compile=blocks has its own tests; here each trainer's loop and logger.
TRAINERS = {"gpu": ["trainer=gpu", "compile=false"], "ddp_1": ["trainer=ddp", "trainer.devices=1", "compile=false"]}


@pytest.mark.slow
@pytest.mark.parametrize("trainer", list(TRAINERS))
@pytest.mark.parametrize("task", list(TASK_RUNS))
def test_train_py_runs_each_task_on_the_gpu(task: str, trainer: str, tmp_path: Path) -> None:
    command = [sys.executable, str(ROOT / "train.py"), *TASK_RUNS[task](tmp_path), *TRAINERS[trainer],
               f"paths.output_root={tmp_path / 'outputs'}"]
    env = {**os.environ, "WANDB_MODE": "offline"}
    result = subprocess.run(command, check=False, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    run_dirs = [p.parent for p in (tmp_path / "outputs" / "runs").glob("*/*/status.json")]
    assert len(run_dirs) == 1, run_dirs
    assert json.loads((run_dirs[0] / "status.json").read_text())["status"] == "completed"
    runs = find_offline_runs(run_dirs[0])
    assert len(runs) == 1, "one offline W&B run, from rank 0"
    assert runs[0].config["trainer"]["accelerator"] == "gpu"
