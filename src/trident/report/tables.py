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
    """What the table below it tests, the families Holm corrects for, and the looks of an adaptive sweep."""
    alpha, level = comparison.attrs["alpha"], comparison.attrs["level"]
    looks = comparison.attrs.get("design") or (
        f"One look at level {level:g} (a fixed-seed sweep)." if level == alpha else f"One look at level {level:g}.")
    return (
        f"Each setting against the best setting by mean, `{comparison.attrs.get('best')}`. Welch's t-test and an "
        f"equivalence test (Wellek's, margin ± {NOISE_MARGIN_SD:g} seed standard deviation) over every pair of settings; "
        f"p (Holm), p equiv. (Holm): each corrected with Holm's method over all the tested pairs (one sweep, one "
        f"metric: m = {comparison.attrs['family']} pairs), so that choosing the best from the same seeds keeps "
        f"the family-wise error at {alpha:g}. \"Worse than the best\": p (Holm) of its pair with the best below "
        f"the level; \"within the noise\": not worse and p equiv. (Holm) below the level. {looks} Difference: the "
        f"setting's mean minus the best's, with Welch's {1 - alpha:.0%} confidence interval (not corrected); "
        f"Hedges' g: the difference in pooled seed standard deviations."
    )


def comparison_table(comparison: pd.DataFrame, metric: str) -> str:
    """:func:`trident.report.statistics.compare_to_best` as markdown; the verdict of an adaptive sweep
    names the round and the level that decided it."""
    lines = [f"| setting | n | {metric} − best [95 % CI] | Hedges' g | Welch t | p | p (Holm) | p equiv. (Holm) | verdict |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for setting, row in comparison.iterrows():
        n = int(row["n"])
        verdict = row["verdict"]
        if comparison.attrs.get("design") and row["decided"] and verdict != "best":
            verdict += f" (round {int(row['round'])}, level {row['level']:.3g})"
        if setting == comparison.attrs.get("best"):
            lines.append(f"| `{setting}` | {n} | best | | | | | | best |")
        elif math.isnan(row["p"]):
            reason = "too few seeds" if min(row["n"], row["n_best"]) < 2 else "no spread over the seeds"
            lines.append(f"| `{setting}` | {n} | {row['difference']:+.4g} | - | - | - | - | - | {verdict} ({reason}) |")
        else:
            difference = f"{row['difference']:+.4g} [{row['ci_low']:+.3g}, {row['ci_high']:+.3g}]"
            lines.append(f"| `{setting}` | {n} | {difference} | {row['hedges_g']:+.2f} | {row['t']:.2f} | "
                         f"{row['p']:.3g} | {row['p_holm']:.3g} | {row['p_equivalence_holm']:.3g} | {verdict} |")
    return "\n".join(lines)
