"""The ``data`` row of issue 26's start-up target: seconds from the command ``python train.py`` to its
first training step, on a cache hit (the data prepared by an earlier run), with ``logger=csv`` and with
the default W&B logger (offline). The clock is a callback added on the command line; it imports
nothing that the run does not import already."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L

from trident.bench.results import Row, Settings, verdict

TARGET_S = 5.0


class FirstStepClock(L.Callback):
    """Writes the wall-clock time (``time.time()``) at which the first training batch starts to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if not self.path.exists():
            self.path.write_text(repr(time.time()))


def seconds_to_first_step(overrides: list[str], workdir: Path, name: str) -> float:
    """Run ``python -m trident.commands.train`` (= ``python train.py``) in a fresh process, one training step; the
    seconds from starting the command to its first training step."""
    clock = workdir / f"{name}.time"
    command = [sys.executable, "-m", "trident.commands.train", *overrides, "trainer.max_steps=1", "test=false",
               f"hydra.run.dir={workdir / name}", f"+callbacks.first_step_clock._target_={__name__}.FirstStepClock",
               f"+callbacks.first_step_clock.path={clock}"]
    env = {**os.environ, "TRIDENT_CACHE_DIR": str(workdir / "cache"), "WANDB_MODE": "offline"}
    start = time.time()
    subprocess.run(command, check=True, capture_output=True, env=env, cwd=workdir)
    return float(clock.read_text()) - start


def first_step_rows(settings: Settings) -> list[Row]:
    overrides = ["model=nano", "data.block_size=32", "data.batch_size=4"] if settings.quick else []
    loggers = ["csv"] if settings.quick else ["csv", "wandb"]
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        miss = seconds_to_first_step([*overrides, "logger=csv"], workdir, "prepare")  # a cache miss: prepares the data
        hits = {logger: seconds_to_first_step([*overrides, f"logger={logger}"], workdir, logger) for logger in loggers}
    return [Row("data", f"first training step of `python train.py{''.join(' ' + o for o in overrides)} logger={logger}`"
                " after a cache hit (Shakespeare, prepared by an earlier run)",
                f"{seconds:.1f} s", "-", f"{seconds:.1f} s from the command", f"< {TARGET_S:g} s",
                verdict(seconds < TARGET_S),
                f"a fresh process: Python start-up, imports, config, data (cache hit), model, trainer, sanity "
                f"validation, logger start; the run that prepared the data took {miss:.1f} s to its first step")
            for logger, seconds in hits.items()]
