"""One ``train.py`` job: a single run stops on a user error; a sweep job records how it ended.

Each job writes ``<run dir>/status.json``: ``completed`` with its final metrics (and ``stopped_early``,
the step and best value, when early stopping ended it), ``failed`` with the
error line (sweep jobs only; a single run keeps failing as one ``error:`` line and exit status 2),
or, when a signal stopped it, ``requeued`` (until the next attempt rewrites it), ``cancelled`` or
``timeout``; a job that was requeued lists its earlier stops under ``requeues``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from trident.errors import find_user_error, run_with_clear_errors
from trident.launch.distributed import is_global_zero
from trident.launch.requeue import REQUEUED, JobStopped, come_back_later, write_json
from trident.runs.code_version import code_version
from trident.runs.pipeline import train
from trident.runs.rerun import continue_job, remember_sweep, remembered_sweep
from trident.runs.sweeps import (
    STATUS_FILE,
    STOPPED_EARLY_BEST,
    STOPPED_EARLY_STEP,
    apply_sweep_identity,
    in_multirun,
    name_after_sweep,
)
from trident.weights.run_config import RUN_CONFIG

log = logging.getLogger(__name__)


def discard_failed_run_dir(run_dir: Path) -> None:
    """Remove a run directory that a failure left with nothing but Hydra's bookkeeping."""
    if not run_dir.is_dir():
        return
    contents = {p.name for p in run_dir.iterdir()}
    log_file = run_dir / "train.log"
    short_log = not log_file.exists() or log_file.stat().st_size < 4096
    if contents <= {".hydra", "train.log", RUN_CONFIG} and short_log:
        # Hydra's handler for train.log stays on the root logger: a later job of this process
        # (a sweep, a test) would log into the removed directory and fail.
        root = logging.getLogger()
        for handler in root.handlers[:]:
            if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).is_relative_to(run_dir):
                root.removeHandler(handler)
                handler.close()
        shutil.rmtree(run_dir, ignore_errors=True)
        date_dir = run_dir.parent
        if date_dir.parent.name == "runs":  # Hydra's <output_root>/runs/<date>/, made for this run
            for folder in (date_dir, date_dir.parent):
                with contextlib.suppress(OSError):  # not empty: other runs are there
                    folder.rmdir()


def objective(cfg: DictConfig, metrics: Mapping[str, float]) -> float | None:
    """What a sweeper optimises: the best value of the monitored metric, else its last value."""
    value = metrics.get(f"best/{cfg.task.monitor}", metrics.get(cfg.task.monitor))
    return None if value is None else float(value)


def stopped_early(cfg: DictConfig, metrics: Mapping[str, float]) -> dict[str, str]:
    """``status.json``'s ``stopped_early`` line for a run that early stopping ended (``callbacks=early_stopping``)."""
    if STOPPED_EARLY_STEP not in metrics:
        return {}
    stop = cfg.callbacks.early_stopping
    return {"stopped_early": f"stopped early at step {metrics[STOPPED_EARLY_STEP]:.0f}: {stop.monitor} best "
                             f"{metrics[STOPPED_EARLY_BEST]:.6g}, no improvement above {stop.min_delta} in "
                             f"{stop.patience} validations"}


def write_status(run_dir: Path, cfg: DictConfig, status: str, **fields: Any) -> None:
    """Write ``status.json``; the requeues of earlier attempts of the job are kept in ``requeues``."""
    if not is_global_zero():  # DDP ranks share the run directory: rank 0 writes it
        return
    path = run_dir / STATUS_FILE
    previous = json.loads(path.read_text()) if path.is_file() else {}
    requeues = previous.get("requeues", [])
    if previous.get("status") == REQUEUED:
        requeues = [*requeues, {k: previous[k] for k in ("signal", "step", "slurm_job") if k in previous}]
    record = {"status": status, "monitor": cfg.task.monitor, "monitor_mode": cfg.task.monitor_mode, **fields}
    if requeues:
        record["requeues"] = requeues
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json(path, record, indent=2)


def record_stop(run_dir: Path, cfg: DictConfig, stop: JobStopped, identity: dict[str, Any]) -> None:
    """A job stopped by a signal: ``requeued`` (SLURM runs it again: this process ends without a
    result, so the launcher waits for the next attempt), else ``cancelled`` or ``timeout``, which
    ``python train.py resume=<run dir>`` continues."""
    outcome = come_back_later(stop, is_global_zero())
    resume = f"python train.py resume={run_dir}"
    write_status(run_dir, cfg, outcome, **stop.record(), resume=resume, **identity)
    if outcome == REQUEUED:
        log.warning("SLURM requeues job %s: the next attempt resumes from %s", stop.slurm_job, stop.checkpoint or "the start")
        raise SystemExit(0)
    log.warning("The job stopped (%s); continue it with: %s", outcome, resume)


def run_job(cfg: DictConfig) -> float | None:
    """``train.py``'s job: a single run fails as one ``error:`` line and exit status 2; a sweep job
    records its failure in ``status.json`` and returns None, so the sweep goes on. A job stopped by a
    signal records how (:func:`record_stop`). ``status.json`` names the code that ran (git commit),
    read as the job starts. A sweep job that finds an earlier attempt in its directory is done,
    resumed or run again (:func:`trident.runs.rerun.continue_job`); a run that a sweep started keeps
    its sweep's W&B group, job type and tag when resumed by its directory."""
    run_dir = Path(cfg.paths.output_dir)
    # When the attempt started: the report's job wall time (Hydra rewrites .hydra/ as a sweep job found done starts).
    identity: dict[str, Any] = {**code_version(), "started": round(time.time(), 3)}
    try:
        if not in_multirun():
            if (sweep := remembered_sweep(run_dir)) is not None:
                name_after_sweep(cfg, *sweep)
                identity.update(sweep=sweep[0], setting=sweep[1])
            # The run directory is rank 0's to clean up after a failure.
            cleanup = (lambda: discard_failed_run_dir(run_dir)) if is_global_zero() else None
            metrics = run_with_clear_errors(lambda: train(cfg), cleanup)
        else:
            done = continue_job(cfg, run_dir)
            if done is not None:
                return objective(cfg, done.get("metrics", {}))
            # A job resumed in its directory keeps its first attempt's sweep and setting: a sweep continued with
            # more swept keys names settings by them all, and the resumed W&B run would change group mid-run.
            if cfg.get("resume") and (sweep := remembered_sweep(run_dir)) is not None:
                name_after_sweep(cfg, *sweep)
                sweep_id, setting = sweep
            else:
                sweep_id, setting = apply_sweep_identity(cfg)
            identity.update(sweep=sweep_id, setting=setting)
            remember_sweep(run_dir, sweep_id, setting)
            metrics = train(cfg)
    except JobStopped as stop:
        record_stop(run_dir, cfg, stop, identity)
        return None
    except Exception as err:  # any failure of one sweep job is recorded, and the sweep goes on
        if not in_multirun():
            raise
        user_error = find_user_error(err)
        if user_error is None:
            log.exception("The job failed")  # the traceback goes to train.log and the console
            message = f"{type(err).__name__}: {err}".splitlines()[0]
        else:
            message = str(user_error)
        print(f"error: {message}", file=sys.stderr)
        write_status(run_dir, cfg, "failed", error=message, **identity)
        return None
    write_status(run_dir, cfg, "completed", metrics=metrics, **stopped_early(cfg, metrics), **identity)
    return objective(cfg, metrics)
