"""Markdown tables of a sweep: final metrics per setting, and each setting against the best."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pandas as pd

from trident.report.statistics import NOISE_MARGIN_SD
from trident.report.sweep import WALL_TIME, Sweep, final_metrics


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


def mean_std(mean: float, std: float) -> str:
    """``mean ± std`` (4 and 2 significant digits); the mean alone for one seed; ``-`` for none."""
    if math.isnan(mean):
        return "-"
    return f"{mean:.4g}" if math.isnan(std) else f"{mean:.4g} ± {std:.2g}"


def markdown_table(summary: pd.DataFrame) -> str:
    """The summary as a markdown table, ``mean ± std`` per cell."""
    metrics = list(dict.fromkeys(column[0] for column in summary.columns if column[0] != "n"))
    lines = ["| setting | n | " + " | ".join(metrics) + " |", "| --- | --- |" + " --- |" * len(metrics)]
    for setting, row in summary.iterrows():
        cells = [mean_std(row[(m, "mean")], row[(m, "std")]) for m in metrics]
        lines.append(f"| `{setting}` | {int(row[('n', '')])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def comparison_heading(comparison: pd.DataFrame) -> str:
    """What the table below it tests, and the family Holm corrects for."""
    return (
        f"Welch's t-test over the seeds against the best setting, `{comparison.attrs.get('best')}`; p (Holm): "
        f"corrected over the comparisons of this table (one sweep, one metric: m = {comparison.attrs['family']}), "
        f"and the verdict is taken from it (alpha = {comparison.attrs['alpha']}). Difference: the setting's mean "
        f"minus the best's, with Welch's {1 - comparison.attrs['alpha']:.0%} confidence interval; Hedges' g: the "
        f"difference in pooled seed standard deviations. \"Within the noise\": the interval lies inside "
        f"± {NOISE_MARGIN_SD:g} pooled seed standard deviation."
    )


def comparison_table(comparison: pd.DataFrame, metric: str) -> str:
    """:func:`trident.report.statistics.compare_to_best` as markdown."""
    lines = [f"| setting | n | {metric} − best [95 % CI] | Hedges' g | Welch t | p | p (Holm) | verdict |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for setting, row in comparison.iterrows():
        n = int(row["n"])
        if setting == comparison.attrs.get("best"):
            lines.append(f"| `{setting}` | {n} | best | | | | | best |")
        elif math.isnan(row["p"]):
            reason = "too few seeds" if min(row["n"], row["n_best"]) < 2 else "no spread over the seeds"
            lines.append(f"| `{setting}` | {n} | {row['difference']:+.4g} | - | - | - | - | {row['verdict']} ({reason}) |")
        else:
            difference = f"{row['difference']:+.4g} [{row['ci_low']:+.3g}, {row['ci_high']:+.3g}]"
            lines.append(f"| `{setting}` | {n} | {difference} | {row['hedges_g']:+.2f} | {row['t']:.2f} | "
                         f"{row['p']:.3g} | {row['p_holm']:.3g} | {row['verdict']} |")
    return "\n".join(lines)
