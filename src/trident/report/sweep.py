"""A sweep's jobs, read from its run directories or from the ``jobs.csv`` a report writes beside itself.

``jobs.csv`` holds one row per job (completed or not): the job directory's name, its setting and seed,
how it ended, the monitored metric and its mode, every final metric, the wall time and the git commit
of the code that ran it, and how long it trained (its steps, and the FLOPs of one step under a FLOP
budget). It is enough to re-make a report (:func:`load_jobs_csv`), so a report
committed under docs/results/ can be recomputed from the repository.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd
from omegaconf import OmegaConf

from trident.errors import DataError
from trident.runs.sweeps import STATUS_FILE, SWEEP_FILE, job_statuses, read_json, setting_of
from trident.weights.run_config import RUN_CONFIG

# The final metrics a report compares: the best validation value, the test metrics and the harness tasks' at the end of
# training (callbacks=harness, trident.runs.harness_callback).
FINAL_PREFIXES = ("best/", "test/", "harness/")
# The column of a job's wall time, in seconds.
WALL_TIME = "job_wall_s"
JOBS_FILE = "jobs.csv"
# jobs.csv: these columns first, then one column per final metric (sorted), then WALL_TIME, the training
# length and the code's version.
JOB_COLUMNS = ("job", "setting", "seed", "status", "error", "monitor", "monitor_mode")
# trainer.max_steps as the job ran (a FLOP budget sets it) and budget.flops_per_step (empty without a budget),
# from the job's config_resolved.yaml: an equal-compute comparison can be checked from jobs.csv alone.
LENGTH_COLUMNS = ("max_steps", "flops_per_step")
CODE_COLUMNS = ("git_commit", "git_dirty")


@dataclass
class Job:
    """One job of a sweep: its setting (swept overrides without the seed), how it ended, its final
    metrics (``status.json``) and its metric history (``metrics.jsonl``, one dict per row)."""

    dir: Path
    setting: str
    status: str
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    history: list[dict[str, float | int | str]] = field(default_factory=list)
    wall_s: float = math.nan
    seed: int | None = None
    monitor: str | None = None
    monitor_mode: str = "min"
    code: dict[str, Any] = field(default_factory=dict)
    length: dict[str, float] = field(default_factory=dict)


@dataclass
class Sweep:
    dir: Path
    name: str
    jobs: list[Job]
    monitor: str | None = None
    monitor_mode: str = "min"
    # The jobs.csv the sweep was read from (None: read from its run directories).
    jobs_csv: Path | None = None

    @property
    def completed(self) -> list[Job]:
        return [job for job in self.jobs if job.status == "completed"]

    @property
    def failed(self) -> list[Job]:
        return [job for job in self.jobs if job.status != "completed"]

    @property
    def settings(self) -> list[str]:
        """Every setting, in job order (the order of the sweep's values, e.g. h = 1, 2, 4, 8, 16)."""
        return list(dict.fromkeys(job.setting for job in self.jobs))


def _read_history(path: Path) -> list[dict[str, float | int | str]]:
    """A job's ``metrics.jsonl`` as one training, each (stage, step) once (the last row of it). A job
    directory holds one training (trident.runs.rerun, trident.runs.attempts); a file that an earlier
    version of trident wrote two trainings into reads as the newest (from the last row at the first
    row's step and stage), never as the mean of two."""
    if not path.is_file():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    first = (lines[0].get("stage"), lines[0].get("step")) if lines else None
    rows: dict[tuple[Any, Any], dict[str, float | int | str]] = {}
    for row in lines:
        key = (row.get("stage"), row.get("step"))
        if key == first:
            rows.clear()  # another training starts here
        rows.pop(key, None)  # a step an interrupted attempt logged past its checkpoint: the resumed one's row
        rows[key] = row
    return list(rows.values())


def _wall_time(job_dir: Path, record: dict[str, Any]) -> float:
    """Seconds from the start of the job's last attempt (``started`` in ``status.json``; from jobs of earlier
    versions, Hydra's ``.hydra/config.yaml``) to its end (``status.json``)."""
    start, end = job_dir / ".hydra" / "config.yaml", job_dir / STATUS_FILE
    if not end.is_file() or ("started" not in record and not start.is_file()):
        return math.nan
    return end.stat().st_mtime - float(record.get("started") or start.stat().st_mtime)


def _training_length(job_dir: Path) -> dict[str, float]:
    """The LENGTH_COLUMNS of a job, from the config it ran with (empty before it wrote one)."""
    config_file = job_dir / RUN_CONFIG
    if not config_file.is_file():
        return {}
    config = OmegaConf.load(config_file)
    values = {"max_steps": OmegaConf.select(config, "trainer.max_steps"),
              "flops_per_step": OmegaConf.select(config, "budget.flops_per_step")}
    # max_steps -1: the job trained by epochs (trainer.max_epochs), a length in steps it never knew.
    return {key: float(value) for key, value in values.items() if value is not None and value != -1}


def _seed(job_dir: Path) -> int | None:
    config = job_dir / ".hydra" / "config.yaml"
    return OmegaConf.load(config).get("seed") if config.is_file() else None


def load_sweep(sweep_dir: str | Path) -> Sweep:
    """Read every job directory of a multirun (``hydra.sweep.dir``)."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise DataError(f"{sweep_dir} is not a directory: give a sweep directory (outputs/multirun/<date>/<time>)")
    statuses = job_statuses(sweep_dir)
    if not statuses:
        raise DataError(f"{sweep_dir} holds no job directories: give the directory of a `train.py -m` sweep")
    sweep_record = read_json(sweep_dir / SWEEP_FILE)
    swept = sweep_record["swept"] if sweep_record else None
    jobs = []
    for status in statuses:
        overrides = OmegaConf.to_container(OmegaConf.load(status.dir / ".hydra" / "overrides.yaml"))
        record = status.record
        jobs.append(
            Job(
                dir=status.dir,
                setting=setting_of(overrides, swept) or "(all)",  # type: ignore[arg-type]
                status=status.status,
                error=status.error,
                metrics=record.get("metrics", {}),
                history=_read_history(status.dir / "metrics.jsonl"),
                wall_s=_wall_time(status.dir, record),
                seed=_seed(status.dir),
                monitor=record.get("monitor"),
                monitor_mode=record.get("monitor_mode", "min"),
                code={key: record[key] for key in CODE_COLUMNS if key in record},
                length=_training_length(status.dir),
            )
        )
    records = [s.record for s in statuses if s.record]
    name = next((r["sweep"] for r in records if "sweep" in r), sweep_dir.name)
    return _sweep(sweep_dir, name, jobs)


def _sweep(sweep_dir: Path, name: str, jobs: list[Job]) -> Sweep:
    """The sweep's monitor: that of its first job that names one."""
    first = next((job for job in jobs if job.monitor), None)
    return Sweep(dir=sweep_dir, name=name, jobs=jobs, monitor=first and first.monitor,
                 monitor_mode=first.monitor_mode if first else "min")


def final_metrics(sweep: Sweep) -> list[str]:
    """The metrics worth a column: best validation value first, then the test metrics."""
    keys = {k for job in sweep.completed for k in job.metrics if k.startswith(FINAL_PREFIXES)}
    return sorted(keys, key=lambda k: (not k.startswith("best/"), k))


def better_is(sweep: Sweep, metric: str) -> str:
    """``"min"`` or ``"max"``: the monitor's mode for the monitored metric (and its ``best/`` value);
    otherwise lower is better for a loss, a perplexity or a preference objective's rejected answers (DPO's
    ``rewards/rejected``, ``logps/rejected``) and higher for anything else (BLEU, accuracy, ``rewards/margins``)."""
    if sweep.monitor and metric in (sweep.monitor, f"best/{sweep.monitor}"):
        return sweep.monitor_mode
    return "min" if re.search(r"loss|ppl|perplexity|/rejected$", metric) else "max"


def jobs_frame(sweep: Sweep) -> pd.DataFrame:
    """One row per job, the columns of ``jobs.csv``; a metric a job did not record is empty."""
    metrics = sorted({key for job in sweep.jobs for key in job.metrics})
    rows = [
        {"job": job.dir.name, "setting": job.setting, "seed": job.seed, "status": job.status, "error": job.error,
         "monitor": job.monitor, "monitor_mode": job.monitor_mode,
         **{m: job.metrics.get(m, math.nan) for m in metrics}, WALL_TIME: job.wall_s,
         **{key: job.length.get(key, math.nan) for key in LENGTH_COLUMNS},
         **{key: job.code.get(key) for key in CODE_COLUMNS}}
        for job in sweep.jobs
    ]
    return pd.DataFrame(rows, columns=[*JOB_COLUMNS, *metrics, WALL_TIME, *LENGTH_COLUMNS, *CODE_COLUMNS])


def write_jobs_csv(sweep: Sweep, path: Path) -> None:
    """Write :func:`jobs_frame` with every digit of each float, so a re-made report is the same."""
    jobs_frame(sweep).to_csv(path, index=False, float_format="%.17g")


def load_jobs_csv(path: str | Path) -> Sweep:
    """A sweep from its ``jobs.csv`` alone: settings, seeds, final metrics and wall times (no curves)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path} does not exist: give a report's {JOBS_FILE} or a sweep directory")
    try:
        frame = pd.read_csv(path, keep_default_na=False, na_values=[""], dtype={"setting": str, "job": str, "error": str})
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as err:
        raise DataError(f"{path} is not a readable CSV ({err}): re-make it with `python -m trident.report <sweep dir>`") from err
    missing = [c for c in (*JOB_COLUMNS, WALL_TIME) if c not in frame.columns]
    if missing or frame.empty:
        problem = f"lacks the column(s) {', '.join(missing)}" if missing else "has no jobs"
        raise DataError(f"{path} {problem}: re-make it with `python -m trident.report <sweep dir>`")
    metrics = [c for c in frame.columns if c not in (*JOB_COLUMNS, WALL_TIME, *LENGTH_COLUMNS, *CODE_COLUMNS)]
    jobs = [
        Job(dir=Path(row["job"]), setting=row["setting"], status=row["status"],
            error=None if pd.isna(row["error"]) else row["error"],
            metrics={m: float(row[m]) for m in metrics if not pd.isna(row[m])},
            wall_s=float(row[WALL_TIME]), seed=None if pd.isna(row["seed"]) else int(row["seed"]),
            monitor=None if pd.isna(row["monitor"]) else row["monitor"], monitor_mode=row["monitor_mode"],
            code={key: row[key] for key in CODE_COLUMNS if key in frame.columns and not pd.isna(row[key])},
            length={key: float(row[key]) for key in LENGTH_COLUMNS if key in frame.columns and not pd.isna(row[key])})
        for _, row in frame.iterrows()
    ]
    return replace(_sweep(path.parent, path.parent.name, jobs), jobs_csv=path)


def load(source: str | Path) -> Sweep:
    """A sweep directory, or the ``jobs.csv`` of a report."""
    source = Path(source)
    return load_jobs_csv(source) if source.suffix == ".csv" else load_sweep(source)
