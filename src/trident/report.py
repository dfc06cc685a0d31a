"""Report on a sweep from its own run directories, without W&B: a table, plots and the failed jobs.

``python -m trident.report outputs/multirun/<date>/<time> [--out DIR] [--metric NAME]`` writes
``report.md`` (final metrics per setting: mean, standard deviation and number of seeds; the failed
jobs), ``curves_<metric>.png`` (validation curves per setting, mean and spread over seeds) and
``final_<metric>.png`` (final value per setting with error bars) into the sweep directory. The
plotted final metric is also compared between settings: each setting against the best one, with
Welch's t-test over their seeds, so a difference can be told from the seed-to-seed noise.

A job's wall time (the ``job_wall_s`` column) is read from its directory: Hydra writes
``.hydra/config.yaml`` as the job starts and trident writes ``status.json`` as it ends, so it covers
data preparation, training, the test and the W&B finish, but not the interpreter's start.

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
from scipy import stats

from trident.errors import DataError, run_with_clear_errors
from trident.runs.budget import comparison_basis
from trident.runs.sweeps import STATUS_FILE, SWEEP_FILE, job_statuses, read_json, setting_of

# The final metrics a report compares: the best validation value and the test metrics.
FINAL_PREFIXES = ("best/", "test/")
# The column of a job's wall time, in seconds.
WALL_TIME = "job_wall_s"
# A difference "exceeds the seed spread" when Welch's two-sided p-value is below this.
SIGNIFICANCE = 0.05


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


@dataclass
class Sweep:
    dir: Path
    name: str
    jobs: list[Job]
    monitor: str | None = None
    monitor_mode: str = "min"

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


def _wall_time(job_dir: Path) -> float:
    """Seconds from the job's start (Hydra's ``.hydra/config.yaml``) to its end (``status.json``)."""
    start, end = job_dir / ".hydra" / "config.yaml", job_dir / STATUS_FILE
    if not (start.is_file() and end.is_file()):
        return math.nan
    return end.stat().st_mtime - start.stat().st_mtime


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
                wall_s=_wall_time(status.dir),
            )
        )
    records = [s.record for s in statuses if s.record]
    name = next((r["sweep"] for r in records if "sweep" in r), sweep_dir.name)
    monitor = next((r["monitor"] for r in records if "monitor" in r), None)
    mode = next((r["monitor_mode"] for r in records if "monitor_mode" in r), "min")
    return Sweep(dir=sweep_dir, name=name, jobs=jobs, monitor=monitor, monitor_mode=mode)


def final_metrics(sweep: Sweep) -> list[str]:
    """The metrics worth a column: best validation value first, then the test metrics."""
    keys = {k for job in sweep.completed for k in job.metrics if k.startswith(FINAL_PREFIXES)}
    return sorted(keys, key=lambda k: (not k.startswith("best/"), k))


def summarize(sweep: Sweep, metrics: Sequence[str] | None = None) -> pd.DataFrame:
    """Mean, standard deviation and count over the completed jobs of each setting.

    Rows: settings in sweep order; columns: ``n`` then ``(<metric>, "mean")`` and ``(<metric>, "std")``
    (std is NaN for a single seed), the job wall time last."""
    metrics = list(metrics or final_metrics(sweep))
    rows = [
        {"setting": job.setting, **{m: job.metrics.get(m, math.nan) for m in metrics}, WALL_TIME: job.wall_s}
        for job in sweep.completed
    ]
    metrics.append(WALL_TIME)
    frame = pd.DataFrame(rows, columns=["setting", *metrics])
    grouped = frame.groupby("setting", sort=False)
    summary = grouped[metrics].agg(["mean", "std"])
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


def better_is(sweep: Sweep, metric: str) -> str:
    """``"min"`` or ``"max"``: the monitor's mode for the monitored metric (and its ``best/`` value);
    otherwise lower is better for a loss or perplexity and higher for anything else (BLEU, accuracy)."""
    if sweep.monitor and metric in (sweep.monitor, f"best/{sweep.monitor}"):
        return sweep.monitor_mode
    return "min" if re.search(r"loss|ppl|perplexity", metric) else "max"


def compare_to_best(sweep: Sweep, metric: str) -> pd.DataFrame:
    """Each setting against the setting with the best mean ``metric``: the difference of the means,
    Welch's t statistic and its two-sided p-value over the seeds (NaN unless both have 2 seeds or
    more, and NaN when neither varies over its seeds).

    Rows: settings in sweep order; columns ``n`` (seeds), ``difference``, ``t``, ``p``;
    ``attrs["best"]`` is the best."""
    values: dict[str, list[float]] = {}
    for job in sweep.completed:
        if not math.isnan(job.metrics.get(metric, math.nan)):
            values.setdefault(job.setting, []).append(job.metrics[metric])
    settings = [s for s in sweep.settings if s in values]
    frame = pd.DataFrame(index=pd.Index(settings, name="setting"), columns=["n", "difference", "t", "p"], dtype=float)
    if not settings:
        return frame
    means = {s: sum(v) / len(v) for s, v in values.items()}
    best = (min if better_is(sweep, metric) == "min" else max)(settings, key=means.__getitem__)
    for setting in settings:
        pair = (values[setting], values[best])
        spread = any(len(set(v)) > 1 for v in pair)
        testable = setting != best and min(map(len, pair)) >= 2 and spread
        test = stats.ttest_ind(*pair, equal_var=False) if testable else None
        frame.loc[setting] = [len(values[setting]), means[setting] - means[best],
                              getattr(test, "statistic", math.nan), getattr(test, "pvalue", math.nan)]
    frame.attrs["best"] = best
    return frame


def comparison_table(comparison: pd.DataFrame, metric: str) -> str:
    """:func:`compare_to_best` as markdown: whether each difference exceeds the seed spread."""
    lines = [f"| setting | {metric} − best | Welch t | p | exceeds the seed spread (p < {SIGNIFICANCE}) |",
             "| --- | --- | --- | --- | --- |"]
    for setting, row in comparison.iterrows():
        if setting == comparison.attrs.get("best"):
            lines.append(f"| `{setting}` | best | | | |")
        elif math.isnan(row["p"]):
            best_n = comparison.loc[comparison.attrs["best"], "n"]
            reason = "too few seeds" if min(row["n"], best_n) < 2 else "no spread over the seeds"
            lines.append(f"| `{setting}` | {row['difference']:+.4g} | - | - | {reason} |")
        else:
            verdict = "yes" if row["p"] < SIGNIFICANCE else "no"
            lines.append(f"| `{setting}` | {row['difference']:+.4g} | {row['t']:.2f} | {row['p']:.3g} | {verdict} |")
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


def _wall_time_line(sweep: Sweep) -> list[str]:
    times = pd.Series([job.wall_s for job in sweep.completed]).dropna()
    if times.empty:
        return []
    spread = f"mean {times.mean():.0f} s (min {times.min():.0f} s, max {times.max():.0f} s)"
    return [f"Wall time of a completed job: {spread}; {times.sum() / 60:.1f} min for all of them.", ""]


def write_report(
    sweep: Sweep, out_dir: Path | None = None, metric: str | None = None, compare: Sequence[str] = ()
) -> Path:
    """Write ``report.md`` and its PNG plots into ``out_dir`` (default: the sweep directory).

    ``metric`` is the one plotted (default: the monitored metric, e.g. ``val/loss``; its best value
    ``best/<metric>`` in the final-value plot). ``compare``: the metrics of ``status.json`` whose
    settings are tested against the best one (default: the plotted final metric), e.g. ``val/loss``,
    the last validation value; each also gets a column. Returns the path of ``report.md``."""
    out_dir = Path(out_dir or sweep.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    metric = metric or sweep.monitor or "val/loss"
    recorded = sorted({key for job in sweep.completed for key in job.metrics})
    unknown = [m for m in compare if m not in recorded]
    if unknown:
        known = ", ".join(recorded) or "none (no job completed)"
        raise DataError(f"--compare {' '.join(unknown)}: no job of {sweep.dir} recorded it; choose among {known}")
    finals = final_metrics(sweep)
    summary = summarize(sweep, [*finals, *(m for m in compare if m not in finals)])
    lines = [
        f"# Sweep `{sweep.name}`",
        "",
        f"`{sweep.dir}`: {len(sweep.jobs)} jobs, {len(sweep.completed)} completed, {len(sweep.failed)} failed.",
        "",
        *([basis, ""] if (basis := comparison_basis([job.dir for job in sweep.jobs])) else []),
        *_wall_time_line(sweep),
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
        compare = compare or [final]
    if len(summary) > 1:
        for compared in compare:
            lines += [f"## {compared}: each setting against the best (Welch's t-test over seeds)", "",
                      comparison_table(compare_to_best(sweep, compared), compared), ""]
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
    parser.add_argument("--compare", nargs="+", default=(), metavar="METRIC",
                        help="metrics to test between settings (default: the plotted final one), e.g. test/ppl val/loss")
    args = parser.parse_args(argv)
    report = run_with_clear_errors(
        lambda: write_report(load_sweep(args.sweep_dir), args.out, args.metric, args.compare)
    )
    print(report)


if __name__ == "__main__":
    main()
