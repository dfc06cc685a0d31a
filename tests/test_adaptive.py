"""Seeds until the answer is clear (trident.adaptive): the loop on a toy metric, the preset's
settings, the command's errors, and one real sweep of two tiny settings."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest
import yaml
from scipy import stats

from trident.adaptive import (
    Outcome,
    Plan,
    Setting,
    add_seeds,
    axis_values,
    main,
    preset_plan,
    read_jobs,
    train_job_runner,
)
from trident.errors import ConfigError

from .conftest import SMALL

METRIC = "best/val/loss"
ALPHA = 0.05


def welch_holm(values: Mapping[str, Sequence[float]], better: str) -> dict[str, bool]:
    """Test double of the report's decision: Welch's test of each setting against the best mean,
    Holm's step-down correction by hand; decided = the best, or corrected p < ALPHA."""
    means = {s: float(np.mean(v)) for s, v in values.items()}
    best = (min if better == "min" else max)(means, key=means.__getitem__)
    p = {s: stats.ttest_ind(v, values[best], equal_var=False).pvalue
         for s, v in values.items() if s != best and len(v) > 1 and len(values[best]) > 1}
    decided = dict.fromkeys(values, False) | {best: True}
    running = 0.0
    for rank, (setting, value) in enumerate(sorted(p.items(), key=lambda item: item[1])):
        running = max(running, (len(p) - rank) * value)
        decided[setting] = running < ALPHA
    return decided


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
    outcome = add_seeds(toy_plan(tmp_path, list(jobs.distributions)), jobs, welch_holm)
    assert len(jobs.calls) == 9, "three settings x the three first seeds, and nothing more"
    assert outcome.decided == {"axis=a": True, "axis=b": True, "axis=c": True}
    assert outcome.summary().startswith("every comparison is decided")


def test_adds_seeds_only_to_the_undecided_and_the_best_until_the_maximum(tmp_path: Path) -> None:
    # b is far worse than a (decided at 3 seeds); c has a's distribution: no test can tell them apart.
    jobs = ToyJobs(tmp_path, {"axis=a": (1.0, 0.1), "axis=b": (9.0, 0.1), "axis=c": (1.0, 0.1)})
    outcome = add_seeds(toy_plan(tmp_path, list(jobs.distributions), max_seeds=6), jobs, welch_holm)
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
    outcome = add_seeds(toy_plan(tmp_path, list(jobs.distributions), max_seeds=30), jobs, welch_holm)
    values = {label: [v for (lab, _), runs in read_jobs(tmp_path, ["axis", "seed"]).items() if lab == label
                      for _, metrics in runs for v in metrics.values()] for label in jobs.distributions}
    n = outcome.seeds["axis=b"]
    assert 3 < n < 30 and outcome.decided == {"axis=a": True, "axis=b": True}
    assert stats.ttest_ind(values["axis=b"], values["axis=a"], equal_var=False).pvalue < ALPHA
    first = stats.ttest_ind(values["axis=b"][: n - 1], values["axis=a"][: n - 1], equal_var=False).pvalue
    assert first >= ALPHA, "one seed fewer did not decide it: the loop stopped at the first decided round"


def test_finished_jobs_are_reused_not_run_again(tmp_path: Path) -> None:
    distributions = {"axis=a": (1.0, 0.1), "axis=b": (1.0, 0.1)}
    first = ToyJobs(tmp_path, distributions)
    add_seeds(toy_plan(tmp_path, list(distributions), max_seeds=4), first, welch_holm)
    assert len(first.calls) == 8
    again = ToyJobs(tmp_path, distributions)
    outcome = add_seeds(toy_plan(tmp_path, list(distributions), max_seeds=5), again, welch_holm)
    assert again.calls == [("axis=a", 5), ("axis=b", 5)], "seeds 1-4 of both settings were in the sweep directory"
    assert outcome.seeds == {"axis=a": 5, "axis=b": 5}
    numbers = sorted(int(d.name.split("_")[0]) for d in tmp_path.iterdir())
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
    outcome = add_seeds(toy_plan(tmp_path, ["axis=a", "axis=b"], max_seeds=3), jobs, welch_holm)
    assert jobs.calls.count(("axis=b", 2)) == 2 and jobs.calls.count(("axis=b", 3)) == 2
    assert jobs.calls.count(("axis=a", 3)) == 2, "a job that left no directory is tried twice, not forever"
    assert outcome.seeds == {"axis=a": 2, "axis=b": 2}
    assert outcome.decided == {"axis=a": True, "axis=b": True}


