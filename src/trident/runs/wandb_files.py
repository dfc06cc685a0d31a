"""Read W&B offline runs back from disk (``<run dir>/wandb/offline-run-*/run-*.wandb``) without an account.

The ``.wandb`` file is a LevelDB-style log of protobuf ``Record`` messages: a 7-byte header,
then 32 KiB blocks of chunks, each with a 7-byte header (crc32, length, type) where the type
says whether the chunk is a whole record or its first, middle or last piece.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2

from trident.errors import DataError

_MAGIC = b":W&B"
_FILE_HEADER = 7
_BLOCK = 32 * 1024
_CHUNK_HEADER = struct.Struct("<IHB")  # crc32, length, type
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


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
    #: True once the file holds the run's exit record (everything it logged was written).
    finished: bool = False

    def metric(self, key: str) -> list[Any]:
        """Every logged value of ``key``, in order."""
        return [row[key] for row in self.history if key in row]


def _records(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    if not data.startswith(_MAGIC):
        raise DataError(f"{path} is not a W&B run file (no {_MAGIC!r} header)")
    pos, pending = _FILE_HEADER, b""
    while pos + _CHUNK_HEADER.size <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < _CHUNK_HEADER.size:  # the block's tail is zero padding
            pos += room
            continue
        _, length, kind = _CHUNK_HEADER.unpack_from(data, pos)
        chunk = data[pos + _CHUNK_HEADER.size : pos + _CHUNK_HEADER.size + length]
        pos += _CHUNK_HEADER.size + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


def read_offline_run(run_file: Path) -> OfflineRun:
    """Parse one ``run-<id>.wandb`` file."""
    run = OfflineRun(path=run_file)
    for raw in _records(run_file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.run_id, run.name = record.run.run_id, record.run.display_name
            run.group, run.job_type, run.tags = record.run.run_group, record.run.job_type, list(record.run.tags)
        elif kind == "config":
            run.config.update({_key(u): json.loads(u.value_json) for u in record.config.update})
        elif kind == "history":
            run.history.append({_key(i): json.loads(i.value_json) for i in record.history.item})
        elif kind == "summary":
            run.summary.update({_key(u): json.loads(u.value_json) for u in record.summary.update})
        elif kind == "exit":
            run.finished = True
    return run


def find_offline_runs(directory: Path) -> list[OfflineRun]:
    """Every offline W&B run below ``directory`` (a run directory or a whole sweep)."""
    return [read_offline_run(p) for p in sorted(Path(directory).rglob("offline-run-*/run-*.wandb"))]


def wait_for_offline_runs(directory: Path, timeout_s: float = 60.0) -> list[OfflineRun]:
    """:func:`find_offline_runs` once every run's file is complete (or ``timeout_s`` has passed):
    ``wandb.finish()`` can return before W&B's service process has written the last records."""
    deadline = time.monotonic() + timeout_s
    runs = find_offline_runs(directory)
    while not (runs and all(run.finished for run in runs)) and time.monotonic() < deadline:
        time.sleep(0.5)
        runs = find_offline_runs(directory)
    return runs
