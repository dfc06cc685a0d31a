"""The tables of docs/results.md that quote a committed jobs.csv, recomputed from it with pandas and
scipy (Holm's correction by hand), not with trident.report, whose reports the page quotes.

A table belongs to the report linked last above it (`Report: [...](results/<name>/report.md)`). Two
kinds are checked cell for cell, every row and no other:

- one axis: ``| setting | n | <metric> | − best [95 % CI] | p | p (Holm) | verdict |``;
- across the tasks: ``| setting | <task>: <metric> | ... |``, each cell ``mean ± std (verdict)``.

The line that follows each report link states its jobs and their summed wall time; that is checked too.
So is every decimal number in the prose of a section with such a table: it must be one this file derives
from the section's jobs.csv files (a mean, a minimum or maximum, a difference of two means, a p-value, a
summed wall time), a table cell of the section, a number of the paper (in a paragraph that starts
``**The paper`` or ``**Against the paper``) or a constant of the set-up listed in SET_UP.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pytest
import yaml
from scipy import stats

from .conftest import ROOT

DOC = ROOT / "docs" / "results.md"
RESULTS = ROOT / "docs" / "results"
ALPHA = 0.05
REPORT_LINK = re.compile(r"\]\(results/([\w-]+)/report\.md\)")
AXIS_HEADER = re.compile(r"^\| setting \| n \| (\S+) \| − best \[95 % CI\] \| p \| p \(Holm\) \| verdict \|$")
TASKS_HEADER = re.compile(r"^\| setting( \| \w+: \S+)+ \|$")
DECIMAL = re.compile(r"(?<![\w.])\d+\.\d+(?![\w.])")
# Configuration values the prose names (not results): the embedding tables' initial std.
SET_UP = {"0.02"}


@dataclass
class Table:
    report: str
    header: str
    rows: list[str]


def doc_tables() -> list[Table]:
    """Every markdown table of the page under a report link, with the report it belongs to."""
    tables: list[Table] = []
    report, lines = None, DOC.read_text().splitlines()
    for number, line in enumerate(lines):
        report = (REPORT_LINK.findall(line) or [report])[-1]
        if report and line.startswith("| setting") and (AXIS_HEADER.match(line) or TASKS_HEADER.match(line)):
            body = []
            for row in lines[number + 2:]:
                if not row.startswith("|"):
                    break
                body.append(row)
            tables.append(Table(report, line, body))
    return tables


def jobs_of(report: str) -> pd.DataFrame:
    jobs = pd.read_csv(RESULTS / report / "jobs.csv", keep_default_na=False, na_values=[""])
    return jobs[jobs.status == "completed"]


def lower_is_better(jobs: pd.DataFrame, metric: str) -> bool:
    monitor = jobs.monitor.iloc[0]
    if metric in (monitor, f"best/{monitor}"):
        return jobs.monitor_mode.iloc[0] == "min"
    return bool(re.search("loss|ppl", metric))


def holm_by_hand(p: list[float]) -> list[float]:
    """Holm's step-down: the k-th smallest of m p-values times (m - k + 1), never below an earlier one."""
    order = np.argsort(p, kind="stable")
    scaled = np.minimum(1.0, np.array(p)[order] * (len(p) - np.arange(len(p))))
    adjusted = np.empty(len(p))
    adjusted[order] = np.maximum.accumulate(scaled)
    return adjusted.tolist()


def against_the_best(jobs: pd.DataFrame, metric: str) -> tuple[str, dict[str, dict[str, object]]]:
    """The best setting, and per setting: seeds, mean, std, difference, Welch's CI and p, Holm's p, verdict."""
    values = {s: group[metric].dropna().to_numpy() for s, group in jobs.groupby("setting", sort=False)}
    means = {s: v.mean() for s, v in values.items()}
    best = (min if lower_is_better(jobs, metric) else max)(means, key=means.__getitem__)
    rows: dict[str, dict[str, object]] = {s: {"n": len(v), "mean": v.mean(), "std": v.std(ddof=1)} for s, v in values.items()}
    others = [s for s in values if s != best]
    for setting in others:
        welch = stats.ttest_ind(values[setting], values[best], equal_var=False)
        interval = welch.confidence_interval(1 - ALPHA)
        rows[setting].update(difference=means[setting] - means[best], low=interval.low, high=interval.high, p=welch.pvalue)
    for setting, p_holm in zip(others, holm_by_hand([rows[s]["p"] for s in others]), strict=True):
        a, b = values[setting], values[best]
        pooled_sd = np.sqrt(((len(a) - 1) * a.var(ddof=1) + (len(b) - 1) * b.var(ddof=1)) / (len(a) + len(b) - 2))
        row = rows[setting]
        if p_holm < ALPHA:
            verdict = "worse than the best"
        elif -pooled_sd < row["low"] and row["high"] < pooled_sd:
            verdict = "within the noise"
        else:
            verdict = f"undecided at {min(len(a), len(b))} seeds"
        row.update(p_holm=p_holm, verdict=verdict)
    rows[best]["verdict"] = "best"
    return best, rows


