"""FSDP and tensor parallelism against DDP on CPU processes (gloo): what each rank holds, its peak memory and
its step time.

Each variant is a real ``python -m trident.commands.train`` run (the command ``train.py`` is), one after the
other, with :class:`trident.bench.rank_record.RecordRank` loaded by ``_target_``: every rank writes its own
``rank<r>.json`` (the bytes of its parameters, gradients and AdamW state read from its tensors at the second
step, its shards under FSDP; its peak RSS; its mean step time after the warm-up steps). A row reports the
largest rank's bytes and peak RSS (the one that must fit) and the ranks' mean step time, against DDP's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trident.bench.data import cache_dir
from trident.bench.rank_record import WARM_UP_STEPS
from trident.bench.results import Row, Settings, verdict

# model=small as docs/scaling.md measures it; --quick: model=nano, a smoke test of the row.
RUN = ["model=small", "data.block_size=128", "trainer.max_steps=12", "trainer.val_check_interval=12"]
QUICK_RUN = ["model=nano", "data.block_size=32", "trainer.max_steps=4", "trainer.val_check_interval=4"]
COMMON = ["task=lm", "data.batch_size=4", "trainer.limit_val_batches=1", "trainer.num_sanity_val_steps=0",
          "test=false", "logger=none", "print_config=false", "callbacks.progress_bar=null",
          "callbacks.model_summary=null", "+callbacks.record_rank._target_=trident.bench.rank_record.RecordRank"]
KINDS = ("parameters", "gradients", "optimizer_state")
MIB = 2**20
# A rank's bytes may exceed 1/N of the whole by fully_shard's rounding up of the first dimension (and, under
# tensor parallelism, by the norms every rank of a group keeps whole).
SHARE_TOLERANCE = 0.1
METHOD = (f"largest rank's bytes (read from its tensors at step 2) and peak RSS (the whole process, the checkpoint "
          f"rank 0 gathers included), the ranks' mean step time after {WARM_UP_STEPS} warm-up steps")


@dataclass(frozen=True)
class Variant:
    """One run: its trainer overrides, how many processes it starts, and the share of one rank's whole model
    (parameters, gradients, optimizer state) each of its ranks should hold."""

    overrides: tuple[str, ...]
    processes: int
    expected_share: float
    note: str = ""


REFERENCE = "ddp"
#: The variant whose ranks hold the whole model: the others' bytes are shares of its.
WHOLE = "fsdp_1"
VARIANTS: dict[str, Variant] = {
    REFERENCE: Variant(("trainer=ddp_cpu",), 2, 1.0),
    WHOLE: Variant(("trainer=fsdp_cpu", "trainer.devices=1"), 1, 1.0),
    "fsdp_2": Variant(("trainer=fsdp_cpu",), 2, 1 / 2),
    "fsdp_4": Variant(("trainer=fsdp_cpu", "trainer.devices=4"), 4, 1 / 4),
    "tp_2": Variant(("trainer=fsdp_cpu", "trainer.strategy.tensor_parallel_size=2"), 2, 1 / 2,
                    "data 1 x tensor 2: both ranks compute one batch together (global batch 4, DDP's 8)"),
}


@dataclass(frozen=True)
class Measured:
    """A run's ranks: the largest rank's bytes (per kind) and peak RSS, the ranks' mean step time."""

    processes: int
    threads: int
    bytes: dict[str, int]
    peak_rss: int
    step_seconds: float

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())


def summarize(records: list[dict[str, Any]], threads: int) -> Measured:
    """One run from its ranks' ``rank<r>.json`` records."""
    return Measured(len(records), threads,
                    {kind: max(r["params"]["bytes"][kind] for r in records) for kind in KINDS},
                    max(r["peak_rss_bytes"] for r in records),
                    sum(r["step_seconds"] for r in records) / len(records))


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def threads_per_process(processes: int) -> int:
    """The cores shared out between the processes (at least one thread each: 4 processes on 2 cores share)."""
    return max(1, _cores() // processes)


def run(variant: Variant, quick: bool, directory: Path) -> Measured:
    """``variant``'s training run in ``directory``: its ranks' records."""
    threads = threads_per_process(variant.processes)
    source = str(Path(__file__).resolve().parents[2])  # the directory holding this trident, for every rank
    env = {**os.environ, "OMP_NUM_THREADS": str(threads),
           "PYTHONPATH": os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "trident.commands.train", *(QUICK_RUN if quick else RUN), *COMMON,
               *variant.overrides, f"hydra.run.dir={directory}", f"paths.cache_dir={Path(cache_dir()).resolve()}"]
    done = subprocess.run(command, check=False, capture_output=True, text=True, env=env, cwd=directory.parent,
                          timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(variant.overrides)} failed (exit {done.returncode}):\n"
                           f"{(done.stdout + done.stderr)[-3000:]}")
    records = [json.loads((directory / f"rank{r}.json").read_text()) for r in range(variant.processes)]
    return summarize(records, threads)


def measure(quick: bool) -> dict[str, Measured]:
    """Every variant, one after the other."""
    with tempfile.TemporaryDirectory(prefix="trident-bench-sharding-") as tmp:
        return {name: run(variant, quick, Path(tmp) / name) for name, variant in VARIANTS.items()}


def _mib(count: int) -> str:
    return f"{count / MIB:,.2f} MiB"


def summary(m: Measured) -> str:
    held = ", ".join(f"{kind.replace('_', ' ')} {_mib(m.bytes[kind])}" for kind in KINDS)
    return f"{held}; peak RSS {m.peak_rss / MIB:,.0f} MiB; step {m.step_seconds:.3f} s"


def rows_of(measured: dict[str, Measured], quick: bool) -> list[Row]:
    """One row per variant: per rank, against DDP's ranks; the bytes checked against 1/N of one rank's whole."""
    reference, whole = measured[REFERENCE], measured[WHOLE]
    model = ", ".join(o for o in (QUICK_RUN if quick else RUN)[:2])
    rows = []
    for name, variant in VARIANTS.items():
        m = measured[name]
        share = m.total_bytes / whole.total_bytes
        oversubscribed = m.processes * m.threads > _cores()
        rows.append(Row(
            "sharding",
            f"per rank, {' '.join(variant.overrides)} ({m.processes} process{'es' if m.processes > 1 else ''}): "
            f"LM {model}, batch 4 per data-parallel rank, AdamW",
            summary(m), "-" if name == REFERENCE else f"ddp_cpu: {summary(reference)}",
            "-" if name == REFERENCE else (f"{m.total_bytes / reference.total_bytes:.2f}x DDP's bytes, "
                                           f"{m.step_seconds / reference.step_seconds:.2f}x DDP's step time"),
            f"bytes {variant.expected_share:.2g} of one rank's whole model",
            verdict(variant.expected_share <= share <= variant.expected_share * (1 + SHARE_TOLERANCE)),
            "; ".join(filter(None, [
                f"{share:.3f} of one rank's whole bytes (fsdp_cpu trainer.devices=1)",
                METHOD,
                f"{m.threads} torch thread(s) a process" + (" **(oversubscribed: more threads than cores, the "
                                                             "step time is not comparable)**" if oversubscribed else ""),
                variant.note])),
        ))
    return rows


def sharding_rows(settings: Settings) -> list[Row]:
    return rows_of(measure(settings.quick), settings.quick)
