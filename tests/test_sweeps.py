"""Sweeps end to end: `train.py -m` on nano grouped in W&B, failed jobs recorded, Optuna, the report."""

from __future__ import annotations

import json
import math
import shutil
import statistics
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import DictConfig, OmegaConf
from scipy import stats as scipy_stats

from trident.report import Job, Sweep, compare_to_best, comparison_table, load_sweep, markdown_table, summarize
from trident.report import main as report_main
from trident.report.sweep import _read_history
from trident.runs.jobs import run_job
from trident.runs.rerun import continue_job, earlier_attempt, remember_sweep, remembered_sweep
from trident.runs.sweeps import SweepCallback, job_dirs, job_subdir, next_job_number, setting_of, swept_keys
from trident.tracking.wandb_files import find_offline_runs

from .conftest import SMALL
from .entry_points import Result, run_in_process

# Two steps with a validation after each (two points per curve); no samples, no progress bars.
TINY = [o for o in SMALL if not o.startswith(("callbacks.", "trainer.max_steps", "trainer.val_check_interval"))] + [
    "trainer.max_steps=2",
    "trainer.val_check_interval=1",
    "data.sample_prompts=[]",
    "callbacks=none",
]


def multirun(*overrides: str, sweep_dir: Path) -> Result:
    """``python train.py -m <overrides>`` with the default logger (W&B, offline), run in this process: a sweep's jobs
    run one after another in its process (Hydra's basic launcher), and no test here checks that process's boundary
    (a fresh one would only add its imports)."""
    with pytest.MonkeyPatch.context() as here:
        return run_in_process("train.py", ["-m", *TINY, *overrides, f"paths.output_root={sweep_dir.parent}",
                                           f"hydra.sweep.dir={sweep_dir}"], sweep_dir.parent, here, wandb_mode="offline")


def load_json(job_dir: Path) -> dict[str, Any]:
    return json.loads((job_dir / "status.json").read_text())