def axis_rows(report: str, metric: str) -> list[str]:
    best, rows = against_the_best(jobs_of(report), metric)
    lines = []
    for setting, row in rows.items():
        cells = [f"`{setting}`", str(row["n"]), f"{row['mean']:.3f} ± {row['std']:.3f}"]
        if setting == best:
            cells += ["best", "", "", "best"]
        else:
            cells += [f"{row['difference']:+.3f} [{row['low']:+.3f}, {row['high']:+.3f}]", f"{row['p']:.2g}",
                      f"{row['p_holm']:.2g}", str(row["verdict"])]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def task_of(setting: str) -> tuple[str, str]:
    """``"task=lm,pos_encoding=rope"`` -> ``("lm", "pos_encoding=rope")``."""
    parts = setting.split(",")
    task = next(p for p in parts if p.startswith("task="))
    return task.removeprefix("task="), ",".join(p for p in parts if p != task)


def cross_task_rows(report: str, columns: list[tuple[str, str]]) -> list[str]:
    jobs = jobs_of(report)
    split = jobs.setting.map(task_of)
    jobs = jobs.assign(task=[t for t, _ in split], setting=[s for _, s in split])
    cells: dict[str, dict[str, str]] = {}
    for task, metric in columns:
        _, rows = against_the_best(jobs[jobs.task == task], metric)
        for setting, row in rows.items():
            cells.setdefault(setting, {})[task] = f"{row['mean']:.3f} ± {row['std']:.3f} ({row['verdict']})"
    return ["| " + " | ".join([f"`{setting}`", *(by_task.get(task, "not run") for task, _ in columns)]) + " |"
            for setting, by_task in cells.items()]


TABLES = doc_tables()


def test_the_page_quotes_tables_of_committed_jobs() -> None:
    assert TABLES, "docs/results.md has tables under report links"
    for report in {table.report for table in TABLES}:
        jobs = pd.read_csv(RESULTS / report / "jobs.csv")
        assert not jobs.git_dirty.any(), f"{report}: every job ran committed code"


@pytest.mark.parametrize("table", TABLES, ids=[f"{t.report}:{t.header.split('|')[3].strip()}" for t in TABLES])
def test_every_row_is_recomputed_from_jobs_csv(table: Table) -> None:
    if match := AXIS_HEADER.match(table.header):
        expected = axis_rows(table.report, match.group(1))
    else:
        columns = [tuple(cell.strip().split(": ")) for cell in table.header.strip("|").split("|")[1:]]
        expected = cross_task_rows(table.report, columns)  # type: ignore[arg-type]
    assert table.rows == expected


@pytest.mark.parametrize("table", [t for t in TABLES if AXIS_HEADER.match(t.header)],
                         ids=lambda t: f"{t.report}:{t.header.split('|')[3].strip()}")
def test_the_verdicts_agree_with_trident_report(table: Table) -> None:
    """Two implementations of the same statistics, on real data: this file's and the report's."""
    from trident.report import compare_to_best, load_jobs_csv

    metric = AXIS_HEADER.match(table.header).group(1)  # type: ignore[union-attr]
    _, rows = against_the_best(jobs_of(table.report), metric)
    report = compare_to_best(load_jobs_csv(RESULTS / table.report / "jobs.csv"), metric)
    assert report["verdict"].to_dict() == {setting: row["verdict"] for setting, row in rows.items()}
    assert report["p_holm"].dropna().to_dict() == pytest.approx(
        {setting: row["p_holm"] for setting, row in rows.items() if "p_holm" in row}, rel=1e-9)


