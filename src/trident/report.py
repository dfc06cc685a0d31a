"""Report on a sweep from its own run directories, without W&B: a table, plots and the failed jobs.

``python -m trident.report outputs/multirun/<date>/<time> [--out DIR] [--metric NAME]`` writes
``report.md`` (final metrics per setting: mean, standard deviation and number of seeds; the failed
jobs), ``curves_<metric>.png`` (validation curves per setting, mean and spread over seeds) and
``final_<metric>.png`` (final value per setting with error bars) into the sweep directory.

The same steps are importable (a notebook uses them): :func:`load_sweep`, :func:`summarize`,
:func:`markdown_table`, :func:`plot_curves`, :func:`plot_final`, :func:`write_report`.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure
from omegaconf import OmegaConf

from trident.errors import DataError, run_with_clear_errors
from trident.runs.sweeps import SWEEP_FILE, job_statuses, read_json, setting_of

# The final metrics a report compares: the best validation value and the test metrics.
FINAL_PREFIXES = ("best/", "test/")


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


@dataclass
class Sweep:
    dir: Path
    name: str
    jobs: list[Job]
    monitor: str | None = None

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
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


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
        jobs.append(
            Job(
                dir=status.dir,
                setting=setting_of(overrides, swept) or "(all)",  # type: ignore[arg-type]
                status=status.status,
                error=status.error,
                metrics=status.record.get("metrics", {}),
                history=_read_history(status.dir / "metrics.jsonl"),
            )
        )
    records = [s.record for s in statuses if s.record]
    name = next((r["sweep"] for r in records if "sweep" in r), sweep_dir.name)
    monitor = next((r["monitor"] for r in records if "monitor" in r), None)
    return Sweep(dir=sweep_dir, name=name, jobs=jobs, monitor=monitor)


def final_metrics(sweep: Sweep) -> list[str]:
    """The metrics worth a column: best validation value first, then the test metrics."""
    keys = {k for job in sweep.completed for k in job.metrics if k.startswith(FINAL_PREFIXES)}
    return sorted(keys, key=lambda k: (not k.startswith("best/"), k))


def summarize(sweep: Sweep, metrics: Sequence[str] | None = None) -> pd.DataFrame:
    """Mean, standard deviation and count over the completed jobs of each setting.

    Rows: settings in sweep order; columns: ``n`` then ``(<metric>, "mean")`` and ``(<metric>, "std")``
    (std is NaN for a single seed)."""
    metrics = list(metrics or final_metrics(sweep))
    rows = [{"setting": job.setting, **{m: job.metrics.get(m, math.nan) for m in metrics}} for job in sweep.completed]
    frame = pd.DataFrame(rows, columns=["setting", *metrics])
    grouped = frame.groupby("setting", sort=False)
    summary = grouped[metrics].agg(["mean", "std"]) if metrics else pd.DataFrame(index=grouped.size().index)
    summary.insert(0, ("n", ""), grouped.size())
    order = [s for s in sweep.settings if s in summary.index]
    return summary.loc[order]


def _mean_std(mean: float, std: float) -> str:
    if math.isnan(mean):
        return "-"
    return f"{mean:.4g}" if math.isnan(std) else f"{mean:.4g} ± {std:.2g}"


def markdown_table(summary: pd.DataFrame) -> str:
    """The summary as a markdown table, ``mean ± std`` per cell."""
    metrics = list(dict.fromkeys(column[0] for column in summary.columns if column[0] != "n"))
    lines = ["| setting | n | " + " | ".join(metrics) + " |", "| --- | --- |" + " --- |" * len(metrics)]
    for setting, row in summary.iterrows():
        cells = [_mean_std(row[(m, "mean")], row[(m, "std")]) for m in metrics]
        lines.append(f"| `{setting}` | {int(row[('n', '')])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def curves(sweep: Sweep, metric: str) -> pd.DataFrame:
    """The history of ``metric`` over the completed jobs: mean, std and count per (setting, step)."""
    rows = [
        {"setting": job.setting, "step": row["step"], "value": row[metric]}
        for job in sweep.completed
        for row in job.history
        if metric in row
    ]
    frame = pd.DataFrame(rows, columns=["setting", "step", "value"])
    return frame.groupby(["setting", "step"], sort=False)["value"].agg(["mean", "std", "count"]).reset_index()


def plot_curves(sweep: Sweep, metric: str) -> Figure:
    """``metric`` against the training step, one line per setting (mean over seeds, band: ± std)."""
    figure = Figure(figsize=(7, 4.5), layout="constrained")
    axes = figure.add_subplot()
    data = curves(sweep, metric)
    for setting in sweep.settings:
        line = data[data["setting"] == setting].sort_values("step")
        if line.empty:
            continue
        (drawn,) = axes.plot(line["step"], line["mean"], marker="o", markersize=3, label=setting)
        spread = line["std"].fillna(0.0)
        axes.fill_between(line["step"], line["mean"] - spread, line["mean"] + spread, color=drawn.get_color(), alpha=0.2)
    axes.set(xlabel="step", ylabel=metric)
    axes.set_title(f"{sweep.name}\n{metric} (mean ± std over seeds)", fontsize="medium")
    axes.grid(alpha=0.3)
    if axes.lines:
        axes.legend(fontsize="small")
    return figure


def plot_final(summary: pd.DataFrame, metric: str, title: str = "") -> Figure:
    """Final ``metric`` per setting with error bars (± std over seeds)."""
    figure = Figure(figsize=(max(6.0, 0.9 * len(summary) + 3), 4.5), layout="constrained")
    axes = figure.add_subplot()
    positions = range(len(summary))
    axes.errorbar(
        positions, summary[(metric, "mean")], yerr=summary[(metric, "std")].fillna(0.0), fmt="o", capsize=4
    )
    axes.set_xticks(list(positions), [str(s) for s in summary.index], rotation=30, ha="right", fontsize="small")
    axes.set(ylabel=metric)
    axes.set_title(title or metric, fontsize="medium")
    axes.margins(x=0.15)
    axes.grid(alpha=0.3, axis="y")
    return figure


def _file_stem(metric: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", metric).strip("_")


def write_report(sweep: Sweep, out_dir: Path | None = None, metric: str | None = None) -> Path:
    """Write ``report.md`` and its PNG plots into ``out_dir`` (default: the sweep directory).

    ``metric`` is the one plotted (default: the monitored metric, e.g. ``val/loss``; its best value
    ``best/<metric>`` in the final-value plot). Returns the path of ``report.md``."""
    out_dir = Path(out_dir or sweep.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    metric = metric or sweep.monitor or "val/loss"
    summary = summarize(sweep)
    lines = [
        f"# Sweep `{sweep.name}`",
        "",
        f"`{sweep.dir}`: {len(sweep.jobs)} jobs, {len(sweep.completed)} completed, {len(sweep.failed)} failed.",
        "",
        "## Final metrics (mean ± std over seeds; n = completed seeds)",
        "",
        markdown_table(summary) if len(summary) else "No job completed.",
        "",
    ]
    if any(metric in row for job in sweep.completed for row in job.history):
        curve_file = out_dir / f"curves_{_file_stem(metric)}.png"
        plot_curves(sweep, metric).savefig(curve_file, dpi=120)
        lines += [f"![{metric} curves]({curve_file.name})", ""]
    final = f"best/{metric}" if (f"best/{metric}", "mean") in summary.columns else metric
    if (final, "mean") in summary.columns:
        final_file = out_dir / f"final_{_file_stem(final)}.png"
        plot_final(summary, final, title=f"{sweep.name}\n{final} (mean ± std over seeds)").savefig(final_file, dpi=120)
        lines += [f"![{final} per setting]({final_file.name})", ""]
    lines += ["## Failed jobs", ""]
    lines += [f"- `{job.dir.name}` ({job.status}): {job.error}" for job in sweep.failed] or ["None."]
    report = out_dir / "report.md"
    report.write_text("\n".join(lines) + "\n")
    return report


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep_dir", type=Path, help="a multirun directory, e.g. outputs/multirun/<date>/<time>")
    parser.add_argument("--out", type=Path, default=None, help="where to write (default: the sweep directory)")
    parser.add_argument("--metric", default=None, help="the metric to plot (default: the monitored one)")
    args = parser.parse_args(argv)
    report = run_with_clear_errors(lambda: write_report(load_sweep(args.sweep_dir), args.out, args.metric))
    print(report)


if __name__ == "__main__":
    main()
