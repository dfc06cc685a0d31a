"""``trainer=fsdp_cpu``: FSDP2 (``fully_shard`` per Transformer block, then the root) on 2 gloo
processes, each a real ``train.py`` subprocess. It trains the same model as DDP (``trainer=ddp_cpu``)
step for step (the LM and the MLM), each rank holding half the weights, and every task trains under it
with the default logger (W&B, offline)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from .conftest import SMALL
from .shared_runs import QUIET, TASK_RUNS, assert_clean, run_script
from .test_classify import CLASSIFY_SMALL

pytestmark = pytest.mark.slow

RECORD = ["+callbacks.record_rank._target_=tests.sharding_helpers.RecordRank"]
# 20 steps with dropout on (each rank's random state matters), validation once.
LM_20 = [*SMALL, *QUIET, "model.dropout=0.1", "trainer.max_steps=20", "trainer.val_check_interval=20", "seed=3"]
MLM_20 = ["task=mlm", *(o for o in LM_20 if not o.startswith("task.sampling"))]
# A few steps of each other task (the LM and the MLM are the runs above): classify, translation, vit.
TASKS = {"classify": [*(o for o in CLASSIFY_SMALL if o != "logger=none"), *QUIET], **TASK_RUNS}


def train(root: Path, trainer: str, *overrides: str) -> Path:
    root.mkdir(exist_ok=True)
    assert_clean(run_script("train.py", f"trainer={trainer}", *overrides, *RECORD,
                            f"paths.output_root={root / 'outputs'}", cwd=root))
    (run_dir,) = root.glob("outputs/runs/*/*")
    return run_dir


def ranks(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(2)]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]


def assert_completed_with_one_wandb_run(run_dir: Path) -> None:
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"
    assert [r["world_size"] for r in ranks(run_dir)] == [2, 2]
    assert len(list(run_dir.glob("wandb/offline-run-*"))) == 1, "one W&B run (the default logger), from rank 0"


@pytest.mark.parametrize("task", [LM_20, MLM_20], ids=["lm", "mlm"])
def test_fsdp_trains_as_ddp_does_each_rank_holding_half_the_weights(task: list[str], tmp_path: Path) -> None:
    ddp, fsdp = (train(tmp_path / trainer, trainer, *task) for trainer in ("ddp_cpu", "fsdp_cpu"))
    assert_completed_with_one_wandb_run(fsdp)
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
    # The checkpoint holds the whole weights, gathered: the same as DDP's after 20 steps.
    torch.testing.assert_close(weights(fsdp), weights(ddp), rtol=0, atol=1e-5)


@pytest.mark.parametrize("task", list(TASKS))
def test_every_other_task_trains_under_fsdp_with_the_default_logger(task: str, tmp_path: Path) -> None:
    assert_completed_with_one_wandb_run(train(tmp_path, "fsdp_cpu", *TASKS[task], "trainer.limit_test_batches=1"))


def test_fsdp_run_stopped_by_sigterm_resumes_exactly(tmp_path: Path) -> None:
    """SIGTERM to every rank during step 5 of 8 (epochs of 4 steps per rank: mid-epoch): the run saves the
    step it was on; resumed under FSDP, it ends like the uninterrupted run, each rank's losses and the weights."""
    task = [*LM_20, "trainer.max_steps=8", "trainer.limit_train_batches=4", "trainer.val_check_interval=4",
            "trainer.check_val_every_n_epoch=null", "logger=none"]
    straight = train(tmp_path / "straight", "fsdp_cpu", *task)
    stopped = train(tmp_path / "stopped", "fsdp_cpu", *task, "+callbacks.signal._target_=tests.resume_helpers.SignalAtStep",
                    "+callbacks.signal.step=5", "+callbacks.signal.signal_name=SIGTERM", "+callbacks.signal.rank=null")
    assert torch.load(stopped / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"] == 6
    assert_clean(run_script("train.py", f"resume={stopped}", "++callbacks.signal=null", cwd=tmp_path / "stopped"))
    for whole, resumed in zip(ranks(straight), ranks(stopped)):
        torch.testing.assert_close(resumed["losses"], whole["losses"][6:], rtol=0, atol=1e-6)
    torch.testing.assert_close(weights(stopped), weights(straight), rtol=0, atol=1e-6)
