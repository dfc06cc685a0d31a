"""``python -m trident.bench``: measure trident against the references and write docs/benchmarks.md.

    python -m trident.bench                     # every row (about 15 minutes on an idle 2-core CPU)
    python -m trident.bench --only lm generation
    python -m trident.bench --only kv_cache      # grouped-query cache bytes and speed, a sliding window's cache
    python -m trident.bench --only lora          # full fine-tuning vs LoRA of a 124 M LM: bytes, peak RSS, step
    python -m trident.bench --only qlora         # full vs LoRA vs QLoRA (NF4 base) of a Llama-style LM: bytes, step, loss
    python -m trident.bench --only lora_dpo      # the weights a LoRA DPO run holds: one copy of the base
    python -m trident.bench --only sharding      # FSDP over 1, 2, 4 processes and tensor parallelism vs DDP, per rank
    python -m trident.bench --only startup       # each command's --help, and trident-export of a nano run, from cold
    python -m trident.bench --only linear_attention  # softmax vs Performer vs Linformer, lengths 512 to 16,384
    python -m trident.bench --only loss_chunk    # cross-entropy at a 50,304 vocabulary: whole logits vs chunked
    python -m trident.bench --quick --out /tmp/bench.md   # tiny shapes: checks the command, times nothing useful
    python -m trident.bench --device cuda --out bench.md  # on a GPU: every row, plus model=base MFU rows
    python -m trident.bench --device cuda --only speed     # issue #57's table (also: python -m trident.bench.speed)
"""

from __future__ import annotations

import argparse
import importlib
import logging
import shlex
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trident.bench.results import Row, Settings


def rows_of(module: str, function: str, *args: str) -> Callable[[Settings], list[Row]]:
    """The rows ``trident.bench.<module>.<function>`` measures (of ``function(*args)`` where it makes the measure),
    its module imported when they run: ``--help`` imports no torch."""
    def measure(settings: Settings) -> list[Row]:
        found = getattr(importlib.import_module(f"trident.bench.{module}"), function)
        return (found(*args) if args else found)(settings)

    return measure


ROWS: dict[str, Callable[[Settings], list[Row]]] = {
    "vit_small": rows_of("steps", "vit_rows", "vit_small"),
    "vit_b16": rows_of("steps", "vit_rows", "vit_b16"),
    "lm": rows_of("steps", "lm_rows"),
    "translation": rows_of("steps", "translation_rows"),
    "pipeline": rows_of("data", "pipeline_rows"),
    "generation": rows_of("generation", "generation_rows"),
    "kv_cache": rows_of("kv_cache", "kv_cache_rows"),
    "lora": rows_of("lora", "lora_rows"),
    "qlora": rows_of("qlora", "qlora_rows"),
    "lora_dpo": rows_of("preference", "lora_dpo_rows"),
    "batching": rows_of("data", "batching_rows"),
    "bf16": rows_of("steps", "bf16_rows"),
    "compile": rows_of("levers", "compile_rows"),
    "fused": rows_of("levers", "fused_rows"),
    "sdpa": rows_of("levers", "sdpa_rows"),
    "checkpointing": rows_of("levers", "checkpointing_rows"),
    "passes": rows_of("passes", "passes_rows"),
    "linear_attention": rows_of("linear_attention", "linear_attention_rows"),
    "loss_chunk": rows_of("chunked_loss", "loss_chunk_rows"),
    "workers": rows_of("data", "workers_rows"),
    "data": rows_of("preparation", "preparation_rows"),
    "data_2gb": rows_of("preparation", "big_corpus_rows"),
    "mfu": rows_of("mfu", "mfu_rows"),
    "speed": rows_of("mfu", "speed_rows"),
    "sharding": rows_of("sharding", "sharding_rows"),
    "startup": rows_of("startup", "startup_rows"),
}
# Compilation alone takes minutes on a small CPU: a quick run leaves it out unless asked for.
NOT_QUICK = ("compile",)
# GPU-sized batches of model=base: on a CPU they run only when named (--only mfu) or tiny (--quick).
GPU_ONLY = ("mfu",)
# Only when named: minutes of disk-bound work (a 2 GB corpus, --only data_2gb); five multi-process train.py
# runs, one after the other (--only sharding); fresh processes timed from their start, which want the machine to
# themselves (--only startup); eleven compilations of model=base networks (--only speed).
ON_REQUEST = ("data_2gb", "sharding", "startup", "speed")

log = logging.getLogger("trident.bench")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trident.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes and few repeats (a smoke test, not timings)")
    parser.add_argument("--only", nargs="+", choices=list(ROWS), metavar="ROW",
                        help=f"rows to run, among: {', '.join(ROWS)}")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"), help="markdown file to write")
    parser.add_argument("--device", default=None, help="default: cuda where torch finds a GPU, else cpu")
    parser.add_argument("--warmup", type=int, default=None, help="untimed rounds (default 1)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per variant (default 5; quick 2)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    import torch

    from trident.bench.results import Settings, render, write

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # nn.Transformer builds its encoder with nested tensors on, then warns that post-/pre-norm turns them off.
    warnings.filterwarnings("ignore", message="enable_nested_tensor is True")
    settings = Settings(
        device=torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu")), quick=args.quick,
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
