"""Sweeps (Hydra multiruns): what each job swept, its W&B identity, and the failed jobs at the end.

Files a sweep leaves behind (read back by :mod:`trident.report`; light imports, no torch):

- ``<sweep dir>/sweep.json``: when the sweep started (a sweep continued in its directory keeps it),
  which keys it sweeps (those of every call into the directory) and the number of this call's first new
  job, written by :class:`SweepCallback` before the first job (``conf/hydra/default.yaml`` registers it);
- ``<sweep dir>/<num>_<run name>/``: a job's directory (``hydra.sweep.subdir``, :func:`job_subdir`): a
  job identical to one already there (same overrides) runs in that job's directory
  (:mod:`trident.runs.rerun` decides: done, resumed or run again); a new one is numbered after the jobs
  there, so a sweep continued with new values never writes into an earlier job's directory;
- ``<job dir>/status.json``: ``completed`` with the final metrics, ``failed`` with the error line,
  or ``cancelled`` / ``timeout`` for a job a signal stopped (written by :func:`trident.runs.jobs.run_job`,
  so a failed job does not stop the sweep).

In a sweep the W&B group is ``<group>-<start time>/<setting>``, where the setting is the job's swept
overrides without ``seed``: the seeds of one setting share a group, and the sweep id
``<group>-<start time>`` is the run's ``job_type`` and one of its tags, so a whole sweep filters together.
The job's ``run.json`` keeps its sweep id and setting, so an attempt that resumes it by its directory
(``python train.py resume=<job dir>``, no longer a multirun) joins the same group.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from trident.errors import ConfigError

SWEEP_FILE = "sweep.json"
STATUS_FILE = "status.json"
# A run that early stopping ended (callbacks=early_stopping) has these final metrics: the step it stopped at
# and the best value of the metric it monitored (trident.training.callbacks.StopEarly).
STOPPED_EARLY_STEP = "stopped_early/step"
STOPPED_EARLY_BEST = "stopped_early/best"
# Jobs of one setting differ only by these keys, so they aggregate into one W&B group and report row.
REPEAT_KEYS = ("seed",)


def swept_keys(command_line: Iterable[str], sweeper_params: Mapping[str, Any] | None) -> list[str]:
    """Keys that take several values in a sweep: the sweeper's ``hydra.sweeper.params`` (which
    experiments and Optuna searches set), then ``key=a,b`` style command-line arguments."""
    parsed = OverridesParser.create().parse_overrides(list(command_line))
    keys = [str(k) for k in (sweeper_params or {})]
    return keys + [o.key_or_group for o in parsed if o.is_sweep_override() and o.key_or_group not in keys]


def setting_of(job_overrides: Iterable[str], swept: Iterable[str] | None) -> str:
    """The job's swept overrides, as written, without the repeat keys: e.g. ``model.n_heads=8``.
    With ``swept`` None (not known), every override but the repeat keys."""
    chosen = set(swept) if swept is not None else None
    parsed = OverridesParser.create().parse_overrides(list(job_overrides))
    return ",".join(
        o.input_line
        for o in parsed
        if (chosen is None or o.key_or_group in chosen) and o.key_or_group not in REPEAT_KEYS
    )


def read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


class SacctNotice(logging.Filter):
    """submitit follows SLURM jobs with ``sacct``, which fails on a cluster without accounting
    (no slurmdbd) and then warns at every poll: say it once, with what it means."""

    def __init__(self) -> None:
        super().__init__()
        self.said = False

    def filter(self, record: logging.LogRecord) -> bool:
        if "Bypassing sacct error" not in record.getMessage():
            return True
        if self.said:
            return False
        self.said = True
        record.msg, record.args = (
            "sacct does not answer (SLURM without accounting): submitit follows the jobs by the result files "
            "they write, which works, but a job killed without writing one (SIGKILL, node failure) keeps the "
            "sweep waiting; further sacct warnings are not shown"
        ), ()
        return True


def discard_refused_sweep(sweep_dir: Path) -> None:
    """Remove the directory of a sweep refused before its first job: it holds only ``sweep.json``."""
    if sweep_dir.is_dir() and {p.name for p in sweep_dir.iterdir()} <= {SWEEP_FILE}:
        shutil.rmtree(sweep_dir)


class SweepCallback(Callback):
    """Writes ``sweep.json`` when a multirun starts; when it ends, prints the failed jobs and exits
    with status 1 if there are any (after every job has run)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        logging.getLogger("submitit").addFilter(SacctNotice())
        sweep_dir = Path(config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        params = config.hydra.sweeper.get("params")
        swept = swept_keys(list(config.hydra.overrides.task), dict(params) if params else None)
        # A sweep continued in its directory (new values, more seeds: trident.report.adaptive adds
        # them job by job) keeps its start time, so its jobs stay one sweep in W&B, and sweeps the keys
        # of every call, so that each job's setting names what varies across the directory.
        earlier = read_json(sweep_dir / SWEEP_FILE) or {}
        record = {"started": earlier.get("started") or datetime.now().strftime("%Y-%m-%d_%H-%M-%S"),
                  "swept": [*earlier.get("swept", []), *(k for k in swept if k not in earlier.get("swept", []))],
                  "first_job": next_job_number(sweep_dir)}
        (sweep_dir / SWEEP_FILE).write_text(json.dumps(record, indent=2) + "\n")

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        jobs = job_statuses(sweep_dir)
        failed = [job for job in jobs if job.status != "completed"]
        if not failed:
            print(f"All {len(jobs)} jobs of the sweep completed: {sweep_dir}", file=sys.stderr)
            return
        ended = "failed" if all(job.status == "failed" for job in failed) else "did not complete"
        print(f"error: {len(failed)} of {len(jobs)} jobs {ended} in {sweep_dir}:", file=sys.stderr)
        for job in failed:
            print(f"  {job.dir.name}: {job.error}", file=sys.stderr)
        sys.exit(1)


@dataclass
class JobStatus:
    """One job directory of a sweep and how the job ended (``completed``, ``failed``, ``cancelled``,
    ``timeout``, ``unfinished``)."""

    dir: Path
    status: str
    error: str | None
    record: dict[str, Any]


def job_dirs(sweep_dir: Path) -> list[Path]:
    """The sweep's job directories (those Hydra wrote a ``.hydra/`` into), in job order."""
    dirs = [d for d in Path(sweep_dir).iterdir() if (d / ".hydra").is_dir()]
    return sorted(dirs, key=_job_number)


def _job_number(job_dir: Path) -> tuple[int, str]:
    """Sort key: ``hydra.sweep.subdir`` starts with the job number (``<num>_<run name>``)."""
    number = job_dir.name.split("_", 1)[0]
    return (int(number) if number.isdigit() else -1, job_dir.name)


def next_job_number(sweep_dir: Path) -> int:
    """One more than the highest job number in the sweep directory (``<num>_<run name>``)."""
    numbers = [_job_number(d)[0] for d in job_dirs(sweep_dir)] if sweep_dir.is_dir() else []
    return max((n for n in numbers if n >= 0), default=-1) + 1


def job_key(overrides: Iterable[str]) -> tuple[str, ...]:
    """What makes two jobs the same training: their overrides, in any order, but ``resume=`` (an attempt
    resuming a job by its directory adds it to the job's saved overrides) and Hydra's own."""
    def counts(override: str) -> bool:
        key = override.lstrip("+~").partition("=")[0]
        return key != "resume" and not key.startswith(("hydra.", "hydra/"))

    return tuple(sorted(o for o in overrides if counts(o)))


def job_subdir(sweep_dir: str, num: int, run_name: str, overrides: Iterable[str]) -> str:
    """``hydra.sweep.subdir`` (resolver ``trident.job_subdir``): the directory of the job with these
    ``overrides`` if the sweep directory holds one, else ``<n>_<run name>``, ``n`` counting on from the
    jobs that were there when this call started (``first_job`` of ``sweep.json``) by ``hydra.job.num``
    (not by the directories at hand: a parallel launcher's jobs start together)."""
    directory = Path(sweep_dir)
    wanted = job_key(str(o) for o in overrides)
    if directory.is_dir():
        for job_dir in job_dirs(directory):
            saved = job_dir / ".hydra" / "overrides.yaml"
            if saved.is_file() and job_key(str(o) for o in OmegaConf.load(saved)) == wanted:
                return job_dir.name
    first = (read_json(directory / SWEEP_FILE) or {}).get("first_job", 0)
    return f"{first + int(num)}_{run_name}"


def job_statuses(sweep_dir: Path) -> list[JobStatus]:
    statuses = []
    for job_dir in job_dirs(sweep_dir):
        record = read_json(job_dir / STATUS_FILE)
        if record is None:  # killed, or still running: no status was written
            statuses.append(JobStatus(job_dir, "unfinished", "no status.json: the job did not finish", {}))
        else:
            error = record.get("error")
            if "signal" in record:  # stopped by a signal (cancelled, timeout): resumable
                error = f"{record['status']} by {record['signal']} at step {record['step']}: continue with {record['resume']}"
            statuses.append(JobStatus(job_dir, record["status"], error, record))
    return statuses


def in_multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def sweep_identity() -> tuple[str, str]:
    """(start time of the sweep, this job's setting), from ``sweep.json`` and the job's overrides."""
    hydra_cfg = HydraConfig.get()
    sweep_file = Path(hydra_cfg.sweep.dir) / SWEEP_FILE
    record = read_json(sweep_file)
    if record is None:
        raise ConfigError(
            f"{sweep_file} is missing: keep hydra.callbacks.sweep (conf/hydra/default.yaml), which writes it"
        )
    return record["started"], setting_of(list(hydra_cfg.overrides.task), record["swept"])


def apply_sweep_identity(cfg: DictConfig) -> tuple[str, str]:
    """Name the job's W&B run after its sweep (:func:`name_after_sweep`). Returns (sweep id, setting)."""
    started, setting = sweep_identity()
    sweep_id = f"{cfg.group}-{started}"
    name_after_sweep(cfg, sweep_id, setting)
    return sweep_id, setting


def name_after_sweep(cfg: DictConfig, sweep_id: str, setting: str) -> None:
    """Group ``<sweep id>/<setting>``, the sweep id as job type and tag."""
    with open_dict(cfg):
        cfg.group = f"{sweep_id}/{setting}" if setting else sweep_id
        cfg.tags = [*cfg.tags, sweep_id]
        if cfg.get("logger") and cfg.logger.get("wandb"):
            cfg.logger.wandb.job_type = sweep_id
