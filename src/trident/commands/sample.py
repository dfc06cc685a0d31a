"""Sample text from a trained language-model checkpoint, or a run directory (its best, else last
checkpoint, as ``trident.load`` reads it).

    python -m trident.commands.sample outputs/runs/.../checkpoints/last.ckpt --prompt "ROMEO:" --max-new-tokens 500
    python -m trident.commands.sample outputs/runs/... --prompt "ROMEO:" --prompt "JULIET: O Romeo" --temperature 0
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trident.errors import ConfigError, run_with_clear_errors

if TYPE_CHECKING:
    from torch import Tensor

    from trident.tasks.base import TridentTask

# torch and the task are imported once the arguments are parsed: ``--help`` and a refused argument answer without them.


def load_lm_checkpoint(path: Path) -> TridentTask:
    """Rebuild the task (model, tokenizer) of a checkpoint file or run directory, one that generates text."""
    from trident.tasks.base import GENERATE
    from trident.weights.capable import load_capable

    return load_capable(path, GENERATE, "trident-sample")


def generate(*args: Any, **kwargs: Any) -> Tensor:
    """:func:`trident.models.generate`, imported on the first call."""
    from trident.models.sampling import generate as sample_tokens

    return sample_tokens(*args, **kwargs)


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1 (argparse prints the refusal as one line)."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return int(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m trident.commands.sample", description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("checkpoint", type=Path, help="a .ckpt file or a train.py run directory")
    parser.add_argument("--prompt", action="append", default=None,
                        help="text to continue (default: a newline); repeat it to continue several prompts as one "
                        "left-padded batch, each as it would be alone")
    parser.add_argument("--num-samples", type=int, default=1, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=300)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy decoding")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--no-cache", action="store_true", help="recompute the whole prefix every step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=positive_int, default=None,
        help="torch's intra-op threads (default: torch's choice). On a CPU, 1 often decodes one sequence of a small "
        "model fastest: its kernels are one-row matmuls too small to split (docs/benchmarks.md, generation rows)",
    )
    args = parser.parse_args(argv)
    import torch

    from trident.data.tokenization import encode_plain

    if args.threads is not None:
        torch.set_num_threads(args.threads)

    def run() -> None:
        task = load_lm_checkpoint(args.checkpoint)
        assert task.tokenizer is not None
        generator = torch.Generator().manual_seed(args.seed)
        # Encoded as the training text is: no post-processor's <s> ... </s>, no padding or truncation of the file.
        texts = args.prompt or ["\n"]
        rows = [ids for text in texts for ids in [encode_plain(task.tokenizer, text)] * args.num_samples]
        empty = [text for text in texts if not encode_plain(task.tokenizer, text)]
        if empty:
            raise ConfigError(f"--prompt {empty[0]!r} encodes to no tokens: give text to continue")
        # Prompts of different lengths are left-padded into one batch (the pad id is never attended to).
        longest = max(len(ids) for ids in rows)
        prompt = torch.tensor([[0] * (longest - len(ids)) + ids for ids in rows])  # (B, T0)
        padding = torch.tensor([[True] * (longest - len(ids)) + [False] * len(ids) for ids in rows])
        out = generate(
            task.net,
            prompt,
            args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            use_cache=not args.no_cache,
            generator=generator,
            padding=padding,
        )
        for row, ids in zip(out.tolist(), rows, strict=True):
            sys.stdout.write(task.tokenizer.decode(row[longest - len(ids):]) + "\n" + "-" * 40 + "\n")

    run_with_clear_errors(run)


if __name__ == "__main__":
    main()
