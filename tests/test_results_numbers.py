"""Every number of docs/results.md is checked: what counts as a number is tests/results_page.py's
docstring (decimals, scientific notation, percentages and the integers that count jobs, seeds, seconds,
minutes or points, anywhere outside code and links, tables and the Summary included).

Each number is checked by exactly one test, and ``test_every_number_of_the_page_is_checked`` proves that
none is left out:
- a row of a table of a section marked *(issue 28)*: tests/test_results_tables.py, row for row;
- the "Does pre-training pay?" section: tests/test_results_pretrain_pays.py, table and prose;
- a row of the Summary: ``test_each_summary_row_quotes_its_section``, from the section the row summarises;
- a sweep's measured wall time (results_page.MEASURED): ``test_each_measured_sweep_time_...``;
- results_page.UNCHECKED: numbers no file of the repository holds, each with its reason;
- every other number (the text of every section): ``test_every_number_of_the_text_is_derived``, from the
  section's reports (test_results_tables.derived_numbers: a table cell, a mean, a standard deviation, a
  difference, an extreme, a p-value, a job count, a wall time), a constant of the set-up in its words
  (``set_up``: "std 0.02", "[95 % CI"), a number of the paper's Table 3 in a paragraph on the paper, or
  the label smoothing section's power calculation (``effect_size_numbers``).
"""

from __future__ import annotations

import re

import pandas as pd
import pytest
import yaml
from scipy import stats

from . import test_results_pretrain_pays as pretrain
from .conftest import ROOT, SWEEPS_PAGE, compose_config
from .results_page import (
    AMD_EPYC_LM,
    MEASURED,
    SECTION_MARK,
    UNCHECKED,
    Measured,
    Number,
    SetUp,
    claimed_by_phrase,
    numbers_of,
    page_lines,
    page_numbers,
    paragraphs,
    plain,
    section_lines,
    value,
)
from .test_results_tables import (
    ACROSS_MACHINES,
    ALPHA,
    RESULTS,
    SECTIONS,
    Table,
    derived_numbers,
    jobs_of,
    section_tables,
)

# "Attention Is All You Need", Table 3: dev perplexity and BLEU of the rows the page quotes.
PAPER_TABLE_3 = {
    "base": (4.92, 25.8), "1 head": (5.29, 24.9), "4 heads": (5.00, 25.5), "16 heads": (4.91, 25.8),
    "32 heads": (5.01, 25.4), "N 2": (6.11, 23.7), "N 4": (5.19, 25.3), "N 8": (4.88, 25.5),
    "d_model 256": (5.75, 24.5), "d_model 1024": (4.66, 26.0), "d_ff 1024": (5.12, 25.4), "d_ff 4096": (4.75, 26.2),
    "P_drop 0.0": (5.77, 24.6), "P_drop 0.2": (4.95, 25.5), "eps_ls 0.0": (4.67, 25.3), "eps_ls 0.2": (5.47, 25.7),
    "learned positions": (4.92, 25.7),
}
PAPER_PARAGRAPH = ("**The paper:", "**The paper** ", "**Against the paper")
# The power calculation of the label smoothing section: the chance to find the paper's gain from smoothing.
POWER = 0.8
EFFECT_SIZE_PARAGRAPH = "**Against the paper's effect size"
STATED_SWEEP_TIME = re.compile(r"^\| `python train\.py -m experiment=(\w+)` \|.*\| \d+[^|]*?, ([\d.]+) min \(", re.MULTILINE)


def set_up() -> list[SetUp]:
    """The constants of the set-up that the text names, read where they are set, each in its words."""
    base = compose_config(["experiment=ablation_base"])
    equal_compute = yaml.safe_load((ROOT / "conf" / "budget" / "equal_compute.yaml").read_text())
    return [
        SetUp("0.02", r"std"),  # the embedding tables' initial std (src/trident/backbone/layers.py), a code constant
        SetUp(plain(f"{base.optimizer.lr:.0e}"), r"learning rate( of)?"),
        SetUp(plain(f"{float(equal_compute['budget']['flops']):.0e}"), after=r"(model )?FLOPs|/ the FLOPs"),
        SetUp(f"{100 * equal_compute['scheduler']['warmup_steps']:.0f} %", r"warms up for", r"% of"),
        SetUp(plain(f"{ACROSS_MACHINES:.0e}"), r"within", r"nats"),  # the reference-row test's tolerance
        SetUp(f"{100 * ALPHA:.0f} %", r"(at|<)", "%"),  # the tests' level
        SetUp(f"{100 * (1 - ALPHA):.0f} %", r"(\[|Welch's)", "% (CI|confidence)"),  # the intervals' level
    ]


