"""The SLURM tests' waits (tests/slurm_jobs.py), against stand-in ``scontrol``, ``squeue``, ``sinfo``, ``sacct``
and ``scancel``: a wait for something a job will not bring stops within seconds (the sweep's process ended,
the job ended or is held, it ran too long), says where the job stands with the tails of its logs, and cancels
the job; time in line is not time running; a job requeued for later is started now. The jobs do not inherit
the pytest process's W&B service; and a job's ranks read whole the run files that rank 0 rewrites."""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from trident.runs.jobs import write_status
from trident.runs.rerun import RESTART, earlier_attempt, remember_sweep, remembered_sweep

from .slurm_jobs import Job, Started, env, run_until

JOB = "18"
# Each stand-in command records its arguments; scontrol shows the job's records from a file, or fails as
# SLURM does for a job it no longer knows.
STAND_IN = """#!/bin/sh
echo "$(basename "$0") $*" >> "{calls}"
if [ "$(basename "$0") $1 $2" = "scontrol show job" ]; then
  [ -f "{records}" ] || {{ echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1; }}
  cat "{records}"
fi
echo "$(basename "$0") stands in"
"""


class Cluster:
    """The stand-in commands on PATH, the job's records and the calls made."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        self.calls, self.records = tmp_path / "calls", tmp_path / "records"
        for name in ("scontrol", "squeue", "sinfo", "sacct", "scancel"):
            (bin_dir / name).write_text(STAND_IN.format(calls=self.calls, records=self.records))
            (bin_dir / name).chmod(0o755)
        monkeypatch.setenv("PATH", f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin")
        self.root = tmp_path / "sweep"
        log = self.root / "multirun" / "day" / "time" / ".submitit" / JOB / f"{JOB}_0_log.err"
        log.parent.mkdir(parents=True)
        log.write_text("srun: error: task 0 launch failed\n")

    def job_is(self, state: str, reason: str = "None") -> None:
        self.records.write_text(f"JobId={JOB} JobName=train JobState={state} Reason={reason} Dependency=(null)\n")

    def called(self, command: str) -> bool:
        return self.calls.is_file() and command in self.calls.read_text().splitlines()


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Cluster:
    return Cluster(tmp_path, monkeypatch)


def _fails_within(job: Job, **limits: float) -> str:
    """The wait's failure message; it came within seconds (a loaded machine starts the stand-ins slowly)."""
    started = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        run_until(job, lambda: False, "checkpoint", **limits)
    assert time.monotonic() - started < 20
    return str(failed.value)


def test_a_wait_stops_when_the_sweep_has_ended_and_says_why(cluster: Cluster) -> None:
    cluster.job_is("RUNNING")
    console = cluster.root / "train-0.console"
    with console.open("w") as out:
        process = subprocess.Popen([sys.executable, "-c", "print('error: the sweep gave up'); raise SystemExit(3)"],
                                   stdout=out, stderr=subprocess.STDOUT, text=True)
    process.wait()
    message = _fails_within(Job(JOB, cluster.root, Started(process, console)))
    assert message.startswith("no checkpoint: the sweep ended (exit status 3)"), message
    assert "error: the sweep gave up" in message, "the sweep's console"
    assert "srun: error: task 0 launch failed" in message, "the tail of submitit's log"
    assert f"$ scontrol show job {JOB}\nJobId={JOB}" in message and "$ squeue" in message and "$ sinfo" in message
    assert cluster.called(f"scancel {JOB}"), "the job's nodes go to the next test's jobs"


@pytest.mark.parametrize("state", ["FAILED", "COMPLETED", "CANCELLED", None])
def test_a_wait_stops_once_the_job_has_ended(cluster: Cluster, state: str | None) -> None:
    if state is not None:
        cluster.job_is(state)
    message = _fails_within(Job(JOB, cluster.root), after_end_s=0)
    assert message.startswith(f"no checkpoint: the job ended ({state or 'no longer listed'})"), message


def test_a_wait_stops_when_the_job_is_held(cluster: Cluster) -> None:
    cluster.job_is("PENDING", "launch_failed_requeued_held")
    message = _fails_within(Job(JOB, cluster.root))
    assert "the job is held (launch_failed_requeued_held)" in message, message


def test_a_job_running_too_long_fails_the_wait_and_time_in_line_is_not_counted(cluster: Cluster) -> None:
    cluster.job_is("RUNNING")
    message = _fails_within(Job(JOB, cluster.root), running_s=0.8)
    assert re.match(r"no checkpoint: the job ran for \d+ s\n", message), message
    cluster.job_is("PENDING", "Resources")
    message = _fails_within(Job(JOB, cluster.root), running_s=0.8, timeout=2)
    assert re.match(r"no checkpoint: waited 2 s, \d+ s of it in line\n", message), message


def test_a_requeued_job_held_until_later_is_started_now_and_the_wait_ends_when_done(cluster: Cluster) -> None:
    cluster.job_is("PENDING", "BeginTime")
    started = time.monotonic()
    run_until(Job(JOB, cluster.root), lambda: time.monotonic() - started > 1, "checkpoint")
    assert cluster.called(f"scontrol update JobId={JOB} StartTime=now")
    assert not cluster.called(f"scancel {JOB}")


def test_the_jobs_get_no_w_and_b_service_of_the_pytest_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """A W&B run in this process leaves WANDB_SERVICE set: a job's rank 0 would connect to that service (seen:
    "Connected to an existing wandb-core service via WANDB_SERVICE"), and fail at its start once it has gone."""
    monkeypatch.setenv("WANDB_SERVICE", "3-1234-unix-/tmp/wandb-gone/socket")
    assert "WANDB_SERVICE" not in env() and env()["OMP_NUM_THREADS"] == "1"


def test_the_jobs_get_no_launcher_port_of_the_pytest_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """An in-process Trainer leaves MASTER_PORT (a free port Lightning found) in this process: a requeued job's
    attempts and the run beside it would all listen on it (seen in CI: EADDRINUSE at the second attempt)."""
    for name, value in {"MASTER_PORT": "44401", "MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "2", "NODE_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    assert not {"MASTER_PORT", "MASTER_ADDR", "WORLD_SIZE", "NODE_RANK"} & env().keys()


def test_every_rank_reads_the_run_files_whole_while_rank_zero_rewrites_them(tmp_path: Path) -> None:
    """Each rank of a multi-node job reads ``status.json`` and ``run.json`` as it starts (is there an earlier
    attempt? a sweep?) while rank 0 may be writing them. A file rewritten in place is empty for a moment: a
    requeued job's rank 1 read it so and failed, and rank 0 waited for it until gloo's 30 minutes ran out.
    A reader sees the old file or the new one, whole."""
    cfg = OmegaConf.create({"task": {"monitor": "val/loss", "monitor_mode": "min"}})
    write_status(tmp_path, cfg, "running")
    remember_sweep(tmp_path, "sweep-0", "model.n_heads=2")
    stop = threading.Event()

    def rewrite() -> None:  # rank 0, as a job starts and runs
        for step in itertools.count():
            if stop.is_set():
                return
            write_status(tmp_path, cfg, "running", step=step)
            remember_sweep(tmp_path, f"sweep-{step}", "model.n_heads=2")

    writer = threading.Thread(target=rewrite)
    writer.start()
    try:
        for _ in range(3000):  # another rank
            assert earlier_attempt(tmp_path) == RESTART  # a job stopped before its first checkpoint
            assert remembered_sweep(tmp_path) is not None
    finally:
        stop.set()
        writer.join()
