"""The plots of a sweep report: validation curves per setting, and the final value per setting."""

from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure

from trident.report.sweep import Sweep


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
