"""The report's statistics against hand computations and scipy: Holm's correction, Welch's confidence
interval, Hedges' g, the verdicts; ``jobs.csv`` and a report re-made from it; the git commit of a job."""

from __future__ import annotations

import math
import statistics
import subprocess
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as scipy_stats

from trident.report import (
    Job,
    Sweep,
    compare_to_best,
    comparison_table,
    hedges_g,
    holm,
    load_jobs_csv,
    main,
    write_jobs_csv,
)
from trident.runs.code_version import code_version

from .conftest import ROOT


def sweep_of(values: dict[str, list[float]], metric: str = "test/bleu") -> Sweep:
    jobs = [Job(dir=Path(f"{i}_{setting}"), setting=setting, status="completed", metrics={metric: value},
                seed=seed + 1, wall_s=10.0 + i)
            for i, (setting, seed, value) in enumerate((s, k, v) for s, vs in values.items() for k, v in enumerate(vs))]
    return Sweep(dir=Path("sweep"), name="s", jobs=jobs)


def test_holm_against_a_hand_computation_with_a_tie_and_the_running_maximum() -> None:
    # Sorted: 0.010 x 4 = 0.040; 0.013 x 3 = 0.039, raised to 0.040 (never below a smaller p's);
    # the tied 0.04s: 0.04 x 2 = 0.08, and 0.04 x 1 = 0.04, raised to 0.08: ties get one value.
    # NaN (no test) stays NaN and is not one of the family: m = 4, not 5.
    adjusted = holm([0.04, math.nan, 0.01, 0.04, 0.013])
    assert adjusted[1] != adjusted[1]
    assert [adjusted[i] for i in (0, 2, 3, 4)] == pytest.approx([0.08, 0.04, 0.08, 0.04])
    assert holm([0.5, 0.9]) == [1.0, 1.0], "capped at 1: 2 x 0.5 = 1.0, then 0.9 raised to it"
    assert holm([0.03]) == [0.03], "a family of one is not corrected"


def test_welch_interval_and_hedges_g_against_hand_computations_and_scipy() -> None:
    best, other = [4.0, 5.0, 6.0], [1.0, 2.0, 3.0, 4.5]
    row = compare_to_best(sweep_of({"other": other, "best": best}), "test/bleu").loc["other"]
    # Welch: se^2 = s_a^2/n_a + s_b^2/n_b, Welch-Satterthwaite degrees of freedom, t quantile 0.975.
    va, vb = statistics.variance(other) / 4, statistics.variance(best) / 3
    dof = (va + vb) ** 2 / (va**2 / 3 + vb**2 / 2)
    half = scipy_stats.t.ppf(0.975, dof) * math.sqrt(va + vb)
    difference = statistics.mean(other) - 5.0  # 2.625 - 5
    assert row["difference"] == pytest.approx(-2.375)
    assert (row["ci_low"], row["ci_high"]) == pytest.approx((difference - half, difference + half), rel=1e-12)
    reference = scipy_stats.ttest_ind(other, best, equal_var=False).confidence_interval(0.95)
    assert (row["ci_low"], row["ci_high"]) == pytest.approx((reference.low, reference.high), rel=1e-12)
    # Hedges' g: pooled sd of [1, 2, 3] and [4, 5, 6] is 1, d = -3, J = 1 - 3 / (4 * 6 - 9) = 0.8.
    assert hedges_g([1.0, 2.0, 3.0], [4.0, 5.0, 6.0]) == pytest.approx(-2.4)
    pooled = math.sqrt((3 * statistics.variance(other) + 2 * 1.0) / 5)
    assert row["hedges_g"] == pytest.approx(difference / pooled * (1 - 3 / 19))


