"""The numbers of docs/results.md, read the way its tests read them, and the few that no file of the
repository holds (MEASURED, UNCHECKED). Parsing only: the statistics are tests/test_results_tables.py's.

A number that is a result, and so must be checked or exempted by name (tests/test_results_numbers.py):
every decimal (``1.941``), every number in scientific notation (``4.6e-06``, ``2e12``, ``4.6 × 10⁻⁶``),
every percentage (``60 %``, ``17.7 ± 2.7 %``), and every integer that counts jobs, seeds, seconds,
minutes or points (``32 jobs``, ``at 8 seeds``, ``45 s``, ``7.4 minutes``, ``+2.3 points``), on any line
of the page, tables included. Not read: fenced code blocks, inline code, link targets and dates (names
and commands, not results), a number glued to a word or a hyphen (``avx512``, ``GPT-2``, ``8x8``, seeds
``1-3``), a version (``2.15.0``), and the other integers: sizes, steps, seed ids, counts of settings or
plays, years, table numbers, which describe the set-up and are not measured. An integer's value keeps
its unit (``"4 seeds"`` is not ``"4 %"``), and a constant of the set-up counts only in its own words
(``SetUp``: ``"[95 % CI"``, not any 95 %).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass

from .conftest import ROOT

DOC = ROOT / "docs" / "results.md"
SECTION_MARK = "*(issue 28)*"
# What is not read: code, link targets, dates.
HIDDEN = re.compile(r"```.*?```|`[^`\n]*`|\]\([^)\n]*\)|\b\d{4}-\d{2}-\d{2}\b", re.DOTALL)
# A number not glued to a word, a hyphen or a version; thousands separated by commas ("5,940").
NUMBER = re.compile(
    r"(?<![\w.])(?<!\w-)(?P<digits>\d{1,3}(?:,\d{3})+|\d+)(?P<fraction>\.\d+)?"
    r"(?P<exponent>e[-+]?\d+| × 10[⁻⁰¹²³⁴⁵⁶⁷⁸⁹]+)?(?!\w|\.\d)")
# An integer is a result when a count of jobs, seeds, seconds, minutes or points, or a percentage, follows;
# its value then carries that unit ("4 seeds" is not "4 %"). The pattern's groups: the unit as written.
RESULT_UNIT = re.compile(r" ?(%)| (jobs|completed|seeds?|s|min|minutes?|points?)\b")
UNITS = {"%": "%", "jobs": "jobs", "completed": "jobs", "seed": "seeds", "seeds": "seeds", "s": "s", "min": "min",
         "minute": "min", "minutes": "min", "point": "points", "points": "points"}
SUPERSCRIPT = str.maketrans("⁻⁰¹²³⁴⁵⁶⁷⁸⁹", "-0123456789")


@dataclass(frozen=True)
class Number:
    """One result number of the page: its text as written and where it stands."""

    text: str
    unit: str  # "jobs", "seeds", "s", "min", "points", "%" or "" (for an integer, what made it a result)
    section: str  # the "## " heading of its section ("" for the text above the first)
    line: int  # 0-based line number on the page
    start: int  # column on the line


def plain(number: str) -> str:
    """``"4.6 × 10⁻⁶"`` -> ``"4.6e-06"``, ``"5,940"`` -> ``"5940"``: the form the checks compute."""
    if " × 10" in number:
        mantissa, power = number.split(" × 10")
        number = f"{mantissa}e{power.translate(SUPERSCRIPT)}"
    if "e" in number:  # Python's form, as f"{p:.2g}" writes it: "1e-4" -> "1e-04", "2e12" -> "2e+12"
        mantissa, power = number.split("e")
        return f"{mantissa}e{int(power):+03d}"
    return number.replace(",", "")


def value(text: str, unit: str) -> str:
    """What a check compares: ``plain`` of a number, with its unit if an integer (``"4 seeds"``)."""
    return f"{plain(text)} {unit}" if unit else plain(text)


def numbers_of(line: str) -> list[tuple[int, str, str]]:
    """``[(column, text, unit), ...]`` of the result numbers of one line of the page."""
    visible = HIDDEN.sub(lambda m: " " * len(m.group()), line)
    found = []
    for match in NUMBER.finditer(visible):
        unit = RESULT_UNIT.match(visible, match.end())
        if not (match.group("fraction") or match.group("exponent")):
            if not unit:
                continue
            found.append((match.start(), match.group(), UNITS[unit.group(1) or unit.group(2)]))
        else:
            found.append((match.start(), match.group(), ""))
    return found


@functools.cache
def page_lines() -> tuple[str, ...]:
    """The page's lines, each fenced code block blanked (its lines kept, so line numbers hold)."""
    text = DOC.read_text()
    return tuple(re.sub(r"```.*?```", lambda m: "\n" * m.group().count("\n"), text, flags=re.DOTALL).splitlines())


