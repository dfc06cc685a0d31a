"""Seeds until the answer is clear (trident.report.adaptive): the loop on a toy metric, the preset's
settings, the command's errors, and one real sweep of two tiny settings."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml
from scipy import stats

from trident.errors import ConfigError
from trident.report import main as report_main
from trident.report.adaptive import (
    Plan,
    Setting,
    add_seeds,
    axis_values,
    main,
    preset_plan,
    read_jobs,
    train_job_runner,
)
from trident.report.sequential import Design, replay

from .conftest import SMALL
from .entry_points import run_in_process

METRIC = "best/val/loss"
ALPHA = 0.05


class ToyJobs:
    """A job runner that writes what ``train.py -m`` leaves behind: ``<num>_toy-seed<seed>/`` with
    ``.hydra/overrides.yaml`` and ``status.json``, the metric drawn from N(mean, sd) of the setting
    (its own random stream per setting and seed). ``fail`` decides, per call, whether a job fails."""

    def __init__(self, sweep_dir: Path, distributions: Mapping[str, tuple[float, float]],
                 fail: Callable[[str, int, int], str | None] = lambda label, seed, attempt: None) -> None:
        self.sweep_dir, self.distributions, self.fail = sweep_dir, distributions, fail
        self.calls: list[tuple[str, int]] = []

    def __call__(self, setting: Setting, seed: int, number: int) -> None:
        self.calls.append((setting.label, seed))
        outcome = self.fail(setting.label, seed, self.calls.count((setting.label, seed)))
        if outcome == "no directory":  # e.g. the process died before Hydra made the job's directory
            return
        job = self.sweep_dir / f"{number}_toy-seed{seed}"
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([*setting.overrides, f"seed={seed}"]))
        (job / ".hydra" / "config.yaml").write_text(f"seed: {seed}\n")
        if outcome == "failed":
            record = {"status": "failed", "error": "RuntimeError: toy failure"}
        else:
            mean, sd = self.distributions[setting.label]
            rng = np.random.default_rng([seed, list(self.distributions).index(setting.label)])
            record = {"status": "completed", "metrics": {METRIC: float(rng.normal(mean, sd))}}
        (job / "status.json").write_text(json.dumps(record))


def toy_plan(sweep_dir: Path, labels: Sequence[str], max_seeds: int = 6) -> Plan:
    settings = [Setting((label,)) for label in labels]
    return Plan(sweep_dir, settings, ["axis", "seed"], METRIC, "min", first_seeds=3, max_seeds=max_seeds)


def seeds_run(jobs: ToyJobs, label: str) -> list[int]:
    return sorted({seed for called, seed in jobs.calls if called == label})


def test_stops_as_soon_as_every_comparison_is_decided(tmp_path: Path) -> None:
    jobs = ToyJobs(tmp_path, {"axis=a": (1.0, 0.01), "axis=b": (2.0, 0.01), "axis=c": (3.0, 0.01)})
    outcome = add_seeds(toy_plan(tmp_path, list(jobs.distributions)), jobs)
    assert len(jobs.calls) == 9, "three settings x the three first seeds, and nothing more"
    assert outcome.decided == {"axis=a": True, "axis=b": True, "axis=c": True}
    assert outcome.summary().startswith("every comparison is decided")


def test_adds_seeds_only_to_the_undecided_and_the_best_until_the_maximum(tmp_path: Path) -> None:
    # b is far worse than a (decided at 3 seeds); c has a's distribution: no test can tell them apart.
    jobs = ToyJobs(tmp_path, {"axis=a": (1.0, 0.1), "axis=b": (9.0, 0.1), "axis=c": (1.0, 0.1)})
    outcome = add_seeds(toy_plan(tmp_path, list(jobs.distributions), max_seeds=6), jobs)
    assert seeds_run(jobs, "axis=b") == [1, 2, 3]
    assert seeds_run(jobs, "axis=a") == seeds_run(jobs, "axis=c") == [1, 2, 3, 4, 5, 6]
    assert outcome.seeds == {"axis=a": 6, "axis=b": 3, "axis=c": 6}
    # The better of a and c is the best (decided); the other stays undecided.
    (undecided,) = outcome.undecided
    assert outcome.decided["axis=b"] and undecided in ("axis=a", "axis=c")
    assert outcome.summary() == f"{undecided}: undecided at 6 seeds"


def test_decides_with_more_seeds_when_three_are_not_enough(tmp_path: Path) -> None:
    # A difference of one standard deviation: Welch's test needs more than 3 seeds a side for it.
    jobs = ToyJobs(tmp_path, {"axis=a": (1.0, 0.5), "axis=b": (1.5, 0.5)})
    plan = toy_plan(tmp_path, list(jobs.distributions), max_seeds=30)
    outcome = add_seeds(plan, jobs)
    values = {label: [v for (lab, _), runs in read_jobs(tmp_path, ["axis", "seed"]).items() if lab == label
                      for _, metrics in runs for v in metrics.values()] for label in jobs.distributions}
    n = outcome.seeds["axis=b"]
    assert 3 < n < 30 and outcome.decided == {"axis=a": True, "axis=b": True}
    # One pair: Holm changes nothing, and round r = n - 2 tests at the level it spends of alpha.
    design = plan.design
    assert stats.ttest_ind(values["axis=b"], values["axis=a"], equal_var=False).pvalue < design.level(n - 2)
    first = stats.ttest_ind(values["axis=b"][: n - 1], values["axis=a"][: n - 1], equal_var=False).pvalue
    assert first >= design.level(n - 3), "one seed fewer did not decide it: the loop stopped at the first decided round"
    assert first < ALPHA, "at alpha, unspent over the looks, one seed fewer would have decided it"
    record = json.loads((tmp_path / "adaptive.json").read_text())
    assert [r["seeds"] for r in record["rounds"]] == list(range(3, n + 1))
    assert record["rounds"][-1]["verdicts"] == {"axis=a": "best", "axis=b": "worse than the best"}
    assert record["rounds"][-1]["level"] == pytest.approx(design.level(n - 2))


def test_finished_jobs_are_reused_not_run_again(tmp_path: Path) -> None:
    distributions = {"axis=a": (1.0, 0.1), "axis=b": (1.0, 0.1)}
    first = ToyJobs(tmp_path, distributions)
    add_seeds(toy_plan(tmp_path, list(distributions), max_seeds=4), first)
    assert len(first.calls) == 8
    again = ToyJobs(tmp_path, distributions)
    outcome = add_seeds(toy_plan(tmp_path, list(distributions), max_seeds=5), again)
    assert again.calls == [("axis=a", 5), ("axis=b", 5)], "seeds 1-4 of both settings were in the sweep directory"
    assert outcome.seeds == {"axis=a": 5, "axis=b": 5}
    numbers = sorted(int(d.name.split("_")[0]) for d in tmp_path.iterdir() if d.is_dir())
    assert numbers == list(range(10)), "new jobs are numbered after the ones already there"


def test_a_failed_job_is_run_once_more_then_counted_missing(tmp_path: Path) -> None:
    def fail(label: str, seed: int, attempt: int) -> str | None:
        if label == "axis=b" and seed == 2:
            return "failed" if attempt == 1 else None  # a passing failure: the second try completes
        if label == "axis=b" and seed == 3:
            return "failed"  # fails every time
        if label == "axis=a" and seed == 3:
            return "no directory"
        return None

    jobs = ToyJobs(tmp_path, {"axis=a": (1.0, 0.01), "axis=b": (2.0, 0.01)}, fail)
    outcome = add_seeds(toy_plan(tmp_path, ["axis=a", "axis=b"], max_seeds=3), jobs)
    assert jobs.calls.count(("axis=b", 2)) == 2 and jobs.calls.count(("axis=b", 3)) == 2
    assert jobs.calls.count(("axis=a", 3)) == 2, "a job that left no directory is tried twice, not forever"
    assert outcome.seeds == {"axis=a": 2, "axis=b": 2}
    assert outcome.decided == {"axis=a": True, "axis=b": True}


def test_more_first_seeds_than_the_maximum_is_a_config_error(tmp_path: Path) -> None:
    plan = toy_plan(tmp_path, ["axis=a", "axis=b"], max_seeds=2)
    with pytest.raises(ConfigError, match="--first-seeds 3 is more than --max-seeds 2"):
        add_seeds(plan, ToyJobs(tmp_path, {}))


def test_the_preset_gives_its_settings_and_the_monitor_direction(tmp_path: Path) -> None:
    plan = preset_plan(["experiment=ablation_heads"], tmp_path, METRIC, None)
    assert [s.label for s in plan.settings] == [f"model.n_heads={h}" for h in (1, 2, 4, 8, 16)]
    assert plan.swept == ["model.n_heads", "seed"] and plan.better == "min"
    assert preset_plan(["experiment=ablation_label_smoothing"], tmp_path, "test/bleu", "max").better == "max"


def test_axis_values_as_the_basic_sweeper_lists_them() -> None:
    assert axis_values("model.d_ff", "range(64,257,64)") == [f"model.d_ff={v}" for v in (64, 128, 192, 256)]
    assert axis_values("pos_encoding", "rope, alibi") == ["pos_encoding=rope", "pos_encoding=alibi"]
    assert axis_values("model.dropout", "0.1") == ["model.dropout=0.1"]
    with pytest.raises(ConfigError, match="not a list of values"):
        axis_values("optimizer.lr", "interval(1e-4,1e-2)")


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["experiment=ablation_base"], "sweeps nothing but the seed"),
        (["experiment=ablation_heads", "--metric", "test/ppl"], "say which is better with --better min"),
        (["experiment=ablation_heads", "--first-seeds", "4", "--max-seeds", "3"], "--first-seeds 4 is more than"),
        (["hparams_search=lm_optuna"], "is not a list of values"),
    ],
)
def test_bad_arguments_end_in_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             arguments: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*arguments, "--sweep-dir", str(tmp_path / "sweep")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: ") and message in error and "\n" not in error
    assert not (tmp_path / "sweep").exists()


def test_the_command_runs_the_loop_and_writes_the_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    sweep_dir = tmp_path / "sweep"
    jobs = ToyJobs(sweep_dir, {"model.norm_first=False": (1.0, 0.1), "model.norm_first=True": (1.0, 0.1)})
    monkeypatch.setattr("trident.report.adaptive.train_job_runner", lambda directory, overrides: jobs)
    main(["experiment=ablation_norm", "--sweep-dir", str(sweep_dir), "--max-seeds", "4", "--out", str(tmp_path / "out")])
    lines = capsys.readouterr().out.splitlines()
    assert len(jobs.calls) == 8, "two settings with the same distribution: both run to the maximum"
    assert "undecided at 4 seeds" in lines[0] and lines[1] == str(tmp_path / "out" / "report.md")
    assert "model.norm_first=True" in (tmp_path / "out" / "report.md").read_text()


@pytest.mark.slow
def test_a_real_sweep_of_two_tiny_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """train.py jobs through the real runner: 2 settings, 1 first seed, at most 2 (4 jobs are enough to show
    seeds added to a real sweep); then the same call again runs nothing (every job is reused). The first job
    is the runner's fresh process; the other 3 run its same command line in this process (a fresh one each
    would only add ~8 CPU-seconds of imports: the process boundary is the first job's to show)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    started: list[list[str]] = []

    def first_fresh_then_here(command: list[str], check: bool = False) -> subprocess.CompletedProcess[str]:
        started.append(command)
        if len(started) == 1:
            return subprocess.run(command, check=check)
        assert command[1:3] == ["-m", "trident.commands.train"], command
        done = run_in_process(command[2], command[3:], tmp_path, monkeypatch)
        return subprocess.CompletedProcess(command, done.returncode, done.stdout, done.stderr)

    # The runner's module alone sees the replacement (subprocess.run stays itself for everyone else).
    monkeypatch.setattr("trident.report.adaptive.subprocess", SimpleNamespace(run=first_fresh_then_here))
    tiny = [o for o in SMALL if not o.startswith(("trainer.max_steps", "callbacks."))]
    overrides = ["experiment=ablation_norm", *tiny, "trainer.max_steps=2", "callbacks=none", "logger=none",
                 "data.sample_prompts=[]", f"paths.output_root={tmp_path}"]
    sweep_dir = tmp_path / "sweep"
    plan = preset_plan(overrides, sweep_dir, METRIC, None)
    plan.first_seeds, plan.max_seeds = 1, 2
    outcome = add_seeds(plan, train_job_runner(sweep_dir, overrides))
    # One seed tests nothing: both settings get their second seed whatever the values.
    assert outcome.seeds == {"model.norm_first=False": 2, "model.norm_first=True": 2}
    statuses = [json.loads((d / "status.json").read_text()) for d in sweep_dir.iterdir() if d.is_dir()]
    assert len(statuses) == 4 and all(s["status"] == "completed" for s in statuses)
    assert all(math.isfinite(s["metrics"][METRIC]) for s in statuses)
    assert len({s["sweep"] for s in statuses}) == 1, "every job of the continued sweep is one W&B sweep"
    assert len(started) == 4 and started[0][0] == sys.executable
    calls: list[tuple[str, int]] = []
    add_seeds(plan, lambda setting, seed, number: calls.append((setting.label, seed)))
    assert calls == [] and os.listdir(sweep_dir).count("sweep.json") == 1