def test_the_verdict_comes_from_holm_over_every_pair_of_settings() -> None:
    """a is worse than the best b at p = 0.0245: significant alone, and after Holm over the 2 comparisons
    against the best (the old family, 2 x 0.0245 < 0.05), but not over the 3 pairs of the 3 settings, the
    family that counts the best being chosen from the same seeds: "undecided at 3 seeds", not "worse"."""
    values = {"a": [1.0, 2.0, 3.0], "b": [4.0, 5.0, 6.0], "c": [3.9, 5.2, 5.8]}
    comparison = compare_to_best(sweep_of(values), "test/bleu")
    pairs = [("a", "b"), ("a", "c"), ("b", "c")]
    raw = {pair: scipy_stats.ttest_ind(values[pair[0]], values[pair[1]], equal_var=False).pvalue for pair in pairs}
    assert raw["a", "c"] < raw["a", "b"] < 0.05 < raw["b", "c"]
    assert comparison.attrs["family"] == 3 and comparison.attrs["best"] == "b"
    assert comparison.loc["a", "p"] == pytest.approx(raw["a", "b"])
    # Sorted: a-c x 3, then a-b x 2 raised to a-c's (the running maximum), then b-c x 1.
    assert comparison.loc["a", "p_holm"] == pytest.approx(max(3 * raw["a", "c"], 2 * raw["a", "b"]))
    assert comparison.loc["c", "p_holm"] == pytest.approx(raw["b", "c"]) and comparison.loc["a", "p_holm"] >= 0.05
    assert 2 * raw["a", "b"] < 0.05, "Holm over the 2 comparisons against the best alone would call a worse"
    assert list(comparison["verdict"]) == ["undecided at 3 seeds", "best", "within the noise"]
    assert list(comparison["decided"]) == [False, True, True]
    # The same gap with one pair only: Holm changes nothing and the setting is worse.
    alone = compare_to_best(sweep_of({"a": values["a"], "b": values["b"]}), "test/bleu")
    assert alone.loc["a", "p_holm"] == pytest.approx(raw["a", "b"]) and alone.loc["a", "verdict"] == "worse than the best"
    table = comparison_table(comparison, "test/bleu")
    row = comparison.loc["a"]
    assert f"| {raw['a', 'b']:.3g} | {row['p_holm']:.3g} | {row['p_equivalence_holm']:.3g} | undecided at 3 seeds |" in table


def wellek_by_hand(a: list[float], b: list[float], margin: float = 1.0) -> float:
    """Wellek's equivalence p from the noncentral t (not the F of the module): P(|T| <= |t|) when the
    true difference is ``margin`` standard deviations, T Student's pooled two-sample t."""
    t = scipy_stats.ttest_ind(a, b, equal_var=True).statistic
    shift = margin * math.sqrt(len(a) * len(b) / (len(a) + len(b)))
    dof = len(a) + len(b) - 2
    return scipy_stats.nct.cdf(abs(t), dof, shift) - scipy_stats.nct.cdf(-abs(t), dof, shift)


def test_within_the_noise_is_wellek_equivalence_test_with_holm_over_every_pair() -> None:
    """Twelve seeds a side, 0.1 seed sd apart: the equivalence test (margin one seed sd) decides it;
    with three settings its p is corrected over the three pairs; 3 seeds of a 0.5 sd gap do not decide."""
    rng = np.random.default_rng(2)  # a seed where close's mean is above best's
    best, close, far = (rng.normal(shift, 1.0, 12).tolist() for shift in (0.0, 0.1, 3.0))
    assert np.mean(best) < np.mean(close)
    row = compare_to_best(sweep_of({"best": best, "close": close}, "test/loss"), "test/loss").loc["close"]
    assert row["p_equivalence_holm"] == pytest.approx(wellek_by_hand(close, best), rel=1e-9)
    assert row["verdict"] == "within the noise" and row["decided"]
    three = compare_to_best(sweep_of({"best": best, "close": close, "far": far}, "test/loss"), "test/loss")
    p_equivalence = sorted(wellek_by_hand(x, y) for x, y in ((best, close), (best, far), (close, far)))
    assert p_equivalence[0] == wellek_by_hand(close, best), "the closest pair ranks first"
    assert three.loc["close", "p_equivalence_holm"] == pytest.approx(3 * p_equivalence[0], rel=1e-9)
    assert three.loc["far", "verdict"] == "worse than the best"
    few = compare_to_best(sweep_of({"best": [0.0, 1.0, 2.0], "close": [0.5, 1.5, 2.5]}, "test/loss"), "test/loss")
    assert few.loc["close", "p_equivalence_holm"] == pytest.approx(wellek_by_hand([0.5, 1.5, 2.5], [0.0, 1.0, 2.0]))
    assert few.loc["close", "p_equivalence_holm"] > 0.05 and few.loc["close", "verdict"] == "undecided at 3 seeds"


def test_single_seeds_are_undecided_and_say_why() -> None:
    comparison = compare_to_best(sweep_of({"a": [1.0, 2.0], "b": [5.0]}), "test/bleu")
    assert comparison.loc["a", "verdict"] == "undecided at 1 seed" and math.isnan(comparison.loc["a", "p_holm"])
    assert comparison.attrs["family"] == 0
    assert "| `a` | 2 | -3.5 | - | - | - | - | - | undecided at 1 seed (too few seeds) |" in comparison_table(comparison, "test/bleu")