@pytest.fixture(scope="module")
def lm_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2 x 2 sweep: two positional encodings x two seeds, logged to W&B offline."""
    sweep_dir = tmp_path_factory.mktemp("multirun") / "sweep"
    result = multirun("pos_encoding=rope,alibi", "seed=1,2", sweep_dir=sweep_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "All 4 jobs of the sweep completed" in result.stderr
    return sweep_dir


def test_setting_is_the_swept_overrides_without_the_seed() -> None:
    swept = swept_keys(["model=nano", "seed=1,2", "pos_encoding=rope,alibi"], {"model.n_heads": "1,2,4"})
    assert swept == ["model.n_heads", "seed", "pos_encoding"]
    job = ["model.n_heads=2", "model=nano", "seed=2", "pos_encoding=alibi"]
    assert setting_of(job, swept) == "model.n_heads=2,pos_encoding=alibi"
    assert setting_of(job, None) == "model.n_heads=2,model=nano,pos_encoding=alibi"


def test_single_run_returns_best_value_and_writes_status(make_config: Callable[..., DictConfig], tmp_path: Path) -> None:
    value = run_job(make_config("logger=none", "data.sample_prompts=[]"))
    status = load_json(tmp_path / "run")
    assert status["status"] == "completed" and status["monitor"] == "val/loss"
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    val_losses = [r["val/loss"] for r in rows if r["stage"] == "validate"]
    assert len(val_losses) == 2 and value == min(val_losses) == status["metrics"]["best/val/loss"]


@pytest.mark.slow
def test_two_by_two_sweep_gives_two_wandb_groups_of_two_runs(lm_sweep: Path) -> None:
    sweep_id = "lm-shakespeare-" + json.loads((lm_sweep / "sweep.json").read_text())["started"]
    runs = find_offline_runs(lm_sweep)
    assert len(runs) == 4 and len({r.run_id for r in runs}) == 4, "exactly one W&B run per job"
    groups: dict[str, list[str]] = {}
    for run in runs:
        groups.setdefault(run.group, []).append(run.name)
    assert groups == {
        f"{sweep_id}/pos_encoding=rope": ["lm-shakespeare-nano-rope-seed1", "lm-shakespeare-nano-rope-seed2"],
        f"{sweep_id}/pos_encoding=alibi": ["lm-shakespeare-nano-alibi-seed1", "lm-shakespeare-nano-alibi-seed2"],
    }
    for run in runs:
        assert run.job_type == sweep_id and sweep_id in run.tags and "nano" in run.tags
        assert run.summary["best/val/loss"] == pytest.approx(min(run.metric("val/loss")))
        assert "test/loss" in run.summary and "test/ppl" in run.summary
        assert len(run.metric("train/loss")) == 2


@pytest.mark.slow
def test_each_job_keeps_status_and_metric_history(lm_sweep: Path) -> None:
    job_dir = next(lm_sweep.glob("0_*"))
    status = json.loads((job_dir / "status.json").read_text())
    assert status["status"] == "completed" and status["setting"] == "pos_encoding=rope"
    rows = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["stage"]) for r in rows] == [(1, "validate"), (2, "validate"), (2, "test")]
    assert status["metrics"]["best/val/loss"] == min(r["val/loss"] for r in rows[:2])
    assert status["metrics"]["test/loss"] == rows[2]["test/loss"]


@pytest.mark.slow
def test_report_command_writes_table_and_plots(lm_sweep: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report_main([str(lm_sweep), "--out", str(tmp_path)])
    assert capsys.readouterr().out.strip() == str(tmp_path / "report.md")
    report = (tmp_path / "report.md").read_text()
    best = {
        setting: [load_json(d)["metrics"]["best/val/loss"] for d in sorted(lm_sweep.glob(f"*_lm-shakespeare-nano-{pe}-*"))]
        for setting, pe in [("pos_encoding=rope", "rope"), ("pos_encoding=alibi", "alibi")]
    }
    for setting, values in best.items():
        mean, std = statistics.mean(values), statistics.stdev(values)
        assert f"| `{setting}` | 2 | {mean:.4g} ± {std:.2g} |" in report
    assert "4 jobs, 4 completed, 0 failed" in report and report.rstrip().endswith("None.")
    for png in ("curves_val_loss.png", "final_best_val_loss.png"):
        assert f"]({png})" in report
        assert (tmp_path / png).read_bytes().startswith(b"\x89PNG")
    # The plotted final metric is tested between the settings; each job's wall time is a column.
    assert "## best/val/loss: each setting against the best" in report
    loser = max(best, key=lambda setting: statistics.mean(best[setting]))
    winner = min(best, key=lambda setting: statistics.mean(best[setting]))
    assert f"| `{winner}` | 2 | best | | | | | | best |" in report
    assert f"| `{loser}` | 2 | {statistics.mean(best[loser]) - statistics.mean(best[winner]):+.4g} [" in report
    assert "each job's results: [jobs.csv](jobs.csv)" in report and (tmp_path / "jobs.csv").is_file()
    assert "Wall time of a completed job: mean " in report
    summary = summarize(load_sweep(lm_sweep))
    assert list(summary.index) == ["pos_encoding=rope", "pos_encoding=alibi"]
    assert summary.loc["pos_encoding=rope", ("best/val/loss", "mean")] == pytest.approx(statistics.mean(best["pos_encoding=rope"]))
    # Jobs run one after another: their wall times are positive and add up to no more than the sweep's.
    sweep = load_sweep(lm_sweep)
    started = datetime.strptime(json.loads((lm_sweep / "sweep.json").read_text())["started"], "%Y-%m-%d_%H-%M-%S")
    ended = max((job.dir / "status.json").stat().st_mtime for job in sweep.jobs)
    walls = [job.wall_s for job in sweep.completed]
    assert all(wall > 0 for wall in walls) and sum(walls) <= ended - started.timestamp() + 1
    assert summary[("job_wall_s", "mean")].sum() == pytest.approx(sum(walls) / 2)


def test_compare_to_best_is_welchs_test_against_the_best_mean() -> None:
    def job(setting: str, value: float) -> Job:
        return Job(dir=Path(setting), setting=setting, status="completed", metrics={"test/bleu": value, "test/ppl": value})

    values = {"a": [1.0, 2.0, 3.0], "b": [4.0, 5.0, 6.0], "c": [3.5]}
    sweep = Sweep(dir=Path("sweep"), name="s", jobs=[job(s, v) for s, vs in values.items() for v in vs])
    # Higher BLEU is better: b is the best; a is 3 below it, t = -3 / sqrt(1/3 + 1/3), 4 degrees of freedom.
    bleu = compare_to_best(sweep, "test/bleu")
    assert bleu.attrs["best"] == "b" and list(bleu.index) == ["a", "b", "c"]
    assert bleu.loc["a", "difference"] == -3.0
    assert bleu.loc["a", "t"] == pytest.approx(-3.6742346) and bleu.loc["a", "p"] == pytest.approx(0.0213116, rel=1e-5)
    table = comparison_table(bleu, "test/bleu")
    # One testable comparison (c has one seed): Holm's p is the raw p.
    equivalence = f"{bleu.loc['a', 'p_equivalence_holm']:.3g}"
    assert f"| -3.67 | 0.0213 | 0.0213 | {equivalence} | worse than the best |" in table
    assert "| `b` | 3 | best | | | | | | best |" in table
    assert "| `c` | 1 | -1.5 | - | - | - | - | - | undecided at 1 seed (too few seeds) |" in table
    # Lower perplexity is better: a is the best.
    assert compare_to_best(sweep, "test/ppl").attrs["best"] == "a"
    # Seeds that all agree leave nothing to test: said so, not taken for too few seeds.
    flat = Sweep(dir=Path("sweep"), name="s", jobs=[job(s, v) for s, v in [("x", 1.0), ("x", 1.0), ("y", 2.0), ("y", 2.0)]])
    assert "| `y` | 2 | +1 | - | - | - | - | - | undecided at 2 seeds (no spread over the seeds) |" in comparison_table(compare_to_best(flat, "test/ppl"), "test/ppl")


def test_welch_p_value_with_unequal_variances_and_seed_counts_against_a_hand_computation() -> None:
    """Eight tight seeds against four spread ones: Welch's test (no shared variance) says the gap is within
    the spread (p = 0.13); Student's pooled test would call it significant (p = 0.012)."""
    a = [20.0, 20.5, 19.5, 20.2, 19.8, 20.1, 19.9, 20.0]
    b = [23.0, 28.0, 19.0, 27.0]
    jobs = [Job(dir=Path(f"{name}{i}"), setting=name, status="completed", metrics={"test/bleu": value})
            for name, values in (("a", a), ("b", b)) for i, value in enumerate(values)]
    comparison = compare_to_best(Sweep(dir=Path("sweep"), name="s", jobs=jobs), "test/bleu")
    # Welch (1947): t = (mean_a - mean_b) / sqrt(s_a^2/n_a + s_b^2/n_b), Welch-Satterthwaite degrees of freedom.
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    t = (statistics.mean(a) - statistics.mean(b)) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    assert comparison.attrs["best"] == "b"
    assert comparison.loc["a", "t"] == pytest.approx(t, rel=1e-9)  # -2.064
    assert comparison.loc["a", "p"] == pytest.approx(2 * scipy_stats.t.sf(abs(t), df), rel=1e-9)  # 0.1305
    assert comparison.loc["a", "p"] > 0.05 > scipy_stats.ttest_ind(a, b, equal_var=True).pvalue, "Student's would differ"
    equivalence = f"{comparison.loc['a', 'p_equivalence_holm']:.3g}"
    assert f"| -2.06 | 0.131 | 0.131 | {equivalence} | undecided at 4 seeds |" in comparison_table(comparison, "test/bleu")


