"""One ``train.py`` job: a single run stops on a user error; a sweep job records how it ended.

Each job writes ``<run dir>/status.json``: ``completed`` with its final metrics, or ``failed`` with
the error line (sweep jobs only; a single run keeps failing as one ``error:`` line and exit status 2).
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from trident.cli import find_user_error, run_with_clear_errors
from trident.distributed import is_global_zero
from trident.pipeline import train
from trident.sweeps import STATUS_FILE, apply_sweep_identity, in_multirun

log = logging.getLogger(__name__)


def objective(cfg: DictConfig, metrics: Mapping[str, float]) -> float | None:
    """What a sweeper optimises: the best value of the monitored metric, else its last value."""
    value = metrics.get(f"best/{cfg.task.monitor}", metrics.get(cfg.task.monitor))
    return None if value is None else float(value)


def write_status(run_dir: Path, cfg: DictConfig, status: str, **fields: Any) -> None:
    if not is_global_zero():  # DDP ranks share the run directory: rank 0 writes it
        return
    record = {"status": status, "monitor": cfg.task.monitor, "monitor_mode": cfg.task.monitor_mode, **fields}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / STATUS_FILE).write_text(json.dumps(record, indent=2) + "\n")


def run_job(cfg: DictConfig) -> float | None:
    """``train.py``'s job: a single run fails as one ``error:`` line and exit status 2; a sweep job
    records its failure in ``status.json`` and returns None, so the sweep goes on."""
    run_dir = Path(cfg.paths.output_dir)
    if not in_multirun():
        # The run directory is rank 0's to clean up after a failure.
        metrics = run_with_clear_errors(lambda: train(cfg), run_dir=run_dir if is_global_zero() else None)
        write_status(run_dir, cfg, "completed", metrics=metrics)
        return objective(cfg, metrics)
    identity: dict[str, str] = {}
    try:
        sweep_id, setting = apply_sweep_identity(cfg)
        identity = {"sweep": sweep_id, "setting": setting}
        metrics = train(cfg)
    except Exception as err:  # any failure of one job is recorded, and the sweep goes on
        user_error = find_user_error(err)
        if user_error is None:
            log.exception("The job failed")  # the traceback goes to train.log and the console
            message = f"{type(err).__name__}: {err}".splitlines()[0]
        else:
            message = str(user_error)
        print(f"error: {message}", file=sys.stderr)
        write_status(run_dir, cfg, "failed", error=message, **identity)
        return None
    write_status(run_dir, cfg, "completed", metrics=metrics, **identity)
    return objective(cfg, metrics)
