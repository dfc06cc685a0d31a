"""The sections of docs/results.md marked *(issue 28)*, recomputed from the committed jobs.csv files
with pandas and scipy (the tests and Holm's correction by hand), not with trident.report.

A table belongs to the report linked last above it in its section (`Report: [...](results/<name>/report.md)`).
Two kinds are checked cell for cell, every row and no other; a section has no other `| setting` table:

- one axis: ``| setting | n | <metric> | − best [95 % CI] | p | p (Holm) | verdict |``;
- across the tasks: ``| setting | <task>: <metric> | ... |``, each cell ``mean ± std (verdict)``.

Each ``Report:`` line states its jobs and their summed wall time; each ``Steps:`` line the steps of the
table below it, in its row order. A commit the text names must have run the jobs. The numbers of the
text are checked by tests/test_results_numbers.py against ``derived_numbers`` below.

The statistics are the corrected procedure of issue 37, and nowhere else in the tests of the page:
``look_by_hand`` (Welch's test and Wellek's equivalence test, ``wellek_by_hand``, over every pair of
settings, each corrected with ``holm_by_hand`` over all the pairs; the verdicts at a level) and
``against_the_best``. Recomputed by hand: a fixed-seed sweep, one look at ALPHA; and each round of a
sweep with seeds until decided, from its committed ``adaptive.json`` (which seeds each setting had, which
settings were open, the round's level from the spending function, ``spent_by_hand``): ``rounds_by_hand``
looks at each round again and must find the file's best and verdicts; each row of that metric's table is
the look of the round that decided it. Not by hand: that the loop would have run exactly those rounds is
trident's replay (``test_the_verdicts_agree_with_trident_report``, through
``trident.report.sequential.read_record``, which replays the jobs and refuses a file whose verdicts they do
not give); the by-hand check still requires each open setting to have every seed of its round.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from itertools import combinations

import numpy as np
import pandas as pd
import pytest
import yaml
from omegaconf import OmegaConf
from scipy import stats

from .conftest import ROOT, compose_config
from .results_page import DOC, SECTION_MARK

RESULTS = ROOT / "docs" / "results"
ALPHA = 0.05
# "Within the noise": the equivalence margin, in seed standard deviations.
NOISE_MARGIN_SD = 1.0
REPORT_LINK = re.compile(r"\]\(results/([\w-]+)/report\.md\)")
AXIS_HEADER = re.compile(r"^\| setting \| n \| (\S+) \| − best \[95 % CI\] \| p \| p \(Holm\) \| verdict \|$")
TASKS_HEADER = re.compile(r"^\| setting( \| \w+: \S+)+ \|$")
# Columns the text may quote besides the tables' metrics, with their decimals.
EXTRA_COLUMNS = {"job_wall_s": 1, "val/ppl": 1, "test/ppl": 1, "val/bleu": 3,
                 "test/kv_cache_bytes_per_token": 0, "test/greedy_tokens_per_s": 1,
                 "test/trainable_params": 0, "test/all_classes_acc": 3}
METRIC_DECIMALS = 3


@dataclass
class Table:
    report: str
    header: str
    rows: list[str]
    steps_line: str | None  # the "Steps: ..." line above it, if any
    first_row: int  # the line of its first row, counted from its section's heading


@dataclass
class Comparison:
    """One setting against the best: its seeds' values, and the test (None for the best itself)."""

    values: np.ndarray
    difference: float = math.nan
    low: float = math.nan
    high: float = math.nan
    p: float = math.nan
    p_holm: float = math.nan
    p_equivalence_holm: float = math.nan
    verdict: str = "best"


def sections() -> list[str]:
    return [s for s in re.split(r"\n(?=## )", DOC.read_text()) if s.splitlines()[0].endswith(SECTION_MARK)]


def section_tables(section: str) -> list[Table]:
    """Every ``| setting`` table of a section, with the report linked last above it."""
    tables: list[Table] = []
    report, steps_line, lines = None, None, section.splitlines()
    for number, line in enumerate(lines):
        report = (REPORT_LINK.findall(line) or [report])[-1]
        steps_line = line if line.startswith("Steps: ") else steps_line
        if line.startswith("| setting") and (number == 0 or not lines[number - 1].startswith("|")):
            assert report, f"a table without a report link above it: {line}"
            assert AXIS_HEADER.match(line) or TASKS_HEADER.match(line), f"a table of an unknown form: {line}"
            body = []
            for row in lines[number + 2:]:
                if not row.startswith("|"):
                    break
                body.append(row)
            tables.append(Table(report, line, body, steps_line, number + 2))
            steps_line = None
    return tables