def test_more_first_seeds_than_the_maximum_is_a_config_error(tmp_path: Path) -> None:
    plan = toy_plan(tmp_path, ["axis=a", "axis=b"], max_seeds=2)
    with pytest.raises(ConfigError, match="--first-seeds 3 is more than --max-seeds 2"):
        add_seeds(plan, ToyJobs(tmp_path, {}), welch_holm)


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


def test_the_report_decision_is_holm_corrected() -> None:
    # Settings c and d are each "significant" alone (Welch p = 0.029 and 0.035) but not after Holm's
    # correction over the three comparisons (x 2 and x 1 after b's x 3, with the running maximum):
    # only b stays decided.
    from trident.adaptive import decide_with_report

    values = {"a": [1.0, 1.1, 0.9], "b": [3.0, 3.1, 2.9], "c": [1.3, 1.45, 1.2], "d": [1.35, 1.5, 1.2]}
    raw = {s: stats.ttest_ind(values[s], values["a"], equal_var=False).pvalue for s in "bcd"}
    assert raw["c"] < ALPHA and raw["d"] < ALPHA and sorted(raw.values())[1] * 2 >= ALPHA
    decided = decide_with_report(values, "min")
    assert decided["a"] and decided["b"] and not decided["c"] and not decided["d"]


def test_the_command_runs_the_loop_and_writes_the_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    sweep_dir = tmp_path / "sweep"
    jobs = ToyJobs(sweep_dir, {"model.norm_first=False": (1.0, 0.1), "model.norm_first=True": (1.0, 0.1)})
    monkeypatch.setattr("trident.adaptive.train_job_runner", lambda directory, overrides: jobs)
    main(["experiment=ablation_norm", "--sweep-dir", str(sweep_dir), "--max-seeds", "4", "--out", str(tmp_path / "out")])
    lines = capsys.readouterr().out.splitlines()
    assert len(jobs.calls) == 8, "two settings with the same distribution: both run to the maximum"
    assert "undecided at 4 seeds" in lines[0] and lines[1] == str(tmp_path / "out" / "report.md")
    assert "model.norm_first=True" in (tmp_path / "out" / "report.md").read_text()


@pytest.mark.slow
def test_a_real_sweep_of_two_tiny_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """train.py jobs through the real runner: 2 settings, 1 first seed, at most 2 (each job is a fresh
    process: 4 are enough to show seeds added to a real sweep); then the same call again runs nothing
    (every job is reused)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    tiny = [o for o in SMALL if not o.startswith(("trainer.max_steps", "callbacks."))]
    overrides = ["experiment=ablation_norm", *tiny, "trainer.max_steps=2", "callbacks=none", "logger=none",
                 "data.sample_prompts=[]", f"paths.output_root={tmp_path}"]
    sweep_dir = tmp_path / "sweep"
    plan = preset_plan(overrides, sweep_dir, METRIC, None)
    plan.first_seeds, plan.max_seeds = 1, 2
    never = lambda values, better: dict.fromkeys(values, False)  # nothing is ever decided
    outcome = add_seeds(plan, train_job_runner(sweep_dir, overrides), never)
    assert outcome == Outcome({"model.norm_first=False": 2, "model.norm_first=True": 2},
                              {"model.norm_first=False": False, "model.norm_first=True": False})
    statuses = [json.loads((d / "status.json").read_text()) for d in sweep_dir.iterdir() if d.is_dir()]
    assert len(statuses) == 4 and all(s["status"] == "completed" for s in statuses)
    assert all(math.isfinite(s["metrics"][METRIC]) for s in statuses)
    assert len({s["sweep"] for s in statuses}) == 1, "every job of the continued sweep is one W&B sweep"
    calls: list[tuple[str, int]] = []
    add_seeds(plan, lambda setting, seed, number: calls.append((setting.label, seed)), never)
    assert calls == [] and os.listdir(sweep_dir).count("sweep.json") == 1
