"""Benchmark rows and the markdown page they are written to."""

from __future__ import annotations

import datetime
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Settings:
    """What every row needs: where to run, whether to use tiny shapes, how many repeats."""

    device: torch.device
    quick: bool
    warmup: int
    repeats: int


@dataclass(frozen=True)
class Row:
    """One line of the table. ``trident`` and ``reference`` carry their unit; ``result`` is the
    comparison (e.g. "1.31x faster"); ``met`` is yes/no against ``target`` ("-" without one)."""

    group: str  # the --only name that produced it
    benchmark: str
    trident: str
    reference: str
    result: str
    target: str
    met: str
    notes: str


COLUMNS = ("Row", "Benchmark", "trident", "Reference", "Result", "Target", "Met", "Notes")


def speedup(trident_seconds: float, reference_seconds: float) -> float:
    """How many times faster trident is (>1: faster)."""
    return reference_seconds / trident_seconds


def verdict(ok: bool) -> str:
    return "yes" if ok else "**no**"


def milliseconds(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def machine_description(device: torch.device) -> str:
    """CPU model and cores, GPU name, torch version."""
    import torch

    cpu = _cpu_model()
    text = f"{cpu} (bf16 matmul units: {_bf16_units()}), {_cores()} cores, {torch.get_num_threads()} torch threads"
    if device.type == "cuda":
        text += f"; GPU {torch.cuda.get_device_name(device)}"
    return f"{text}; torch {torch.__version__}, Python {platform.python_version()}"


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


# CPU flags of native bf16 matrix products; without them PyTorch emulates bf16 (much slower than fp32).
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def _bf16_units() -> str:
    """The CPU's native bf16 flags (Linux), "none", or "unknown" where /proc/cpuinfo is missing:
    bf16 rows are only comparable between machines that agree on this."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return "unknown"
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), [])
    return ", ".join(flag for flag in BF16_FLAGS if flag in flags) or "none"


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def render(rows: list[Row], *, command: str, settings: Settings) -> str:
    """The markdown page: how it was produced, on what, and the table."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = [
        "# Benchmarks",
        "",
        f"- Command: `{command}`",
        f"- Machine: {machine_description(settings.device)}",
        f"- Device: {settings.device.type}; dtype fp32 unless a row says bf16 (autocast)",
        f"- Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        (f"- Method: {settings.warmup} warm-up round(s), then the median of {settings.repeats} repeats; compared "
         "variants run in turns (A B, B A, ...) in one process so machine noise hits both alike."),
        *(["- **Quick run: tiny shapes, a smoke test of the command; its numbers and verdicts mean nothing.**"]
          if settings.quick else []),
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "|".join("---" for _ in COLUMNS) + "|",
    ]
    for row in rows:
        cells = (row.group, row.benchmark, row.trident, row.reference, row.result, row.target, row.met, row.notes)
        lines.append("| " + " | ".join(cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
