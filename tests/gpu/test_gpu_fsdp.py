"""``trainer=fsdp`` (FSDP2) on one GPU over NCCL, each run a real ``train.py`` subprocess: every task trains with
the default logger; in bf16 (parameters gathered and run in bf16, gradients reduced in fp32) the LM trains as
``trainer=gpu`` does in bf16; its sharded checkpoint, written on the GPU, resumes where the run stopped.

The CPU suite proves the sharding itself on 2 gloo processes (``tests/test_fsdp.py``); these prove the NCCL
backend, CUDA tensors in the shards and the bf16 policy, which gloo on CPUs does not reach."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import trident
from trident.parallel.distributed_checkpoint import is_sharded_checkpoint

from ..conftest import SMALL
from ..shared_runs import QUIET, assert_clean, run_script
from .runs import TASK_RUNS
from .test_gpu_precision import BF16_LOSS_TOLERANCE

pytestmark = pytest.mark.slow

FSDP_ONE_GPU = ["trainer=fsdp", "trainer.devices=1", "precision=bf16", "compile=false",
                "+callbacks.record_rank._target_=tests.sharding_helpers.RecordRank"]
STEPS = 60
# The nano LM, no logger or test pass: only the optimizer steps differ between the runs compared.
LM_60 = [*SMALL, "task=lm", *QUIET, "logger=none", "test=false", "data.block_size=64", "data.batch_size=32",
         f"trainer.max_steps={STEPS}", "trainer.limit_train_batches=20", "trainer.check_val_every_n_epoch=null",
         f"trainer.val_check_interval={STEPS}", "seed=5"]
STOP_AT_30 = ["trainer.strategy.save_distributed_checkpoint=true",
              "+callbacks.signal._target_=tests.resume_helpers.SignalAtStep", "+callbacks.signal.signal_name=SIGTERM",
              "+callbacks.signal.step=30"]


def train(root: Path, *overrides: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    assert_clean(run_script("train.py", *overrides, f"paths.output_root={root / 'outputs'}", cwd=root))
    (run_dir,) = root.glob("outputs/runs/*/*")
    return run_dir


def record(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "rank0.json").read_text())


@pytest.fixture(scope="module")
def lm_fsdp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train(tmp_path_factory.mktemp("lm-fsdp"), *LM_60, *FSDP_ONE_GPU)


@pytest.mark.parametrize("task", list(TASK_RUNS))
def test_every_task_trains_under_fsdp_on_one_gpu_over_nccl(task: str, tmp_path: Path) -> None:
    run_dir = train(tmp_path, *TASK_RUNS[task](tmp_path), *FSDP_ONE_GPU)
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"
    assert len(list(run_dir.glob("wandb/offline-run-*"))) == 1, "one W&B run (the default logger)"
    rank = record(run_dir)
    assert (rank["world_size"], rank["backend"]) == (1, "nccl")
    assert rank["device"].startswith("cuda")
    # fully_shard makes every parameter a DTensor, one rank holding all of it.
    assert rank["params"]["dtensors"] == rank["params"]["tensors"] > 0
    assert rank["params"]["local"] == rank["params"]["total"]


def test_fsdp_in_bf16_trains_the_lm_as_plain_bf16_does(lm_fsdp: Path, tmp_path: Path) -> None:
    """FSDP's policy runs bf16 copies of the weights (autocast casts them per matmul): the same updates within
    bf16's rounding, so the last losses agree as bf16's agree with fp32's (tests/gpu/test_gpu_precision.py)."""
    plain = train(tmp_path, *LM_60, "trainer=gpu", "precision=bf16", "compile=false",
                  "+callbacks.record_rank._target_=tests.sharding_helpers.RecordRank")
    sharded_losses, plain_losses = record(lm_fsdp)["losses"], record(plain)["losses"]
    assert len(sharded_losses) == len(plain_losses) == STEPS
    first, last = sum(sharded_losses[:5]) / 5, sum(sharded_losses[-5:]) / 5
    assert last < 0.85 * first, f"the loss must fall: first steps {first:.3f}, last steps {last:.3f}"
    plain_last = sum(plain_losses[-5:]) / 5
    assert abs(last - plain_last) <= BF16_LOSS_TOLERANCE * plain_last, (last, plain_last)


def test_a_sharded_checkpoint_written_on_the_gpu_resumes_where_the_run_stopped(lm_fsdp: Path, tmp_path: Path) -> None:
    """Stopped by SIGTERM as step 30 begins, the run leaves a sharded checkpoint of 30 steps; resumed, it
    continues as the uninterrupted run did (the same kernels on the same batches: equal to bf16's rounding)."""
    run_dir = train(tmp_path, *LM_60, *FSDP_ONE_GPU, *STOP_AT_30)
    checkpoint = run_dir / "checkpoints" / "last.ckpt"
    assert is_sharded_checkpoint(checkpoint)
    assert_clean(run_script("train.py", f"resume={run_dir}", "++callbacks.signal=null", cwd=run_dir))
    resumed, uninterrupted = record(run_dir)["losses"], record(lm_fsdp)["losses"]
    assert len(resumed) == STEPS
    torch.testing.assert_close(resumed, uninterrupted, rtol=1e-2, atol=0)
    # Read whole, in this process without FSDP.
    model = trident.load(run_dir)
    assert sum(p.numel() for p in model.parameters()) == record(lm_fsdp)["params"]["total"]
