"""Translate free text with a trained translation checkpoint (the tokenizer is stored inside it), or a
run directory (its best, else last checkpoint, as ``trident.load`` reads it).

    python -m trident.commands.translate outputs/runs/.../checkpoints/best-step3000.ckpt "In the beginning was the Word."
    echo "And God said, Let there be light." | python -m trident.commands.translate CKPT --beam-size 1

Each argument (or, without arguments, each line of stdin) is one sentence; one translation per
line is printed, in order.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from trident.errors import ConfigError, run_with_clear_errors

if TYPE_CHECKING:
    from trident.tasks.base import TridentTask


def load_translation_checkpoint(path: Path) -> TridentTask:
    """Rebuild the task (model, tokenizer, decoding settings) of a checkpoint or run directory, one that translates."""
    # Imported here, once the arguments are parsed: ``--help`` answers without torch.
    from trident.tasks.base import TRANSLATE
    from trident.weights.capable import load_capable

    return load_capable(path, TRANSLATE, "trident-translate")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a .ckpt file or a train.py run directory")
    parser.add_argument("texts", nargs="*", help="sentences to translate (default: read lines from stdin)")
    parser.add_argument("--beam-size", type=int, default=None, help="1 = greedy (default: the run's task.beam_size)")
    parser.add_argument("--length-penalty", type=float, default=None, help="alpha of the run's task.scoring (GNMT or length ** alpha; default: the run's)")
    parser.add_argument("--max-len-a", type=float, default=None, help="max length = a * source length + b")
    parser.add_argument("--max-len-b", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=32, help="sentences decoded together")
    parser.add_argument("--no-cache", action="store_true", help="recompute the whole prefix every step")
    args = parser.parse_args(argv)

    def run() -> None:
        if args.beam_size is not None and args.beam_size < 1:
            raise ConfigError(f"--beam-size must be at least 1, got {args.beam_size}")
        import torch

        task = load_translation_checkpoint(args.checkpoint)
        for name in ("length_penalty", "max_len_a", "max_len_b"):
            if getattr(args, name) is not None:
                setattr(task, name, getattr(args, name))
        texts = args.texts or [line.rstrip("\n") for line in sys.stdin]
        with torch.inference_mode():
            for start in range(0, len(texts), args.batch_size):
                chunk = texts[start : start + args.batch_size]
                # Empty lines stay empty, so output lines match input lines one to one.
                nonempty = [t for t in chunk if t.strip()]
                out = iter(task.translate(nonempty, beam_size=args.beam_size, use_cache=not args.no_cache))
                for text in chunk:
                    sys.stdout.write((next(out) if text.strip() else "") + "\n")
                sys.stdout.flush()

    run_with_clear_errors(run)


if __name__ == "__main__":
    main()
