"""``report.md``, its plots and ``jobs.csv`` for one sweep (the command: :mod:`trident.report.command`)."""

from __future__ import annotations

import re
import shutil
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from trident.errors import DataError
from trident.report.cross_task import cross_task_markdown, cross_task_table, task_metric, task_sweeps
from trident.report.plots import plot_curves, plot_final
from trident.report.sequential import ADAPTIVE_FILE, read_record
from trident.report.statistics import compare_to_best
from trident.report.sweep import JOBS_FILE, Job, Sweep, final_metrics, write_jobs_csv
from trident.report.tables import comparison_heading, comparison_table, markdown_table, summarize
from trident.runs.budget import comparison_basis
from trident.runs.sweeps import STOPPED_EARLY_STEP


def _file_stem(metric: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", metric).strip("_")


def _wall_time_line(sweep: Sweep) -> list[str]:
    times = pd.Series([job.wall_s for job in sweep.completed]).dropna()
    if times.empty:
        return []
    spread = f"mean {times.mean():.0f} s (min {times.min():.0f} s, max {times.max():.0f} s)"
    return [f"Wall time of a completed job: {spread}; {times.sum() / 60:.1f} min for all of them.", ""]


def _length_line(sweep: Sweep) -> list[str]:
    """Under a FLOP budget, each setting's steps and model FLOPs (steps x FLOPs per step), from the
    jobs' training lengths: the equal compute of the comparison, checkable from jobs.csv."""
    lengths: dict[str, set[tuple[float, float]]] = {}
    for job in sweep.completed:
        if "flops_per_step" in job.length and "max_steps" in job.length:
            lengths.setdefault(job.setting, set()).add((job.length["max_steps"], job.length["flops_per_step"]))
    if not lengths:
        return []
    cells = [f"`{setting}` " + ", ".join(f"{steps:.0f} x {per_step:.4g} = {steps * per_step:.4g}" for steps, per_step in sorted(pairs))
             for setting, pairs in lengths.items()]
    return ["Steps x FLOPs per step = model FLOPs of each setting's jobs: " + "; ".join(cells) + ".", ""]


def _stopped_early(sweep: Sweep) -> list[Job]:
    """The completed jobs that early stopping ended (``callbacks=early_stopping``): shorter than their setting's steps."""
    return [job for job in sweep.completed if STOPPED_EARLY_STEP in job.metrics]


def _stopped_early_section(sweep: Sweep) -> list[str]:
    lines = []
    for job in _stopped_early(sweep):
        steps = f" of {job.length['max_steps']:.0f}" if "max_steps" in job.length else ""
        lines.append(f"- `{job.dir.name}` ({job.setting}): stopped early at step {job.metrics[STOPPED_EARLY_STEP]:.0f}{steps}")
    return ["## Stopped early", "", *lines, ""] if lines else []


def _comparison_section(sweep: Sweep, metric: str, title: str) -> list[str]:
    """The loop's verdicts when ``adaptive.json`` says it decided on ``metric``, else one look at alpha."""
    record = read_record(sweep, metric)
    comparison = record.frame() if record else compare_to_best(sweep, metric)
    return [f"## {title}", "", comparison_heading(comparison), "", comparison_table(comparison, metric), ""]


def _cross_task_sections(sweep: Sweep) -> list[str]:
    """The table across the tasks, then each task's comparisons (the family of its Holm correction)."""
    lines = ["## Across the tasks (each task's own metric, mean ± std over seeds; verdict against that task's best)",
             "", cross_task_markdown(cross_task_table(sweep)), ""]
    for task, part in task_sweeps(sweep).items():
        metric = task_metric(part)
        if len(part.settings) > 1:
            lines += _comparison_section(part, metric, f"task={task}, {metric}: each setting against the best")
    return lines


def _plots(sweep: Sweep, summary: pd.DataFrame, metric: str, out_dir: Path) -> tuple[list[str], str | None]:
    """The curve and final-value plots; returns their markdown lines and the plotted final metric."""
    lines = []
    if any(metric in row for job in sweep.completed for row in job.history):
        curve_file = out_dir / f"curves_{_file_stem(metric)}.png"
        plot_curves(sweep, metric).savefig(curve_file, dpi=120)
        lines += [f"![{metric} curves]({curve_file.name})", ""]
    final = f"best/{metric}" if (f"best/{metric}", "mean") in summary.columns else metric
    if (final, "mean") not in summary.columns:
        return lines, None
    final_file = out_dir / f"final_{_file_stem(final)}.png"
    plot_final(summary, final, title=f"{sweep.name}\n{final} (mean ± std over seeds)").savefig(final_file, dpi=120)
    return [*lines, f"![{final} per setting]({final_file.name})", ""], final


def write_report(
    sweep: Sweep, out_dir: Path | None = None, metric: str | None = None, compare: Sequence[str] = ()
) -> Path:
    """Write ``report.md``, its PNG plots and ``jobs.csv`` into ``out_dir`` (default: the sweep directory).

    ``metric`` is the one plotted (default: the monitored metric, e.g. ``val/loss``; its best value
    ``best/<metric>`` in the final-value plot). ``compare``: the metrics of ``status.json`` whose
    settings are tested against the best one (default: the plotted final metric), e.g. ``val/loss``,
    the last validation value; each also gets a column. A sweep over ``task=`` gets a table across
    the tasks instead, each task judged on its own metric. Returns the path of ``report.md``."""
    out_dir = Path(out_dir or sweep.dir)
    recorded = sorted({key for job in sweep.completed for key in job.metrics})
    unknown = [m for m in compare if m not in recorded]
    if unknown:
        known = ", ".join(recorded) or "none (no job completed)"
        raise DataError(f"--compare {' '.join(unknown)}: no job of {sweep.dir} recorded it; choose among {known}")
    out_dir.mkdir(parents=True, exist_ok=True)
    finals = final_metrics(sweep)
    summary = summarize(sweep, [*finals, *(m for m in compare if m not in finals)])
    stopped = f" ({len(_stopped_early(sweep))} stopped early)" if _stopped_early(sweep) else ""
    lines = [
        f"# Sweep `{sweep.name}`",
        "",
        (f"`{sweep.dir}`: {len(sweep.jobs)} jobs, {len(sweep.completed)} completed{stopped}, {len(sweep.failed)} failed; "
         f"each job's results: [{JOBS_FILE}]({JOBS_FILE})."),
        "",
        *([basis, ""] if (basis := comparison_basis([job.dir for job in sweep.jobs])) else []),
        *_length_line(sweep),
        *_wall_time_line(sweep),
        "## Final metrics (mean ± std over seeds; n = completed seeds)",
        "",
        markdown_table(summary) if len(summary) else "No job completed.",
        "",
    ]
    if task_sweeps(sweep):
        lines += _cross_task_sections(sweep)
    else:
        plot_lines, final = _plots(sweep, summary, metric or sweep.monitor or "val/loss", out_dir)
        lines += plot_lines
        compared = list(compare) or ([final] if final else [])
        for tested in compared if len(summary) > 1 else []:
            lines += _comparison_section(sweep, tested, f"{tested}: each setting against the best")
    lines += _stopped_early_section(sweep)
    lines += ["## Failed jobs", ""]
    lines += [f"- `{job.dir.name}` ({job.status}): {job.error}" for job in sweep.failed] or ["None."]
    jobs_csv = out_dir / JOBS_FILE
    if sweep.jobs_csv is None or sweep.jobs_csv.resolve() != jobs_csv.resolve():  # re-made from it: kept
        write_jobs_csv(sweep, jobs_csv)
    record = sweep.dir / ADAPTIVE_FILE
    if record.is_file() and record.resolve() != (out_dir / ADAPTIVE_FILE).resolve():  # a re-made report keeps it
        shutil.copyfile(record, out_dir / ADAPTIVE_FILE)
    report = out_dir / "report.md"
    report.write_text("\n".join(lines) + "\n")
    return report

