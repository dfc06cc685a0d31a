"""Read W&B offline runs back from disk (``<run dir>/wandb/offline-run-*/run-*.wandb``) without an account,
and upload them: ``python -m trident.tracking.wandb_files sync <run or sweep dir>...``.

W&B's own reader does the reading: ``wandb leet inspect --json`` prints each record of the run's
transaction log as one JSON line; this module only gathers the records into an :class:`OfflineRun`.

Each attempt of a run (a resume, a requeue, an extension) writes its own ``offline-run-*`` directory
under the run's one W&B id, and the newest attempt's holds the whole history: it first sends again
the rows logged before its checkpoint (:class:`trident.tracking.wandb_journal.WandbJournal`). So the
upload is the newest attempt of each run id (:func:`offline_runs_to_sync`); uploading every attempt
would send the steps before each resume once per attempt.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trident.errors import DataError


@dataclass
class OfflineRun:
    """What one W&B run logged: identity, config, every history row, and the final summary."""

    path: Path
    run_id: str = ""
    name: str = ""
    group: str = ""
    job_type: str = ""
    tags: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    #: Every artifact the run logged (W&B's record: name, type, aliases, metadata as JSON, manifest).
    artifacts: list[dict[str, Any]] = field(default_factory=list)
    #: True once the file holds the run's exit record (everything it logged was written).
    finished: bool = False

    def metric(self, key: str) -> list[Any]:
        """Every logged value of ``key``, in order."""
        return [row[key] for row in self.history if key in row]


def _inspect(run_file: Path) -> list[dict[str, Any]]:
    """The run's records, as ``wandb leet inspect --json`` prints them (a file still being written
    gives the records complete so far)."""
    # -P: a run directory holds a ``wandb/`` folder, which ``python -m wandb`` run from there would import.
    command = [sys.executable, "-P", "-m", "wandb", "leet", "inspect", "--json", str(run_file)]
    # Offline: W&B's CLI then reports nothing to its server (reading a local file needs none).
    env = {**os.environ, "WANDB_MODE": "offline"}
    result = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if result.returncode != 0:
        reason = (result.stderr.strip().splitlines() or ["no reason given"])[-1]
        raise DataError(f"W&B cannot read {run_file} ({reason}): it is not a complete W&B run file")
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def _media_values(item: dict[str, Any]) -> dict[str, Any]:
    """``item`` with each logged media value (an image, a table: W&B writes it as a JSON object
    with ``_type``) back under its own key; ``leet inspect`` prints its fields as dotted keys
    (``test/confusion_matrix._type``, ``test/confusion_matrix.filenames``, ...)."""
    media = [key.removesuffix("._type") for key in item if key.endswith("._type")]
    values: dict[str, Any] = {}
    for key, value in item.items():
        owner = next((name for name in media if key.startswith(f"{name}.")), None)
        if owner is None:
            values[key] = value
        else:
            values.setdefault(owner, {})[key.removeprefix(f"{owner}.")] = value
    return values


def read_offline_run(run_file: Path) -> OfflineRun:
    """Parse one ``run-<id>.wandb`` file."""
    run = OfflineRun(path=run_file)
    for record in _inspect(run_file):
        kind = record["type"]
        if kind == "run":
            info = record["run"]
            run.run_id, run.name, run.tags = info.get("run_id", ""), info.get("display_name", ""), info.get("tags", [])
            run.group, run.job_type = info.get("run_group", ""), info.get("job_type", "")
            # The config passed to wandb.init comes with the run record; later updates follow as config records.
            run.config.update(info.get("config", {}).get("update", {}))
        elif kind == "config":
            run.config.update(record["config"].get("update", {}))
        elif kind == "history":
            run.history.append(_media_values(record["history"]["item"]))
        elif kind == "summary":
            run.summary.update(_media_values(record["summary"].get("update", {})))
        elif kind == "artifact":
            run.artifacts.append(record["artifact"])
        elif kind == "exit":
            run.finished = True
    run.config.pop("_wandb", None)  # W&B's own bookkeeping, not the run's config
    return run


def _run_files(directory: Path) -> list[Path]:
    return sorted(Path(directory).rglob("offline-run-*/run-*.wandb"))


def find_offline_runs(directory: Path) -> list[OfflineRun]:
    """Every offline W&B run below ``directory`` (a run directory or a whole sweep)."""
    return [read_offline_run(p) for p in _run_files(directory)]


def wait_for_offline_runs(directory: Path, timeout_s: float = 60.0) -> list[OfflineRun]:
    """:func:`find_offline_runs` once every run's file is complete (or ``timeout_s`` has passed):
    ``wandb.finish()`` can return before W&B's service process has written the last records.
    A finished run is read once; only the others are read again (each read starts W&B's reader)."""
    deadline = time.monotonic() + timeout_s
    finished: dict[Path, OfflineRun] = {}
    while True:
        runs = [finished.get(path) or read_offline_run(path) for path in _run_files(directory)]
        finished.update({run.path: run for run in runs if run.finished})
        if (runs and all(run.finished for run in runs)) or time.monotonic() >= deadline:
            return runs
        time.sleep(0.5)


def offline_runs_to_sync(directories: Sequence[Path]) -> list[Path]:
    """The ``offline-run-*`` directory to upload for each W&B run below ``directories`` (run or sweep
    directories): of a run's attempts (one id), the newest, by the start time in the directory name
    (``offline-run-<date>_<time>-<id>``), then by the file's age."""
    newest: dict[str, Path] = {}
    for run_file in sorted({f for d in directories for f in _run_files(Path(d))}):
        run_id = run_file.stem.removeprefix("run-")
        order = (run_file.parent.name.removeprefix("offline-run-"), run_file.stat().st_mtime_ns)
        kept = newest.get(run_id)
        if kept is None or order > (kept.parent.name.removeprefix("offline-run-"), kept.stat().st_mtime_ns):
            newest[run_id] = run_file
    return sorted(run_file.parent for run_file in newest.values())


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trident.tracking.wandb_files",
                                     description="Upload offline W&B runs: the newest attempt of each run.")
    commands = parser.add_subparsers(dest="command", required=True)
    sync = commands.add_parser("sync", help="wandb sync the newest attempt of every run below the directories")
    sync.add_argument("directories", nargs="+", type=Path, help="run or sweep directories")
    sync.add_argument("--dry-run", action="store_true", help="print the offline-run directories, upload nothing")
    args = parser.parse_args(argv)
    chosen = offline_runs_to_sync(args.directories)
    if not chosen:
        raise SystemExit(f"error: no offline W&B run below {', '.join(map(str, args.directories))}")
    if args.dry_run:
        print("\n".join(map(str, chosen)))
        return
    # -P: a run directory holds a ``wandb/`` folder, which ``python -m wandb`` run from there would import.
    raise SystemExit(subprocess.run([sys.executable, "-P", "-m", "wandb", "sync", *map(str, chosen)], check=False).returncode)


if __name__ == "__main__":
    main()
