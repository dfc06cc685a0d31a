"""Each setting of a sweep against the best one: Welch's test and an equivalence test over every pair,
Holm's correction, effect sizes, a verdict.

The best setting is the one with the best mean, chosen from the same data as the tests: a family of
the k - 1 comparisons against it does not keep its error rate (with 5 equal settings x 8 seeds, Holm
over those 4 comparisons calls one of them worse in about 8 % of sweeps, not 5 %). So every unordered
pair of settings with a test (two seeds or more on both sides and some spread) is tested, k (k - 1) / 2
of them, and Holm's (1979) step-down method corrects over all of them: it controls the family-wise
error strongly over the pairs, hence over any subset the data pick, the pairs with the best included.
The verdict of a setting comes from the corrected p-values of its pair with the best, at the level
of this look (``level``: ``alpha`` for a fixed-seed sweep, less at each look of the seeds-until-decided
loop, :mod:`trident.report.sequential`):

- ``worse than the best``: Welch's two-sided p (Holm over the pairs) < level;
- ``within the noise``: not worse, and the equivalence test of the difference against a margin of
  ``NOISE_MARGIN_SD`` seed standard deviations (Holm over the pairs, a family of its own) < level:
  the difference is smaller than what changing the seed does. The test is Wellek's two-sample t-test
  for equivalence (Wellek 2010, *Testing Statistical Hypotheses of Equivalence and Noninferiority*,
  2nd ed., section 6.1): with Student's pooled two-sample t, T^2 follows a noncentral F(1, n1 + n2 - 2)
  with noncentrality eps^2 n1 n2 / (n1 + n2) when the true difference is eps standard deviations, and
  the p-value is that distribution's cdf at the observed T^2 (small T: evidence of a small difference);
- ``undecided at N seeds`` otherwise (N: the fewer seeds of the two); more seeds can decide it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations

import numpy as np
import pandas as pd
from scipy import stats

from trident.report.sweep import Sweep, better_is

# The family-wise error rate of the corrected tests (and 1 - the confidence of the intervals).
ALPHA = 0.05
# "Within the noise": the equivalence margin, in seed standard deviations.
NOISE_MARGIN_SD = 1.0
WORSE = "worse than the best"
WITHIN_NOISE = "within the noise"
BEST = "best"
COLUMNS = ["n", "n_best", "mean", "difference", "ci_low", "ci_high", "hedges_g", "t", "p", "p_holm",
           "p_equivalence_holm", "round", "level", "verdict", "decided"]


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's (1979) step-down adjusted p-values, in the order given; NaN (no test) stays NaN and is
    not counted in the family. The i-th smallest of m p-values is multiplied by m - i + 1; a running
    maximum keeps the adjusted values in the order of the raw ones; 1 caps them."""
    p = np.asarray(p_values, dtype=float)
    adjusted = np.full(p.shape, math.nan)
    tested = np.flatnonzero(~np.isnan(p))
    order = tested[np.argsort(p[tested], kind="stable")]
    factors = np.arange(len(order), 0, -1)  # m, m - 1, ..., 1
    adjusted[order] = np.minimum(1.0, np.maximum.accumulate(factors * p[order]))
    return adjusted.tolist()


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


def undecided(seeds: int) -> str:
    return f"undecided at {seeds} seed{'s' if seeds != 1 else ''}"


@dataclass(frozen=True)
class Look:
    """One look at the values of a sweep: per setting, its Welch p against the best, that p and the
    equivalence p after Holm's correction over every tested pair, and its verdict at ``level``."""

    best: str
    level: float
    family: int  # the tested pairs, the size of each of the two Holm families
    p: dict[str, float]  # NaN: no test (too few seeds, no spread) or the best itself
    p_holm: dict[str, float]
    p_equivalence_holm: dict[str, float]
    verdicts: dict[str, str]


def pair_tests(values: Mapping[str, Sequence[float]]) -> tuple[list[tuple[str, str]], np.ndarray, np.ndarray]:
    """Every unordered pair of settings with a test, Welch's two-sided p and Wellek's equivalence p of
    each (numpy over the pairs: the simulation tests run thousands of sweeps)."""
    names = list(values)
    n = np.array([len(values[s]) for s in names], dtype=float)
    mean = np.array([statistics.fmean(values[s]) for s in names])
    var = np.array([statistics.variance(values[s]) if len(values[s]) > 1 else 0.0 for s in names])
    pairs = [(i, j) for i, j in combinations(range(len(names)), 2)
             if n[i] >= 2 and n[j] >= 2 and (var[i] > 0 or var[j] > 0)]
    if not pairs:
        return [], np.empty(0), np.empty(0)
    i, j = np.array(pairs).T  # (pairs,) each
    se2_i, se2_j = var[i] / n[i], var[j] / n[j]
    welch_t = (mean[i] - mean[j]) / np.sqrt(se2_i + se2_j)
    welch_dof = (se2_i + se2_j) ** 2 / (se2_i**2 / (n[i] - 1) + se2_j**2 / (n[j] - 1))
    p = 2 * stats.t.sf(np.abs(welch_t), welch_dof)
    dof = n[i] + n[j] - 2
    pooled_var = ((n[i] - 1) * var[i] + (n[j] - 1) * var[j]) / dof
    student_t2 = (mean[i] - mean[j]) ** 2 / (pooled_var * (1 / n[i] + 1 / n[j]))
    p_equivalence = stats.ncf.cdf(student_t2, 1, dof, NOISE_MARGIN_SD**2 * n[i] * n[j] / (n[i] + n[j]))
    return [(names[a], names[b]) for a, b in pairs], p, p_equivalence


