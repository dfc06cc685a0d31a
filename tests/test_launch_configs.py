"""Scaling-out configs: submitit launchers (a real submitit_local sweep), the SLURM preset (FSDP: tests/test_parallel.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.plugins import Plugins
from omegaconf import DictConfig, OmegaConf

from trident.errors import ConfigError
from trident.runs.command_line import check_group_choices, prepare_command_line
from trident.runs.pipeline import train

from .conftest import ROOT, SMALL, compose_config


@pytest.mark.slow
def test_submitit_local_sweep_writes_each_jobs_run_directory(tmp_path: Path) -> None:
    overrides = [o for o in SMALL if not o.startswith("callbacks.")] + ["callbacks=none", "logger=csv", "test=false"]
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "-m", "hydra/launcher=submitit_local", *overrides,
         "trainer.max_steps=2", "seed=1,2", f"paths.output_root={tmp_path}"],
        check=False, capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    sweeps = list((tmp_path / "multirun").glob("*/*"))
    assert len(sweeps) == 1, sweeps
    assert list(sweeps[0].glob(".submitit/*/*_result.pkl")), "the jobs ran through submitit"
    jobs = sorted(p for p in sweeps[0].iterdir() if p.is_dir() and not p.name.startswith("."))
    assert [p.name for p in jobs] == ["0_lm-shakespeare-nano-rope-seed1", "1_lm-shakespeare-nano-rope-seed2"]
    for seed, job in enumerate(jobs, start=1):
        assert OmegaConf.load(job / "config_resolved.yaml").seed == seed
        assert f"Run directory: {job}" in (job / "train.log").read_text()
        header = next(job.rglob("metrics.csv")).read_text().splitlines()[0]
        assert "train/loss" in header and "val/loss" in header


def test_ddp_inside_a_submitit_local_job_is_refused_in_one_line(
    make_config: Callable[..., DictConfig], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "local")
    with pytest.raises(ConfigError, match=r"trainer.devices=2 needs DDP worker processes.*hydra/launcher=slurm"):
        train(make_config("trainer=ddp_cpu"))
    assert not (tmp_path / "run").exists(), "refused before writing anything"


def test_slurm_preset_runs_one_task_per_gpu_on_the_trainers_nodes() -> None:
    Plugins.instance()  # the submitit plugin registers hydra/launcher=submitit_slurm, which the preset extends
    GlobalHydra.instance().clear()
    overrides = ["hydra/launcher=slurm", "trainer=ddp", "trainer.num_nodes=2", "hydra.launcher.gpus_per_node=8",
                 "hydra.launcher.partition=gpu"]
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    launcher: dict[str, Any] = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)  # type: ignore[assignment]
    assert launcher["_target_"].endswith("submitit_launcher.SlurmLauncher")
    assert (launcher["nodes"], launcher["gpus_per_node"], launcher["tasks_per_node"]) == (2, 8, 8)
    assert launcher["partition"] == "gpu" and launcher["timeout_min"] == 1440
    assert cfg.trainer.strategy == "ddp" and cfg.trainer.devices == -1, "ddp takes the GPUs SLURM gives each node"


@pytest.mark.parametrize(
    ("overrides", "gpus", "tasks"),
    [
        (["trainer=ddp_cpu"], None, 2),  # a CPU cluster: no GPUs asked for, one task per process
        (["trainer=ddp_cpu", "trainer.devices=1"], None, 1),
        (["trainer=ddp", "trainer.devices=4"], 4, 4),  # a number of GPUs: as many tasks
        (["trainer=ddp"], 1, 1),  # devices=-1 (all GPUs): set gpus_per_node, the tasks follow
        (["trainer=ddp", "hydra.launcher.gpus_per_node=8"], 8, 8),
    ],
)
def test_slurm_preset_asks_for_one_task_per_device(overrides: list[str], gpus: int | None, tasks: int) -> None:
    Plugins.instance()
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        cfg = compose("train", overrides=["hydra/launcher=slurm", "trainer.num_nodes=2", *overrides], return_hydra_config=True)
    launcher: dict[str, Any] = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)  # type: ignore[assignment]
    assert (launcher["gpus_per_node"], launcher["tasks_per_node"], launcher["nodes"]) == (gpus, tasks, 2)


@pytest.mark.parametrize("preset", ["cpu", "gpu", "ddp", "ddp_cpu", "fsdp", "fsdp_cpu", "default"])
def test_every_trainer_preset_has_num_nodes(preset: str) -> None:
    assert compose_config([f"trainer={preset}"]).trainer.num_nodes == 1


def test_launcher_choices_include_the_plugins_options(capsys: pytest.CaptureFixture[str]) -> None:
    check_group_choices(["-m", "hydra/launcher=submitit_local"], ROOT / "conf")
    check_group_choices(["hydra/launcher=slurm"], ROOT / "conf")
    with pytest.raises(SystemExit) as exit_info:
        prepare_command_line(["hydra/launcher=slrum"], ROOT / "conf")
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "error: hydra/launcher=slrum does not exist: choose one of basic, slurm, submitit_local, submitit_slurm"
    )
