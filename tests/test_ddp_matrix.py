"""Every task under real 2-process DDP (``trainer=ddp_cpu``: gloo on CPU) with the default logger
(W&B, offline), each a real ``train.py`` / ``eval.py`` subprocess: a single run per task, resume
after SIGKILL and SIGTERM, eval.py on a DDP checkpoint. (The ``-m`` sweep under DDP: tests/test_ddp.py;
SIGTERM to rank 0 alone and a rank that fails: tests/test_ddp_signals.py.)

Every run must exit 0 with no traceback from any rank, and leave one run directory holding one
W&B run with the test metrics in its summary. Runs are shared between tests (module fixtures).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trident.runs.wandb_files import OfflineRun, read_offline_run, wait_for_offline_runs

from .conftest import ROOT, SMALL
from .test_translation_train import SMALL_MT
from .test_vit_pipeline import VIT_SMALL

pytestmark = pytest.mark.slow

DDP = ["trainer=ddp_cpu", "trainer.limit_test_batches=1"]
# The LM run that resume and SIGTERM repeat: dropout on (the RNG state matters), epochs of 4
# steps per rank, `last.ckpt` every 3 steps (the one a kill during step 7 leaves is mid-epoch).
LM = [
    *SMALL, *DDP, "model.dropout=0.1", "trainer.max_steps=8", "trainer.limit_train_batches=4",
    "trainer.val_check_interval=4", "trainer.check_val_every_n_epoch=null",
    "callbacks.last_checkpoint.every_n_train_steps=3", "callbacks.lr_monitor=null",
]


def run_script(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    env.pop("HYDRA_FULL_ERROR", None)
    env.pop("WANDB_SERVICE", None)  # its own W&B service, as a job started from a shell has
    return subprocess.run([sys.executable, str(ROOT / script), *args], check=False, capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=300)


def assert_clean(result: subprocess.CompletedProcess[str]) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "Traceback" not in output, output[-3000:]


def signal_at(step: int, name: str, rank: int | None = None) -> list[str]:
    return ["+callbacks.signal._target_=tests.resume_helpers.SignalAtStep", f"+callbacks.signal.step={step}",
            f"+callbacks.signal.signal_name={name}", f"+callbacks.signal.rank={'null' if rank is None else rank}"]


def one_run_dir(root: Path) -> Path:
    run_dirs = list(root.glob("outputs/runs/*/*"))
    assert len(run_dirs) == 1, f"one run directory, not one per rank: {run_dirs}"
    return run_dirs[0]


def one_wandb_run(run_dir: Path) -> OfflineRun:
    runs = wait_for_offline_runs(run_dir)
    assert len(runs) == 1, "one W&B run, from rank 0 only"
    return runs[0]


def train_losses(run_dir: Path) -> dict[int, float]:
    """Per-step training losses of every W&B segment of a run (a resumed run adds one)."""
    return {int(row["trainer/global_step"]): row["train/loss"]
            for run in wait_for_offline_runs(run_dir) for row in run.history if "train/loss" in row}


def checkpoint_step(path: Path) -> int:
    return int(torch.load(path, map_location="cpu", weights_only=True)["global_step"])


def ddp_run(root: Path, *overrides: str) -> Path:
    assert_clean(run_script("train.py", *overrides, f"paths.output_root={root / 'outputs'}", cwd=root))
    return one_run_dir(root)


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory: pytest.TempPathFactory, _shared_data_cache: None) -> Path:
    return ddp_run(tmp_path_factory.mktemp("lm"), *LM)


@pytest.fixture(scope="module")
def translation_run(tmp_path_factory: pytest.TempPathFactory, _shared_data_cache: None) -> Path:
    return ddp_run(tmp_path_factory.mktemp("translation"), *SMALL_MT, *DDP, "trainer.max_steps=2")


@pytest.fixture(scope="module")
def vit_run(tmp_path_factory: pytest.TempPathFactory, _shared_data_cache: None) -> Path:
    return ddp_run(tmp_path_factory.mktemp("vit"), *VIT_SMALL, *DDP, "trainer.limit_train_batches=2")


@pytest.mark.parametrize(("run", "test_metrics"), [
    ("lm_run", {"test/loss", "test/ppl"}),
    ("translation_run", {"test/bleu", "test/chrf", "test/ppl"}),
    ("vit_run", {"test/acc", "test/loss"}),
])
def test_each_task_runs_under_ddp_with_the_default_logger(run: str, test_metrics: set[str],
                                                          request: pytest.FixtureRequest) -> None:
    run_dir: Path = request.getfixturevalue(run)
    wandb_run = one_wandb_run(run_dir)
    assert wandb_run.finished and wandb_run.config["trainer"]["devices"] == 2
    assert wandb_run.config["precision_used"] == "32-true"
    assert test_metrics <= set(wandb_run.summary), wandb_run.summary
    assert all(math.isfinite(wandb_run.summary[key]) for key in test_metrics)
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "completed"


def test_lm_summary_keeps_the_best_validation_value(lm_run: Path) -> None:
    wandb_run = one_wandb_run(lm_run)
    val_losses = wandb_run.metric("val/loss")
    assert len(val_losses) == 2
    assert wandb_run.summary["best/val/loss"] == pytest.approx(min(val_losses))
    assert wandb_run.summary["val/loss"] == {"min": pytest.approx(min(val_losses)), "last": pytest.approx(val_losses[-1])}


def test_sigkilled_ddp_run_resumes_mid_epoch_step_for_step(lm_run: Path, tmp_path: Path) -> None:
    expected = train_losses(lm_run)
    assert sorted(expected) == list(range(8))
    result = run_script("train.py", *LM, *signal_at(7, "SIGKILL"), f"paths.output_root={tmp_path / 'outputs'}", cwd=tmp_path)
    assert result.returncode == -9 and "Traceback" not in result.stdout + result.stderr, result.stderr[-3000:]
    killed = one_run_dir(tmp_path)
    last = killed / "checkpoints" / "last.ckpt"
    assert checkpoint_step(last) == 6, "killed during step 7: the newest checkpoint is the mid-epoch one of step 6"

    assert_clean(run_script("train.py", f"resume={killed}", "++callbacks.signal=null", cwd=tmp_path))
    assert one_run_dir(tmp_path) == killed and checkpoint_step(last) == 8
    run_id = json.loads((killed / "run.json").read_text())["run_id"]
    segments = sorted(killed.glob("wandb/offline-run-*"))
    assert len(segments) == 2 and all(d.name.endswith(f"-{run_id}") for d in segments), "one W&B run, continued"
    # The SIGKILLed segment never finishes; the resumed one is complete when its job ends, and holds
    # the whole history: the steps before the checkpoint sent again from the W&B journal, then its own.
    (resumed_file,) = segments[-1].glob("run-*.wandb")
    resumed_run = read_offline_run(resumed_file)
    assert resumed_run.run_id == run_id and {"test/loss", "test/ppl"} <= set(resumed_run.summary)
    steps = [int(row["trainer/global_step"]) for row in resumed_run.history if "train/loss" in row]
    assert steps == list(range(8)), "every step once, in order"
    resumed = {int(row["trainer/global_step"]): row["train/loss"] for row in resumed_run.history if "train/loss" in row}
    torch.testing.assert_close(resumed, expected, rtol=0, atol=1e-6)


def test_ddp_run_stopped_by_sigterm_on_every_rank_resumes_exactly(lm_run: Path, tmp_path: Path) -> None:
    """SIGTERM to every rank, as SLURM sends it: the run saves the step it was on and exits 0; resumed,
    it trains step for step like the uninterrupted run (lm_run, shared with the other tests)."""
    result = run_script("train.py", *LM, *signal_at(4, "SIGTERM"), f"paths.output_root={tmp_path / 'outputs'}",
                        cwd=tmp_path)
    assert_clean(result)
    stopped = one_run_dir(tmp_path)
    assert checkpoint_step(stopped / "checkpoints" / "last.ckpt") == 5, "mid-epoch: epochs are 4 steps"
    assert_clean(run_script("train.py", f"resume={stopped}", "+callbacks.signal.step=-1", cwd=tmp_path))
    expected, resumed = train_losses(lm_run), train_losses(stopped)
    assert sorted(resumed) == sorted(expected) == list(range(8))
    torch.testing.assert_close(resumed, expected, rtol=0, atol=1e-6)


def test_eval_on_a_ddp_checkpoint_scores_the_same_test_blocks_in_one_process(lm_run: Path, tmp_path: Path) -> None:
    # The DDP test: 1 batch of 4 blocks per rank, blocks dealt out in turn, i.e. the first 8 blocks.
    (best,) = (lm_run / "checkpoints").glob("best-*.ckpt")
    result = run_script("eval.py", f"ckpt_path={best}", "data.batch_size=8", "trainer.limit_test_batches=1", cwd=tmp_path)
    assert_clean(result)
    metrics = json.loads((lm_run / "eval" / f"{best.stem}.json").read_text())["metrics"]
    assert metrics["test/loss"] == pytest.approx(one_wandb_run(lm_run).summary["test/loss"], rel=1e-5)