def test_summary_mean_and_std_over_seeds_are_the_sample_statistics() -> None:
    values = {"x": [1.0, 2.0, 4.0], "y": [10.0]}
    jobs = [Job(dir=Path(f"{name}{i}"), setting=name, status="completed", metrics={"test/acc": value}, wall_s=1.0)
            for name, seeds in values.items() for i, value in enumerate(seeds)]
    summary = summarize(Sweep(dir=Path("sweep"), name="s", jobs=jobs))
    assert summary.loc["x", ("test/acc", "mean")] == pytest.approx(7 / 3)
    # The sample standard deviation (n - 1): sqrt(((1 - 7/3)^2 + (2 - 7/3)^2 + (4 - 7/3)^2) / 2) = 1.5275.
    assert summary.loc["x", ("test/acc", "std")] == pytest.approx(math.sqrt((16 / 9 + 1 / 9 + 25 / 9) / 2))
    assert summary.loc["y", ("n", "")] == 1 and math.isnan(summary.loc["y", ("test/acc", "std")])
    assert "| `x` | 3 | 2.333 ± 1.5 |" in markdown_table(summary)


@pytest.mark.slow
def test_report_names_an_unknown_compared_metric(lm_sweep: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        report_main([str(lm_sweep), "--out", str(tmp_path), "--compare", "test/bleu"])
    assert exit_info.value.code == 2
    assert "error: --compare test/bleu: no job of" in capsys.readouterr().err
    assert not (tmp_path / "report.md").exists()


@pytest.mark.slow
def test_failing_job_does_not_stop_the_sweep(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    result = multirun("model.n_heads=5,4", "logger=none", sweep_dir=sweep_dir)
    assert result.returncode == 1
    problem = "model.d_model=64 is not divisible by model.n_heads=5"
    assert "Traceback" not in result.stderr
    assert f"error: 1 of 2 jobs failed in {sweep_dir}:" in result.stderr
    assert f"  0_lm-shakespeare-nano-rope-seed1337: {problem}" in result.stderr
    failed, completed = (load_json(d) for d in sorted(sweep_dir.glob("[01]_*")))
    assert failed["status"] == "failed" and failed["error"].startswith(problem)
    assert completed["status"] == "completed" and completed["metrics"]["test/loss"] > 0
    sweep = load_sweep(sweep_dir)
    assert [job.setting for job in sweep.failed] == ["model.n_heads=5"]
    report_main([str(sweep_dir)])
    report = (sweep_dir / "report.md").read_text()
    assert "| `model.n_heads=4` | 1 |" in report
    assert f"- `{sweep.failed[0].dir.name}` (failed): {problem}" in report


@pytest.mark.slow
def test_optuna_search_on_nano(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    result = multirun("hparams_search=lm_optuna", "hydra.sweeper.n_trials=2", "logger=none", sweep_dir=sweep_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    jobs = [load_json(d) for d in sorted(sweep_dir.glob("[01]_*"))]
    assert len(jobs) == 2 and all(job["setting"].startswith("optimizer.lr=") for job in jobs)
    assert jobs[0]["setting"] != jobs[1]["setting"], "each trial samples its own learning rate and warmup"
    results = OmegaConf.load(sweep_dir / "optimization_results.yaml")
    assert set(results.best_params) == {"optimizer.lr", "scheduler.warmup_steps"}
    assert results.best_value == pytest.approx(min(job["metrics"]["best/val/loss"] for job in jobs))


@pytest.mark.slow
def test_a_sweep_continued_with_new_values_keeps_every_job_and_runs_none_twice(lm_sweep: Path, tmp_path: Path) -> None:
    """The 2 x 2 sweep continued in (a copy of) its directory with one setting it has and one it lacks,
    then the same command again: the earlier jobs stay as they were, a job that ran is done in one line,
    the new one gets a new directory and W&B run, and each job's history is one training."""
    # Beside the sweep: multirun() sets paths.output_root to the parent, as it did for the sweep's jobs.
    sweep_dir = lm_sweep.parent / f"continued-{tmp_path.name}"
    shutil.copytree(lm_sweep, sweep_dir)
    started = json.loads((sweep_dir / "sweep.json").read_text())["started"]
    before = {d.name: (d / "metrics.jsonl").read_text() for d in sweep_dir.glob("*_lm-*")}
    walls = {job.dir.name: job.wall_s for job in load_sweep(sweep_dir).jobs}
    alibi = next(sweep_dir.glob("*_lm-shakespeare-nano-alibi-seed1"))
    for attempt in range(2):
        result = multirun("pos_encoding=alibi,sinusoidal", "seed=1", sweep_dir=sweep_dir)
        assert result.returncode == 0, result.stderr[-3000:]
        new = [d for d in sweep_dir.glob("*_lm-*") if d.name not in before]
        assert [d.name.split("_", 1)[1] for d in new] == ["lm-shakespeare-nano-sinusoidal-seed1"]
        assert int(new[0].name.split("_")[0]) >= len(before), "numbered after the jobs there"
        done = [line for line in result.stdout.splitlines() if line.startswith("done: ")]
        assert done == [f"done: {alibi}", *([f"done: {new[0]}"] if attempt else [])]
    assert {name: (sweep_dir / name / "metrics.jsonl").read_text() for name in before} == before
    for job in sweep_dir.glob("*_lm-*"):
        rows = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
        assert [(r["step"], r["stage"]) for r in rows] == [(1, "validate"), (2, "validate"), (2, "test")], job
    runs = find_offline_runs(sweep_dir)
    assert len(runs) == 5 and len({run.run_id for run in runs}) == 5, "one W&B run per training"
    assert json.loads((sweep_dir / "sweep.json").read_text())["started"] == started
    assert {job.setting for job in load_sweep(sweep_dir).completed} == {
        "pos_encoding=rope", "pos_encoding=alibi", "pos_encoding=sinusoidal"}
    after = {job.dir.name: job.wall_s for job in load_sweep(sweep_dir).jobs}
    assert {name: after[name] for name in walls} == walls and all(wall > 0 for wall in after.values())


def test_a_job_directory_is_found_by_its_overrides_and_new_jobs_are_numbered_after_the_others(tmp_path: Path) -> None:
    (tmp_path / "sweep.json").write_text(json.dumps({"started": "x", "swept": ["a"], "first_job": 7}))
    earlier = tmp_path / "3_run"
    (earlier / ".hydra").mkdir(parents=True)
    (earlier / ".hydra" / "overrides.yaml").write_text("- a=1\n- seed=2\n- resume=/somewhere\n")
    assert job_subdir(str(tmp_path), 0, "run", ["seed=2", "a=1"]) == "3_run"
    assert job_subdir(str(tmp_path), 1, "run", ["seed=2", "a=2"]) == "8_run"
    assert next_job_number(tmp_path) == 4


def test_jobs_are_in_number_order_and_a_call_without_earlier_jobs_starts_at_zero(tmp_path: Path) -> None:
    assert job_subdir(str(tmp_path), 0, "run", ["a=1"]) == "0_run", "no sweep.json yet"
    for name in ("10_run", "9_run", "2_run"):
        (tmp_path / name / ".hydra").mkdir(parents=True)
    assert [d.name for d in job_dirs(tmp_path)] == ["2_run", "9_run", "10_run"]
    assert next_job_number(tmp_path) == 11


def test_a_sweep_continued_keeps_its_start_and_sweeps_the_keys_of_every_call(tmp_path: Path) -> None:
    def start(*task: str) -> dict[str, Any]:
        config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}, "sweeper": {"params": None},
                                             "overrides": {"task": list(task)}}})
        SweepCallback().on_multirun_start(config)
        return json.loads((tmp_path / "sweep.json").read_text())

    first = start("a=1,2", "seed=1")
    (tmp_path / "4_run" / ".hydra").mkdir(parents=True)
    (tmp_path / "sweep.json").write_text(json.dumps({**first, "started": "2026-01-01_00-00-00"}))
    assert start("b=1,2", "seed=1,2") == {"started": "2026-01-01_00-00-00", "swept": ["a", "b", "seed"], "first_job": 5}