def jobs_of(report: str) -> pd.DataFrame:
    jobs = pd.read_csv(RESULTS / report / "jobs.csv", keep_default_na=False, na_values=[""])
    return jobs[jobs.status == "completed"]


def lower_is_better(jobs: pd.DataFrame, metric: str) -> bool:
    monitor = jobs.monitor.iloc[0]
    if metric in (monitor, f"best/{monitor}"):
        return jobs.monitor_mode.iloc[0] == "min"
    return bool(re.search("loss|ppl|perplexity", metric))


def holm_by_hand(p: list[float]) -> list[float]:
    """Holm's step-down: the k-th smallest of m p-values times (m - k + 1), never below an earlier one."""
    if not p:
        return []
    order = np.argsort(p, kind="stable")
    scaled = np.minimum(1.0, np.array(p)[order] * (len(p) - np.arange(len(p))))
    adjusted = np.empty(len(p))
    adjusted[order] = np.maximum.accumulate(scaled)
    return adjusted.tolist()


def wellek_by_hand(a: np.ndarray, b: np.ndarray) -> float:
    """Wellek's equivalence p within ± NOISE_MARGIN_SD: Student's pooled T^2 under the noncentral F(1, n_a + n_b - 2)
    of a true difference of that many standard deviations."""
    dof = len(a) + len(b) - 2
    pooled_var = ((len(a) - 1) * a.var(ddof=1) + (len(b) - 1) * b.var(ddof=1)) / dof
    t2 = (a.mean() - b.mean()) ** 2 / (pooled_var * (1 / len(a) + 1 / len(b)))
    return float(stats.ncf.cdf(t2, 1, dof, NOISE_MARGIN_SD**2 * len(a) * len(b) / (len(a) + len(b))))


def look_by_hand(values: dict[str, np.ndarray], lower: bool, level: float,
                 candidates: list[str] | None = None) -> tuple[str, dict[str, Comparison]]:
    """The best setting by mean (among ``candidates``), and every setting's comparison with it: Welch's and
    Wellek's tests over every pair of settings, each corrected with Holm over all the pairs, the verdicts at
    ``level``."""
    means = {s: v.mean() for s, v in values.items() if candidates is None or s in candidates}
    best = (min if lower else max)(means, key=means.__getitem__)
    pairs = [pair for pair in combinations(values, 2)
             if min(len(values[s]) for s in pair) >= 2 and any(values[s].var() > 0 for s in pair)]
    welch = holm_by_hand([stats.ttest_ind(values[a], values[b], equal_var=False).pvalue for a, b in pairs])
    wellek = holm_by_hand([wellek_by_hand(values[a], values[b]) for a, b in pairs])
    corrected = {frozenset(pair): (w, e) for pair, w, e in zip(pairs, welch, wellek, strict=True)}
    rows = {s: Comparison(v) for s, v in values.items()}
    b = values[best]
    for setting in (s for s in values if s != best):
        row, a = rows[setting], values[setting]
        row.difference = a.mean() - b.mean()
        row.verdict = f"undecided at {min(len(a), len(b))} seeds"
        if frozenset((setting, best)) not in corrected:
            continue
        test = stats.ttest_ind(a, b, equal_var=False)
        interval = test.confidence_interval(1 - ALPHA)
        row.low, row.high, row.p = interval.low, interval.high, test.pvalue
        row.p_holm, row.p_equivalence_holm = corrected[frozenset((setting, best))]
        if row.p_holm < level:
            row.verdict = "worse than the best"
        elif row.p_equivalence_holm < level:
            row.verdict = "within the noise"
    return best, rows


def adaptive_record(report: str, metric: str) -> dict | None:
    """The committed ``adaptive.json`` of a sweep run with seeds until decided on ``metric``, else None."""
    path = RESULTS / report / "adaptive.json"
    record = json.loads(path.read_text()) if path.is_file() else None
    return record if record and record["metric"] == metric else None


def spent_by_hand(design: dict, seeds: int) -> float:
    """The Pocock-type spending function alpha ln(1 + (e - 1) t) at t = seeds / max_seeds."""
    return design["alpha"] * math.log(1 + (math.e - 1) * seeds / design["max_seeds"])


