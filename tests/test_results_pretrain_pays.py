"""Every number of docs/results.md's "Does pre-training pay?" section, recomputed from the committed
jobs.csv files with pandas and scipy (not with trident.report, whose output the section quotes): the
table row for row, each comparison line, and every number of the prose (tests/results_page.py says what
a number is; the few that no jobs.csv holds are results_page.MEASURED and UNCHECKED, with reasons)."""

from __future__ import annotations

import re

import pandas as pd
import pytest
from scipy import stats

from .conftest import ROOT
from .results_page import (
    MEASURED,
    UNCHECKED,
    Number,
    SetUp,
    claimed_by_phrase,
    page_lines,
    page_numbers,
    section_lines,
    value,
)

RESULTS = ROOT / "docs" / "results"
HEADING = "## Does pre-training pay?"
# (the row's name in the section, the report directory)
PAIRS = [("text", "pretrain_pays_text"), ("vision", "pretrain_pays_vision"),
         ("vision, seeds until decided", "pretrain_pays_vision_adaptive")]
METRICS = ["test/acc", "best/val/acc"]
# Accuracies the prose quotes besides the table's, in % at one decimal (those it compares with Welch's test,
# then the majority baseline); the loss at two, in nats.
COMPARED = ["test/acc", "best/val/acc", "test/macro_f1"]
PERCENT_COLUMNS = [*COMPARED, "test/majority_acc"]
LOSS_DIGITS = 2
ALPHA = 0.05
CONFIDENCE = SetUp(f"{100 * (1 - ALPHA):.0f} %", r"\[", "% CI")  # the intervals' level, "[95 % CI"
# The bound the prose states: both starts' test accuracy lies within this many points of the majority's.
ABOVE_MAJORITY = 10


def section() -> str:
    text = (ROOT / "docs" / "results.md").read_text()
    start = text.index(HEADING)
    return text[start:text.index("\n## ", start + 1)]


def jobs_of(report: str) -> pd.DataFrame:
    return pd.read_csv(RESULTS / report / "jobs.csv")


def starts(jobs: pd.DataFrame) -> dict[str, pd.DataFrame]:
    return {start: jobs[jobs.setting == f"start={start}"] for start in ("scratch", "pretrained")}


def welch(jobs: pd.DataFrame, metric: str) -> tuple[float, float, float, float]:
    """Pre-trained minus scratch on one metric: the difference of the means, Welch's confidence interval
    and p-value over the seeds."""
    pretrained, scratch = (runs[metric] for runs in reversed(starts(jobs).values()))
    test = stats.ttest_ind(pretrained, scratch, equal_var=False)
    interval = test.confidence_interval(1 - ALPHA)
    return pretrained.mean() - scratch.mean(), interval.low, interval.high, test.pvalue


def percent(values: pd.Series) -> str:
    return f"{100 * values.mean():.1f} ± {100 * values.std(ddof=1):.1f}"


def expected_rows(name: str, jobs: pd.DataFrame) -> list[str]:
    """The table's two rows of one pair."""
    return [f"| {name} | {start} | {len(runs)} | " + " | ".join(percent(runs[m]) for m in METRICS) + " |"
            for start, runs in starts(jobs).items()]


def expected_comparison(name: str, jobs: pd.DataFrame) -> str:
    """The pair's comparison line: pre-trained minus scratch, Welch."""
    difference, low, high, p = welch(jobs, "test/acc")
    return (f"{name}: pre-trained minus scratch, test accuracy {100 * difference:+.1f} points "
            f"[95 % CI {100 * low:+.1f}, {100 * high:+.1f}], Welch p = {p:.2g}")


def table_lines() -> list[int]:
    """The page's line numbers of the section's table rows."""
    lines = page_lines()
    return [i for i in section_lines(HEADING) if lines[i].startswith(("| text |", "| vision"))]


def derived_numbers() -> set[str]:
    """What the prose may quote of the section's reports: job counts, seeds, summed wall times, means and
    standard deviations in % (and rounded to the point), the test loss, Welch's p and interval, and the
    time of the seeds the loop added."""
    allowed = {f"{ABOVE_MAJORITY} points"}  # the bound, tested below
    for _, report in PAIRS:
        jobs = jobs_of(report)
        seeds = jobs.groupby("setting").size()
        allowed |= {f"{len(jobs)} jobs", *(f"{n} seeds" for n in seeds), f"{jobs.job_wall_s.sum() / 60:.1f}"}
        columns = [column for column in PERCENT_COLUMNS if column in jobs]
        for runs in starts(jobs).values():
            allowed |= {f"{100 * runs[c].mean():.0f} %" for c in columns} | {f"{100 * runs[c].mean():.1f}" for c in columns}
            allowed |= {f"{100 * runs[c].std(ddof=1):.1f}" for c in columns}
            allowed.add(f"{runs['test/loss'].mean():.{LOSS_DIGITS}f}")
        for metric in (column for column in COMPARED if column in jobs):
            difference, low, high, p = welch(jobs, metric)
            allowed |= {f"{p:.2g}", *(f"{abs(100 * v):.1f}" for v in (difference, low, high))}
    added = jobs_of(PAIRS[2][1]).pipe(lambda jobs: jobs[~jobs.seed.isin(jobs_of(PAIRS[1][1]).seed)])
    allowed.add(f"{added.job_wall_s.sum() / 60:.1f}")
    return allowed


def prose_numbers() -> list[Number]:
    """The section's numbers outside its table rows, the measured sweep times and the UNCHECKED."""
    numbers = [n for n in page_numbers() if n.section.startswith(HEADING) and n.line not in table_lines()]
    phrases = [(m.section, m.phrase) for m in MEASURED] + list(UNCHECKED)
    exempt = {n for section, phrase in phrases for n in claimed_by_phrase(numbers, section, phrase)}
    return [n for n in numbers if n not in exempt]


@pytest.mark.parametrize(("name", "report"), PAIRS)
def test_the_section_quotes_the_committed_jobs(name: str, report: str) -> None:
    jobs = jobs_of(report)
    assert set(jobs.status) == {"completed"} and not jobs.git_dirty.any(), "every job ran committed code to the end"
    line = expected_comparison(name, jobs)
    assert line in section(), f"docs/results.md does not say: {line}"


def test_the_table_is_the_jobs_row_for_row() -> None:
    lines = page_lines()
    assert [lines[i] for i in table_lines()] == [row for name, report in PAIRS
                                                 for row in expected_rows(name, jobs_of(report))]


def test_every_number_of_the_prose_is_derived_from_the_jobs() -> None:
    allowed, quoted = derived_numbers(), prose_numbers()
    assert len(quoted) > 20, "the prose quotes numbers"
    wrong = [n for n in quoted if value(n.text, n.unit) not in allowed and not CONFIDENCE.names(n)]
    assert [(n.line + 1, n.text) for n in wrong] == []


def test_the_wall_times_are_the_jobs_sums() -> None:
    text = section()
    for name, report in PAIRS[:2]:
        minutes = jobs_of(report).job_wall_s.sum() / 60
        assert re.search(rf"{re.escape(name)} fine-tuning jobs: {minutes:.1f} min", text), (name, f"{minutes:.1f}")


def test_both_starts_stay_within_the_stated_points_of_the_majority_baseline() -> None:
    assert f"within {ABOVE_MAJORITY} points of the" in section()
    for runs in starts(jobs_of(PAIRS[0][1])).values():
        gap = 100 * (runs["test/acc"].mean() - runs["test/majority_acc"].mean())
        assert 0 < gap < ABOVE_MAJORITY, gap
