"""task=classify under 2-process DDP (gloo, ``trainer=ddp_cpu``) and resumed after SIGKILL
step for step: real ``train.py`` subprocesses, as tests/test_ddp_matrix.py and tests/test_resume.py
do for the other tasks."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trident.runs.pipeline import train

from .conftest import ROOT, compose_config
from .test_classify import CLASSIFY_SMALL

pytestmark = pytest.mark.slow

WITH_CSV = ["+logger.csv._target_=lightning.pytorch.loggers.CSVLogger", "+logger.csv.name=csv"]
# Dropout on (the RNG state matters), epochs of 4 batches, `last.ckpt` every 3 steps (mid-epoch).
RESUMABLE = [
    *CLASSIFY_SMALL, *WITH_CSV, "model.dropout=0.1", "trainer.max_steps=10", "trainer.limit_train_batches=4",
    "trainer.val_check_interval=5", "trainer.check_val_every_n_epoch=null",
    "callbacks.last_checkpoint.every_n_train_steps=3", "callbacks.throughput=null", "callbacks.lr_monitor=null",
    "test=false",
]


def run_train(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    env.pop("HYDRA_FULL_ERROR", None)
    env.pop("WANDB_SERVICE", None)
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], check=False, capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=300)


def train_losses(run_dir: Path) -> dict[int, float]:
    """Per-step training losses from every CSV log of a run (a resumed run adds a version)."""
    return {int(row["step"]): float(row["train/loss"]) for metrics in sorted(run_dir.glob("csv/version_*/metrics.csv"))
            for row in csv.DictReader(metrics.open()) if row.get("train/loss")}


def test_classify_runs_under_two_process_ddp_with_a_backbone_frozen_for_steps(tmp_path: Path) -> None:
    # Freezing for some steps too: DDP must still reduce every parameter it registered.
    result = run_train(*CLASSIFY_SMALL, *WITH_CSV, "trainer=ddp_cpu", "task.freeze_backbone_steps=2",
                       f"paths.output_root={tmp_path / 'outputs'}", cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "Traceback" not in output, output[-3000:]
    (run_dir,) = tmp_path.glob("outputs/runs/*/*")
    rows = [row for metrics in run_dir.glob("csv/version_*/metrics.csv") for row in csv.DictReader(metrics.open())]
    test_rows = [row for row in rows if row.get("test/acc")]
    assert len(test_rows) == 1, "one test result, from rank 0's logger"
    assert all(math.isfinite(float(test_rows[0][key])) for key in ("test/acc", "test/macro_f1", "test/majority_acc"))
    assert (run_dir / "figures" / "test_confusion_matrix.png").is_file()


def test_sigkilled_classify_run_resumes_step_for_step(tmp_path: Path) -> None:
    train(compose_config(RESUMABLE, output_dir=tmp_path / "uninterrupted"))
    expected = train_losses(tmp_path / "uninterrupted")
    assert sorted(expected) == list(range(10))

    killed = tmp_path / "killed"
    signal = ["+callbacks.signal._target_=tests.resume_helpers.SignalAtStep", "+callbacks.signal.step=7",
              "+callbacks.signal.signal_name=SIGKILL"]
    result = run_train(*RESUMABLE, *signal, f"hydra.run.dir={killed}", cwd=tmp_path)
    assert result.returncode == -9, result.stderr[-2000:]
    last = killed / "checkpoints" / "last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=True)["global_step"] == 6

    train(compose_config([*RESUMABLE, f"resume={killed}"], output_dir=killed))
    resumed = {step: loss for step, loss in train_losses(killed).items() if step >= 6}
    assert sorted(resumed) == list(range(6, 10))
    torch.testing.assert_close(resumed, {step: expected[step] for step in resumed}, rtol=0, atol=1e-6)
