"""Every number of docs/results.md's "Does pre-training pay?" section, recomputed from the committed
jobs.csv files with pandas and scipy (not with trident.report, whose output the section quotes)."""

from __future__ import annotations

import re

import pandas as pd
import pytest
from scipy import stats

from .conftest import ROOT

RESULTS = ROOT / "docs" / "results"
# (the row's name in the section, the report directory)
PAIRS = [("text", "pretrain_pays_text"), ("vision", "pretrain_pays_vision"),
         ("vision, seeds until decided", "pretrain_pays_vision_adaptive")]
METRICS = ["test/acc", "best/val/acc"]


def section() -> str:
    text = (ROOT / "docs" / "results.md").read_text()
    start = text.index("## Does pre-training pay?")
    return text[start:text.index("\n## ", start + 1)]


def percent(values: pd.Series) -> str:
    return f"{100 * values.mean():.1f} ± {100 * values.std(ddof=1):.1f}"


def expected_rows(name: str, jobs: pd.DataFrame) -> list[str]:
    """The table's two rows of one pair, then its comparison line (pre-trained minus scratch, Welch)."""
    by_start = {start: jobs[jobs.setting == f"start={start}"] for start in ("scratch", "pretrained")}
    rows = [f"| {name} | {start} | {len(runs)} | " + " | ".join(percent(runs[m]) for m in METRICS) + " |"
            for start, runs in by_start.items()]
    welch = stats.ttest_ind(by_start["pretrained"]["test/acc"], by_start["scratch"]["test/acc"], equal_var=False)
    low, high = welch.confidence_interval(0.95)
    difference = by_start["pretrained"]["test/acc"].mean() - by_start["scratch"]["test/acc"].mean()
    rows.append(f"{name}: pre-trained minus scratch, test accuracy {100 * difference:+.1f} points "
                f"[95 % CI {100 * low:+.1f}, {100 * high:+.1f}], Welch p = {welch.pvalue:.2g}")
    return rows


@pytest.mark.parametrize(("name", "report"), PAIRS)
def test_the_section_quotes_the_committed_jobs(name: str, report: str) -> None:
    jobs = pd.read_csv(RESULTS / report / "jobs.csv")
    assert set(jobs.status) == {"completed"} and not jobs.git_dirty.any(), "every job ran committed code to the end"
    text = section()
    for row in expected_rows(name, jobs):
        assert row in text, f"docs/results.md does not say: {row}"


def test_the_wall_times_are_the_jobs_sums() -> None:
    text = section()
    for name, report in PAIRS[:2]:
        minutes = pd.read_csv(RESULTS / report / "jobs.csv").job_wall_s.sum() / 60
        assert re.search(rf"{re.escape(name)} fine-tuning jobs: {minutes:.1f} min", text), (name, f"{minutes:.1f}")