def test_the_design_spends_alpha_over_its_rounds() -> None:
    """Lan-DeMets Pocock-type spending: alpha ln(1 + (e - 1) t) at t = n_r / max_seeds, by hand."""
    design = Design(first_seeds=3, max_seeds=8, step=2)
    assert design.rounds == 4 and [design.seeds(r) for r in range(1, 5)] == [3, 5, 7, 8]
    spent = [ALPHA * math.log(1 + (math.e - 1) * n / 8) for n in (0, 3, 5, 7, 8)]
    assert [design.level(r) for r in range(1, 5)] == pytest.approx(np.diff(spent).tolist(), rel=1e-12)
    assert sum(design.level(r) for r in range(1, 5)) == pytest.approx(ALPHA, rel=1e-12)
    assert design.level(1) == pytest.approx(0.05 * math.log(1 + (math.e - 1) * 3 / 8))  # 0.0243
    assert Design(3, 10, 1).rounds == 8 and Design(3, 10, 4).rounds == 3 and Design(3, 10, 4).seeds(3) == 10
    fixed = Design(first_seeds=3, max_seeds=3)
    assert fixed.rounds == 1 and fixed.level(1) == pytest.approx(ALPHA), "a fixed-seed sweep: one look at alpha"


def csv_of(path: Path, values: Mapping[tuple[str, int], float]) -> Path:
    rows = [f"{i}_{setting},{setting},{seed},completed,,best/val/loss,min,{value!r},1.0"
            for i, ((setting, seed), value) in enumerate(values.items())]
    path.mkdir(parents=True, exist_ok=True)
    (path / "jobs.csv").write_text("\n".join(["job,setting,seed,status,error,monitor,monitor_mode,best/val/loss,job_wall_s",
                                              *rows]) + "\n")
    return path / "jobs.csv"


