"""Quantize a trained run's weights to int8 or int4 (weight-only, after training: torchao, trident's ``[quant]``
extra) and measure what it costs on the run's own test split, before and after, as eval.py scores it.

    trident-quantize outputs/runs/<date>/<run> --bits 8
    trident-quantize outputs/runs/<date>/<run> --bits 4 --group-size 64 --eval trainer.limit_test_batches=20

The linears of the Transformer blocks are quantized; embeddings, the output head, biases and norms keep their
precision. The quantized model goes to ``<run>/quantized-int<bits>/last.ckpt`` (``--out``), which trident-sample,
trident-chat, trident-harness, eval.py and ``trident.load`` read as a run's own checkpoint, with
``quantization.json`` beside it (the bytes of the weights and the test metrics, before and after).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from trident.errors import run_with_clear_errors

# torch, torchao and Lightning are imported once the arguments are parsed: ``--help`` and a refused argument answer
# without them.

REPORT = "quantization.json"
# The test metric that counts trainable parameters (trident.training.callbacks.ModelCosts).
FROZEN_COUNT = "trainable_params"
# The evaluations' first override (a later --eval trainer.limit_test_batches=N wins): every test batch.
WHOLE_SPLIT = "trainer.limit_test_batches=1.0"


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1 (argparse prints the refusal as one line)."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return int(text)


def key_value(text: str) -> str:
    """--eval: an eval.py override, ``key=value``."""
    if "=" not in text or text.startswith("="):
        raise argparse.ArgumentTypeError(f"must be key=value (an eval.py override, e.g. trainer.limit_test_batches=10), "
                                         f"got {text!r}")
    return text


def table(report: dict[str, Any]) -> str:
    """The bytes and test metrics before and after, one row each, with the change."""
    after = f"int{report['bits']}" + (f" (groups of {report['group_size']})" if report["group_size"] else " (per row)")
    sizes, before_metrics, after_metrics = report["bytes"], report["metrics"]["before"], report["metrics"]["after"]
    rows = [("weights, bytes in memory", f"{sizes['before']:,}", f"{sizes['after']:,}",
             f"x{sizes['after'] / sizes['before']:.3f}"),
            ("weights, bytes in the file", f"{sizes['before']:,}", f"{sizes['stored']:,}",
             f"x{sizes['stored'] / sizes['before']:.3f}")]
    # The quantized weights are frozen tensors: the test's count of trainable parameters drops by them, which says
    # nothing of the model (it stays in the JSON).
    rows += [(name, f"{value:.4f}", f"{after_metrics[name]:.4f}", f"{after_metrics[name] - value:+.4f}")
             for name, value in before_metrics.items() if name in after_metrics and not name.endswith(FROZEN_COUNT)]
    header = ("", "before", after, "change")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(4)]
    return "\n".join("  ".join(cell.ljust(width) if i == 0 else cell.rjust(width)
                               for i, (cell, width) in enumerate(zip(row, widths, strict=True)))
                     for row in [header, *rows])


def refuse_float_target(out: Path, run_dir: Path) -> None:
    """One line when ``out`` would put the quantized model where the run's own checkpoints are (the run's folder or its
    ``checkpoints/``: eval.py and the readers would take it for the run's) or would replace a checkpoint
    trident-quantize did not write; an earlier quantized model in ``out`` is replaced."""
    from trident.converters.weight_only import QUANTIZED_KEY
    from trident.errors import ConfigError
    from trident.weights.checkpoint_files import read_checkpoint

    target = out / "last.ckpt"
    if (out.resolve() in (run_dir.resolve(), (run_dir / "checkpoints").resolve())
            or (target.exists() and QUANTIZED_KEY not in read_checkpoint(target, "--out", weights=False))):
        raise ConfigError(f"--out {str(out)!r} holds the run's own checkpoints (or one trident-quantize did not write), "
                          f"which the quantized model would replace or pass for: pass another folder, or no --out "
                          f"(<run>/quantized-int<bits>)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trident-quantize", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a train.py run directory (its best, else last checkpoint) or a .ckpt in one")
    parser.add_argument("--bits", type=int, choices=(8, 4), required=True, help="8: int8; 4: int4 (grouped)")
    parser.add_argument("--group-size", type=positive_int, default=None,
                        help="inputs sharing a scale (default: int8 one scale a row, int4 groups of 32); it must divide "
                             "every block linear's inputs")
    parser.add_argument("--out", type=Path, default=None, help="folder of the quantized model (default: <run>/quantized-int<bits>)")
    parser.add_argument("--eval", action="append", type=key_value, default=[], metavar="KEY=VALUE",
                        help="an eval.py override for both evaluations (repeat it), e.g. trainer.limit_test_batches=10")
    args = parser.parse_args(argv)

    def run() -> None:
        from trident.converters.weight_only import DEFAULT_GROUP_SIZE, require_torchao
        from trident.runs.evaluation import evaluate, find_run_config
        from trident.weights.checkpoint_files import checkpoint_of
        from trident.weights.quantize import quantize_checkpoint

        require_torchao()
        checkpoint = checkpoint_of(args.run)
        config = find_run_config(checkpoint)  # the test split is the run's: its config, before any work
        out = args.out or config.parent / f"quantized-int{args.bits}"
        refuse_float_target(out, config.parent)
        if not out.exists():
            created.append(out)
        out.mkdir(parents=True, exist_ok=True)
        group_size = args.group_size or DEFAULT_GROUP_SIZE[args.bits]
        quantized = quantize_checkpoint(checkpoint, out / "last.ckpt", args.bits, group_size)
        if config.parent.resolve() not in out.resolve().parents:  # outside the run: eval.py and trident-chat read it
            shutil.copy(config, out / config.name)
        # The whole test split unless --eval says otherwise: a run trained with trainer.limit_test_batches tested a
        # part of it, which its config (read by eval.py) would keep. Both evaluations see the same batches.
        overrides = [WHOLE_SPLIT, *args.eval]
        metrics = {"before": evaluate([f"ckpt_path={checkpoint}", *overrides], write=False),
                   "after": evaluate([f"ckpt_path={quantized.path}", *overrides], write=False)}
        report = {**quantized.record(), "eval_overrides": overrides, "metrics": metrics}
        (out / REPORT).write_text(json.dumps(report, indent=1))
        sys.stdout.write(f"{table(report)}\nquantized model in {quantized.path}, report in {out / REPORT}\n")

    created: list[Path] = []

    def remove_created() -> None:
        # A folder this call made held nothing before: a model that failed its evaluation leaves with it, not without
        # its report.
        for folder in created:
            shutil.rmtree(folder, ignore_errors=True)

    run_with_clear_errors(run, cleanup=remove_created)


if __name__ == "__main__":
    main()