def test_a_report_remade_from_jobs_csv_has_the_same_numbers(tmp_path: Path) -> None:
    values = {"a": [1.0, 2.0, 3.0], "b": [4.0, 5.0, 6.25]}
    sweep = sweep_of(values)
    sweep.jobs[0].code = {"git_commit": "abc123", "git_dirty": True}
    for job in sweep.jobs:  # as status.json records them
        job.monitor, job.monitor_mode = "test/bleu", "max"
    sweep.jobs.append(Job(dir=Path("6_c"), setting="c", status="failed", error="out of memory, really"))
    write_jobs_csv(sweep, tmp_path / "jobs.csv")
    header, first = (tmp_path / "jobs.csv").read_text().splitlines()[:2]
    assert header == ("job,setting,seed,status,error,monitor,monitor_mode,test/bleu,job_wall_s,max_steps,flops_per_step,"
                      "git_commit,git_dirty")
    assert first == "0_a,a,1,completed,,test/bleu,max,1,10,,,abc123,True"
    again = load_jobs_csv(tmp_path / "jobs.csv")
    assert [(j.setting, j.seed, j.metrics, j.wall_s) for j in again.jobs[:6]] == [
        (j.setting, j.seed, j.metrics, j.wall_s) for j in sweep.jobs[:6]]
    assert again.failed[0].error == "out of memory, really"
    main([str(tmp_path / "jobs.csv"), "--out", str(tmp_path / "remade")])
    report = (tmp_path / "remade" / "report.md").read_text()
    p = scipy_stats.ttest_ind(values["a"], values["b"], equal_var=False).pvalue
    assert f"| `b` | 3 | {statistics.mean(values['b']):.4g} ± {statistics.stdev(values['b']):.2g} |" in report
    p_equivalence = wellek_by_hand(values["a"], values["b"])
    assert f"| {p:.3g} | {p:.3g} | {p_equivalence:.3g} | worse than the best |" in report
    assert "- `6_c` (failed): out of memory, really" in report
    assert (tmp_path / "remade" / "jobs.csv").read_text() == (tmp_path / "jobs.csv").read_text()


def test_jobs_csv_carries_each_jobs_training_length_and_the_report_its_model_flops(tmp_path: Path) -> None:
    """Under a FLOP budget the steps differ per setting: jobs.csv keeps each job's steps and FLOPs per
    step (from its config_resolved.yaml), so the equal compute can be checked from the CSV alone."""
    sweep_dir = tmp_path / "sweep"
    for number, (width, steps, per_step) in enumerate([(32, 1500, 1.3e9), (32, 1500, 1.3e9), (128, 210, 9.5e9), (128, 210, 9.5e9)]):
        job = sweep_dir / f"{number}_lm-seed{number}"
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text(f"- model.d_model={width}\n- seed={number}\n")
        (job / ".hydra" / "config.yaml").write_text(f"seed: {number}\n")
        (job / "config_resolved.yaml").write_text(f"trainer:\n  max_steps: {steps}\nbudget:\n  flops_per_step: {per_step}\n")
        (job / "status.json").write_text(f'{{"status": "completed", "metrics": {{"best/val/loss": {2 - number / 10}}}}}')
    main([str(sweep_dir), "--out", str(tmp_path / "report")])
    jobs = (tmp_path / "report" / "jobs.csv").read_text().splitlines()
    assert jobs[0].split(",")[-4:-2] == ["max_steps", "flops_per_step"]
    assert [line.split(",")[-4:-2] for line in jobs[1:]] == [["1500", "1300000000"]] * 2 + [["210", "9500000000"]] * 2
    line = ("Steps x FLOPs per step = model FLOPs of each setting's jobs: `model.d_model=32` 1500 x 1.3e+09 = 1.95e+12; "
            "`model.d_model=128` 210 x 9.5e+09 = 1.995e+12.")
    assert line in (tmp_path / "report" / "report.md").read_text()
    main([str(tmp_path / "report" / "jobs.csv"), "--out", str(tmp_path / "remade")])
    assert line in (tmp_path / "remade" / "report.md").read_text(), "the same line from jobs.csv alone"


@pytest.mark.parametrize(("content", "problem"), [
    (None, "does not exist"),
    ("", "is not a readable CSV"),
    ("job,setting\n0_a,a\n", "lacks the column(s) seed, status, error, monitor, monitor_mode, job_wall_s"),
])
def test_a_bad_jobs_csv_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          content: str | None, problem: str) -> None:
    source = tmp_path / "jobs.csv"
    if content is not None:
        source.write_text(content)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "report.md").write_text("earlier report\n")
    with pytest.raises(SystemExit) as exit_info:
        main([str(source), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {source} {problem}") and len(err.splitlines()) == 1
    assert (tmp_path / "out" / "report.md").read_text() == "earlier report\n", "the earlier report is kept"


def test_a_job_records_the_git_commit_of_its_code_or_nothing_outside_git(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.strip()
    assert code_version() == {"git_commit": head, "git_dirty": bool(changed)}
    monkeypatch.setenv("PATH", str(tmp_path))  # no git command
    assert code_version() == {}
