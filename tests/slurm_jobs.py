"""Runs and jobs of the SLURM tests (tests/test_slurm.py, tests/test_slurm_sharded.py) on the two-node cluster
of ``scripts/slurm_cluster.sh``: ``train.py`` processes whose console output goes to a file, and waits for a job.

A wait ends as soon as what it waits for can no longer come: the sweep's process ended, the job ended or is
held, it ran longer than a run of these tests takes, or it waited in line too long. It then fails with where the
job stands (``squeue``, ``scontrol show job``, ``sinfo``, ``sacct``), the tail of the job's logs (submitit's
``*_log.err``/``*_log.out``, ``train.log``) and of the sweep's console, and cancels the job, so that the jobs of
later tests get the nodes. (A sweep waited for a job that was gone: submitit follows jobs with ``sacct``, which
this cluster lacks; a wait that only watched for a file then ran into its 30-minute limit, saying nothing.)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .conftest import ROOT

# A job's time RUNNING (not in line) within one wait: its runs take a minute or two on a busy machine.
RUNNING_S = 600
# The first checkpoint of a job comes within a minute of its start (imports, then 2 steps).
CHECKPOINT_S = 300
# Any one wait, the time in line included: the two nodes take one job at a time, and the jobs of the other
# SLURM test module (another pytest-xdist worker) may be ahead.
TIMEOUT_S = 1800
# A process on this machine (2 ranks of a run, a resume).
LOCAL_S = 600
# How long a sweep may take to notice that its job ended (submitit polls for the job's result file).
SWEEP_NOTICES_S = 60
# SLURM's states of a job that has ended, and those of one held: it will not start without a person.
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE"}
HELD = {"REQUEUE_HOLD", "SPECIAL_EXIT"}
# What a launcher sets for the ranks it starts (Lightning's own launcher and torchrun's).
LAUNCHER_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "GROUP_RANK", "LOCAL_RANK", "RANK", "WORLD_SIZE",
                      "LOCAL_WORLD_SIZE")


def env() -> dict[str, str]:
    """The environment of the runs and sweeps (sbatch exports it to the jobs): the tests' helpers, one thread,
    and no ``WANDB_SERVICE``: a W&B run in the pytest process (an in-process test's) leaves its service's
    address there, and a job's rank 0 would log into that service, not one of its own (which SLURM's signals
    reach, as they do on a cluster), or fail at its start when that service has gone. Nor the launcher variables
    an in-process test's Trainer leaves (Lightning sets ``MASTER_PORT`` to a free port it found): every attempt of a
    job, and the run beside it, would then listen on that one port (seen: a requeued job's rank 0 failed with
    EADDRINUSE, and rank 1 waited for it until gloo's 30 minutes ran out)."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    for name in ("WANDB_SERVICE", *LAUNCHER_VARIABLES):
        environment.pop(name, None)
    return environment


@dataclass(frozen=True)
class Started:
    """A ``train.py`` process; its stdout and stderr go to ``console``, which can be read while it runs."""

    process: subprocess.Popen[str]
    console: Path

    def ended(self) -> bool:
        return self.process.poll() is not None

    def output(self) -> str:
        return self.console.read_text(errors="replace")


def start(root: Path, *args: str, environment: dict[str, str] | None = None) -> Started:
    """``python train.py <args>`` in ``root`` (its outputs there too)."""
    root.mkdir(parents=True, exist_ok=True)
    console = root / f"train-{len(list(root.glob('train-*.console')))}.console"
    command = [sys.executable, str(ROOT / "train.py"), *args, f"paths.output_root={root}"]
    with console.open("w") as out:
        process = subprocess.Popen(command, cwd=root, env=environment or env(), text=True, stdout=out,
                                   stderr=subprocess.STDOUT)
    return Started(process, console)


def finish(started: Started, timeout: float = LOCAL_S) -> tuple[int, str]:
    """The exit status and console output of a process once it has ended."""
    try:
        started.process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        started.process.kill()  # not left running after the test
        started.process.wait()
        raise AssertionError(f"{started.process.args} still ran after {timeout} s:\n{_tail(started.console)}") from None
    return started.process.returncode, started.output()


@dataclass(frozen=True)
class Job:
    """A SLURM job (an array's id stands for all its tasks), the directory its logs are under and, for a
    sweep's job, the sweep's process."""

    id: str
    root: Path
    sweep: Started | None = None


def submitted_job(root: Path, sweep: Started) -> Job:
    """The (one) job, or array of jobs, that ``sweep`` submits under ``root``, once submitted."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if found := list(root.glob("multirun/*/*/.submitit/*/*_submitted.pkl")):
            return Job(found[0].parent.name.split("_")[0], root, sweep)  # <array id>_<task> for an array's job
        if sweep.ended():
            raise AssertionError(f"the sweep ended (exit status {sweep.process.returncode}) before it submitted a "
                                 f"job:\n{_tail(sweep.console)}")
        time.sleep(0.5)
    raise AssertionError(f"no job was submitted in 300 s:\n{_tail(sweep.console)}")


def _records(job: str) -> list[tuple[str, str]] | None:
    """(state, reason) of each of the job's records (an array's tasks), [] when SLURM no longer knows it
    (MinJobAge after its end), None when ``scontrol`` did not answer."""
    shown = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, check=False)
    if shown.returncode != 0:
        return [] if "Invalid job id" in shown.stderr else None
    return re.findall(r"\bJobState=(\S+) Reason=(\S+)", shown.stdout)


def run_until(job: Job, done: Callable[[], bool], what: str, running_s: float = RUNNING_S,
              timeout: float = TIMEOUT_S, after_end_s: float = 10) -> None:
    """Wait for ``done()``: at most ``running_s`` of the job running, ``timeout`` in all, and ``after_end_s``
    once the job has ended. SLURM holds a requeued job for about 2 minutes (BeginTime): it is started now."""
    started = last = time.monotonic()
    ran = 0.0
    ended_at: float | None = None
    while not done():
        now = time.monotonic()
        records = _records(job.id)
        if records and any(state != "PENDING" for state, _ in records):
            ran += now - last
        last = now
        ended = records == [] or (records is not None and all(state in ENDED for state, _ in records))
        ended_at = (ended_at or now) if ended else None
        held = [reason for state, reason in records or [] if state in HELD or "held" in reason.lower()]
        why = ""
        if job.sweep is not None and job.sweep.ended():
            why = f"the sweep ended (exit status {job.sweep.process.returncode})"
        elif ended_at is not None and now - ended_at >= after_end_s:
            why = f"the job ended ({', '.join(state for state, _ in records or []) or 'no longer listed'})"
        elif held:
            why = f"the job is held ({', '.join(held)}): it would not start again"
        elif ran > running_s:
            why = f"the job ran for {ran:.0f} s"
        elif now - started > timeout:
            why = f"waited {timeout} s, {now - started - ran:.0f} s of it in line"
        if why:
            if done():  # it came at the last moment
                return
            raise AssertionError(_report(job, f"no {what}: {why}"))
        if any(state == "PENDING" and reason == "BeginTime" for state, reason in records or []):
            subprocess.run(["scontrol", "update", f"JobId={job.id}", "StartTime=now"], check=False)
        time.sleep(0.5)


def sweep_end(job: Job) -> tuple[int, str]:
    """The exit status and console output of the job's sweep, once its jobs have ended."""
    assert job.sweep is not None
    sweep = job.sweep
    run_until(job, sweep.ended, "end of the sweep", after_end_s=SWEEP_NOTICES_S)
    return finish(sweep)


