"""One axis across the tasks: the excluding sweeper, and the report of a tiny sweep over ``task=`` (lm, mlm)
x ``pos_encoding=`` (rope, alibi) x seeds 1, 2 with mlm + alibi excluded, checked against its own jobs."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from scipy import stats as scipy_stats

from hydra_plugins.trident_sweeper import register_sweeper
from trident.report import cross_task_table, load_jobs_csv, load_sweep, main

from .entry_points import run_in_process

# Keys every task has (no data.* or task.* of one task alone): two steps, a validation after each.
TINY_ANY_TASK = ["model=nano", "data.block_size=32", "data.batch_size=4", "trainer.max_steps=2",
                 "trainer.val_check_interval=1", "trainer.limit_val_batches=1", "trainer.num_sanity_val_steps=0",
                 "test=false", "logger=none", "callbacks=none", "data.sample_prompts=[]", "print_config=false"]


def jobs_of(**swept: str) -> list[list[str]]:
    return [job for batch in register_sweeper()(None, exclude=[["task=vit", "pos_encoding=alibi"]]).split_arguments(
        OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in swept.items()]), 2) for job in batch]


def test_the_sweeper_leaves_out_the_excluded_combinations_only() -> None:
    jobs = jobs_of(task="lm,vit", pos_encoding="rope,alibi", seed="1,2")
    assert jobs == [["task=lm", "pos_encoding=rope", "seed=1"], ["task=lm", "pos_encoding=rope", "seed=2"],
                    ["task=lm", "pos_encoding=alibi", "seed=1"], ["task=lm", "pos_encoding=alibi", "seed=2"],
                    ["task=vit", "pos_encoding=rope", "seed=1"], ["task=vit", "pos_encoding=rope", "seed=2"]]


def test_an_exclusion_with_a_key_the_sweep_does_not_set_fails_before_any_job(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        register_sweeper()(None, exclude=[["tsk=vit", "pos_encoding=alibi"]]).split_arguments(
            OverridesParser.create().parse_overrides(["task=lm,vit", "pos_encoding=rope,alibi"]), None)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "error: hydra.sweeper.exclude names tsk, which this sweep does not set: write each override as the "
        "sweep spells it, with a key among task, pos_encoding\n")
    with pytest.raises(SystemExit) as exit_info:  # checked with the sweep, once a refusal can clean up (issue 38)
        register_sweeper()(None, exclude=["task=vit"]).split_arguments(OverridesParser.create().parse_overrides(["task=lm,vit"]), None)
    assert exit_info.value.code == 2 and "entry 'task=vit' is not a list of key=value overrides" in capsys.readouterr().err


def test_an_exclusion_outside_a_narrower_sweep_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    """The preset excludes vit + alibi; a command line that sweeps rope alone runs every job it asks for."""
    assert len(jobs_of(task="lm,vit", pos_encoding="rope")) == 2
    assert "hydra.sweeper.exclude ['pos_encoding=alibi', 'task=vit'] matches no job of this sweep" in caplog.text


@pytest.fixture(scope="module")
def cross_task_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    sweep_dir = tmp_path_factory.mktemp("cross_task") / "sweep"
    # In this process (its jobs run one after another in it, as in `python train.py -m`): a fresh one only adds imports.
    with pytest.MonkeyPatch.context() as here:
        result = run_in_process(
            "train.py", ["-m", *TINY_ANY_TASK, "task=lm,mlm", "pos_encoding=rope,alibi", "seed=1,2", "hydra/sweeper=excluding",
                         "hydra.sweeper.exclude=[['task=mlm','pos_encoding=alibi']]", f"paths.output_root={sweep_dir.parent}",
                         f"hydra.sweep.dir={sweep_dir}"], sweep_dir.parent, here)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "All 6 jobs of the sweep completed" in result.stderr, "mlm + alibi is left out, not failed"
    return sweep_dir


def best_val_loss(sweep_dir: Path, task: str, encoding: str) -> list[float]:
    return [json.loads((d / "status.json").read_text())["metrics"]["best/val/loss"]
            for d in sorted(sweep_dir.glob(f"*_{task}-shakespeare-nano-{encoding}-seed*"))]


@pytest.mark.slow
def test_the_cross_task_report_has_a_row_per_encoding_and_a_column_per_task(cross_task_sweep: Path, tmp_path: Path) -> None:
    main([str(cross_task_sweep), "--out", str(tmp_path)])
    report = (tmp_path / "report.md").read_text()
    assert "| setting | lm: `best/val/loss` | mlm: `best/val/loss` |" in report
    lm = {pe: best_val_loss(cross_task_sweep, "lm", pe) for pe in ("rope", "alibi")}
    mlm_rope = best_val_loss(cross_task_sweep, "mlm", "rope")
    assert len(mlm_rope) == 2 and not best_val_loss(cross_task_sweep, "mlm", "alibi")
    winner, loser = sorted(lm, key=lambda pe: statistics.mean(lm[pe]))
    p = scipy_stats.ttest_ind(lm[loser], lm[winner], equal_var=False).pvalue  # one pair: Holm's p is p
    # Wellek's equivalence test at one seed SD: Student's t squared against a noncentral F(1, 2, 2 * 2 / 4).
    t2 = scipy_stats.ttest_ind(lm[loser], lm[winner]).statistic ** 2
    p_equivalence = scipy_stats.ncf.cdf(t2, 1, 2, 1.0)
    loser_verdict = ("worse than the best" if p < 0.05 else "within the noise" if p_equivalence < 0.05
                     else "undecided at 2 seeds")

    def cell(values: list[float], verdict: str) -> str:
        return f"{statistics.mean(values):.4g} ± {statistics.stdev(values):.2g} ({verdict}, n = 2)"

    rows = {pe: [cell(lm[pe], "best" if pe == winner else loser_verdict)] for pe in lm}
    rows["rope"].append(cell(mlm_rope, "best"))
    rows["alibi"].append("not run")
    for pe, cells in rows.items():
        assert f"| `pos_encoding={pe}` | " + " | ".join(cells) + " |" in report
    assert f"| {p:.3g} | {p:.3g} | {p_equivalence:.3g} | {loser_verdict} |" in report
    table = cross_task_table(load_sweep(cross_task_sweep))
    assert list(table.index) == ["pos_encoding=rope", "pos_encoding=alibi"]
    assert list(dict.fromkeys(task for task, _ in table.columns)) == ["lm", "mlm"]
    assert table.loc["pos_encoding=rope", ("mlm", "mean")] == pytest.approx(statistics.mean(mlm_rope), rel=1e-12)
    # The committed jobs.csv alone gives the same table.
    remade = cross_task_table(load_jobs_csv(tmp_path / "jobs.csv"))
    assert remade.equals(table)
