"""Stop now, come back later: what a stop signal means for a job, and how a requeued job continues.

SIGTERM (SLURM's ``scancel``, ``scontrol requeue`` and preemption), SIGUSR2 (submitit's warning
before the time limit) and SIGUSR1 (an sbatch ``--signal=USR1@<seconds>``) all reach
:class:`trident.launch.preemption.PreemptionCheckpoint`, which finishes the current step, saves
``last.ckpt`` and stops training with a :class:`JobStopped`. Then:

- **requeued**: SLURM runs the job again. For SIGTERM, SLURM is already requeueing it (it has
  counted one more restart than this attempt's ``SLURM_RESTART_COUNT``); for SIGUSR2 in a submitit
  job, submitit's own handler requeues it (within ``max_num_timeout``); for SIGUSR1 (and SIGUSR2
  outside submitit), trident runs ``scontrol requeue``. Every rank then exits without a result (see
  :func:`trident.runs.jobs.record_stop`), so a waiting launcher keeps waiting, and the next attempt
  resumes from the run directory's newest checkpoint (:func:`requeued_attempt`).
- **cancelled** (``scancel``, or any stop signal outside SLURM) or **timeout** (submitit allows no
  more requeues): the job ends; ``python train.py resume=<run dir>`` continues it exactly.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from submitit.core.utils import UncompletedJobError

log = logging.getLogger(__name__)

REQUEUED, CANCELLED, TIMEOUT = "requeued", "cancelled", "timeout"
RUN_INFO = "run.json"


def write_json(path: Path, record: dict[str, Any], indent: int) -> None:
    """Write ``record`` as JSON to ``path`` at once (a temporary file renamed over it). Every rank of a
    multi-node job reads ``run.json`` and ``status.json`` as it starts, while rank 0 may be writing them:
    written in place, a file is empty for a moment, and a rank that read it so failed while rank 0 waited
    for it (30 minutes, gloo's limit)."""
    partial = path.with_name(f"{path.name}.partial")
    partial.write_text(json.dumps(record, indent=indent) + "\n")
    os.replace(partial, path)


@dataclass(eq=False)  # an exception keeps identity equality (and stays hashable)
class JobStopped(Exception):
    """Training stopped on a signal after saving ``checkpoint`` at ``step``; ``outcome`` says
    whether SLURM runs the job again (``requeued``) or not (``cancelled``)."""

    signal: str
    step: int
    checkpoint: str
    outcome: str
    slurm_job: str | None

    def __str__(self) -> str:
        return f"{self.signal} at step {self.step}: {self.outcome}"

    def record(self) -> dict[str, Any]:
        """The fields ``status.json`` keeps (the outcome is its ``status``)."""
        return {k: v for k, v in asdict(self).items() if k != "outcome"}


def slurm_job() -> str | None:
    """This process's SLURM job (``<array job>_<task>`` for array jobs); None outside SLURM."""
    if os.environ.get("SLURM_ARRAY_JOB_ID"):
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ.get('SLURM_ARRAY_TASK_ID', '')}"
    return os.environ.get("SLURM_JOB_ID")


def restart_count() -> int:
    """How often SLURM had requeued this job when this attempt started (0 for the first)."""
    return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)


def scheduler_restarts(job: str) -> int | None:
    """How often SLURM has requeued ``job`` by now (``Restarts`` of ``scontrol show job``)."""
    try:
        shown = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError) as err:
        log.warning("cannot ask SLURM about job %s (%s): taking the stop as a cancellation", job, err)
        return None
    match = re.search(r"\bRestarts=(\d+)", shown.stdout)
    return int(match.group(1)) if match else None


def stop_outcome(signal_name: str) -> str:
    """``requeued`` or ``cancelled``, as global rank 0 reads the signal it got."""
    job = slurm_job()
    if job is None:
        return CANCELLED
    if signal_name != "SIGTERM":
        return REQUEUED  # SIGUSR1/SIGUSR2 ask for a requeue: :func:`come_back_later` makes it happen
    # SLURM sends SIGTERM for scancel and for a requeue alike; a requeue has been counted already.
    restarts = scheduler_restarts(job)
    return REQUEUED if restarts is not None and restarts > restart_count() else CANCELLED


def come_back_later(stop: JobStopped, global_zero: bool) -> str:
    """Make sure SLURM requeues a job that asks for it (SIGUSR1, SIGUSR2) and return the outcome:
    ``requeued``, or ``timeout`` when submitit allows no more requeues (``max_num_timeout``)."""
    if stop.outcome != REQUEUED or not global_zero or stop.signal == "SIGTERM":
        return stop.outcome  # SLURM requeues a SIGTERMed job itself
    # The requeue's own SIGTERM must not cut the job's last writes short (SIGKILL follows KillWait later).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    handler = signal.getsignal(signal.SIGUSR2)
    if stop.signal == "SIGUSR2" and os.environ.get("SUBMITIT_EXECUTOR") == "slurm" and callable(handler):
        # submitit's handler pickles the job to run again, requeues it and exits; it counts the
        # time-outs against hydra.launcher.max_num_timeout.
        try:
            handler(signal.SIGUSR2, None)
        except SystemExit:
            return REQUEUED
        except UncompletedJobError as err:
            log.warning("%s", str(err).strip())
            return TIMEOUT
        return REQUEUED
    subprocess.run(["scontrol", "requeue", str(stop.slurm_job)], check=True, timeout=60)
    log.warning("requeued SLURM job %s", stop.slurm_job)
    return REQUEUED


def requeued_attempt(run_dir: Path) -> bool:
    """True in a requeued SLURM job that started this run directory in an earlier attempt (the
    launcher runs the same job in the same directory again): it resumes from the run's newest
    checkpoint, with no ``resume=`` needed."""
    info = run_dir / RUN_INFO
    return restart_count() > 0 and info.is_file() and json.loads(info.read_text()).get("slurm_job") == slurm_job()


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run under ``checkpoints/``, a file or a sharded checkpoint directory
    (hidden ``.*.tmp`` files and directories are writes in progress, never picked)."""
    # Here, not at the top: trident.training's package imports torch, and train.py imports this module before its checks.
    from trident.parallel.distributed_checkpoint import is_checkpoint

    candidates = [p for p in run_dir.glob("checkpoints/**/*.ckpt") if is_checkpoint(p) and not p.name.startswith(".")]
    # On equal times (same save), last.ckpt: it is the name users expect.
    return max(candidates, key=lambda p: (p.stat().st_mtime_ns, p.name == "last.ckpt"), default=None)