def rounds_by_hand(jobs: pd.DataFrame, metric: str, record: dict) -> tuple[str, dict[str, Comparison]]:
    """The rounds of ``adaptive.json`` looked at again by hand, each at its level of the design: every setting
    open at a round has its seeds up to that round's count; the open ones are the best and the undecided of
    the round before; each row comes from the round that decided it (the best and the undecided: the last)."""
    design, lower = record["design"], record["better"] == "min"
    by_seed = {s: group.sort_values("seed")[["seed", metric]].dropna() for s, group in jobs.groupby("setting")}
    rows: dict[str, Comparison] = {}
    open_settings = list(record["settings"])
    for number, seen in enumerate(record["rounds"], start=1):
        seeds = min(design["max_seeds"], design["first_seeds"] + (number - 1) * design["step"])
        level = spent_by_hand(design, seeds) - spent_by_hand(design, seeds - design["step"] if number > 1 else 0)
        assert (seen["number"], seen["seeds"], seen["level"]) == (number, seeds, pytest.approx(level, rel=1e-12))
        assert list(seen["verdicts"]) == [s for s in open_settings if s in seen["completed"]]
        for setting in seen["verdicts"]:
            assert seen["completed"][setting] == (by_seed[setting].seed <= seeds).sum(), (number, setting)
        values = {s: by_seed[s][metric].to_numpy()[:n] for s, n in seen["completed"].items()}
        best, compared = look_by_hand(values, lower, level, list(seen["verdicts"]))
        assert (best, {s: compared[s].verdict for s in seen["verdicts"]}) == (seen["best"], seen["verdicts"])
        for setting in seen["verdicts"]:
            rows[setting] = compared[setting]
            if compared[setting].verdict in ("worse than the best", "within the noise"):
                compared[setting].verdict += f" (round {number}, level {level:.3g})"
        open_settings = [s for s in open_settings if s == best or seen["verdicts"].get(s, "undecided").startswith("undecided")]
    assert open_settings == [best] or len(record["rounds"]) == 1 + math.ceil(
        (design["max_seeds"] - design["first_seeds"]) / design["step"]), "the loop ran until decided or the last round"
    return best, {s: rows[s] for s in record["settings"] if s in rows}


def against_the_best(jobs: pd.DataFrame, metric: str, report: str | None = None) -> tuple[str, dict[str, Comparison]]:
    """The best setting, and every setting's comparison with it: the rounds of ``report``'s ``adaptive.json``
    when the loop decided on ``metric``, else one look at ALPHA over all the completed seeds."""
    if report and (record := adaptive_record(report, metric)):
        return rounds_by_hand(jobs, metric, record)
    values = {s: group[metric].dropna().to_numpy() for s, group in jobs.groupby("setting", sort=False)}
    return look_by_hand(values, lower_is_better(jobs, metric), ALPHA)


def mean_std(values: np.ndarray) -> str:
    return f"{values.mean():.3f} ± {values.std(ddof=1):.3f}"


def axis_rows(report: str, metric: str) -> list[str]:
    lines = []
    for setting, row in against_the_best(jobs_of(report), metric, report)[1].items():
        cells = [f"`{setting}`", str(len(row.values)), mean_std(row.values)]
        if row.verdict == "best":
            cells += ["best", "", "", "best"]
        else:
            cells += [f"{row.difference:+.3f} [{row.low:+.3f}, {row.high:+.3f}]", f"{row.p:.2g}", f"{row.p_holm:.2g}",
                      row.verdict]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def task_of(setting: str) -> tuple[str, str]:
    """``"task=lm,pos_encoding=rope"`` -> ``("lm", "pos_encoding=rope")``."""
    parts = setting.split(",")
    task = next(p for p in parts if p.startswith("task="))
    return task.removeprefix("task="), ",".join(p for p in parts if p != task)


