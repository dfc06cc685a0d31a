"""Issue #57's table: lm, translation and vit at ``model=base`` in bf16, eager and compiled (``compile=true`` and
``compile=blocks``), plain and FSDP2 at one GPU, with the task's default loss and, where the task has task.loss_chunk,
on the whole logits too (trident.bench.mfu's SPEED_VARIANTS): MFU, tokens (target tokens, images) per second, against the issue's targets.

    python -m trident.bench.speed --device cuda --record speed.json --out speed.md        # every row
    python -m trident.bench.speed --device cuda --only 'lm-*' --record speed.json --out speed.md --deadline EPOCH
    python -m trident.bench.speed --list                                                   # the row names
    python -m trident.bench --device cuda --only speed                                     # the same rows, in bench.md

Each row is added to the record (JSON) once measured and the table rewritten from it: a process stopped at its
deadline keeps what it finished, and a later call on the same record measures only the rows it lacks
(scripts/gpu_check.sh's ``speed`` stage runs one process per task so that a fatal CUDA error costs one task only).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import logging
import os
import sys
from dataclasses import asdict
from pathlib import Path

from trident.bench.mfu import (
    FSDP_TARGET,
    SPEED_VARIANTS,
    Measured,
    Variant,
    measure_variants,
    ratio_to_plain,
    target_of,
)
from trident.bench.results import Settings
from trident.bench.workloads import WORKLOADS

log = logging.getLogger("trident.bench.speed")

ROWS: dict[str, tuple[str, Variant]] = {f"{kind.KEY}-{v.name}": (kind.KEY, v) for kind in WORKLOADS for v in SPEED_VARIANTS}


def read_record(path: Path | None) -> dict[str, Measured]:
    if path is None or not path.exists():
        return {}
    return {row["name"]: Measured(**row) for row in json.loads(path.read_text())}


def write_record(path: Path, measured: dict[str, Measured]) -> None:
    """Written beside, then renamed over the last: gpu_check.sh kills a process at its deadline, perhaps mid-write,
    and a torn record would stop every later process (and a later call) at reading it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(path.name + ".partial")
    staged.write_text(json.dumps([asdict(row) for row in measured.values()], indent=1))
    os.replace(staged, path)


def table(measured: dict[str, Measured]) -> list[str]:
    """The issue's table, a line per row of :data:`ROWS` ("not run" where the record has none), then the workloads."""
    lines = ["| run | batch | step | rate | MFU | target | met | first step | peak memory | status |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    workloads: dict[str, str] = {}
    for name, (key, variant) in ROWS.items():
        row = measured.get(name)
        if row is None:
            lines.append(f"| {name} | - | - | - | - | - | - | - | - | not run |")
            continue
        target, met = target_of(row, variant, measured)
        if row.status != "ok":
            lines.append(f"| {name} | - | - | - | - | {target} | - | - | - | {row.status.replace('|', '/')} |")
            continue
        workloads.setdefault(key, row.workload)
        assert row.seconds is not None and row.units is not None and row.first_seconds is not None
        mfu, ratio = row.mfu, ratio_to_plain(row, variant, measured)
        lines.append(
            f"| {name} | {row.batch} | {row.seconds * 1e3:.1f} ms | {row.units / row.seconds:,.0f} {row.unit}/s | "
            + (f"{mfu:.1%}" if mfu is not None else "-") + (f" ({ratio:.2f}x {variant.plain})" if ratio else "")
            + f" | {target} | {met} | {row.first_seconds:.1f} s | "
            + (f"{row.memory_gib:.1f} GiB" if row.memory_gib is not None else "-") + " | ok |")
    lines += ["", *(f"- {key}: {text}" for key, text in workloads.items()),
              (f"- MFU: the task's model FLOPs (flops_per_batch, as the Throughput callback counts them) per second over "
               f"the device's bf16 peak; FSDP rows: also their time per item (token, target token, image) over the plain "
               f"variant's, its step time's ratio at equal batches (target <= {FSDP_TARGET}x); first step: allocation "
               f"and compilation."),
              "- Variants (train.py overrides): " + "; ".join(f"{v.name}: {' '.join(v.overrides)}" for v in SPEED_VARIANTS)]
    return lines


def chosen(patterns: list[str], measured: dict[str, Measured], task: str | None = None) -> dict[str, list[Variant]]:
    """The variants to measure per workload (of ``task`` alone where given): names matching a pattern, not in the
    record yet."""
    todo: dict[str, list[Variant]] = {}
    for name, (key, variant) in ROWS.items():
        if name not in measured and key == (task or key) and any(fnmatch.fnmatchcase(name, p) for p in patterns):
            todo.setdefault(key, []).append(variant)
    return todo


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trident.bench.speed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="default: cuda")
    parser.add_argument("--only", nargs="+", default=["*"], help="row name patterns (lm-*, *-fsdp*); default all")
    parser.add_argument("--task", choices=[kind.KEY for kind in WORKLOADS], help="this task's rows only")
    parser.add_argument("--record", type=Path, default=Path("speed.json"), help="measured rows (JSON), read and extended")
    parser.add_argument("--out", type=Path, default=Path("speed.md"), help="the table (markdown), rewritten per row")
    parser.add_argument("--deadline", type=float, default=float("inf"), help="epoch seconds: start no row within 20 s of it")
    parser.add_argument("--quick", action="store_true", help="model=nano at tiny shapes (a smoke test, not timings)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps after the first (default 1)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps (default 5)")
    parser.add_argument("--list", action="store_true", help="print the row names and exit")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.list:
        print("\n".join(ROWS))
        return 0
    import torch

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    settings = Settings(device=torch.device(args.device), quick=args.quick, warmup=args.warmup, repeats=args.repeats)
    measured = read_record(args.record)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(table(measured)) + "\n")
    for kind in WORKLOADS:
        variants = chosen(args.only, measured, args.task).get(kind.KEY)
        if not variants:
            continue
        # A later call goes on from the batch an earlier one found for this task.
        known = next((row.batch for name, row in measured.items() if name.startswith(f"{kind.KEY}-") and row.batch), None)
        for result in measure_variants(kind(args.quick), tuple(variants), settings, known, args.deadline):
            measured[result.name] = result
            write_record(args.record, measured)
            args.out.write_text("\n".join(table(measured)) + "\n")
    return 0 if all(row.status == "ok" or row.status.startswith("not available") for row in measured.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
