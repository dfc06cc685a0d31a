"""Reference runs that tests in several files share, and so several pytest-xdist workers: each is
computed once per test session, by the first worker that asks, under a file lock in the directory
that the workers' temporary directories have in common.

Today: each task's 2-process DDP run on one machine (``trainer=ddp_cpu``), which
tests/test_ddp_matrix.py checks as a run of its own (the LM's is also the run that its SIGTERM/SIGKILL chain must
end like) and tests/test_slurm.py compares step for step with the same job on two SLURM nodes (the LM's, with
the jobs that SLURM interrupts, with the 2 nodes started by hand)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock

from .conftest import ROOT, SMALL
from .test_translation_train import SMALL_MT
from .test_vit_pipeline import VIT_SMALL

QUIET = ["callbacks.progress_bar=null", "callbacks.model_summary=null", "callbacks.throughput=null"]
# The LM run, one for the DDP matrix and the SLURM tests (one run of 2 processes fewer than a config each):
# 24 steps, a validation every 8 (a job interrupted soon after a checkpoint is well before the last);
# dropout on (the RNG state matters), epochs of 4 steps per rank, last.ckpt every 2 steps (the one that a
# SIGKILL during step 7 leaves is mid-epoch), and an EMA of the weights (decay far from 1, so that the
# average is far from the raw weights): resume under DDP and SLURM restores the average too.
LM_RUN = [o for o in SMALL if not o.startswith(("trainer.max_steps", "trainer.val_check_interval", "callbacks."))] + [
    *QUIET, "model.dropout=0.1", "trainer.max_steps=24", "trainer.limit_train_batches=4", "trainer.val_check_interval=8",
    "trainer.check_val_every_n_epoch=null", "callbacks=ema", "callbacks.ema.decay=0.5",
    "callbacks.last_checkpoint.every_n_train_steps=2", "callbacks.lr_monitor=null",
]
# Each task's small run, as the SLURM tests launch it too (there: trainer.num_nodes=2, one rank a node).
TASK_RUNS = {
    "lm": LM_RUN,
    "translation": [o for o in SMALL_MT if not o.startswith("callbacks.")] + QUIET,
    "vit": [o for o in VIT_SMALL if not o.startswith("callbacks.")] + QUIET,
}
# The same 2 ranks as processes of one machine.
ONE_NODE = ["trainer=ddp_cpu", "seed=1"]


def run_script(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python <script> <args>`` in a fresh process with one torch thread and its own W&B service."""
    # The caller's PYTHONPATH stays after the project's (the GPU machine finds its carried packages there).
    path = [str(ROOT / "src"), str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(path)}
    env.pop("HYDRA_FULL_ERROR", None)
    env.pop("WANDB_SERVICE", None)  # its own W&B service, as a job started from a shell has
    return subprocess.run([sys.executable, str(ROOT / script), *args], check=False, capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=600)


def assert_clean(result: subprocess.CompletedProcess[str]) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "Traceback" not in output, output[-3000:]


def one_node_run(tmp_path_factory: pytest.TempPathFactory, task: str) -> Path:
    """The run directory of ``task``'s 2-process DDP run on this machine (the default logger, W&B
    offline); computed once per session."""
    base = tmp_path_factory.getbasetemp()
    # A worker's directory is <the session's>/<worker id>; a pytest started inside a worker inherits
    # the variable, not the layout, and keeps to its own directory.
    shared = (base.parent if base.name == os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared-runs"
    shared.mkdir(exist_ok=True)
    root = shared / f"{task}-one-node"
    run_dir, failed = root / "run", shared / f"{task}-one-node.failed"
    with FileLock(str(root) + ".lock"):
        if failed.is_file():  # the first attempt failed: every test that needs the run fails with its output
            pytest.fail(failed.read_text())
        if not (root / "done").is_file():
            root.mkdir()
            result = run_script("train.py", *ONE_NODE, *TASK_RUNS[task], f"hydra.run.dir={run_dir}", cwd=root)
            output = result.stdout + result.stderr
            if result.returncode != 0 or "Traceback" in output:
                failed.write_text(f"the shared {task} run failed (exit status {result.returncode}):\n{output[-3000:]}")
                pytest.fail(failed.read_text())
            (root / "done").touch()
    return run_dir
