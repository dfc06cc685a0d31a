"""The sweep report ranks settings by a harness metric of callbacks=harness (issue 52, item 4) with the statistics it
gives the validation loss: Welch and Holm against the best, higher is better for an accuracy."""

from __future__ import annotations

import json
from pathlib import Path

from scipy import stats as scipy_stats

from trident.report import main

ACC = "harness/trident_shakespeare_next_line/acc"
# Two settings, three seeds: learned positions have the lower loss, rope the higher accuracy.
JOBS = {"pos_encoding=learned": [(1.50, 0.30), (1.52, 0.32), (1.51, 0.29)],
        "pos_encoding=rope": [(1.55, 0.41), (1.56, 0.44), (1.57, 0.40)]}


def write_sweep(sweep_dir: Path) -> None:
    """A sweep's job directories as train.py -m leaves them, each with callbacks=harness rows in metrics.jsonl."""
    number = 0
    for setting, runs in JOBS.items():
        for seed, (loss, acc) in enumerate(runs):
            job = sweep_dir / f"{number}_job"
            (job / ".hydra").mkdir(parents=True)
            (job / ".hydra" / "overrides.yaml").write_text(f"- {setting}\n- seed={seed}\n")
            (job / ".hydra" / "config.yaml").write_text(f"seed: {seed}\n")
            metrics = {"best/val/loss": loss, ACC: acc}
            (job / "status.json").write_text(json.dumps({"status": "completed", "metrics": metrics,
                                                         "monitor": "val/loss", "monitor_mode": "min"}))
            rows = [{"step": 2, "stage": "validate", "val/loss": loss + 0.2}, {"step": 2, "stage": "harness", ACC: acc / 2},
                    {"step": 4, "stage": "validate", "val/loss": loss}, {"step": 4, "stage": "harness", ACC: acc}]
            (job / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
            number += 1


def test_the_report_ranks_settings_by_a_harness_metric(tmp_path: Path) -> None:
    write_sweep(tmp_path / "sweep")
    main([str(tmp_path / "sweep"), "--metric", ACC, "--out", str(tmp_path / "report")])
    report = (tmp_path / "report" / "report.md").read_text()
    assert ACC in (tmp_path / "report" / "jobs.csv").read_text().splitlines()[0]
    stem = ACC.replace("/", "_")
    assert f"curves_{stem}.png" in report and f"final_{stem}.png" in report  # its curve over the steps, its finals
    learned, rope = ([acc for _, acc in runs] for runs in JOBS.values())
    p = scipy_stats.ttest_ind(learned, rope, equal_var=False).pvalue
    # rope is the best by accuracy (higher is better); learned is tested against it, as the loss would be.
    assert "against the best setting by mean, `pos_encoding=rope`." in report
    assert "| `pos_encoding=rope` | 3 | best |" in report
    assert f"| {p:.3g} | {p:.3g} |" in report and "worse than the best" in report
    # By the validation loss, the same statistics rank them the other way.
    main([str(tmp_path / "sweep"), "--out", str(tmp_path / "by_loss")])
    by_loss = (tmp_path / "by_loss" / "report.md").read_text()
    losses = [[loss for loss, _ in runs] for runs in JOBS.values()]
    p_loss = scipy_stats.ttest_ind(*losses, equal_var=False).pvalue
    assert "against the best setting by mean, `pos_encoding=learned`." in by_loss
    assert f"| {p_loss:.3g} | {p_loss:.3g} |" in by_loss