@functools.cache
def page_numbers() -> tuple[Number, ...]:
    """Every result number of the page, in order."""
    found, section = [], ""
    for index, line in enumerate(page_lines()):
        if line.startswith("## "):
            section = line
        found += [Number(text, unit, section, index, column) for column, text, unit in numbers_of(line)]
    return tuple(found)


def section_lines(heading_start: str) -> range:
    """The line numbers of the section whose heading starts with ``heading_start``."""
    lines = page_lines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading_start))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return range(start, end)


def paragraphs(lines: range) -> list[range]:
    """The line ranges of the blank-line separated blocks of some lines (a table is one block)."""
    text, blocks, start = page_lines(), [], None
    for index in [*lines, lines.stop]:
        blank = index == lines.stop or not text[index].strip()
        if blank and start is not None:
            blocks.append(range(start, index))
            start = None
        elif not blank and start is None:
            start = index
    return blocks


@dataclass(frozen=True)
class SetUp:
    """A constant of the set-up, a result nowhere else: its value, and the words before and after it
    (regular expressions; ``after`` starts with the number's unit, if any)."""

    value: str
    before: str = ""
    after: str = ""

    def names(self, number: Number) -> bool:
        """Whether the number is this constant, in its words (which may begin on the line before)."""
        if value(number.text, number.unit) != self.value:
            return False
        lines = page_lines()
        previous = lines[number.line - 1] if number.line else ""
        following = lines[number.line + 1] if number.line + 1 < len(lines) else ""
        line = lines[number.line]
        ahead = f"{previous} {line[:number.start]}"
        behind = f"{line[number.start + len(number.text):]} {following}"
        return bool(re.search(rf"(?:{self.before})\s*$", ahead) and re.match(rf"\s*(?:{self.after})", behind))


@dataclass(frozen=True)
class Measured:
    """A sweep's wall time from its command's start to its end: measured outside its jobs, so in no
    jobs.csv; it must exceed the sum of its jobs' wall times, and agree with docs/sweeps.md's table."""

    section: str  # the start of its section's heading
    phrase: str  # the words on the page that state it: "1 h 39 min", "7.4 minutes", "(5,940 s)"
    reports: tuple[str, ...]  # the reports of the jobs it ran
    sweeps_page_preset: str | None = None  # the row of docs/sweeps.md's table that states it too

    @property
    def seconds(self) -> float:
        hours = re.search(r"(\d+) h (\d+) min", self.phrase)
        if hours:
            return 3600 * int(hours.group(1)) + 60 * int(hours.group(2))
        value, unit = re.search(r"([\d,.]+) (s|min|minutes)\b", self.phrase).groups()  # type: ignore[union-attr]
        return float(plain(value)) * (1 if unit == "s" else 60)


# The LM sweeps with seeds until decided and the reference row, on the AMD EPYC (the Wall time section).
AMD_EPYC_LM = ("ablation_base", "ablation_pos_encoding", "ablation_pos_encoding_scaled", "ablation_width",
               "ablation_depth", "ablation_ffn", "ablation_norm", "ablation_dropout")
EQUAL_COMPUTE = ("ablation_width_equal_compute", "ablation_depth_equal_compute", "ablation_ffn_equal_compute",
                 "ablation_heads_equal_compute")