def test_an_identical_job_is_done_resumed_or_run_again_by_how_its_earlier_attempt_ended(tmp_path: Path) -> None:
    job = tmp_path / "0_run"
    (job / ".hydra").mkdir(parents=True)
    (job / "train.log").write_text("Hydra opens it as the job starts\n")
    assert earlier_attempt(job) == "new"
    (job / "metrics.jsonl").write_text("{}\n")
    assert earlier_attempt(job) == "restart", "stopped before its first checkpoint"
    (job / "checkpoints").mkdir()
    torch.save({"global_step": 3}, job / "checkpoints" / "last.ckpt")
    assert earlier_attempt(job) == "resume"
    (job / "status.json").write_text(json.dumps({"status": "failed", "error": "boom"}))
    assert earlier_attempt(job) == "restart"
    (job / "status.json").write_text(json.dumps({"status": "completed"}))
    assert earlier_attempt(job) == "done"


def test_a_job_resumes_in_its_directory_or_starts_again_with_only_hydras_files_left(tmp_path: Path) -> None:
    job = tmp_path / "0_run"
    (job / ".hydra").mkdir(parents=True)
    (job / "checkpoints").mkdir()
    torch.save({"global_step": 3}, job / "checkpoints" / "last.ckpt")
    cfg = OmegaConf.create({"resume": None})
    assert continue_job(cfg, job) is None and cfg.resume == str(job)
    (job / "status.json").write_text(json.dumps({"status": "failed", "error": "boom"}))
    (job / "metrics.jsonl").write_text("{}\n")
    (job / "train.log").write_text("this attempt's log\n")
    cfg = OmegaConf.create({"resume": None})
    assert continue_job(cfg, job) is None and cfg.resume is None
    assert sorted(p.name for p in job.iterdir()) == [".hydra", "train.log"]


def test_the_report_reads_two_trainings_appended_in_one_job_as_the_newest(tmp_path: Path) -> None:
    rows = [(1, "validate", 5.0), (2, "validate", 4.0), (2, "test", 4.1), (1, "validate", 3.0), (2, "validate", 2.0),
            (2, "test", 2.1)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "stage": t, "val/loss": v}) + "\n"
                                                    for s, t, v in rows))
    assert [(r["step"], r["stage"], r["val/loss"]) for r in _read_history(tmp_path / "metrics.jsonl")] == rows[3:]


def test_a_run_a_sweep_started_is_known_by_its_run_json_or_an_older_jobs_status(tmp_path: Path) -> None:
    assert remembered_sweep(tmp_path) is None
    (tmp_path / "status.json").write_text(json.dumps({"status": "cancelled", "sweep": "lm-1", "setting": "a=1"}))
    assert remembered_sweep(tmp_path) == ("lm-1", "a=1")
    remember_sweep(tmp_path, "lm-2", "a=2")
    assert remembered_sweep(tmp_path) == ("lm-2", "a=2")
