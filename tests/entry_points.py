"""Running an entry point (``train.py``, ``eval.py``, ``python -m trident.commands.sample``) as the command line does,
for the tests of its exit status and error line: in this process through its ``__main__`` (runpy: the same
argument checks, Hydra entry and error handling, without ~5 s of imports per run), or as a real subprocess
(``tests/test_bad_inputs.py`` checks that the two agree)."""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra.core.global_hydra import GlobalHydra

from .conftest import ROOT


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def last_line(self) -> str:
        lines = [line for line in self.stderr.splitlines() if line.strip()]
        return lines[-1] if lines else ""


def command(entry: str) -> list[str]:
    return [sys.executable, "-m", entry] if entry.startswith("trident.") else [sys.executable, str(ROOT / entry)]


def run_in_process(entry: str, args: list[str], cwd: Path, monkeypatch: pytest.MonkeyPatch,
                   wandb_mode: str = "disabled") -> Result:
    """``python <entry> <args>`` run in this process (``entry``: a script or a module such as ``trident.commands.sample``);
    W&B disabled unless ``wandb_mode`` says otherwise (``offline``: the default logger's runs, for the tests that read them)."""
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", [str(ROOT / entry), *args])
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setenv("WANDB_MODE", wandb_mode)
    GlobalHydra.instance().clear()  # a fresh process would start without it
    stdout, stderr = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            if entry.startswith("trident."):
                runpy.run_module(entry, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(str(ROOT / entry), run_name="__main__")
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        except Exception:  # noqa: BLE001 - what the interpreter would print, for the assertions
            code = 1
            traceback.print_exc()
    return Result(code, stdout.getvalue(), stderr.getvalue())


def run_subprocess(entry: str, args: list[str], cwd: Path, **env: str) -> Result:
    environment = {**os.environ, "WANDB_MODE": "disabled", **env}
    if "HYDRA_FULL_ERROR" not in env:
        environment.pop("HYDRA_FULL_ERROR", None)
    done = subprocess.run(
        [*command(entry), *args], capture_output=True, text=True, cwd=cwd, env=environment, timeout=300, check=False
    )
    return Result(done.returncode, done.stdout, done.stderr)