MEASURED = [
    Measured("## Wall time", "1 h 39 min together", AMD_EPYC_LM),
    Measured("## Wall time", "(5,940 s)", AMD_EPYC_LM),
    Measured("## Wall time", "from 2.3 minutes", ("ablation_base",), "ablation_base"),
    Measured("## Wall time", "to 25.7 minutes", ("ablation_ffn",), "ablation_ffn"),
    Measured("## Wall time", "took 7.4 minutes more", ("ablation_dropout_full_data",)),
    Measured("## Wall time", "took 30.9 minutes", ("ablation_heads",), "ablation_heads"),
    Measured("## Wall time", "sweeps 34.5 minutes", EQUAL_COMPUTE),
    Measured("## Wall time", "tasks 50.4 minutes", ("ablation_pos_encoding_tasks",),
             "ablation_pos_encoding_tasks"),
    Measured("## Wall time", "took 77.5 minutes", ("ablation_label_smoothing",), "ablation_label_smoothing"),
    Measured("## Label smoothing", "took 4,652 s from its start", ("ablation_label_smoothing",),
             "ablation_label_smoothing"),
    Measured("## Does pre-training pay?", "the sweep command 819 s", ("pretrain_pays_text",)),
    Measured("## Does pre-training pay?", "the sweep command 530 s", ("pretrain_pays_vision",)),
]
# Numbers that no file of the repository holds, each with the reason; every other number is checked.
UNCHECKED = {
    ("## Does pre-training pay?", "(240 s)"): "the MLM pre-training's time, in the uncommitted times.txt",
    ("## Does pre-training pay?", "MLM pre-training 240 s"): "the same time, said again",
    ("## Does pre-training pay?", "4,000 MNIST digits; 420 s"): "the ViT pre-training's time, in times.txt",
    ("## Does pre-training pay?", "pre-training 420 s)"): "the same time, said again",
    ("## Does pre-training pay?", "for 4 minutes"): "the MLM pre-training's 240 s, in minutes",
    ("## Does pre-training pay?", "~0.1 M parameters"): "the model's size, a set-up, in no jobs.csv",
    ("## Does pre-training pay?", "about 15 points"): "GPT's paper (Radford et al. 2018, Table 5)",
    ("## Does pre-training pay?", "~1 min of Hydra"): "the script's times beyond the jobs', in times.txt",
    ("## Post-norm versus pre-norm", "runs of about 2 s"): "test runs beside the sweep, in no jobs.csv",
    ("## The reference row", "(about 60 % of one pass)"): "a property of the corpus, not of a run",
    ("## Positional encodings", "d_model^-0.5"): "the exponent of a formula, not a result",
    ("## Preference tuning", "SFT alone: 0.175"): "trident-harness on the SFT run, docs/results/dpo_beta/sft_harness.json",
    ("## CLIP's zero-shot", "cosine 0.998"): "a one-seed diagnostic after the sweep (its command in the text), in no jobs.csv",
    ("## CLIP's zero-shot", "above 0.98"): "a one-seed diagnostic after the sweep (its command in the text), in no jobs.csv",
    ("## CLIP's zero-shot", "for 0.33 of"): "a one-seed diagnostic after the sweep (its command in the text), in no jobs.csv",
    ("## CLIP's zero-shot", "and 0.27 of"): "a one-seed diagnostic after the sweep (its command in the text), in no jobs.csv",
    ("## CLIP's zero-shot", "for 0.69 of"): "a one-seed diagnostic after the sweep (its command in the text), in no jobs.csv",
    ("## CLIP's zero-shot", "and 0.18"): "a one-seed diagnostic after the sweep (its command in the text), in no jobs.csv",
    ("## CLIP's zero-shot", "at 0.62"): "a one-seed diagnostic after the sweep (its command in the text), in no jobs.csv",
    ("## CLIP's zero-shot", "(69 % of"): "a one-seed diagnostic after the sweep (its command in the text), in no jobs.csv",
    ("## CLIP's zero-shot", "only 7 % of"): "a one-seed diagnostic after the sweep (its command in the text), in no jobs.csv",
}


def claimed_by_phrase(numbers: Sequence[Number], section: str, phrase: str) -> list[Number]:
    """The numbers of a section that lie inside an occurrence of the phrase on their line."""
    lines = page_lines()
    claimed = []
    for number in numbers:
        if not number.section.startswith(section):
            continue
        line = lines[number.line]
        for match in re.finditer(re.escape(phrase), line):
            if match.start() <= number.start < match.end():
                claimed.append(number)
    return claimed
