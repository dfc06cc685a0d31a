"""``python -m trident.bench``: measure trident against the references and write docs/benchmarks.md.

    python -m trident.bench                     # every row (about 15 minutes on an idle 2-core CPU)
    python -m trident.bench --only lm generation
    python -m trident.bench --only kv_cache      # grouped-query cache bytes and speed, a sliding window's cache
    python -m trident.bench --only lora          # full fine-tuning vs LoRA of a 124 M LM: bytes, peak RSS, step
    python -m trident.bench --only sharding      # FSDP over 1, 2, 4 processes and tensor parallelism vs DDP, per rank
    python -m trident.bench --quick --out /tmp/bench.md   # tiny shapes: checks the command, times nothing useful
    python -m trident.bench --device cuda --out bench.md  # on a GPU: every row, plus model=base MFU rows
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from trident.bench import data, generation, kv_cache, levers, lora, mfu, preparation, sharding, steps
from trident.bench.results import Row, Settings, render, write

ROWS: dict[str, Callable[[Settings], list[Row]]] = {
    "vit_small": steps.vit_rows("vit_small"),
    "vit_b16": steps.vit_rows("vit_b16"),
    "lm": steps.lm_rows,
    "translation": steps.translation_rows,
    "pipeline": data.pipeline_rows,
    "generation": generation.generation_rows,
    "kv_cache": kv_cache.kv_cache_rows,
    "lora": lora.lora_rows,
    "batching": data.batching_rows,
    "bf16": steps.bf16_rows,
    "compile": levers.compile_rows,
    "fused": levers.fused_rows,
    "sdpa": levers.sdpa_rows,
    "checkpointing": levers.checkpointing_rows,
    "workers": data.workers_rows,
    "data": preparation.preparation_rows,
    "data_2gb": preparation.big_corpus_rows,
    "mfu": mfu.mfu_rows,
    "sharding": sharding.sharding_rows,
}
# Compilation alone takes minutes on a small CPU: a quick run leaves it out unless asked for.
NOT_QUICK = ("compile",)
# GPU-sized batches of model=base: on a CPU they run only when named (--only mfu) or tiny (--quick).
GPU_ONLY = ("mfu",)
# Only when named: minutes of disk-bound work (a 2 GB corpus, --only data_2gb); five multi-process train.py
# runs, one after the other (--only sharding).
ON_REQUEST = ("data_2gb", "sharding")

log = logging.getLogger("trident.bench")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trident.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes and few repeats (a smoke test, not timings)")
    parser.add_argument("--only", nargs="+", choices=list(ROWS), metavar="ROW",
                        help=f"rows to run, among: {', '.join(ROWS)}")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"), help="markdown file to write")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--warmup", type=int, default=None, help="untimed rounds (default 1)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per variant (default 5; quick 2)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # nn.Transformer builds its encoder with nested tensors on, then warns that post-/pre-norm turns them off.
    warnings.filterwarnings("ignore", message="enable_nested_tensor is True")
    settings = Settings(
        device=torch.device(args.device), quick=args.quick,
        warmup=1 if args.warmup is None else args.warmup,
        repeats=args.repeats or (2 if args.quick else 5),
    )
    names = args.only or [n for n in ROWS if n not in ON_REQUEST and not (args.quick and n in NOT_QUICK)
                          and not (settings.device.type == "cpu" and not args.quick and n in GPU_ONLY)]
    rows: list[Row] = []
    for name in names:
        start = time.perf_counter()
        torch.manual_seed(0)
        rows += ROWS[name](settings)
        log.info("%s: %.0f s", name, time.perf_counter() - start)
        # Written after every row, so an interrupted run keeps what it measured.
        write(args.out, render(rows, command=shlex.join(["python", "-m", "trident.bench", *argv]), settings=settings))
    log.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