def test_replay_re_decides_a_jobs_csv_and_the_report_gives_the_loops_verdicts(tmp_path: Path) -> None:
    """b is far worse (decided at round 1, 3 seeds); c is close to a, undecided at 3 seeds, and its 4th seed
    is missing from the table; a gets its 4th seed as the best. The report shows each row as of its round."""
    rng = np.random.default_rng(5)
    table = {(s, seed): float(rng.normal(mean, 0.1)) for s, mean in (("a", 1.0), ("b", 9.0), ("c", 1.05))
             for seed in range(1, 6)}
    del table["c", 4], table["c", 5]
    jobs_csv = csv_of(tmp_path / "results", table)
    main(["--replay", str(jobs_csv), "--max-seeds", "5", "--out", str(tmp_path / "report")])
    record = json.loads((jobs_csv.parent / "adaptive.json").read_text())
    assert record["design"] == {"first_seeds": 3, "max_seeds": 5, "step": 1, "alpha": ALPHA}
    assert [r["seeds"] for r in record["rounds"]] == [3, 4, 5]
    assert record["rounds"][0]["verdicts"]["b"] == "worse than the best"
    assert "b" not in record["rounds"][1]["verdicts"], "a decided setting is not looked at again"
    assert record["rounds"][2]["completed"] == {"a": 5, "b": 3, "c": 3}, "c's missing seeds 4 and 5"
    report = (tmp_path / "report" / "report.md").read_text()
    level = Design(3, 5).level(1)
    assert "| `b` | 3 | +8" in report and f"| worse than the best (round 1, level {level:.3g}) |" in report
    assert "| `c` | 3 |" in report and "| `a` | 5 | best |" in report
    assert "3 looks at the levels" in report
    assert (tmp_path / "report" / "adaptive.json").read_text() == (jobs_csv.parent / "adaptive.json").read_text()
    # Without the record the same jobs are one fixed-seed look at alpha, every completed seed.
    (jobs_csv.parent / "adaptive.json").unlink()
    report_main([str(jobs_csv), "--out", str(tmp_path / "fixed")])
    fixed = (tmp_path / "fixed" / "report.md").read_text()
    assert "| `b` | 5 | +8" in fixed and "(a fixed-seed sweep)" in fixed and "(round" not in fixed