def test_each_report_link_states_its_jobs_and_wall_time() -> None:
    lines = DOC.read_text().splitlines()
    stated = {}
    for line in lines:
        if line.startswith("Report: ") and (reports := REPORT_LINK.findall(line)):
            stated[reports[0]] = line
    assert {t.report for t in TABLES} <= set(stated), "each quoted report has its Report: line"
    for report in {t.report for t in TABLES}:
        jobs = pd.read_csv(RESULTS / report / "jobs.csv")
        done = jobs[jobs.status == "completed"]
        minutes, mean = done.job_wall_s.sum() / 60, done.job_wall_s.mean()
        claim = f"{len(jobs)} jobs, {len(done)} completed; job wall time {minutes:.1f} min in all, {mean:.0f} s a job"
        assert claim in stated[report], f"{report}: the Report: line should say {claim!r}"


def task_split(jobs: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """The jobs per task of a sweep over ``task=`` (one entry, "", for any other sweep)."""
    if not jobs.setting.str.contains("task=").all():
        return {"": jobs}
    tasks = jobs.setting.map(lambda s: task_of(s)[0])
    return {str(task): jobs[tasks == task] for task in tasks.unique()}


def derived_numbers(report: str, metrics: list[str]) -> set[str]:
    """What the prose may quote of one report, at 0 to 3 decimals."""
    values: list[float] = []
    jobs = jobs_of(report)
    for part in task_split(jobs).values():
        numeric = part.select_dtypes("number").drop(columns=["seed"], errors="ignore")
        means = numeric.groupby(part.setting).mean()
        values += [*means.to_numpy().ravel(), *numeric.min(), *numeric.max(), part.job_wall_s.sum() / 60,
                   jobs.job_wall_s.sum() / 60]
        for column in means:
            column_means = means[column].dropna().to_numpy()
            values += [abs(a - b) for a in column_means for b in column_means]
        for metric in metrics:
            if metric in part and part[metric].notna().any():
                _, rows = against_the_best(part, metric)
                values += [row[key] for row in rows.values() for key in ("p", "p_holm") if key in row]
    numbers = {f"{v:.{d}f}" for v in values if np.isfinite(v) for d in range(4)}
    return numbers | {f"{v:.2g}" for v in values if np.isfinite(v)}


def checked_sections() -> list[tuple[str, list[Table]]]:
    text = DOC.read_text()
    sections = re.split(r"\n(?=## )", text)
    return [(section, [t for t in TABLES if t.header in section and t.rows[0] in section]) for section in sections
            if any(t.header in section and t.rows and t.rows[0] in section for t in TABLES)]


def table_metrics(table: Table) -> list[str]:
    if match := AXIS_HEADER.match(table.header):
        return [match.group(1)]
    return [cell.strip().split(": ")[1] for cell in table.header.strip("|").split("|")[1:]]


@pytest.mark.parametrize(("section", "tables"), checked_sections(), ids=lambda v: v[:40] if isinstance(v, str) else "")
def test_every_decimal_of_the_prose_is_derived_from_the_jobs(section: str, tables: list[Table]) -> None:
    allowed = set(SET_UP)
    for table in tables:
        allowed |= derived_numbers(table.report, table_metrics(table))
        allowed |= set(DECIMAL.findall(" ".join(table.rows)))
    paragraphs = [p for p in section.split("\n\n") if not p.startswith(("|", "**The paper", "**Against the paper"))]
    quoted = DECIMAL.findall(re.sub(r"`[^`]*`|\]\([^)]*\)", "", " ".join(paragraphs)))
    assert quoted, "the section quotes numbers"
    assert [number for number in quoted if number not in allowed] == []


def test_equal_compute_reports_spend_the_budget_within_one_step_and_the_page_says_their_steps() -> None:
    """The page's "Steps: ..." lines name each setting's steps; under the budget of
    conf/budget/equal_compute.yaml every job spends it to within one of its steps."""
    budget = float(yaml.safe_load((ROOT / "conf" / "budget" / "equal_compute.yaml").read_text())["budget"]["flops"])
    checked = 0
    for section, tables in checked_sections():
        steps_lines = [line for line in section.splitlines() if line.startswith("Steps: ")]
        jobs = pd.concat([jobs_of(t.report) for t in tables])
        if "flops_per_step" not in jobs or jobs.flops_per_step.isna().all():
            assert not steps_lines, "a Steps: line belongs to an equal-compute report"
            continue
        spent = jobs.max_steps * jobs.flops_per_step
        assert ((budget - spent >= 0) & (budget - spent < jobs.flops_per_step)).all()
        said = {int(n) for line in steps_lines for n in re.findall(r"(\d+) for", line)}
        assert said and said <= set(jobs.max_steps.astype(int)), (said, sorted(set(jobs.max_steps)))
        checked += 1
    assert checked, "the page has an equal-compute section"
