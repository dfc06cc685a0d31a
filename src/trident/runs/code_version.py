"""Which code ran a job: the git commit of trident's checkout and whether it had uncommitted changes.

Recorded in each job's ``status.json`` (``git_commit``, ``git_dirty``) as the job starts, so a report's
``jobs.csv`` says which code produced each number. Outside a git checkout (an installed trident, no
``git`` command) there is nothing to record.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

# git answers in milliseconds; a hung one (a network file system) must not hold the job.
GIT_TIMEOUT_S = 10


def _git(*args: str) -> str:
    source = Path(__file__).resolve().parent  # inside trident's checkout, where git finds its repository
    result = subprocess.run(["git", *args], cwd=source, capture_output=True, text=True, timeout=GIT_TIMEOUT_S, check=True)
    return result.stdout.strip()


def code_version() -> dict[str, str | bool]:
    """``{"git_commit": <HEAD>, "git_dirty": <tracked files changed>}``, or ``{}`` outside git."""
    try:
        commit = _git("rev-parse", "HEAD")
        dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"git_commit": commit, "git_dirty": dirty}
