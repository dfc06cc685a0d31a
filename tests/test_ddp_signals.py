"""Real 2-process DDP LM runs that share nothing with tests/test_ddp_matrix.py's runs (a file of their
own, so that pytest-xdist runs them beside that file): SIGTERM to rank 0, and a rank that fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from .shared_runs import assert_clean, run_script
from .test_ddp_matrix import LM, checkpoint_step, one_run_dir, one_wandb_run, signal_at

pytestmark = pytest.mark.slow


def test_sigterm_to_rank_zero_saves_once_and_every_rank_exits_cleanly(tmp_path: Path) -> None:
    # Rank 0 exits 0 only if its worker did too (trident.launch.distributed.ranks_fail_together).
    result = run_script("train.py", *LM, *signal_at(4, "SIGTERM", rank=0), f"paths.output_root={tmp_path / 'outputs'}",
                        cwd=tmp_path)
    assert_clean(result)
    run_dir = one_run_dir(tmp_path)
    assert checkpoint_step(run_dir / "checkpoints" / "last.ckpt") == 5, "the step running is finished and saved"
    assert (result.stdout + result.stderr).count("SIGTERM received: saved") == 1, "one rank reports the save, once"
    assert (run_dir / "train.log").read_text().count("Stopped by SIGTERM") == 1
    assert one_wandb_run(run_dir).finished


def test_a_failing_rank_fails_the_run_with_its_error_line(tmp_path: Path) -> None:
    result = run_script("train.py", *LM, "+callbacks.fail._target_=tests.probes.FailOnRank", "+callbacks.fail.rank=1",
                        "+callbacks.fail.step=2", f"paths.output_root={tmp_path / 'outputs'}", cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: injected failure of rank 1: nothing to fix",
                      ("error: DDP rank 1 failed (ended with exit status 2), which stopped the run: "
                      "that rank's output above says why")], output[-3000:]
