"""Loggers side by side (``logger=[wandb,mlflow,csv]``): each gets the same metrics, the resolved config and
the run name; the MLflow store is read back with MLflow's client. ``logger.wandb.log_model=best``: the best
checkpoint as a W&B artifact in the offline run directory, with the run's config in its metadata."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from trident.errors import ConfigError
from trident.runs.command_line import prepare_command_line
from trident.runs.pipeline import train
from trident.tracking.wandb_artifacts import check_log_model
from trident.tracking.wandb_files import OfflineRun, wait_for_offline_runs

from .conftest import SMALL, compose_config


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, single_thread: None) -> tuple[Path, Path]:
    """(run directory, MLflow store) of one small run with three loggers and the best checkpoint uploaded."""
    root = tmp_path_factory.mktemp("loggers")
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)
        patch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # set by the run: gone after it
        cfg = compose_config([*SMALL, "logger=[wandb,mlflow,csv]", "logger.wandb.log_model=best",
                              f"paths.output_root={root}"], output_dir=root / "run")
        train(cfg)
    return root / "run", root / "mlruns"


def the_wandb_run(run_dir: Path) -> OfflineRun:
    runs = wait_for_offline_runs(run_dir)
    assert len(runs) == 1
    return runs[0]


def test_mlflow_store_holds_the_metrics_config_and_run_name_the_other_loggers_got(run: tuple[Path, Path]) -> None:
    run_dir, store = run
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # reading the file store, as `mlflow ui` would
    client = MlflowClient(tracking_uri=store.resolve().as_uri())
    experiment = client.get_experiment_by_name("trident")
    assert experiment is not None, f"no experiment trident in {store}"
    found, = client.search_runs([experiment.experiment_id])
    wandb_run = the_wandb_run(run_dir)
    assert found.info.run_name == wandb_run.name == "lm-shakespeare-nano-rope-seed1337"
    assert found.info.status == "FINISHED"
    assert found.data.params["model/name"] == "nano" and found.data.params["trainer/max_steps"] == "4"
    assert wandb_run.config["model"]["name"] == "nano"
    mlflow_val = [m.value for m in client.get_metric_history(found.info.run_id, "val/loss")]
    with (run_dir / "csv" / "version_0" / "metrics.csv").open() as rows:
        csv_val = [float(row["val/loss"]) for row in csv.DictReader(rows) if row.get("val/loss")]
    assert len(mlflow_val) == 2
    assert mlflow_val == pytest.approx(csv_val) and mlflow_val == pytest.approx(wandb_run.metric("val/loss"))
    assert found.data.metrics["test/loss"] == pytest.approx(wandb_run.summary["test/loss"])
    csv_config = OmegaConf.load(run_dir / "csv" / "version_0" / "hparams.yaml")
    assert csv_config.run_name == found.info.run_name and csv_config.model.name == "nano"


def test_best_checkpoint_is_a_wandb_artifact_in_the_offline_run(run: tuple[Path, Path]) -> None:
    run_dir, _ = run
    wandb_run = the_wandb_run(run_dir)
    models = [a for a in wandb_run.artifacts if a["type"] == "model"]
    assert len(models) == 1, wandb_run.artifacts
    model = models[0]
    assert model["name"] == f"model-{wandb_run.run_id}" and "best" in model["aliases"]
    metadata = json.loads(model["metadata"])
    assert metadata["config"]["run_name"] == wandb_run.name and metadata["monitor"] == "val/loss"
    assert metadata["best"] == pytest.approx(wandb_run.summary["best/val/loss"])
    entry, = model["manifest"]["contents"]
    kept = Path(entry["local_path"])
    assert kept.is_relative_to(run_dir / "wandb"), "the checkpoint travels with the offline run"
    best = next((run_dir / "checkpoints").glob("best-step*.ckpt"))
    assert entry["path"] == best.name and kept.read_bytes() == best.read_bytes()
    assert torch.load(kept, map_location="cpu", weights_only=True)["global_step"] == 4


@pytest.mark.parametrize("value", [True, "all", "last", 0])
def test_log_model_takes_false_or_best(value: object) -> None:
    check_log_model(False)
    check_log_model("best")
    with pytest.raises(ConfigError, match="set false .no upload. or best"):
        check_log_model(value)


def test_a_list_of_loggers_passes_the_command_line_check() -> None:
    assert prepare_command_line(["logger=[wandb,tensorboard,mlflow]"]) == ["logger=[wandb,tensorboard,mlflow]"]
    with pytest.raises(SystemExit):
        prepare_command_line(["logger=[wandb,tensorbord]"])
