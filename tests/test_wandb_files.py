"""trident.tracking.wandb_files reads an offline W&B run back as W&B itself reads it: identity, the config given
to ``wandb.init`` and its later updates, every history row, the summary, and whether it finished."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trident.errors import DataError
from trident.tracking.wandb_files import OfflineRun, find_offline_runs, offline_runs_to_sync, read_offline_run
from trident.tracking.wandb_files import main as wandb_files_main

# A run logged the way a user's script would: config at init and later, rows, a table, a summary value.
SCRIPT = """
import wandb
run = wandb.init(project="p", name="n", group="g", job_type="j", tags=["t1", "t2"], dir=".",
                 config={"lr": 0.1, "model": {"d_model": 4}})
run.config.update({"extra": "x"})
for i in range(3):
    run.log({"train/loss": 1.0 / (i + 1)})
run.log({"samples": wandb.Table(columns=["prompt", "text"], data=[["To be", "or not"]])})
run.summary["best/val"] = 0.5
run.finish()
"""


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory: pytest.TempPathFactory) -> OfflineRun:
    directory = tmp_path_factory.mktemp("wandb_run")
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    subprocess.run([sys.executable, "-c", SCRIPT], cwd=directory, env=env, check=True, timeout=120)
    (run,) = find_offline_runs(directory)
    return run


def test_offline_run_reads_back_what_was_logged(offline_run: OfflineRun) -> None:
    run = offline_run
    assert (run.name, run.group, run.job_type, run.tags) == ("n", "g", "j", ["t1", "t2"])
    assert run.path.name == f"run-{run.run_id}.wandb"
    # The config given to wandb.init, and the update after it (W&B's own "_wandb" entry left out).
    assert run.config == {"lr": 0.1, "model": {"d_model": 4}, "extra": "x"}
    assert run.metric("train/loss") == pytest.approx([1.0, 0.5, 1 / 3])
    assert run.summary["best/val"] == 0.5 and run.summary["train/loss"] == pytest.approx(1 / 3)
    (table,) = run.metric("samples")  # a media value is one value under its key, as W&B holds it
    assert table["_type"] == "table-file" and (run.path.parent / "files" / table["path"]).is_file()
    assert run.finished


def test_offline_run_matches_wandbs_own_summary(offline_run: OfflineRun) -> None:
    """The same file through ``wandb leet inspect --summary --json`` (W&B's merged view of the run)."""
    command = [sys.executable, "-P", "-m", "wandb", "leet", "inspect", "--summary", "--json", str(offline_run.path)]
    env = {**os.environ, "WANDB_MODE": "offline"}
    view = json.loads(subprocess.run(command, capture_output=True, text=True, check=True, env=env).stdout)
    assert offline_run.config == view["config"]
    assert (offline_run.run_id, offline_run.name, offline_run.tags) == (view["run_id"], view["name"], view["tags"])
    logged = {key: value for key, value in view["summary"].items() if not key.startswith("_")}
    assert {"samples", "best/val"} <= logged.keys()
    assert all(offline_run.summary[key] == value for key, value in logged.items())
    assert offline_run.finished == (view["state"] == "finished")


def test_a_file_that_is_no_wandb_run_is_one_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "run-x.wandb"
    bad.write_bytes(b"not a W&B log")
    with pytest.raises(DataError, match="not a complete W&B run file"):
        read_offline_run(bad)


def test_the_upload_is_the_newest_attempt_of_each_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run resumed twice (three attempts under one id) and a run of one attempt, in a sweep directory:
    the sync command uploads one directory per run id, the newest attempt's."""
    attempts = {"0_job/wandb/offline-run-20261128_090000-aaa": "aaa", "0_job/wandb/offline-run-20261128_100000-aaa": "aaa",
                "0_job/wandb/offline-run-20261128_093000-aaa": "aaa", "1_job/wandb/offline-run-20261128_091500-bbb": "bbb"}
    for directory, run_id in attempts.items():
        (tmp_path / directory).mkdir(parents=True)
        (tmp_path / directory / f"run-{run_id}.wandb").write_bytes(b"")
    expected = [tmp_path / "0_job/wandb/offline-run-20261128_100000-aaa", tmp_path / "1_job/wandb/offline-run-20261128_091500-bbb"]
    assert offline_runs_to_sync([tmp_path]) == expected
    wandb_files_main(["sync", "--dry-run", str(tmp_path)])
    assert capsys.readouterr().out.split() == [str(path) for path in expected]
    with pytest.raises(SystemExit, match="no offline W&B run below"):
        wandb_files_main(["sync", str(tmp_path / "1_job" / "nothing")])