def is_allowed(number: Number, allowed: set[str]) -> bool:
    """The number's value is one of ``allowed``, or a constant of the set-up named in its words."""
    return value(number.text, number.unit) in allowed or any(constant.names(number) for constant in SET_UP)


def paper_numbers() -> set[str]:
    """The paper's perplexities at two decimals and BLEU scores at one, as the paper prints them."""
    return {f"{number:.2f}" if number < 10 else f"{number:.1f}" for row in PAPER_TABLE_3.values() for number in row}


def effect_size_numbers() -> set[str]:
    """How many seeds find the paper's 0.5 BLEU from smoothing, at this budget's seed spread."""
    gain = PAPER_TABLE_3["base"][1] - PAPER_TABLE_3["eps_ls 0.0"][1]
    jobs = jobs_of("ablation_label_smoothing")
    spread = round(float(jobs.groupby("setting")["best/val/bleu"].var().mean() ** 0.5), 1)
    alpha = ALPHA / 3  # Holm's first level over the three pairs of three settings (a fixed-seed look)
    normal = 2 * ((stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(POWER)) * spread / gain) ** 2

    def power(n: int) -> float:
        df, shift = 2 * n - 2, gain / spread / (2 / n) ** 0.5
        t = stats.t.ppf(1 - alpha / 2, df)
        return 1 - stats.nct.cdf(t, df, shift) + stats.nct.cdf(-t, df, shift)

    student = next(n for n in range(2, 100) if power(n) >= POWER)
    share = gain / PAPER_TABLE_3["base"][1]
    score = round(jobs["best/val/bleu"].mean())
    return {f"{gain:.1f}", f"{spread:.1f}", f"{alpha:.3f}", f"{normal:.0f} seeds", f"{student} seeds",
            f"{(normal + student) / 2:.0f} seeds", f"{100 * share:.0f} %", f"{share * score:.2f}"}


def wall_time_numbers() -> set[str]:
    """What the Wall time section may quote of the reports: job counts (one sweep's or the AMD EPYC's LM
    sweeps' together), the most seeds of a setting, a job's mean minutes."""
    reports = [path.parent.name for path in RESULTS.glob("*/jobs.csv")]
    allowed = {f"{sum(len(jobs_of(report)) for report in AMD_EPYC_LM)} jobs"}
    for report in reports:
        jobs = jobs_of(report)
        allowed |= {f"{len(jobs)} jobs", f"{jobs.groupby('setting').size().max()} seeds",
                    f"{jobs.job_wall_s.mean() / 60:.0f} min"}
    return allowed


def section_allowed(heading: str) -> set[str]:
    """What the text of a section may quote, from the reports of its tables."""
    if heading.endswith(SECTION_MARK):
        section = next(s for s in SECTIONS if s.splitlines()[0] == heading)
        tables = section_tables(section)
        return set().union(*(derived_numbers(t) | numbers_in_rows(t) for t in tables))
    if heading.startswith(pretrain.HEADING):
        return pretrain.derived_numbers()
    if heading.startswith("## Wall time"):
        return wall_time_numbers()
    assert heading in ("", "## Summary", "## The same comparison in a W&B dashboard"), f"no rule for {heading}"
    return set()


def headings() -> list[str]:
    return ["", *(line for line in page_lines() if line.startswith("## "))]


def table_row_lines() -> set[int]:
    """The page's table rows that a test checks row for row: the *(issue 28)* tables' (test_results_tables.py),
    the pre-training table's (test_results_pretrain_pays.py) and the Summary's (below)."""
    lines = page_lines()
    rows = set(pretrain.table_lines()) | set(summary_rows())
    for section in SECTIONS:
        heading = lines.index(section.splitlines()[0])
        for table in section_tables(section):
            rows |= {heading + table.first_row + i for i in range(len(table.rows))}
    return rows


def summary_rows() -> list[int]:
    """The Summary table's rows (not its header or the line under it)."""
    lines = page_lines()
    table = [i for i in section_lines("## Summary") if lines[i].startswith("|")]
    return table[2:]


def numbers_in_rows(table: Table) -> set[str]:
    return {value(text, unit) for row in table.rows for _, text, unit in numbers_of(row)}


