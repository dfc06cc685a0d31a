"""Report on a sweep from its own run directories, without W&B: tables, statistics, plots, per-job results.

``python -m trident.report outputs/multirun/<date>/<time> [--out DIR] [--metric NAME] [--compare METRIC ...]``
writes into the sweep directory (or ``--out``):

- ``report.md``: final metrics per setting (mean, standard deviation and number of seeds); each
  setting against the best one (Welch's t-test and Wellek's equivalence test over every pair of
  settings, each with Holm's correction over the pairs, the difference with its 95 % confidence
  interval, Hedges' g and a verdict; a sweep of the seeds-until-decided loop: the loop's verdicts,
  each with the round that decided it); the jobs early stopping ended (``callbacks=early_stopping``), each
  with its step; the failed jobs;
- ``curves_<metric>.png`` (validation curves per setting, mean and spread over seeds) and
  ``final_<metric>.png`` (final value per setting with error bars);
- ``jobs.csv``: one row per job (setting, seed, final metrics, wall time, git commit), from which
  ``python -m trident.report <dir>/jobs.csv --out DIR`` re-makes the report (without the curves).

A sweep over ``task=`` (e.g. ``experiment=ablation_pos_encoding_tasks``) gets a table with a row per
setting and a column per task, each task judged on its own metric (:mod:`trident.report.cross_task`).

A job's wall time (the ``job_wall_s`` column) is read from its directory: Hydra writes
``.hydra/config.yaml`` as the job starts and trident writes ``status.json`` as it ends, so it covers
data preparation, training, the test and the W&B finish, but not the interpreter's start.

The steps are importable (a notebook uses them; the adaptive-seed loop runs
:mod:`trident.report.sequential`, whose looks are :func:`trident.report.statistics.look`).
"""

import importlib
from typing import Any

from trident.report.command import main

# Public name -> its module, imported on first use: pandas, scipy and matplotlib take seconds, which
# ``trident-report --help`` does not wait for.
_MODULES = {
    "Job": "sweep",
    "Sweep": "sweep",
    "compare_to_best": "statistics",
    "comparison_table": "tables",
    "cross_task_markdown": "cross_task",
    "cross_task_table": "cross_task",
    "hedges_g": "statistics",
    "holm": "statistics",
    "load": "sweep",
    "load_jobs_csv": "sweep",
    "load_sweep": "sweep",
    "markdown_table": "tables",
    "plot_curves": "plots",
    "plot_final": "plots",
    "summarize": "tables",
    "write_jobs_csv": "sweep",
    "write_report": "write",
}

__all__ = list(_MODULES) + ["main"]


def __getattr__(name: str) -> Any:
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULES[name]}"), name)
