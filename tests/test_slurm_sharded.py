"""A sharded job on the SLURM cluster of tests/test_slurm.py: ``trainer=fsdp_cpu`` on two nodes (one rank a node)
with sharded checkpoints (``trainer.strategy.save_distributed_checkpoint=true``), preempted mid-run
(``scontrol requeue``), comes back, resumes from its sharded checkpoint directory and ends like the same run
uninterrupted: the same losses step for step, the same last step. The uninterrupted run is the same 2 ranks
as 2 processes of this machine, run beside the job (SLURM's two nodes take one job at a time)."""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from trident.errors import DataError
from trident.parallel.distributed_checkpoint import is_sharded_checkpoint
from trident.weights.checkpoints import read_checkpoint

from . import test_slurm as slurm
from .conftest import SMALL
from .shared_runs import QUIET
from .slurm_jobs import CHECKPOINT_S, finish, run_until, start, submitted_job, sweep_end

pytestmark = slurm.pytestmark

STEPS = 16
SHARDED = ["trainer.strategy.save_distributed_checkpoint=true"]
# tests/test_slurm.py's 2-node command, under FSDP: one gloo rank a node, each holding half the weights.
FSDP = [*(o for o in slurm.SLURM if not o.startswith("trainer=")), "trainer=fsdp_cpu", *SHARDED]
# The small LM with a checkpoint every 2 steps and a validation every 8 (tests/test_slurm.py's, without its dropout
# and weight average), shorter.
LM = [*(o for o in SMALL if not o.startswith(("trainer.max_steps", "trainer.val_check_interval", "callbacks."))),
      *QUIET, f"trainer.max_steps={STEPS}", "trainer.val_check_interval=8", "callbacks.last_checkpoint.every_n_train_steps=2",
      "seed=1"]
# Slower steps than test_slurm.py's, so that the preemption lands well before the validation at step 8.
SLOW = ["+callbacks.slow._target_=tests.resume_helpers.SlowSteps", "+callbacks.slow.seconds=0.5"]


def _saved_step(checkpoint: Path) -> int:
    """The training step of a checkpoint being replaced now and then (0 while it steps aside)."""
    try:
        return int(read_checkpoint(checkpoint, "the job's checkpoint", weights=False)["global_step"])
    except DataError:  # not there for a moment, or not complete yet
        return 0


def _checkpoint_step(root: Path) -> int:
    found = list(root.glob(slurm.CHECKPOINT))
    return _saved_step(found[0]) if found else 0


def _preempted(root: Path) -> tuple[int, str, Path]:
    """The sharded 2-node job, requeued by SLURM (a preemption's SIGTERM) once it has saved a checkpoint:
    its sweep's exit status and console output, and its run directory."""
    job = submitted_job(root, start(root, *FSDP, *LM, *SLOW))
    run_until(job, lambda: _checkpoint_step(root) > 0, "checkpoint", running_s=CHECKPOINT_S)
    subprocess.run(["scontrol", "requeue", job.id], check=True)
    rc, err = sweep_end(job)
    return rc, err, slurm._sweep_jobs(root)[0]


def _uninterrupted(root: Path) -> Path:
    rc, err = finish(start(root, "trainer=fsdp_cpu", *SHARDED, *LM, "hydra.run.dir=run"))  # 2 processes
    assert rc == 0, err[-3000:]
    return root / "run"


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[tuple[int, str, Path], Path, Path]:
    """The preempted job and the uninterrupted run, side by side; and the job's sweep root."""
    root = tmp_path_factory.mktemp("slurm-sharded")
    with ThreadPoolExecutor(max_workers=2) as pool:
        preempted = pool.submit(_preempted, root / "preempted")
        uninterrupted = pool.submit(_uninterrupted, root / "uninterrupted")
        return preempted.result(), uninterrupted.result(), root / "preempted"


def test_a_preempted_sharded_two_node_job_resumes_exactly(sharded_runs: tuple[tuple[int, str, Path], Path, Path]) -> None:
    (rc, err, run_dir), reference, root = sharded_runs
    assert rc == 0, err[-3000:]
    slurm._no_traceback(root)
    status = slurm._status(run_dir)
    assert status["status"] == "completed", status
    (preemption,) = status["requeues"]
    assert preemption["signal"] == "SIGTERM" and 0 < preemption["step"] < 8, preemption
    # It saved a sharded checkpoint at the signal, and the second attempt resumed the run from it.
    checkpoint = run_dir / "checkpoints" / "last.ckpt"
    log = (run_dir / "train.log").read_text()
    assert f"SIGTERM received: saved {checkpoint} at step {preemption['step']} and stopping" in log
    assert log.count("requeued SLURM job") == 1 and f"resuming {checkpoint}\n" in log
    (rank_zero,) = root.glob("multirun/*/*/.submitit/*/*_0_log.err")
    assert f"Restored all states from the checkpoint at {checkpoint}" in rank_zero.read_text()
    assert is_sharded_checkpoint(checkpoint) and _saved_step(checkpoint) == STEPS
    assert json.loads((run_dir / "run.json").read_text())["slurm_job"]
    # Every step once, in order, with the uninterrupted run's loss; the same validations.
    resumed, expected = slurm._losses(slurm._wandb(run_dir)), slurm._losses(slurm._wandb(reference))
    assert len(expected) == STEPS and list(resumed) == list(expected)
    assert list(resumed.values()) == pytest.approx(list(expected.values()), rel=1e-5)
    validations, expected_validations = dict(slurm._validations(run_dir)), dict(slurm._validations(reference))
    assert list(validations) == list(expected_validations) == [8, 16]
    assert list(validations.values()) == pytest.approx(list(expected_validations.values()), rel=1e-5)