def exempt_numbers() -> dict[Number, str]:
    """The measured sweep times and the UNCHECKED numbers, each with what checks or excuses it."""
    numbers, exempt = page_numbers(), {}
    for measured in MEASURED:
        exempt |= dict.fromkeys(claimed_by_phrase(numbers, measured.section, measured.phrase), "measured")
    for (section, phrase), reason in UNCHECKED.items():
        exempt |= dict.fromkeys(claimed_by_phrase(numbers, section, phrase), reason)
    return exempt


def text_numbers(heading: str) -> list[tuple[Number, set[str]]]:
    """The numbers of a section's text (not a checked row, not exempt), each with what its paragraph may
    quote besides the section's numbers."""
    rows, exempt, lines = table_row_lines(), exempt_numbers(), page_lines()
    extra_by_line: dict[int, set[str]] = {}
    for block in paragraphs(section_lines(heading)) if heading else []:
        if lines[block.start].startswith(EFFECT_SIZE_PARAGRAPH):
            extra_by_line |= dict.fromkeys(block, paper_numbers() | effect_size_numbers())
        elif lines[block.start].startswith(PAPER_PARAGRAPH):
            extra_by_line |= dict.fromkeys(block, paper_numbers())
    return [(n, extra_by_line.get(n.line, set())) for n in page_numbers()
            if n.section == heading and n.line not in rows and n not in exempt]


SET_UP = set_up()
TEXT_HEADINGS = [h for h in headings() if not h.startswith(pretrain.HEADING)]


@pytest.mark.parametrize("heading", TEXT_HEADINGS, ids=lambda h: h[3:40] or "(top)")
def test_every_number_of_the_text_is_derived(heading: str) -> None:
    allowed = section_allowed(heading)
    wrong = [(n.line + 1, n.text) for n, extra in text_numbers(heading) if not is_allowed(n, allowed | extra)]
    assert wrong == [], f"{heading or 'the top of the page'}: numbers not derived from its reports"


def summarised_section(row: str) -> str:
    """The heading of the section a Summary row summarises: the one naming its preset, or starting with
    its axis."""
    axis = row.split("|")[1]
    for heading in headings()[1:]:
        if any(f"`{name}`" in heading for name in re.findall(r"`(\w+)`", axis)):
            return heading
    return next(h for h in headings()[1:] if h[3:].lower().startswith(axis.split("(")[0].strip().lower()))


def test_each_summary_row_quotes_its_section() -> None:
    lines = page_lines()
    assert len(summary_rows()) >= 10, "the Summary has a row per axis"
    for index in summary_rows():
        heading = summarised_section(lines[index])
        allowed = section_allowed(heading)
        quoted = [n for n in page_numbers() if n.line == index]
        assert [n.text for n in quoted if not is_allowed(n, allowed)] == [], (lines[index][:60], heading)


@pytest.mark.parametrize("measured", MEASURED, ids=lambda m: m.phrase)
def test_each_measured_sweep_time_exceeds_its_jobs_and_agrees_with_the_sweeps_page(measured: Measured) -> None:
    assert claimed_by_phrase(page_numbers(), measured.section, measured.phrase), "the page says it"
    jobs = pd.concat([pd.read_csv(RESULTS / report / "jobs.csv") for report in measured.reports])
    assert measured.seconds > jobs.job_wall_s.sum(), "a sweep takes longer than its jobs"
    assert measured.seconds < 1.5 * jobs.job_wall_s.sum() + 120, "a sweep's overhead is its processes' starts"
    if measured.sweeps_page_preset:
        stated = dict(STATED_SWEEP_TIME.findall(SWEEPS_PAGE.read_text()))
        assert f"{measured.seconds / 60:.1f}" == stated[measured.sweeps_page_preset], "docs/sweeps.md's table says"
    same = [m.seconds for m in MEASURED if m.reports == measured.reports and m.section == measured.section]
    assert len(set(same)) == 1, f"one sweep, one time: {same}"


def test_every_number_of_the_page_is_checked() -> None:
    """Each number of the page is a checked row, exempt by name, or in the text of a section that
    ``test_every_number_of_the_text_is_derived`` or the pre-training test reads; and every exemption
    names a number that is on the page (the measured times: their own test)."""
    rows, exempt = table_row_lines(), exempt_numbers()
    text = {n for heading in TEXT_HEADINGS for n, _ in text_numbers(heading)} | set(pretrain.prose_numbers())
    numbers = page_numbers()
    assert len(numbers) > 900, "the page's numbers are read"
    assert [(n.line + 1, n.text) for n in numbers if (n.line in rows) + (n in exempt) + (n in text) != 1] == []
    for section, phrase in UNCHECKED:
        assert claimed_by_phrase(numbers, section, phrase), f"not on the page: {phrase}"
