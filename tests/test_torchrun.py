"""``torchrun --nproc_per_node=2 train.py trainer=ddp_cpu``: torchrun starts every rank; rank 0 hands its
job (overrides, run directory) to the others through torchrun's store (trident.launch.torchrun), so
the job has one run directory and one W&B run. Fast tests of the hand-over, and one real 2-process run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from trident.errors import TridentError
from trident.launch import torchrun
from trident.launch.distributed import workers_follow
from trident.launch.workers import JOB_VARIABLE
from trident.runs.command_line import prepare_command_line
from trident.tracking.wandb_files import wait_for_offline_runs

from .conftest import ROOT, SMALL
from .shared_runs import assert_clean

JOB = json.dumps({"overrides": ["model=nano", "seed=3"], "run_dir": "/runs/rank-zero's"})


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def torchrun_env(monkeypatch: pytest.MonkeyPatch, rank: int, port: int, agent_store: bool) -> None:
    """What torchrun puts in a rank's environment."""
    for name, value in {"TORCHELASTIC_RUN_ID": "test", "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                        "TORCHELASTIC_USE_AGENT_STORE": str(agent_store), "TORCHELASTIC_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(JOB_VARIABLE, raising=False)


@pytest.fixture(autouse=True)
def short_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that gets no job fails in seconds here, not after torchrun's minutes."""
    monkeypatch.setattr(torchrun, "JOB_WAIT_S", 5.0)


@pytest.fixture
def agent_store(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """The store torchrun's agent hosts: the port of a running TCPStore server."""
    port = free_port()
    server = TCPStore("127.0.0.1", port, 3, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    yield port
    del server


def test_rank_one_runs_the_job_rank_zero_published(agent_store: int, monkeypatch: pytest.MonkeyPatch) -> None:
    torchrun_env(monkeypatch, 0, agent_store, agent_store=True)
    monkeypatch.setattr(torchrun, "_hosted", [])
    torchrun.publish_job(JOB)
    assert not torchrun._hosted, "torchrun's agent hosts the store (in its own process): rank 0 is a client"
    torchrun_env(monkeypatch, 1, agent_store, agent_store=True)
    argv = prepare_command_line(["model=nano", "seed=3", "hydra.run.dir=outputs/runs/${now:%H-%M-%S-%f}"])
    assert argv == ["model=nano", "seed=3", "hydra.run.dir='/runs/rank-zero\\'s'", "hydra.output_subdir=null"]


def test_rank_zero_publishes_the_job_it_runs(agent_store: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    torchrun_env(monkeypatch, 0, agent_store, agent_store=True)
    with workers_follow([], ["model=nano"], tmp_path / "run"):
        assert json.loads(torchrun.job_of_rank_zero(1)) == {"overrides": ["model=nano"], "run_dir": str(tmp_path / "run")}


def test_without_the_agent_store_rank_zero_hosts_it(monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    torchrun_env(monkeypatch, 0, port, agent_store=False)
    monkeypatch.setattr(torchrun, "_hosted", [])
    torchrun.publish_job(JOB)
    assert len(torchrun._hosted) == 1
    torchrun_env(monkeypatch, 1, port, agent_store=False)
    assert torchrun.job_of_rank_zero(1) == JOB


def test_a_rank_without_a_job_from_rank_zero_stops_in_one_line(agent_store: int, monkeypatch: pytest.MonkeyPatch) -> None:
    torchrun_env(monkeypatch, 1, agent_store, agent_store=True)
    monkeypatch.setattr(torchrun, "JOB_WAIT_S", 0.5)
    with pytest.raises(TridentError, match="torchrun rank 1 got no job from rank 0 within 0 s"):
        torchrun.job_of_rank_zero(1)


def test_a_sweep_under_torchrun_is_refused(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    torchrun_env(monkeypatch, 0, free_port(), agent_store=True)
    with pytest.raises(SystemExit) as stop:
        prepare_command_line(["-m", "seed=1,2"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.startswith("error: torchrun runs one job: drop -m/--multirun")


def test_outside_torchrun_nothing_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("RANK", "1")  # e.g. SLURM's tasks: no torchrun store to wait on
    assert torchrun.torchrun_rank() is None


@pytest.mark.slow
def test_torchrun_two_processes_one_run_directory_one_wandb_run(tmp_path: Path, _shared_data_cache: None) -> None:
    # Microseconds in the run directory's name: each rank naming its own would always differ.
    run_dirs = "hydra.run.dir=${paths.output_root}/runs/torchrun/${now:%H-%M-%S-%f}"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", str(ROOT / "train.py"),
               "trainer=ddp_cpu", *SMALL, "trainer.max_steps=2", f"paths.output_root={tmp_path / 'outputs'}", run_dirs]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600, check=False)
    assert_clean(result)
    run_dir, = list((tmp_path / "outputs" / "runs").glob("*/*"))  # not one per rank
    runs = wait_for_offline_runs(run_dir)
    assert len(runs) == 1 and runs[0].finished, "one W&B run, from rank 0"
    assert runs[0].config["trainer"]["devices"] == 2 and "test/loss" in runs[0].summary
