"""The test cluster's node prolog (scripts/slurm_prolog.sh), run here with a stand-in ``scontrol``:
it returns as soon as the job's log directory exists, reading this job's record only, and never
fails (a failing prolog drains the node). The cluster itself runs it in tests/test_slurm.py."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from .conftest import ROOT

PROLOG = ROOT / "scripts" / "slurm_prolog.sh"
# Below the prolog's own limit (5 s): a prolog that waits for the wrong directory runs into it.
PROMPT_S = 3


def _run_prolog(tmp_path: Path, records: list[str]) -> subprocess.CompletedProcess[str]:
    """The prolog of job 45, an array's task, with ``scontrol show job -o 45`` printing ``records``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text("#!/bin/sh\ncat <<'RECORDS'\n" + "\n".join(records) + "\nRECORDS\n")
    scontrol.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "45"}
    return subprocess.run(["sh", str(PROLOG)], env=env, capture_output=True, text=True, timeout=PROMPT_S, check=False)


def _records(tmp_path: Path) -> list[str]:
    # Job 45 is task 0 of array 44; the array's other task, still pending, keeps the id 44.
    return [f"JobId=45 ArrayJobId=44 ArrayTaskId=0 StdOut={tmp_path}/logs/44_0/44_0_0_log.out",
            f"JobId=44 ArrayJobId=44 ArrayTaskId=1 StdOut={tmp_path}/logs/44_1/44_1_0_log.out"]


def test_returns_at_once_when_this_jobs_log_directory_exists(tmp_path: Path) -> None:
    (tmp_path / "logs" / "44_0").mkdir(parents=True)  # not the other task's
    assert _run_prolog(tmp_path, _records(tmp_path)).returncode == 0


def test_waits_for_the_log_directory_that_appears_after_sbatch(tmp_path: Path) -> None:
    log_dir = tmp_path / "logs" / "44_0"
    made = threading.Timer(0.5, log_dir.mkdir, kwargs={"parents": True})
    started = time.monotonic()
    made.start()
    result = _run_prolog(tmp_path, _records(tmp_path))
    made.join()
    assert result.returncode == 0 and time.monotonic() - started >= 0.5


@pytest.mark.parametrize("records", [[], ["JobId=45 StdOut=/no/such/%x/log.out"]], ids=["no record", "unexpanded"])
def test_a_job_it_cannot_read_is_let_through_at_once(tmp_path: Path, records: list[str]) -> None:
    assert _run_prolog(tmp_path, records).returncode == 0
