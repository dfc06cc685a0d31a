"""callbacks=harness (issue 52, item 4): harness tasks during training, logged as harness/<task>/<metric> at the
optimizer step, the training left as it was (a run with the callback trains step for step like one without it)."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from tests.conftest import LM_REFERENCE, SMALL, compose_config
from trident.errors import ConfigError

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.usefixtures("single_thread")

# Short enough for a character-level nano model on data.block_size=32.
QUESTIONS = [("ROMEO:\nO", [" love", " grave", " night"], 0), ("JULIET:\nGood", [" night", " day", " morrow"], 0),
             ("KING:\nMy", [" lord", " liege", " crown"], 1), ("QUEEN:\nThe", [" king", " crown", " sea"], 2)]


def write_task(folder: Path) -> Path:
    """``tiny_play_mc``: a multiple-choice task over a local JSONL file."""
    folder.mkdir()
    rows = [{"question": q, "choices": c, "answer": a} for q, c, a in QUESTIONS]
    (folder / "mc.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "tiny_play_mc.yaml").write_text(
        f"task: tiny_play_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'mc.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{question}}\"\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: answer\ntarget_delimiter: \"\"\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    return folder


class Recorder:
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append((step, dict(metrics)))


def test_an_evaluation_logs_at_the_step_and_leaves_the_mode_and_every_random_state(tmp_path: Path) -> None:
    from tests.test_harness import lm_task
    from trident.runs.harness_callback import HarnessEvaluation
    from trident.training.callbacks import MetricHistory

    task = lm_task().train()
    callback = HarnessEvaluation(tasks=["tiny_play_mc"], include_path=str(write_task(tmp_path / "tasks")), limit=3)
    recorder, history = Recorder(), MetricHistory(tmp_path / "metrics.jsonl", "val/loss", "min")
    waited: list[str] = []
    trainer = SimpleNamespace(is_global_zero=True, global_step=6, loggers=[recorder], callbacks=[history],
                              strategy=SimpleNamespace(barrier=waited.append), callback_metrics={})
    callback.setup(trainer, task, "fit")  # type: ignore[arg-type]
    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    callback._evaluate(trainer, task)  # type: ignore[arg-type]
    assert task.training and task.net.training
    after = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(after[0], expected[0]) and np.array_equal(after[1], expected[1]) and after[2] == expected[2]
    ((step, values),) = recorder.rows
    assert step == 6 and set(values) == {"harness/tiny_play_mc/acc", "harness/tiny_play_mc/acc_norm"}
    assert waited == ["harness"]
    (row,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert row == {"step": 6, "stage": "harness", **values}
    callback.on_train_end(trainer, task)  # type: ignore[arg-type]  # step 6 was evaluated: not again
    assert len(recorder.rows) == 1 and float(trainer.callback_metrics["harness/tiny_play_mc/acc"]) == values[
        "harness/tiny_play_mc/acc"]


def test_bad_settings_are_one_line(tmp_path: Path) -> None:
    from trident.runs.harness_callback import HarnessEvaluation

    with pytest.raises(ConfigError, match=r"callbacks.harness.tasks is empty"):
        HarnessEvaluation(tasks=[])
    with pytest.raises(ConfigError, match=r"every_n_steps=0 must be a whole number >= 1"):
        HarnessEvaluation(tasks=["x"], every_n_steps=0)
    with pytest.raises(ConfigError, match=r"callbacks.harness.limit=0 must be > 0"):
        HarnessEvaluation(tasks=["x"], limit=0)
    tasks = str(write_task(tmp_path / "tasks"))
    with pytest.raises(ConfigError, match=r"unknown task 'tiny_play_mq'.*did you mean tiny_play_mc"):
        HarnessEvaluation(tasks=["tiny_play_mq"], include_path=tasks)
    callback = HarnessEvaluation(tasks=["tiny_play_mc"], include_path=tasks)
    vit = SimpleNamespace(CAPABILITIES=frozenset(), NAME="vit", tokenizer=None)
    with pytest.raises(ConfigError, match=r"callbacks=harness scores a language model \(task=lm\), not task=vit: "
                                          r"remove it and evaluate with trident-eval \(test accuracy\)"):
        callback.setup(SimpleNamespace(), vit, "fit")  # type: ignore[arg-type]


def csv_rows(run_dir: Path) -> list[dict[str, Any]]:
    (metrics,) = run_dir.glob("csv/version_*/metrics.csv")
    return list(csv.DictReader(metrics.open()))


@pytest.mark.slow  # one 4-step nano run in-process, evaluated at steps 2 and 4 (the reference run is shared), W&B offline
def test_a_run_with_the_callback_trains_step_for_step_like_one_without(
        lm_reference_run: tuple[Path, dict[str, float]], tmp_path: Path) -> None:
    from trident.runs.pipeline import train

    reference, _ = lm_reference_run
    tasks = write_task(tmp_path / "tasks")
    run_dir = tmp_path / "run"
    cfg = compose_config([*SMALL, *LM_REFERENCE, "callbacks=harness", "callbacks.harness.tasks=[tiny_play_mc]",
                          f"callbacks.harness.include_path={tasks}", "callbacks.harness.every_n_steps=2",
                          "callbacks.harness.limit=3", "callbacks.harness.batch_size=2"], output_dir=run_dir)
    metrics = train(cfg)
    losses = {int(r["step"]): r["train/loss"] for r in csv_rows(run_dir) if r.get("train/loss")}
    assert losses == {int(r["step"]): r["train/loss"] for r in csv_rows(reference) if r.get("train/loss")}
    assert len(losses) == 4
    evaluated = [int(r["step"]) for r in csv_rows(run_dir) if r.get("harness/tiny_play_mc/acc")]
    assert evaluated == [2, 4]  # every 2 optimizer steps; the last step once, not again at the end
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in history if row["stage"] == "harness"]
    assert [row["step"] for row in rows] == [2, 4]
    # The values at the last step are among the run's final metrics (status.json, the sweep report).
    assert metrics["harness/tiny_play_mc/acc_norm"] == rows[-1]["harness/tiny_play_mc/acc_norm"]
    # W&B (offline here): the values in the summary, and at each evaluation a table of the documents scored.
    from trident.tracking.wandb_files import wait_for_offline_runs

    (wandb_run,) = wait_for_offline_runs(run_dir)
    assert wandb_run.summary["harness/tiny_play_mc/acc"] == metrics["harness/tiny_play_mc/acc"]
    tables = wandb_run.metric("harness/tiny_play_mc/samples")
    assert len(tables) == 2 and all(table["_type"] == "table-file" for table in tables)
    table = json.loads((wandb_run.path.parent / "files" / tables[-1]["path"]).read_text())
    assert table["columns"] == ["doc_id", "prompt", "target", "response", "acc", "acc_norm"]
    assert [row[:3] for row in table["data"]] == [[i, q, str(a)] for i, (q, _, a) in enumerate(QUESTIONS[:3])]
    assert sum(row[4] for row in table["data"]) / 3 == metrics["harness/tiny_play_mc/acc"]
