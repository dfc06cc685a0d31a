"""``trainer=fsdp_cpu``: FSDP2 (``fully_shard`` per Transformer block, then the root) on 2 gloo
processes, each a real ``train.py`` subprocess. It trains the same model as DDP (``trainer=ddp_cpu``)
step for step (the LM and the MLM), each rank holding half the weights, and every task trains under it
with the default logger (W&B, offline).

The LM run is stopped by SIGTERM twice and resumed each time, first from a checkpoint file, then from a
sharded checkpoint (``trainer.strategy.save_distributed_checkpoint=true``), and still trains as DDP's
uninterrupted run; its sharded checkpoints are read whole without FSDP (``trident.load``, eval.py,
trident-export, ``init_from``), and one of them resumes in one process (2 ranks -> 1)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import trident
from trident.training.distributed_checkpoint import is_sharded_checkpoint
from trident.weights.checkpoints import read_checkpoint
from trident.weights.init_from import read_init_source

from .conftest import SMALL
from .entry_points import run_in_process
from .shared_runs import QUIET, TASK_RUNS, assert_clean, run_script
from .test_classify import CLASSIFY_SMALL

pytestmark = pytest.mark.slow

RECORD = ["+callbacks.record_rank._target_=tests.sharding_helpers.RecordRank"]
# 20 steps with dropout on (each rank's random state matters), epochs of 4 steps, validation once.
LM_20 = [*SMALL, *QUIET, "model.dropout=0.1", "trainer.max_steps=20", "trainer.limit_train_batches=4",
         "trainer.check_val_every_n_epoch=null", "trainer.val_check_interval=20", "seed=3"]
MLM_20 = ["task=mlm", *(o for o in LM_20 if not o.startswith("task.sampling"))]
# The DDP references are compared, not read: no logger, no test.
REFERENCE = ["logger=none", "test=false"]
# A resume that changes it names the trainer again: the command line is checked against the default config first.
SHARDED = ["trainer.strategy.save_distributed_checkpoint=true"]
# SIGTERM to every rank as optimizer step `callbacks.signal.step` (0-based) begins: the run saves after it and stops.
STOP = ["+callbacks.signal._target_=tests.resume_helpers.SignalAtStep", "+callbacks.signal.signal_name=SIGTERM",
        "+callbacks.signal.rank=null"]
# A few steps of each other task (the LM and the MLM are the runs above): classify, translation, vit.
TASKS = {"classify": [*(o for o in CLASSIFY_SMALL if o != "logger=none"), *QUIET], **TASK_RUNS}


def train(root: Path, trainer: str, *overrides: str) -> Path:
    root.mkdir(exist_ok=True)
    assert_clean(run_script("train.py", f"trainer={trainer}", *overrides, *RECORD,
                            f"paths.output_root={root / 'outputs'}", cwd=root))
    (run_dir,) = root.glob("outputs/runs/*/*")
    return run_dir


def resume(run_dir: Path, *overrides: str) -> None:
    assert_clean(run_script("train.py", f"resume={run_dir}", *overrides, cwd=run_dir))


def ranks(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(2)]


def last(run_dir: Path, weights: bool = True) -> dict[str, Any]:
    """The run's last checkpoint, a file or sharded (then gathered here, in one process without FSDP)."""
    return read_checkpoint(run_dir / "checkpoints" / "last.ckpt", "the run's last checkpoint", weights=weights)


def net_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return {k.removeprefix("net."): v for k, v in last(run_dir)["state_dict"].items() if k.startswith("net.")}


def assert_completed_with_one_wandb_run(run_dir: Path) -> None:
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"
    assert [r["world_size"] for r in ranks(run_dir)] == [2, 2]
    assert len(list(run_dir.glob("wandb/offline-run-*"))) == 1, "one W&B run (the default logger), from rank 0"