def _tail(path: Path, lines: int = 25) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _report(job: Job, headline: str) -> str:
    """Where the job stands and its logs' tails; then the job is cancelled and its sweep stopped."""
    parts = [headline]
    for command in (["squeue", "-a", "-o", "%i %T %r %M %N"], ["scontrol", "show", "job", job.id],
                    ["sinfo", "-N", "-o", "%N %T %E"], ["sacct", "-j", job.id, "-o", "JobID,State,ExitCode"]):
        shown = subprocess.run(command, capture_output=True, text=True, check=False)
        parts.append(f"$ {' '.join(command)}\n{(shown.stdout + shown.stderr).strip()}")
    subprocess.run(["scancel", job.id], check=False)  # the nodes go to the next test's jobs
    if job.sweep is not None and not job.sweep.ended():
        job.sweep.process.kill()
        job.sweep.process.wait()
    # What the jobs saved (a wait for a checkpoint that is there but unreadable shows here).
    saved = sorted(job.root.glob("multirun/*/*/*/checkpoints/*"))
    parts.append("checkpoints: " + (", ".join(f"{p.name} ({time.ctime(p.stat().st_mtime)})" for p in saved) or "none"))
    logs = [*job.root.glob("multirun/*/*/.submitit/*/*_log.*"), *job.root.glob("multirun/*/*/*/train.log"),
            *job.root.glob("*/*.out"), *([job.sweep.console] if job.sweep is not None else [])]
    parts += [f"--- {log}\n{_tail(log)}" for log in sorted(logs)] or [f"(no logs under {job.root})"]
    return "\n".join(parts)