def best_of(values: Mapping[str, Sequence[float]], better: str, candidates: Collection[str] | None = None) -> str:
    """The setting with the best mean (``better``: "min" or "max"), among ``candidates`` if given."""
    means = {s: statistics.fmean(v) for s, v in values.items() if candidates is None or s in candidates}
    return (min if better == "min" else max)(means, key=means.__getitem__)


def look(values: Mapping[str, Sequence[float]], better: str, level: float = ALPHA,
         candidates: Collection[str] | None = None) -> Look:
    """The verdicts of the module docstring at ``level``; the best among ``candidates`` (default: every
    setting; the loop passes the settings it has not decided yet)."""
    best = best_of(values, better, candidates)
    pairs, p, p_equivalence = pair_tests(values)
    with_best = {(a if b == best else b): index for index, (a, b) in enumerate(pairs) if best in (a, b)}
    p_holm, p_equivalence_holm = holm(p), holm(p_equivalence)

    def of(column: Sequence[float]) -> dict[str, float]:
        return {s: column[with_best[s]] if s in with_best else math.nan for s in values}

    row_p, row_holm, row_equivalence = of(p.tolist()), of(p_holm), of(p_equivalence_holm)
    verdicts = {}
    for setting, seeds in values.items():
        if setting == best:
            verdicts[setting] = BEST
        elif row_holm[setting] < level:
            verdicts[setting] = WORSE
        elif row_equivalence[setting] < level:
            verdicts[setting] = WITHIN_NOISE
        else:
            verdicts[setting] = undecided(min(len(seeds), len(values[best])))
    return Look(best, level, len(pairs), row_p, row_holm, row_equivalence, verdicts)


def seed_values(sweep: Sweep, metric: str) -> dict[str, list[float]]:
    """The values of ``metric`` over the completed seeds of each setting, in sweep order."""
    values: dict[str, list[float]] = {}
    for job in sweep.completed:
        if not math.isnan(job.metrics.get(metric, math.nan)):
            values.setdefault(job.setting, []).append(job.metrics[metric])
    return {s: values[s] for s in sweep.settings if s in values}


def compare_to_best(sweep: Sweep, metric: str, alpha: float = ALPHA, level: float | None = None) -> pd.DataFrame:
    """Each setting against the setting with the best mean ``metric`` over its completed seeds, one
    look at ``level`` (default ``alpha``: a fixed-seed sweep).

    Rows: settings in sweep order. Columns: ``n`` and ``n_best`` (seeds of the setting and of the
    best), ``mean``, ``difference`` (its mean minus the best's), ``ci_low`` / ``ci_high`` (Welch's
    ``1 - alpha`` interval of the difference, as ``scipy.stats.ttest_ind(equal_var=False)
    .confidence_interval()``), ``hedges_g``, Welch's ``t`` and two-sided ``p``, ``p_holm`` and
    ``p_equivalence_holm`` (Holm over every tested pair, see the module), ``round`` and ``level`` (the
    look that gave the verdict: 1 and ``level`` here), ``verdict`` and ``decided`` (False only for
    "undecided at N seeds": more seeds could change the answer). Test columns are NaN without two
    seeds on both sides or without any spread. ``attrs``: ``best``, ``metric``, ``alpha``, ``level``
    and ``family`` (the number of tested pairs each Holm correction counts)."""
    return comparison_frame(seed_values(sweep, metric), better_is(sweep, metric), metric, alpha,
                            alpha if level is None else level)


def comparison_frame(values: Mapping[str, Sequence[float]], better: str, metric: str, alpha: float, level: float,
                     looks: Mapping[str, tuple[int, Look, Mapping[str, Sequence[float]]]] | None = None) -> pd.DataFrame:
    """:func:`compare_to_best`'s table of ``values``; ``looks`` (from the seeds-until-decided loop): per
    setting, the round, the look and the values that gave its verdict (default: one look at ``level``)."""
    frame = pd.DataFrame(index=pd.Index(list(values), name="setting"), columns=COLUMNS)
    frame.attrs.update(metric=metric, alpha=alpha, level=level, family=0)
    if not values:
        return frame
    final = look(values, better, level)
    looks = looks or {s: (1, final, values) for s in values}
    for setting in values:
        number, seen, seen_values = looks[setting]
        seeds, best = seen_values[setting], seen_values[seen.best]
        row = dict.fromkeys(COLUMNS, math.nan)
        row.update(n=len(seeds), n_best=len(best), mean=statistics.fmean(seeds), round=number, level=seen.level,
                   difference=statistics.fmean(seeds) - statistics.fmean(best), verdict=seen.verdicts[setting],
                   p_holm=seen.p_holm[setting], p_equivalence_holm=seen.p_equivalence_holm[setting])
        if not math.isnan(seen.p[setting]):
            test = stats.ttest_ind(seeds, best, equal_var=False)
            interval = test.confidence_interval(1 - alpha)
            row.update(t=test.statistic, p=test.pvalue, ci_low=interval.low, ci_high=interval.high,
                       hedges_g=hedges_g(seeds, best))
        frame.loc[setting] = row
    frame["decided"] = [not str(verdict).startswith("undecided") for verdict in frame["verdict"]]
    numeric = [c for c in COLUMNS if c not in ("verdict", "decided")]
    frame[numeric] = frame[numeric].astype(float)
    best = next(s for s, (_, seen, _) in looks.items() if seen.verdicts[s] == BEST) if looks else final.best
    frame.attrs.update(best=best, family=max(seen.family for _, seen, _ in looks.values()))
    return frame