def assert_trains_as_ddp(ddp: Path, fsdp: Path) -> None:
    """Each rank's 20 losses equal DDP's, each rank holds half of every parameter, gradient and optimizer
    state, and the last checkpoint holds the whole weights, the same as DDP's."""
    for ddp_rank, fsdp_rank in zip(ranks(ddp), ranks(fsdp)):
        assert len(fsdp_rank["losses"]) == 20
        torch.testing.assert_close(fsdp_rank["losses"], ddp_rank["losses"], rtol=0, atol=1e-5)
        held, whole = fsdp_rank["params"], ddp_rank["params"]
        assert held["dtensors"] == held["tensors"] == whole["tensors"] and whole["dtensors"] == 0
        assert held["total"] == whole["total"] == whole["local"]
        # fully_shard splits each tensor's first dimension in two (rounded up): about half each.
        assert 0.45 < held["local"] / held["total"] < 0.55, held
        # Gradients and optimizer state are sharded like the parameters (AdamW: two moments a parameter).
        for kind in ("parameters", "gradients", "optimizer_state"):
            assert 0.45 < held["bytes"][kind] / whole["bytes"][kind] < 0.55, (kind, held["bytes"], whole["bytes"])
    torch.testing.assert_close(last(fsdp)["state_dict"], last(ddp)["state_dict"], rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def lm_ddp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train(tmp_path_factory.mktemp("lm-ddp"), "ddp_cpu", *LM_20, *REFERENCE)


@pytest.fixture(scope="module")
def lm_fsdp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The LM under FSDP, stopped by SIGTERM during steps 6 and 14 (mid-epoch) and resumed each time: from a
    checkpoint file, after which it saves sharded checkpoints, then from a sharded one. Returns its run
    directory and a copy of it as it stood at step 14 (the sharded checkpoint of 2 ranks)."""
    root = tmp_path_factory.mktemp("lm-fsdp")
    run_dir = train(root, "fsdp_cpu", *LM_20, "logger=none", *STOP, "+callbacks.signal.step=5")
    checkpoint = run_dir / "checkpoints" / "last.ckpt"
    assert checkpoint.is_file() and last(run_dir, weights=False)["global_step"] == 6
    resume(run_dir, "trainer=fsdp_cpu", *SHARDED, "++callbacks.signal.step=13")
    assert is_sharded_checkpoint(checkpoint) and last(run_dir, weights=False)["global_step"] == 14
    at_step_14 = Path(shutil.copytree(run_dir, root / "at-step-14"))
    resume(run_dir, "trainer=fsdp_cpu", *SHARDED, "++callbacks.signal=null")
    return run_dir, at_step_14


def test_fsdp_stopped_and_resumed_twice_trains_as_ddp_does(lm_ddp: Path, lm_fsdp: tuple[Path, Path]) -> None:
    """Steps 7-14 follow a resume from a checkpoint file, steps 15-20 one from a sharded checkpoint: each rank's
    losses and the weights are still DDP's uninterrupted run's."""
    run_dir, _ = lm_fsdp
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"
    assert_trains_as_ddp(lm_ddp, run_dir)


def test_fsdp_trains_the_mlm_as_ddp_does(tmp_path: Path) -> None:
    ddp = train(tmp_path / "ddp", "ddp_cpu", *MLM_20, *REFERENCE)
    fsdp = train(tmp_path / "fsdp", "fsdp_cpu", *MLM_20)
    assert_completed_with_one_wandb_run(fsdp)
    assert_trains_as_ddp(ddp, fsdp)


@pytest.mark.parametrize("task", list(TASKS))
def test_every_other_task_trains_under_fsdp_with_the_default_logger(task: str, tmp_path: Path) -> None:
    assert_completed_with_one_wandb_run(train(tmp_path, "fsdp_cpu", *TASKS[task], "trainer.max_steps=2",
                                              "trainer.limit_test_batches=1"))


def evaluate(run_dir: Path, cwd: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, float]:
    result = run_in_process("eval.py", [f"ckpt_path={run_dir}"], cwd, monkeypatch)
    assert result.returncode == 0, result.stderr
    (written,) = (run_dir / "eval").glob("*.json")
    metrics = json.loads(written.read_text())["metrics"]
    return {k: v for k, v in metrics.items() if not k.endswith("_per_s")}  # speeds vary


def test_a_sharded_run_is_read_whole_without_fsdp(lm_ddp: Path, lm_fsdp: tuple[Path, Path], tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank wrote its shards; trident.load, init_from, trident-export and eval.py gather them in one
    process into the weights of DDP's run (the checkpoint at step 20: the best, the run's only validation)."""
    run_dir, _ = lm_fsdp
    folder = run_dir / "checkpoints"
    assert sorted(os.listdir(folder)) == ["best-step20.ckpt", "last.ckpt"], "nothing staged is left behind"
    for checkpoint in folder.iterdir():
        assert sorted(os.listdir(checkpoint)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    whole = net_weights(lm_ddp)
    torch.testing.assert_close(trident.load(run_dir).net.state_dict(), whole, rtol=0, atol=1e-5)
    torch.testing.assert_close(read_init_source(str(run_dir)).state_dict, whole, rtol=0, atol=1e-5)
    out = tmp_path / "exported"
    result = run_in_process("trident.commands.export", [str(run_dir), "--format", "safetensors", "--out", str(out)],
                            tmp_path, monkeypatch)
    assert result.returncode == 0, result.stderr
    exported = load_file(out / "model.safetensors")
    torch.testing.assert_close(exported, {k: whole[k] for k in exported}, rtol=0, atol=1e-5)
    sharded, reference = evaluate(run_dir, tmp_path, monkeypatch), evaluate(lm_ddp, tmp_path, monkeypatch)
    assert sharded.keys() == reference.keys() and "test/loss" in sharded
    assert sharded == pytest.approx(reference, abs=1e-4)


def test_a_sharded_checkpoint_of_two_ranks_resumes_in_one_process(lm_fsdp: tuple[Path, Path]) -> None:
    """2 ranks -> 1: the sharded checkpoint of step 14 resumes under trainer=fsdp_cpu trainer.devices=1 with the
    weights it holds (each whole parameter's sum as training starts), and trains on."""
    _, at_step_14 = lm_fsdp
    saved = last(at_step_14)["state_dict"]
    resume(at_step_14, "trainer.devices=1", "trainer.max_steps=16", "test=false", "++callbacks.signal=null")
    record = json.loads((at_step_14 / "rank0.json").read_text())
    assert record["world_size"] == 1 and len(record["losses"]) == 16
    assert record["start_sums"] == pytest.approx({name: float(saved[name].double().sum()) for name in record["start_sums"]},
                                                 rel=0, abs=1e-9)
