"""Predict the [MASK] tokens of texts with a trained masked-LM checkpoint (the tokenizer is inside it),
or a run directory (its best, else last checkpoint, as ``trident.load`` reads it).

    python -m trident.commands.fill_mask outputs/runs/.../checkpoints/last.ckpt "To be or not to [MASK]"
    echo "Now is the winter of our [MASK]" | python -m trident.commands.fill_mask CKPT --top-k 3

Each argument (or, without arguments, each line of stdin) is one text; for each it prints the text
with every [MASK] filled by the most likely token, then the top-k candidates of each [MASK] with
their probabilities. A character-level model predicts one character per [MASK].
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from trident.data.special_tokens import MASK_TOKEN
from trident.errors import ConfigError, run_with_clear_errors

if TYPE_CHECKING:
    from trident.tasks.base import TridentTask


def load_mlm_checkpoint(path: Path) -> TridentTask:
    """Rebuild the task (model, tokenizer) of a checkpoint file or run directory, one that fills in masks."""
    # Imported here, once the arguments are parsed: ``--help`` answers without torch.
    from trident.tasks.base import FILL_MASK
    from trident.weights.capable import load_capable

    return load_capable(path, FILL_MASK, "trident-fill-mask")


def fill_in(text: str, tokens: list[str]) -> str:
    """``text`` with its [MASK]s replaced, in order, by ``tokens``. A BPE token brings its own
    leading space (" be"), which then replaces the space written before the [MASK]."""
    parts = text.split(MASK_TOKEN)
    filled = parts[0]
    for token, rest in zip(tokens, parts[1:]):
        if token.startswith(" ") and filled.endswith(" "):
            filled = filled[:-1]
        filled += token + rest
    return filled


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m trident.commands.fill_mask", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", type=Path, help="a .ckpt file or a train.py run directory")
    parser.add_argument("texts", nargs="*", help="texts holding [MASK] (default: read lines from stdin)")
    parser.add_argument("--top-k", type=int, default=5, help="candidates shown per [MASK]")
    args = parser.parse_args(argv)

    def run() -> None:
        if args.top_k < 1:
            raise ConfigError(f"--top-k must be at least 1, got {args.top_k}")
        texts = args.texts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
        if not texts:
            raise ConfigError('no text given: pass texts holding [MASK], e.g. "To be or not to [MASK]"')
        task = load_mlm_checkpoint(args.checkpoint)
        for text, masks in zip(texts, task.fill_mask(texts, top_k=args.top_k)):
            sys.stdout.write(fill_in(text, [candidates[0][0] for candidates in masks]) + "\n")
            for number, candidates in enumerate(masks, start=1):
                shown = "  ".join(f"{token!r} {probability:.3f}" for token, probability in candidates)
                sys.stdout.write(f"  [MASK] {number}: {shown}\n")

    run_with_clear_errors(run)


if __name__ == "__main__":
    main()