def task_split(jobs: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """The jobs per task, each setting without its ``task=`` (one entry, "", for a sweep of one task)."""
    if not jobs.setting.str.contains("task=").all():
        return {"": jobs}
    split = jobs.setting.map(task_of)
    jobs = jobs.assign(task=[t for t, _ in split], setting=[s for _, s in split])
    return {str(task): part for task, part in jobs.groupby("task", sort=False)}


def tasks_columns(table: Table) -> list[tuple[str, str]]:
    """``[(task, metric), ...]`` of a table across the tasks."""
    return [tuple(cell.strip().split(": ")) for cell in table.header.strip("|").split("|")[1:]]  # type: ignore[misc]


def cross_task_rows(report: str, columns: list[tuple[str, str]]) -> list[str]:
    parts = task_split(jobs_of(report))
    cells: dict[str, dict[str, str]] = {}
    for task, metric in columns:
        for setting, row in against_the_best(parts[task], metric)[1].items():
            cells.setdefault(setting, {})[task] = f"{mean_std(row.values)} ({row.verdict})"
    return ["| " + " | ".join([f"`{setting}`", *(by_task.get(task, "not run") for task, _ in columns)]) + " |"
            for setting, by_task in cells.items()]


def table_metrics(table: Table) -> list[str]:
    match = AXIS_HEADER.match(table.header)
    return [match.group(1)] if match else [metric for _, metric in tasks_columns(table)]


SECTIONS = sections()
# The sweeps the page ran with seeds until decided (MAX_SEEDS=8 or 6, or `python -m trident.report.adaptive`).
ADAPTIVE = ["ablation_heads", "ablation_kv_heads_equal_compute", "ablation_width", "ablation_depth", "ablation_ffn", "ablation_dropout",
            "ablation_label_smoothing", "ablation_pos_encoding", "ablation_pos_encoding_scaled", "ablation_pos_encoding_harness",
            "ablation_norm",
            "pretrain_pays_vision_adaptive"]
TABLES = [table for section in SECTIONS for table in section_tables(section)]
AXIS_TABLES = [table for table in TABLES if AXIS_HEADER.match(table.header)]


def table_id(table: Table) -> str:
    return f"{table.report}:{table.header.split('|')[3].strip()}"


def test_the_page_has_issue_28_sections_of_committed_code() -> None:
    assert SECTIONS and AXIS_TABLES and len(TABLES) > len(AXIS_TABLES), "axis and cross-task tables"
    for section in SECTIONS:
        commits = {c for t in section_tables(section) for c in pd.read_csv(RESULTS / t.report / "jobs.csv").git_commit}
        for named in re.findall(r"commit `([0-9a-f]{7,40})`", section):
            assert any(c.startswith(named) for c in commits), f"commit {named} ran none of the section's jobs"
    for report in {table.report for table in TABLES}:
        jobs = pd.read_csv(RESULTS / report / "jobs.csv")
        assert not jobs.git_dirty.any(), f"{report}: every job ran committed code"


@pytest.mark.parametrize("table", TABLES, ids=table_id)
def test_every_row_is_recomputed_from_jobs_csv(table: Table) -> None:
    if match := AXIS_HEADER.match(table.header):
        expected = axis_rows(table.report, match.group(1))
    else:
        expected = cross_task_rows(table.report, tasks_columns(table))
    assert table.rows == expected


@pytest.mark.parametrize("table", AXIS_TABLES, ids=table_id)
def test_the_verdicts_agree_with_trident_report(table: Table) -> None:
    """Two implementations of the same statistics, on real data: this file's and the report's (for a sweep
    with seeds until decided, trident's replay of the committed ``adaptive.json``, which also checks that the
    file's verdicts are the ones its jobs give)."""
    from trident.report import compare_to_best, load_jobs_csv
    from trident.report.sequential import read_record

    metric = table_metrics(table)[0]
    rows = against_the_best(jobs_of(table.report), metric, table.report)[1]
    sweep = load_jobs_csv(RESULTS / table.report / "jobs.csv")
    record = read_record(sweep, metric)
    assert (record is None) == (adaptive_record(table.report, metric) is None)
    report = record.frame() if record else compare_to_best(sweep, metric)
    verdicts = {s: v + (f" (round {r:.0f}, level {level:.3g})" if record and v in ("worse than the best", "within the noise")
                        else "") for s, v, r, level in zip(report.index, report.verdict, report["round"], report.level)}
    assert verdicts == {setting: row.verdict for setting, row in rows.items()}
    for column in ("p", "p_holm", "p_equivalence_holm"):
        assert report[column].dropna().to_dict() == pytest.approx(
            {setting: getattr(row, column) for setting, row in rows.items() if row.verdict != "best"}, rel=1e-9), column


@pytest.mark.parametrize("report", ADAPTIVE)
def test_each_sweep_with_seeds_until_decided_has_the_record_of_its_command(report: str) -> None:
    """Its ``adaptive.json`` is the design and metric of the command the page gives (seeds 1, 2, 3, then one
    more a round, up to its ``--max-seeds``); a fixed-seed sweep has none."""
    record = json.loads((RESULTS / report / "adaptive.json").read_text())
    section = next(s for s in SECTIONS + [DOC.read_text()] if f"results/{report}/report.md" in s)
    command = re.search(rf"--metric {re.escape(record['metric'])} (--better \w+ )?--max-seeds (\d+)", section)
    assert command, f"{report}: the page's command decides on {record['metric']}"
    assert record["design"] == {"first_seeds": 3, "max_seeds": int(command.group(2)), "step": 1, "alpha": ALPHA}
    assert {path.parent.name for path in RESULTS.glob("*/adaptive.json")} == set(ADAPTIVE)


def test_each_report_line_states_its_jobs_and_wall_time() -> None:
    stated = {REPORT_LINK.findall(line)[0]: line for line in DOC.read_text().splitlines()
              if line.startswith("Report: ") and REPORT_LINK.search(line)}
    for report in {t.report for t in TABLES}:
        jobs = pd.read_csv(RESULTS / report / "jobs.csv")
        done = jobs[jobs.status == "completed"]
        minutes, mean = done.job_wall_s.sum() / 60, done.job_wall_s.mean()
        claim = f"{len(jobs)} jobs, {len(done)} completed; job wall time {minutes:.1f} min in all, {mean:.0f} s a job"
        assert claim in stated.get(report, ""), f"{report}: its Report: line should say {claim!r}"


def job_counts_and_times(jobs: pd.DataFrame) -> set[str]:
    """A group of jobs' count, its seeds per setting, its summed wall time in minutes, its mean and each
    job's wall time in seconds."""
    seeds = jobs.groupby("setting", sort=False).size()
    wall = jobs.job_wall_s
    return {f"{len(jobs)} jobs", *(f"{n} seeds" for n in seeds), f"{wall.sum() / 60:.1f}", f"{wall.mean():.0f} s",
            *(f"{s:.0f} s" for s in wall), *(f"{s:.1f}" for s in wall)}


def derived_numbers(table: Table) -> set[str]:
    """What the text may quote of one table's report, each value at its column's precision, as
    ``results_page.value`` writes it (an integer with its unit): job counts and wall times, the settings' values, and per setting
    and column the mean, standard deviation, extremes, differences of means and p-values."""
    jobs = jobs_of(table.report)
    allowed = {f"{len(pd.read_csv(RESULTS / table.report / 'jobs.csv'))} jobs", *job_counts_and_times(jobs)}
    allowed |= {value for setting in jobs.setting.unique() for value in re.findall(r"=(\d[\d.]*)", setting)}
    parts = task_split(jobs)
    for part in parts.values():
        allowed |= job_counts_and_times(part)
        for column, digits in [*((m, METRIC_DECIMALS) for m in table_metrics(table)), *EXTRA_COLUMNS.items()]:
            if column not in part or part[column].isna().all():
                continue
            by_setting = part.groupby("setting", sort=False)[column]
            means = by_setting.mean().to_numpy()
            values = [*means, *by_setting.std(), part[column].min(), part[column].max(),
                      *(abs(a - b) for a in means for b in means)]
            allowed |= {f"{v:.{digits}f}" for v in values}
        for metric in table_metrics(table):
            if metric in part and part[metric].notna().any():
                rows = against_the_best(part, metric, table.report if len(parts) == 1 else None)[1].values()
                allowed |= {f"{p:.2g}" for row in rows for p in (row.p, row.p_holm) if not math.isnan(p)}
            if record := adaptive_record(table.report, metric):  # the levels of its looks
                allowed |= {f"{r['level']:.2g}" for r in record["rounds"]} | {f"{r['level']:.3g}" for r in record["rounds"]}
    return allowed


def test_equal_compute_spends_the_budget_within_one_step_and_the_steps_lines_say_each_settings_steps() -> None:
    budget = float(yaml.safe_load((ROOT / "conf" / "budget" / "equal_compute.yaml").read_text())["budget"]["flops"])
    steps_tables = [table for table in TABLES if table.steps_line]
    assert steps_tables, "the page has equal-compute tables"
    for table in steps_tables:
        jobs = jobs_of(table.report)
        spent = jobs.max_steps * jobs.flops_per_step
        assert ((budget - spent >= 0) & (budget - spent < jobs.flops_per_step)).all(), table.report
        per_setting = [int(steps) for steps in jobs.groupby("setting", sort=False).max_steps.unique().explode()]
        said = [int(n) for n in re.findall(r"(\d+) for", str(table.steps_line))]
        assert said == (per_setting if len(set(per_setting)) > 1 else per_setting[:1]), (table.report, said)
    for table in TABLES:
        if not table.steps_line:
            assert jobs_of(table.report).get("flops_per_step", pd.Series(dtype=float)).isna().all(), (
                f"{table.report} trained on a FLOP budget: say its steps in a Steps: line")


# The reference row of Table 3 on trident (the nano LM: 4 heads, d_model 64, 2 layers, d_ff 256, pre-norm,
# rotary, no dropout, the whole corpus, 600 steps) is one setting of each of these equal-step sweeps:
# report -> (its preset, the sweep's other command-line overrides, the setting).
REFERENCE_ROW: dict[str, tuple[str, list[str], str]] = {
    "ablation_base": ("ablation_base", [], "(all)"),
    "ablation_heads": ("ablation_heads", [], "model.n_heads=4"),
    "ablation_width": ("ablation_width", [], "model.d_model=64"),
    "ablation_depth": ("ablation_depth", [], "model.n_layers=2"),
    "ablation_ffn": ("ablation_ffn", [], "model.d_ff=256"),
    "ablation_norm": ("ablation_norm", [], "model.norm_first=True"),
    "ablation_pos_encoding": ("ablation_pos_encoding", [], "pos_encoding=rope"),
    "ablation_dropout_full_data": (
        "ablation_dropout", ["model.d_model=64", "model.d_ff=256", "data.train_tokens=null"], "model.dropout=0.0"),
}
# What a job trains: the groups that set its model, data, optimisation and length (not its paths or logging).
TRAINING_KEYS = ["model", "pos_encoding", "data", "task", "optimizer", "scheduler", "budget", "precision_name"]
# Another CPU or build sums in another order: the same job agrees to about 1e-5 nats, not to the bit.
ACROSS_MACHINES = 1e-4


def test_the_reference_row_gives_each_seed_the_same_loss_in_every_sweep_that_runs_it() -> None:
    """Bit for bit among the jobs of one commit (one machine, one run of the re-runs), to ACROSS_MACHINES
    between commits: so a table's differences come from its settings and seeds, not from run-to-run noise."""
    losses: dict[tuple[int, str], dict[str, float]] = {}  # (seed, commit) -> {report: best/val/loss}
    for report, (_, _, setting) in REFERENCE_ROW.items():
        jobs = jobs_of(report)
        reference = jobs[jobs.setting == setting]
        assert len(reference) >= 3, f"{report} has no reference row {setting!r} of 3 seeds"
        for seed, commit, loss in zip(reference.seed, reference.git_commit, reference["best/val/loss"], strict=True):
            losses.setdefault((int(seed), commit), {})[report] = float(loss)
    for (seed, commit), by_report in losses.items():
        assert len(set(by_report.values())) == 1, f"seed {seed}, commit {commit[:7]}: {by_report}"
    for seed in {seed for seed, _ in losses}:
        values = [v for (s, _), by_report in losses.items() if s == seed for v in by_report.values()]
        assert max(values) - min(values) < ACROSS_MACHINES, f"seed {seed}: {values}"
    assert max(len(by_report) for by_report in losses.values()) > 1, "a seed of one commit recurs in several sweeps"


def what_trains(overrides: list[str]) -> dict[str, object]:
    cfg = compose_config(overrides)
    groups = {key: OmegaConf.to_container(cfg[key]) if OmegaConf.is_config(cfg[key]) else cfg[key] for key in TRAINING_KEYS}
    return {**groups, "max_steps": cfg.trainer.max_steps}


@pytest.mark.parametrize("report", [r for r in REFERENCE_ROW if r != "ablation_base"])
def test_each_sweeps_reference_setting_composes_the_reference_rows_config(report: str) -> None:
    """The settings the test above compares are the reference row: the preset with that setting trains what
    ``experiment=ablation_base`` trains (a preset that moved its other values would break the comparison)."""
    preset, overrides, setting = REFERENCE_ROW[report]
    assert what_trains([f"experiment={preset}", *overrides, setting]) == what_trains(["experiment=ablation_base"])
