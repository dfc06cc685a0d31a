"""The CI tells the truth: under CI=true a skip not on tests/ci_skips.py's allow-list fails pytest, and
.ci/run stops, with the reason, when the SLURM cluster or the Fashion-MNIST package cannot be had."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .ci_skips import ALLOWED_CI_SKIPS, GPU_SKIP_REASON
from .conftest import ROOT

SKIPPING_TESTS = f'''
import pytest

def test_without_its_cluster() -> None:
    pytest.skip("no SLURM cluster here")

@pytest.mark.skip(reason={GPU_SKIP_REASON!r})
def test_on_a_gpu() -> None:
    pass
'''


def run_pytest(tmp_path: Path, ci: str | None, *args: str) -> subprocess.CompletedProcess[str]:
    """pytest in a folder holding this suite's CI skip rule as its conftest and two skipping tests (one allowed)."""
    shutil.copy(ROOT / "tests" / "ci_skips.py", tmp_path / "conftest.py")
    (tmp_path / "test_skips.py").write_text(SKIPPING_TESTS)
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({"CI": ci} if ci is not None else {})
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


# The suite runs on pytest-xdist workers (pyproject's addopts); the rule must hold there and in one process.
@pytest.mark.parametrize("workers", [["-n", "0"], ["-n", "2", "--dist", "loadfile"]], ids=["one-process", "xdist"])
def test_a_skip_not_on_the_allow_list_fails_under_ci_and_the_summary_says_which(tmp_path: Path,
                                                                                workers: list[str]) -> None:
    assert GPU_SKIP_REASON in ALLOWED_CI_SKIPS
    result = run_pytest(tmp_path, "true", *workers)
    assert result.returncode == pytest.ExitCode.TESTS_FAILED, result.stdout[-2000:]
    assert "1 skipped: no SLURM cluster here  [NOT allowed under CI=true]" in result.stdout
    assert f"1 skipped: {GPU_SKIP_REASON}  [allowed under CI:" in result.stdout
    assert "error: CI=true: 1 tests skipped for a reason not in tests/ci_skips.py's ALLOWED_CI_SKIPS " \
           "(first: test_skips.py::test_without_its_cluster)" in result.stdout
    # Outside CI the same skips are only listed.
    assert run_pytest(tmp_path, None, *workers).returncode == pytest.ExitCode.OK


def test_ci_run_stops_with_the_reason_when_what_the_tests_need_cannot_be_had(tmp_path: Path) -> None:
    # `id -u` answers 1000: not root, so the cluster cannot be started (and nothing is installed).
    (tmp_path / "id").write_text("#!/bin/sh\necho 1000\n")
    (tmp_path / "id").chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(["bash", str(ROOT / ".ci" / "run")], env={**env, "CI": "true"}, capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 2
    reason = ("not root: the SLURM test cluster (scripts/slurm_cluster.sh start) needs root"
              if Path("/usr/share/datasets/fashion-mnist").is_dir()  # else the first thing missing is the dataset
              else "dataset-fashion-mnist is not installed and cannot be here (needs root and apt-get)")
    assert result.stderr.strip() == f"error: CI=true: {reason}"
