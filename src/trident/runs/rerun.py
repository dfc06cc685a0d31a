"""A sweep job run again in its own directory (the same overrides: the same command once more, or a sweep
continued with some of its values): one training per job directory, never two appended.

- an earlier attempt that completed: the job is done, in one line (``done: <dir>``), and not run again;
- one that stopped with a checkpoint (a signal, a kill, a node failure; not a failure of its own): the
  job resumes from its newest checkpoint, in the same W&B run;
- one that failed, or stopped before its first checkpoint: the job runs again from the start, its
  earlier files cleared first (``metrics.jsonl``, checkpoints, logs and ``run.json``, so a new W&B run id).

A requeued SLURM attempt is left to :func:`trident.runs.resume.checkpoint_to_resume`, which resumes it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, open_dict

from trident.launch.distributed import is_global_zero
from trident.launch.requeue import RUN_INFO, latest_checkpoint, requeued_attempt, write_json
from trident.launch.workers import JOB_VARIABLE
from trident.runs.sweeps import STATUS_FILE, read_json

log = logging.getLogger(__name__)

# What Hydra puts into a job directory as the job starts: a directory holding nothing else is new.
HYDRA_FILES = frozenset({".hydra", "train.log"})
DONE, RESUME, RESTART, NEW = "done", "resume", "restart", "new"


def earlier_attempt(run_dir: Path) -> str:
    """What this attempt does with the job directory: :data:`DONE`, :data:`RESUME`, :data:`RESTART` or :data:`NEW`."""
    if requeued_attempt(run_dir) or not run_dir.is_dir() or not {p.name for p in run_dir.iterdir()} - HYDRA_FILES:
        return NEW
    record = read_json(run_dir / STATUS_FILE)
    if record is not None and record.get("status") == "completed":
        return DONE
    failed = record is not None and record.get("status") == "failed"
    return RESUME if not failed and latest_checkpoint(run_dir) is not None else RESTART


def continue_job(cfg: DictConfig, run_dir: Path) -> dict[str, Any] | None:
    """Prepare the job's directory for this attempt; returns the completed job's ``status.json`` when
    there is nothing to run."""
    action = earlier_attempt(run_dir)
    if action == DONE:
        print(f"done: {run_dir}")
        return read_json(run_dir / STATUS_FILE)
    if action == RESUME:
        log.warning("continuing the unfinished job in %s from %s", run_dir, latest_checkpoint(run_dir))
        with open_dict(cfg):
            cfg.resume = str(run_dir)
        _workers_resume(run_dir)
    elif action == RESTART:
        log.warning("running the job in %s again from the start: its earlier attempt %s", run_dir,
                    (read_json(run_dir / STATUS_FILE) or {}).get("error", "stopped before its first checkpoint"))
        if is_global_zero():
            _clear(run_dir)
    return None


def _clear(run_dir: Path) -> None:
    """Remove an earlier attempt's files, Hydra's excepted (written for this attempt, its log open)."""
    for path in run_dir.iterdir():
        if path.name not in HYDRA_FILES:
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def _workers_resume(run_dir: Path) -> None:
    """DDP workers that Lightning starts for this job (:func:`trident.launch.distributed.workers_follow`
    published its overrides) resume from the same checkpoint."""
    spec = os.environ.get(JOB_VARIABLE)
    if spec:
        job = json.loads(spec)
        job["overrides"] = [*job["overrides"], f"resume={run_dir}"]
        os.environ[JOB_VARIABLE] = json.dumps(job)


def remember_sweep(run_dir: Path, sweep_id: str, setting: str) -> None:
    """Keep the job's sweep id and setting in ``run.json``, for attempts that resume it outside the sweep."""
    if not is_global_zero():
        return
    path = run_dir / RUN_INFO
    info = json.loads(path.read_text()) if path.is_file() else {}
    info.update(sweep=sweep_id, setting=setting)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json(path, info, indent=1)


def remembered_sweep(run_dir: Path) -> tuple[str, str] | None:
    """(sweep id, setting) of a run directory that a sweep started, else None; from ``run.json``, or for
    a job an earlier version of trident started, from the ``status.json`` its attempt ended with."""
    for name in (RUN_INFO, STATUS_FILE):
        info = read_json(run_dir / name) or {}
        if "sweep" in info:
            return info["sweep"], info.get("setting", "")
    return None
