"""One axis across the tasks: a sweep over ``task=`` and an axis (e.g. positional encoding) as one table.

Rows: the axis's settings; columns: the tasks. A cell is the task's own final metric (the best value of
its monitored metric: validation loss for lm and mlm, BLEU for translation, accuracy for vit), mean ± std
over the seeds, and its verdict against that task's best setting (:func:`compare_to_best`, Holm's family:
the pairs of that task's settings). A setting a task refuses (the preset excludes it from the sweep) is "not run".
"""

from __future__ import annotations

import re
from dataclasses import replace

import pandas as pd

from trident.report.statistics import compare_to_best, seed_values
from trident.report.sweep import Job, Sweep
from trident.report.tables import mean_std

TASK_KEY = "task"
# A setting joins its overrides with commas: split where the next override's key starts.
_NEXT_OVERRIDE = re.compile(r",(?=[\w.+~/@-]+=)")


def split_setting(setting: str) -> dict[str, str]:
    """``"task=lm,pos_encoding=rope"`` -> ``{"task": "lm", "pos_encoding": "rope"}``."""
    return dict(part.split("=", 1) for part in _NEXT_OVERRIDE.split(setting) if "=" in part)


def _without_task(setting: str) -> str:
    return ",".join(f"{k}={v}" for k, v in split_setting(setting).items() if k != TASK_KEY) or "(all)"


def task_sweeps(sweep: Sweep) -> dict[str, Sweep]:
    """The sweep split by task, each job's setting without its ``task=`` part; empty unless the sweep
    swept ``task`` over two tasks or more."""
    tasks = [split_setting(setting).get(TASK_KEY) for setting in sweep.settings]
    if None in tasks or len(set(tasks)) < 2:
        return {}
    parts: dict[str, list[Job]] = {str(task): [] for task in tasks}
    for job in sweep.jobs:
        parts[split_setting(job.setting)[TASK_KEY]].append(replace(job, setting=_without_task(job.setting)))
    return {
        task: Sweep(dir=sweep.dir, name=f"{sweep.name} {TASK_KEY}={task}", jobs=jobs,
                    monitor=next((j.monitor for j in jobs if j.monitor), None),
                    monitor_mode=next((j.monitor_mode for j in jobs if j.monitor), "min"))
        for task, jobs in parts.items()
    }


def task_metric(sweep: Sweep) -> str:
    """A task's own metric: the best value of its monitored metric, else the metric itself."""
    monitor = sweep.monitor or "val/loss"
    recorded = {key for job in sweep.completed for key in job.metrics}
    return f"best/{monitor}" if f"best/{monitor}" in recorded else monitor


def cross_task_table(sweep: Sweep) -> pd.DataFrame:
    """Rows: the axis's settings in sweep order; columns: ``(task, field)`` with the fields ``metric``,
    ``n``, ``mean``, ``std`` and ``verdict`` (NaN / empty where the task did not run the setting)."""
    parts = task_sweeps(sweep)
    rows = list(dict.fromkeys(setting for part in parts.values() for setting in part.settings))
    columns = pd.MultiIndex.from_product([list(parts), ["metric", "n", "mean", "std", "verdict"]])
    table = pd.DataFrame(index=pd.Index(rows, name="setting"), columns=columns, dtype=object)
    for task, part in parts.items():
        metric = task_metric(part)
        comparison = compare_to_best(part, metric)
        for setting, values in seed_values(part, metric).items():
            series = pd.Series(values)
            table.loc[setting, task] = [metric, len(values), series.mean(), series.std(),
                                        comparison.loc[setting, "verdict"]]
    return table


def cross_task_markdown(table: pd.DataFrame) -> str:
    """The table as markdown: ``mean ± std (verdict)`` per cell; the metric of each task in its header."""
    tasks = list(dict.fromkeys(task for task, _ in table.columns))
    headers = [f"{task}: `{table[(task, 'metric')].dropna().iloc[0]}`" if table[(task, "metric")].notna().any()
               else task for task in tasks]
    lines = ["| setting | " + " | ".join(headers) + " |", "| --- |" + " --- |" * len(tasks)]
    for setting, row in table.iterrows():
        cells = []
        for task in tasks:
            if pd.isna(row[(task, "n")]):
                cells.append("not run")
                continue
            verdict = row[(task, "verdict")]
            seeds = f"n = {int(row[(task, 'n')])}"
            cells.append(f"{mean_std(row[(task, 'mean')], row[(task, 'std')])} ({verdict}, {seeds})")
        lines.append(f"| `{setting}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)
