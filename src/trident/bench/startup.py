"""The ``startup`` row (issue 51): seconds from starting a command that does not train to its answer, each in a
fresh process, as a user waits for it: every console command's ``--help`` (which imports neither torch nor
Lightning), and ``trident-export`` of a nano run, beside the floor it cannot go under, importing what it reads and
writes with: torch, safetensors and tokenizers (the network is read without its task: no Lightning; the directory is
written without transformers). Timings want the machine to themselves: ``--only startup``."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import entry_points
from pathlib import Path

from trident.bench.results import Row, Settings, verdict

HELP_TARGET_S = 1.0
# What the hf export of an LM cannot do without: torch (the checkpoint, the network), safetensors and tokenizers (the
# files); transformers is not imported (trident.weights.adapters.hf_writing).
FLOOR = "import torch, safetensors.torch, tokenizers"
EXPORT_TARGET_S = 5.0
# A nano LM that Hugging Face reads as GPT-2 (learned positions, tanh GELU), trained two steps.
NANO_RUN = ["task=lm", "model=nano", "pos_encoding=learned", "model.activation=gelu_tanh", "data.block_size=32",
            "data.batch_size=4", "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
            "test=false", "logger=none", "callbacks.progress_bar=null", "callbacks.model_summary=null"]


def console_commands() -> dict[str, str]:
    """The console scripts trident installs: name -> ``module:function`` (pyproject.toml's [project.scripts])."""
    return {e.name: e.value for e in entry_points(group="console_scripts") if e.value.startswith("trident.")}


def wall_seconds(command: list[str], repeats: int, env: dict[str, str], before: list[str] | None = None) -> float:
    """The median wall-clock seconds of ``command`` in a fresh process (after ``before``, untimed, each time)."""
    times = []
    for _ in range(repeats):
        if before is not None:
            subprocess.run(before, check=True, capture_output=True, env=env)
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True, env=env)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def startup_rows(settings: Settings) -> list[Row]:
    env = {**os.environ, "WANDB_MODE": "offline"}
    python = sys.executable
    rows = []
    for name, target in sorted(console_commands().items()):
        module, function = target.split(":")
        code = f"import sys; sys.argv = [{name!r}, '--help']; from {module} import {function}; {function}()"
        seconds = wall_seconds([python, "-c", code], settings.repeats, env)
        hydra = " (the groups read from conf/, the config composed once: trident.runs.train_help)" if module == "trident.commands.train" else ""
        rows.append(Row("startup", f"`{name} --help`", f"{seconds:.2f} s", "-", f"{seconds:.2f} s from the command",
                        f"< {HELP_TARGET_S:g} s", verdict(seconds < HELP_TARGET_S),
                        f"a fresh process, median of {settings.repeats}; imports neither torch nor Lightning{hydra}"))
    floor = wall_seconds([python, "-c", FLOOR], settings.repeats, env)
    with tempfile.TemporaryDirectory() as tmp:
        run, out = Path(tmp) / "run", Path(tmp) / "hf"
        env["TRIDENT_CACHE_DIR"] = str(Path(tmp) / "cache")
        subprocess.run([python, "-m", "trident.commands.train", *NANO_RUN, f"hydra.run.dir={run}"], check=True,
                       capture_output=True, env=env, cwd=tmp)
        export = [python, "-m", "trident.commands.export", str(run), "--format", "hf", "--out", str(out)]
        seconds = wall_seconds(export, settings.repeats, env, before=["rm", "-rf", str(out)])
    rows.append(Row("startup", "`trident-export <nano run> --format hf --out DIR` (GPT-2 directory)", f"{seconds:.2f} s",
                    f"{floor:.2f} s", f"{seconds:.2f} s from the command; `python -c '{FLOOR}'` alone takes {floor:.2f} s",
                    f"< {EXPORT_TARGET_S:g} s", verdict(seconds < EXPORT_TARGET_S),
                    f"a fresh process, median of {settings.repeats}: imports, the checkpoint read, the network "
                    "rebuilt without its task (trident.weights.network), the files written without transformers "
                    "(trident.weights.adapters.hf_writing); no transformers, Lightning, torchmetrics, Hydra, W&B or "
                    "datasets"))
    return rows
