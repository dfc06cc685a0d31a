"""The learning-rate finder (``tune=lr_find``, Lightning's Tuner.lr_find through ``TridentTask.learning_rate``):
a finite suggestion on nano models, its curve and command line in the run directory and W&B, and no
training state left behind (no checkpoint; the weights and the optimizer config as they were)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch
from lightning.pytorch.tuner import Tuner

from trident.runs import lr_find
from trident.runs.jobs import run_job
from trident.runs.lr_find import FIGURE_FILE, RESULT_FILE, SUGGESTED_LR, find_learning_rate
from trident.runs.pipeline import build_data_and_task, build_trainer, check_config
from trident.tasks.lm import LanguageModelTask
from trident.tracking.wandb_files import find_offline_runs

from .conftest import SMALL, compose_config
from .test_vit_pipeline import VIT_SMALL

pytestmark = pytest.mark.usefixtures("single_thread")

# 24 rates from 1e-7 to 1 on the nano model (the suggestion needs more than 11 finite points).
FINDER = [*SMALL, "tune=lr_find", "tune.num_training=24", "callbacks.throughput=null"]


class FrozenLanguageModel(LanguageModelTask):
    """The LM task with every parameter frozen (train.py loads it by ``task._target_``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.requires_grad_(False)


def test_the_lm_finder_writes_its_curve_and_suggestion_and_leaves_no_training_state(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_job(compose_config([*FINDER, "logger=wandb"], output_dir=run_dir))  # W&B offline (conftest)
    status = json.loads((run_dir / "status.json").read_text())
    lr = status["metrics"][SUGGESTED_LR]
    assert status["status"] == "completed" and math.isfinite(lr) and 1e-7 <= lr <= 1
    result = json.loads((run_dir / RESULT_FILE).read_text())
    assert result["suggested_lr"] == lr and lr in result["lr"]
    assert 12 <= len(result["lr"]) == len(result["loss"]) <= 24
    assert result["command"].startswith("python train.py ") and result["command"].endswith(f" optimizer.lr={lr:.3g}")
    assert "tune" not in result["command"] and "model=nano" in result["command"]
    assert (run_dir / FIGURE_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # No training state: no checkpoint (the finder's own one removed), no validation history.
    assert not (run_dir / "checkpoints").exists() and not list(run_dir.rglob("*.ckpt"))
    assert not (run_dir / "metrics.jsonl").exists()
    (run,) = find_offline_runs(run_dir)
    assert run.summary[SUGGESTED_LR] == pytest.approx(lr)
    assert any("lr_find/curve" in row for row in run.history)


@pytest.mark.parametrize("task", ["mlm", "vit"])
def test_the_finder_on_another_task_suggests_a_rate_and_puts_the_weights_back(task: str, tmp_path: Path) -> None:
    overrides = ([*VIT_SMALL, "trainer.limit_train_batches=1.0", "trainer.max_epochs=null"] if task == "vit"
                 else [*(o for o in SMALL if not o.startswith("task.sampling")), "task=mlm"])
    cfg = compose_config([*overrides, "tune=lr_find", "tune.num_training=24", "callbacks.throughput=null",
                          "logger=none", "optimizer.lr=0.5"], output_dir=tmp_path / "run")
    (tmp_path / "run").mkdir()
    datamodule, module = build_data_and_task(cfg, check_config(cfg), "fit")
    before = {name: value.clone() for name, value in module.state_dict().items()}
    trainer = build_trainer(cfg.trainer, logger=False, enable_checkpointing=False, default_root_dir=str(tmp_path / "run"))
    metrics = find_learning_rate(cfg, trainer, module, datamodule)
    lr = metrics[SUGGESTED_LR]
    assert math.isfinite(lr) and 1e-7 <= lr <= 1
    after = module.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before), "the finder left trained weights"
    # Lightning's finder set the task's rate (TridentTask.learning_rate) to its suggestion.
    assert module.learning_rate == lr and module.hparams["optimizer"]["lr"] == lr
    assert (tmp_path / "run" / FIGURE_FILE).is_file() and not list((tmp_path / "run").rglob("*.ckpt"))


def test_lightnings_tuner_finds_the_rate_on_a_task_by_its_default_name(tmp_path: Path) -> None:
    """``Tuner(trainer).lr_find(task)`` with no attr_name, as a notebook calls it, finds ``learning_rate``."""
    cfg = compose_config([*SMALL, "logger=none"], output_dir=tmp_path / "run")
    datamodule, module = build_data_and_task(cfg, check_config(cfg), "fit")
    trainer = build_trainer(cfg.trainer, logger=False, enable_checkpointing=False, default_root_dir=str(tmp_path))
    finder = Tuner(trainer).lr_find(module, datamodule=datamodule, num_training=16)
    assert finder is not None and module.learning_rate == finder.suggestion()


class RecordingTuner:
    """Stands in for Lightning's Tuner: records the arguments ``lr_find`` receives, returns a finder."""

    calls: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, trainer: object) -> None:
        self.trainer = trainer

    def lr_find(self, task: object, **kwargs: Any) -> SimpleNamespace:
        RecordingTuner.calls.append(kwargs)
        rates = [1e-4 * 2**i for i in range(20)]
        return SimpleNamespace(results={"lr": rates, "loss": [1.0] * 20}, mode=kwargs["mode"], suggestion=lambda: 1e-3)


@pytest.mark.parametrize(("mode", "threshold"), [("linear", 2.5), ("exponential", None)])
def test_the_finder_passes_its_mode_and_early_stop_threshold_to_lightning(
        mode: str, threshold: float | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tune.mode and tune.early_stop_threshold (neither Lightning's default) reach ``Tuner.lr_find`` as set."""
    cfg = compose_config([*FINDER, f"tune.mode={mode}", f"tune.early_stop_threshold={threshold or 'null'}",
                          "tune.min_lr=1e-5", "tune.max_lr=0.5"], output_dir=tmp_path)
    check_config(cfg)
    monkeypatch.setattr(lr_find, "Tuner", RecordingTuner)
    RecordingTuner.calls.clear()
    trainer = SimpleNamespace(is_global_zero=True, default_root_dir=str(tmp_path), loggers=[])
    assert find_learning_rate(cfg, trainer, object(), object()) == {SUGGESTED_LR: 1e-3}  # type: ignore[arg-type]
    (kwargs,) = RecordingTuner.calls
    assert kwargs["mode"] == mode and kwargs["early_stop_threshold"] == threshold
    assert (kwargs["min_lr"], kwargs["max_lr"], kwargs["num_training"]) == (1e-5, 0.5, 24)
    assert json.loads((tmp_path / RESULT_FILE).read_text())["mode"] == mode


def test_the_finder_records_each_optimizer_steps_loss_under_accumulation(tmp_path: Path) -> None:
    """Two micro-batches of 4 blocks give the curve of one batch of 8: the finder records each optimizer step's
    ``train/loss`` (the global batch's token mean). Lightning's finder took what the step's last micro-batch's
    ``training_step`` returned: that micro-batch's summed loss times the token-loss scale, divided by
    ``accumulate_grad_batches`` (about half the loss, and one micro-batch's)."""
    results = {}
    for name, batch in {"accumulated": ["data.batch_size=4", "trainer.accumulate_grad_batches=2"],
                        "whole": ["data.batch_size=8"]}.items():
        run_job(compose_config([*FINDER, "logger=none", "model.dropout=0.0", "tune.num_training=20", *batch],
                               output_dir=tmp_path / name))
        results[name] = json.loads((tmp_path / name / RESULT_FILE).read_text())
    accumulated, whole = results["accumulated"], results["whole"]
    assert len(accumulated["loss"]) == len(whole["loss"]) >= 12
    # The same steps on the same data; the rates near 1 amplify float reordering between the two: 1e-4.
    assert accumulated["loss"] == pytest.approx(whole["loss"], rel=1e-4)
    assert accumulated["suggested_lr"] == pytest.approx(whole["suggested_lr"])
