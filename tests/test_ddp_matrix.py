"""Every task under real 2-process DDP (``trainer=ddp_cpu``: gloo on CPU) with the default logger
(W&B, offline), each a real ``train.py`` / ``eval.py`` subprocess: a single run per task, resume
after SIGKILL and SIGTERM, eval.py on a DDP checkpoint, a ``finetune=lora`` run and its adapter. (The ``-m`` sweep under DDP: tests/test_ddp.py;
SIGTERM to rank 0 alone and a rank that fails: tests/test_ddp_signals.py.)

Every run must exit 0 with no traceback from any rank, and leave one run directory holding one
W&B run with the test metrics in its summary. Runs are shared between tests (module fixtures), the
translation and ViT runs with tests/test_slurm.py too (tests/shared_runs.py).
The LM runs average their weights (``callbacks=ema``), so resume under DDP restores the average too.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import trident
from trident.backbone import is_lora_parameter
from trident.runs.pipeline import train
from trident.tracking.wandb_files import OfflineRun, read_offline_run, wait_for_offline_runs

from .conftest import SMALL, compose_config
from .entry_points import run_in_process
from .shared_runs import ONE_NODE, TASK_RUNS, assert_clean, one_node_run, run_script

pytestmark = pytest.mark.slow

DDP = ["trainer=ddp_cpu", "trainer.limit_test_batches=1"]
# The LM run that the interrupted runs repeat (tests/shared_runs.py's, shared with tests/test_slurm.py): dropout
# on, epochs of 4 steps per rank, last.ckpt every 2 steps, 24 steps with a validation every 8, an EMA of the weights.
LM = [*ONE_NODE, *TASK_RUNS["lm"]]


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


# Each task's run is the one that tests/test_slurm.py compares with its 2-node jobs (shared_runs).
@pytest.fixture(scope="module")
def lm_run(tmp_path_factory: pytest.TempPathFactory, _shared_data_cache: None) -> Path:
    return one_node_run(tmp_path_factory, "lm")


@pytest.fixture(scope="module")
def translation_run(tmp_path_factory: pytest.TempPathFactory, _shared_data_cache: None) -> Path:
    return one_node_run(tmp_path_factory, "translation")


@pytest.fixture(scope="module")
def vit_run(tmp_path_factory: pytest.TempPathFactory, _shared_data_cache: None) -> Path:
    return one_node_run(tmp_path_factory, "vit")


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
    assert len(val_losses) == 3
    assert wandb_run.summary["best/val/loss"] == pytest.approx(min(val_losses))
    assert wandb_run.summary["val/loss"] == {"min": pytest.approx(min(val_losses)), "last": pytest.approx(val_losses[-1])}


def test_ema_under_ddp_averages_every_step_and_rank_zero_saves_both_weights(lm_run: Path) -> None:
    last = torch.load(lm_run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert int(last["averaging_state"]["n_averaged"]) == 24
    gap = max((last["state_dict"][k] - w).abs().max().item()
              for k, w in last["current_model_state"].items() if w.is_floating_point())
    assert gap > 1e-4, "state_dict holds the average, current_model_state the raw weights"


def test_ddp_run_stopped_by_sigterm_then_sigkilled_resumes_exactly_each_time(lm_run: Path, tmp_path: Path) -> None:
    """SIGTERM to every rank during step 1, as SLURM sends it: the run saves the step it was on and
    exits 0. Resumed, it is SIGKILLed during step 7, so its newest checkpoint is the mid-epoch one of
    step 6. Resumed again, it ends like the uninterrupted run (lm_run, 24 steps): each step's loss, the raw
    weights and their average, and one W&B run whose last segment holds the whole history."""
    expected = train_losses(lm_run)
    assert sorted(expected) == list(range(24))
    result = run_script("train.py", *LM, *signal_at(1, "SIGTERM"), f"paths.output_root={tmp_path / 'outputs'}",
                        cwd=tmp_path)
    assert_clean(result)
    run_dir = one_run_dir(tmp_path)
    last = run_dir / "checkpoints" / "last.ckpt"
    assert checkpoint_step(last) == 2, "stopped at the step the signal came in, mid-epoch (epochs are 4 steps)"

    killed = run_script("train.py", f"resume={run_dir}", "+callbacks.signal.step=7",
                        "+callbacks.signal.signal_name=SIGKILL", cwd=tmp_path)
    assert killed.returncode == -9 and "Traceback" not in killed.stdout + killed.stderr, killed.stderr[-3000:]
    assert checkpoint_step(last) == 6, "killed during step 7: the newest checkpoint is the mid-epoch one of step 6"

    assert_clean(run_script("train.py", f"resume={run_dir}", "++callbacks.signal=null", cwd=tmp_path))
    assert one_run_dir(tmp_path) == run_dir and checkpoint_step(last) == 24
    finished, straight = (torch.load(d / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
                          for d in (run_dir, lm_run))
    for key in ("state_dict", "current_model_state", "averaging_state"):
        torch.testing.assert_close(finished[key], straight[key], rtol=0, atol=1e-6)
    run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
    segments = sorted(run_dir.glob("wandb/offline-run-*"))
    assert len(segments) == 3 and all(d.name.endswith(f"-{run_id}") for d in segments), "one W&B run, continued twice"
    # The SIGKILLed segment never finishes; the last one is complete when its job ends and holds the
    # whole history: the steps before its checkpoint sent again from the W&B journal, then its own.
    (last_file,) = segments[-1].glob("run-*.wandb")
    last_segment = read_offline_run(last_file)
    assert last_segment.run_id == run_id and {"test/loss", "test/ppl"} <= set(last_segment.summary)
    steps = [int(row["trainer/global_step"]) for row in last_segment.history if "train/loss" in row]
    assert steps == list(range(24)), "every step once, in order"
    resumed = {int(row["trainer/global_step"]): row["train/loss"] for row in last_segment.history if "train/loss" in row}
    torch.testing.assert_close(resumed, expected, rtol=0, atol=1e-6)


def test_eval_on_a_ddp_checkpoint_scores_the_same_test_blocks_in_one_process(lm_run: Path, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # The DDP test: 1 batch of 4 blocks per rank, blocks dealt out in turn, i.e. the first 8 blocks. eval.py runs in
    # this process (one process is what is compared; a fresh one would only add its imports).
    (best,) = (lm_run / "checkpoints").glob("best-*.ckpt")
    result = run_in_process("eval.py", [f"ckpt_path={best}", "data.batch_size=8", "trainer.limit_test_batches=1"],
                            tmp_path, monkeypatch)
    assert result.returncode == 0 and "Traceback" not in result.stdout + result.stderr, result.stderr[-3000:]
    metrics = json.loads((lm_run / "eval" / f"{best.stem}.json").read_text())["metrics"]
    assert metrics["test/loss"] == pytest.approx(one_wandb_run(lm_run).summary["test/loss"], rel=1e-5)


def test_a_lora_run_under_ddp_writes_one_w_and_b_run_and_the_adapter_of_its_best_weights(tmp_path: Path) -> None:
    """finetune=lora from a tiny base (trained here in-process), 2 ranks, the default logger: one W&B run that
    says what trains, one adapter (rank 0's), holding the adapters of the best checkpoint alone, which on the
    base reproduce the run's logits."""
    base = tmp_path / "base"
    train(compose_config([*SMALL, "logger=none", "test=false", "trainer.max_steps=2", "callbacks.lr_monitor=null"],
                         output_dir=base))
    (tmp_path / "lora").mkdir()
    run_dir = ddp_run(tmp_path / "lora", *SMALL, *DDP, "finetune=lora", f"init_from={base}")
    wandb_run = one_wandb_run(run_dir)
    assert wandb_run.finished and wandb_run.config["finetune"]["name"] == "lora"
    assert 0 < wandb_run.summary["params/trainable_share"] < 0.2
    adapter = load_file(str(run_dir / "adapter" / "adapter.safetensors"))
    assert adapter and all(is_lora_parameter(name) for name in adapter)
    assert wandb_run.summary["params/trainable"] == sum(t.numel() for t in adapter.values())
    (best,) = (run_dir / "checkpoints").glob("best-*.ckpt")
    state = torch.load(best, map_location="cpu", weights_only=True)["state_dict"]
    assert all(torch.equal(t, state[f"net.{name}"]) for name, t in adapter.items())
    assert any(t.abs().sum() > 0 for name, t in adapter.items() if ".lora_B." in name), "the adapters trained"
    tuned, plain = trident.load(run_dir), trident.load(base)
    rebuilt = type(plain)(**{**plain.hparams, "lora": tuned.hparams["lora"]}).eval()
    rebuilt.net.load_state_dict(plain.net.state_dict(), strict=False)
    rebuilt.net.load_state_dict(adapter, strict=False)
    ids = torch.randint(0, tuned.net.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(rebuilt.net(ids), tuned.net(ids), rtol=0, atol=0)