def test_a_record_the_jobs_do_not_give_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    table = {(s, seed): float(seed + (8 if s == "b" else 0)) for s in ("a", "b") for seed in range(1, 4)}
    jobs_csv = csv_of(tmp_path, table)
    main(["--replay", str(jobs_csv), "--max-seeds", "3", "--out", str(tmp_path / "report")])
    record = json.loads((tmp_path / "adaptive.json").read_text())
    record["rounds"][0]["verdicts"]["b"] = "undecided at 3 seeds"
    (tmp_path / "adaptive.json").write_text(json.dumps(record))
    with pytest.raises(SystemExit):
        report_main([str(jobs_csv), "--out", str(tmp_path / "again")])
    error = capsys.readouterr().err
    assert "adaptive.json records verdicts that the sweep's jobs do not give" in error and error.count("\n") == 1


def test_a_decided_setting_keeps_its_verdict_and_the_best_is_chosen_among_the_open_ones() -> None:
    """Round 1: c within the noise of the best a (3 seeds). Round 2: a's 4th seed raises its mean above
    c's frozen one; c stays within the noise (of a at round 1), and the best is a, the better of the open."""
    table = {("a", 1): 0.0, ("a", 2): 1.0, ("a", 3): 2.0, ("a", 4): 5.0, ("b", 1): 1.5, ("b", 2): 2.5,
             ("b", 3): 3.5, ("b", 4): 1.5, ("c", 1): 0.001, ("c", 2): 1.001, ("c", 3): 2.001}
    record = replay(table, ["a", "b", "c"], "min", METRIC, Design(3, 4))
    assert [r.verdicts for r in record.rounds] == [
        {"a": "best", "b": "undecided at 3 seeds", "c": "within the noise"},
        {"a": "best", "b": "undecided at 4 seeds"}]
    assert np.mean([table["c", s] for s in (1, 2, 3)]) < np.mean([table["a", s] for s in (1, 2, 3, 4)])
    frame = record.frame()
    assert frame.attrs["best"] == "a" and list(frame["round"]) == [2, 2, 1] and list(frame["n"]) == [4, 4, 3]
    assert frame.loc["c", "level"] == pytest.approx(Design(3, 4).level(1))
