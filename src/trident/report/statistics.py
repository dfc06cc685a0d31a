"""Each setting of a sweep against the best one: Welch's test, Holm's correction, effect sizes, a verdict.

The family of a correction is the comparisons against the best in one sweep and on one metric (the
settings with a test: two seeds or more on both sides and some spread). Holm's step-down method keeps
the chance of calling any equal setting worse at ``alpha``, whatever the number of settings, and is
uniformly more powerful than Bonferroni. The verdict comes from the corrected p-value:

- ``worse than the best``: Holm's p < alpha;
- ``within the noise``: not worse, and the 95 % confidence interval of the difference lies inside
  ± one seed standard deviation (pooled over the two settings): whatever the truth, the difference is
  smaller than what changing the seed does;
- ``undecided at N seeds`` otherwise (N: the fewer seeds of the two); more seeds can decide it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import numpy as np
import pandas as pd
from scipy import stats

from trident.report.sweep import Sweep, better_is

# The family-wise error rate of the corrected tests (and 1 - the confidence of the intervals).
ALPHA = 0.05
# "Within the noise": the confidence interval inside ± this many pooled seed standard deviations.
NOISE_MARGIN_SD = 1.0
WORSE = "worse than the best"
WITHIN_NOISE = "within the noise"
BEST = "best"
COLUMNS = ["n", "n_best", "mean", "difference", "ci_low", "ci_high", "hedges_g", "t", "p", "p_holm", "verdict", "decided"]


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's (1979) step-down adjusted p-values, in the order given; NaN (no test) stays NaN and is
    not counted in the family. The i-th smallest of m p-values is multiplied by m - i + 1; a running
    maximum keeps the adjusted values in the order of the raw ones; 1 caps them."""
    tested = sorted((p, i) for i, p in enumerate(p_values) if not math.isnan(p))
    adjusted = [math.nan] * len(p_values)
    running = 0.0
    for rank, (p, i) in enumerate(tested):
        running = max(running, min(1.0, (len(tested) - rank) * p))
        adjusted[i] = running
    return adjusted


def hedges_g(a: Sequence[float], b: Sequence[float]) -> float:
    """The difference of the means in pooled standard deviations, with Hedges' small-sample correction
    J = 1 - 3 / (4 (n_a + n_b) - 9) (Hedges 1981); NaN without spread."""
    pooled = _pooled_sd(a, b)
    if not pooled:
        return math.nan
    return (statistics.mean(a) - statistics.mean(b)) / pooled * (1 - 3 / (4 * (len(a) + len(b)) - 9))


def _pooled_sd(a: Sequence[float], b: Sequence[float]) -> float:
    dof = len(a) + len(b) - 2
    return math.sqrt(((len(a) - 1) * statistics.variance(a) + (len(b) - 1) * statistics.variance(b)) / dof)


def seed_values(sweep: Sweep, metric: str) -> dict[str, list[float]]:
    """The values of ``metric`` over the completed seeds of each setting, in sweep order."""
    values: dict[str, list[float]] = {}
    for job in sweep.completed:
        if not math.isnan(job.metrics.get(metric, math.nan)):
            values.setdefault(job.setting, []).append(job.metrics[metric])
    return {s: values[s] for s in sweep.settings if s in values}


def compare_to_best(sweep: Sweep, metric: str, alpha: float = ALPHA) -> pd.DataFrame:
    """Each setting against the setting with the best mean ``metric`` over its completed seeds.

    Rows: settings in sweep order. Columns: ``n`` and ``n_best`` (seeds of the setting and of the
    best), ``mean``, ``difference`` (its mean minus the best's), ``ci_low`` / ``ci_high`` (Welch's
    ``1 - alpha`` interval of the difference, as ``scipy.stats.ttest_ind(equal_var=False)
    .confidence_interval()``), ``hedges_g``, Welch's ``t`` and two-sided ``p``, ``p_holm`` (Holm over
    the settings with a test), ``verdict`` (see the module) and ``decided`` (False only for
    "undecided at N seeds": more seeds could change the answer). Test columns are NaN without two
    seeds on both sides or without any spread. ``attrs``: ``best``, ``metric``, ``alpha``, ``family``
    (the number of tests Holm corrects for)."""
    values = seed_values(sweep, metric)
    frame = pd.DataFrame(index=pd.Index(list(values), name="setting"), columns=COLUMNS)
    frame.attrs.update(metric=metric, alpha=alpha, family=0)
    if not values:
        return frame
    means = {s: statistics.mean(v) for s, v in values.items()}
    best = (min if better_is(sweep, metric) == "min" else max)(values, key=means.__getitem__)
    for setting, seeds in values.items():
        pair = (seeds, values[best])
        testable = setting != best and min(map(len, pair)) >= 2 and any(len(set(v)) > 1 for v in pair)
        row = dict.fromkeys(COLUMNS, math.nan)
        row.update(n=len(seeds), n_best=len(values[best]), mean=means[setting], difference=means[setting] - means[best])
        if testable:
            test = stats.ttest_ind(*pair, equal_var=False)
            interval = test.confidence_interval(1 - alpha)
            row.update(t=test.statistic, p=test.pvalue, ci_low=interval.low, ci_high=interval.high,
                       hedges_g=hedges_g(*pair))
        frame.loc[setting] = row
    frame["p_holm"] = holm(frame["p"].astype(float).tolist())
    verdicts = [_verdict(row, alpha, values, best) for _, row in frame.iterrows()]
    frame["verdict"] = [verdict for verdict, _ in verdicts]
    frame["decided"] = [decided for _, decided in verdicts]
    numeric = [c for c in COLUMNS if c not in ("verdict", "decided")]
    frame[numeric] = frame[numeric].astype(float)
    frame.attrs.update(best=best, family=int(np.isfinite(frame["p"]).sum()))
    return frame


def _verdict(row: pd.Series, alpha: float, values: dict[str, list[float]], best: str) -> tuple[str, bool]:
    """(verdict, decided) of one row of :func:`compare_to_best`."""
    if row.name == best:
        return BEST, True
    if row["p_holm"] < alpha:
        return WORSE, True
    if not math.isnan(row["p"]):
        margin = NOISE_MARGIN_SD * _pooled_sd(values[str(row.name)], values[best])
        if -margin < row["ci_low"] and row["ci_high"] < margin:
            return WITHIN_NOISE, True
    seeds = int(min(row["n"], row["n_best"]))
    return f"undecided at {seeds} seed{'s' if seeds > 1 else ''}", False
