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

from trident.report.cross_task import cross_task_markdown, cross_task_table
from trident.report.plots import plot_curves, plot_final
from trident.report.statistics import compare_to_best, hedges_g, holm
from trident.report.sweep import Job, Sweep, load, load_jobs_csv, load_sweep, write_jobs_csv
from trident.report.tables import comparison_table, markdown_table, summarize
from trident.report.write import main, write_report

__all__ = [
    "Job",
    "Sweep",
    "compare_to_best",
    "comparison_table",
    "cross_task_markdown",
    "cross_task_table",
    "hedges_g",
    "holm",
    "load",
    "load_jobs_csv",
    "load_sweep",
    "main",
    "markdown_table",
    "plot_curves",
    "plot_final",
    "summarize",
    "write_jobs_csv",
    "write_report",
]
