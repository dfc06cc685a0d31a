"""Early stopping (``callbacks=early_stopping``, Lightning's EarlyStopping): a run whose monitored metric
stalls stops at the step the patience gives, status.json and the sweep report say so, and resuming it
neither trains again (same settings) nor forgets the validations counted (a larger patience)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from trident.report import write_report
from trident.report.sweep import Job, Sweep
from trident.runs.jobs import run_job
from trident.runs.pipeline import configured_task_class
from trident.runs.sweeps import STOPPED_EARLY_STEP

from .conftest import SMALL, compose_config, one_step
from .test_classify import CLASSIFY_SMALL
from .test_mlm import SMALL_MLM
from .test_translation_train import SMALL_MT
from .test_vit_pipeline import VIT_SMALL

pytestmark = pytest.mark.usefixtures("single_thread")

# A learning rate too small to move the validation loss by min_delta: validations at steps 2, 4, 6, ...;
# the first sets the best value, each later one waits, and patience 2 stops the run at step 6.
STALLING = [
    *SMALL,
    "callbacks=early_stopping",
    "callbacks.early_stopping.patience=2",
    "callbacks.early_stopping.min_delta=0.1",
    "optimizer.lr=1e-9",
    "scheduler.name=constant",
    "trainer.max_steps=20",
    "callbacks.throughput=null",
    "callbacks.lr_monitor=null",
    "logger=none",
    "test=false",
]


def validation_steps(run_dir: Path) -> list[int]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["step"] for row in rows if row["stage"] == "validate"]


def last_step(run_dir: Path) -> int:
    return int(torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"])


def test_a_stalled_metric_stops_the_run_and_resume_continues_correctly(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run_dir = tmp_path / "run"
    run_job(compose_config(STALLING, output_dir=run_dir))
    assert validation_steps(run_dir) == [2, 4, 6]
    assert last_step(run_dir) == 6
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "completed"
    assert status["metrics"][STOPPED_EARLY_STEP] == 6
    assert status["stopped_early"].startswith("stopped early at step 6: val/loss best ")
    assert status["metrics"]["stopped_early/best"] == pytest.approx(status["metrics"]["best/val/loss"])

    # Resumed as it was: the run ended at its stop; nothing trains, the record stays.
    with caplog.at_level(logging.WARNING):
        run_job(compose_config([*STALLING, f"resume={run_dir}"], output_dir=run_dir))
    assert "The run stopped early at step 6" in caplog.text
    assert validation_steps(run_dir) == [2, 4, 6] and last_step(run_dir) == 6
    assert json.loads((run_dir / "status.json").read_text())["stopped_early"].startswith("stopped early at step 6:")

    # A larger patience trains on from the stop, the two validations without an improvement counted: 4 at step 10.
    run_job(compose_config([*STALLING, f"resume={run_dir}", "callbacks.early_stopping.patience=4"], output_dir=run_dir))
    assert validation_steps(run_dir) == [2, 4, 6, 8, 10] and last_step(run_dir) == 10
    assert json.loads((run_dir / "status.json").read_text())["stopped_early"].startswith("stopped early at step 10:")


def test_a_run_that_improves_does_not_stop(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_job(compose_config([*STALLING, "optimizer.lr=1e-2", "callbacks.early_stopping.min_delta=0", "trainer.max_steps=8"],
                           output_dir=run_dir))
    assert validation_steps(run_dir) == [2, 4, 6, 8]
    status = json.loads((run_dir / "status.json").read_text())
    assert "stopped_early" not in status and STOPPED_EARLY_STEP not in status["metrics"]


def test_the_report_marks_the_jobs_that_stopped_early(tmp_path: Path) -> None:
    jobs = [Job(dir=tmp_path / f"{i}_job", setting=setting, status="completed", seed=i, monitor="val/loss",
                metrics={"best/val/loss": 2.0 + i, **({STOPPED_EARLY_STEP: 300.0} if i == 1 else {})},
                length={"max_steps": 1000.0})
            for i, setting in enumerate(["model.n_heads=2", "model.n_heads=4"])]
    report = write_report(Sweep(dir=tmp_path, name="sweep", jobs=jobs, monitor="val/loss"), tmp_path / "report")
    text = report.read_text()
    assert "2 completed (1 stopped early)" in text
    assert "- `1_job` (model.n_heads=4): stopped early at step 300 of 1000" in text
    assert "`0_job`" not in text.split("## Stopped early")[1]


# Translation prepares its BPE data first (about 20 s): slow.
@pytest.mark.parametrize("task", ["lm", "mlm", "classify", "vit", pytest.param("translation", marks=pytest.mark.slow)])
def test_each_task_declares_the_metrics_it_logs_at_validation(task: str, tmp_path: Path) -> None:
    """``VALIDATION_METRICS`` (what callbacks.early_stopping.monitor may name) is what a validation logs."""
    small = {"lm": SMALL, "mlm": SMALL_MLM, "classify": CLASSIFY_SMALL, "vit": VIT_SMALL, "translation": SMALL_MT}[task]
    cfg = compose_config([*small, "logger=none"], output_dir=tmp_path / "run")
    logged = sorted(name for name in one_step(cfg) if name.startswith("val/"))
    assert logged == sorted(configured_task_class(cfg).VALIDATION_METRICS)
