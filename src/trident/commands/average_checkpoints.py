"""Average the weights of several checkpoints (the paper averaged the last 5 or 20, section 6.1).

    python -m trident.commands.average_checkpoints a.ckpt b.ckpt c.ckpt -o averaged.ckpt
    python -m trident.commands.average_checkpoints outputs/runs/<date>/<run> --last 5 -o averaged.ckpt

With a run directory, the N checkpoints of the highest training steps under its ``checkpoints/``
are averaged (``task=translation`` keeps the last 5 in ``checkpoints/periodic/``; copies of one
step, such as ``last.ckpt``, count once). The output is the newest input with its weights
replaced by the mean, without optimizer state: score it with ``python eval.py ckpt_path=...``
or translate with it; it is not meant for resuming training. A ``finetune=lora`` run's checkpoints
hold what trains without the frozen base (trident.weights.frozen_base): that part is averaged, and the
output keeps their record of the base, which every reader refills.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trident.errors import ConfigError, DataError, run_with_clear_errors

if TYPE_CHECKING:
    from torch import Tensor

# torch and the checkpoint readers are imported in the functions that use them: ``--help`` answers without them.

TRAINING_STATE = ("optimizer_states", "lr_schedulers")


def _load(path: Path) -> dict[str, Any]:
    import torch

    from trident.parallel.distributed_checkpoint import holds_shards
    from trident.weights.checkpoints import READ_ERRORS, read_checkpoint, unreadable_checkpoint

    if holds_shards(path):  # a sharded checkpoint (trainer=fsdp): its weights gathered
        return read_checkpoint(path, "the checkpoints to average")
    if not path.is_file():
        raise DataError(f"checkpoint {str(path)!r} not found: pass .ckpt files or a run directory with --last N")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except READ_ERRORS as err:
        raise unreadable_checkpoint(path, err, "average checkpoints written by train.py") from err
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise DataError(f"{str(path)!r} is not a Lightning checkpoint (no state_dict): pass checkpoints written by train.py")
    return checkpoint


def average_state_dicts(state_dicts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Element-wise mean of floating-point tensors (summed in float64); other tensors (integer
    buffers such as counters) are taken from the last state dict."""
    import torch

    keys = list(state_dicts[-1])
    for i, state in enumerate(state_dicts):
        if list(state) != keys:
            missing = sorted(set(keys) ^ set(state))[:3]
            raise DataError(f"checkpoint {i + 1} has different weights ({missing}...): average checkpoints of one run only")
    averaged: dict[str, Tensor] = {}
    for key in keys:
        last = state_dicts[-1][key]
        if not last.is_floating_point():
            averaged[key] = last.clone()
            continue
        total = torch.zeros(last.shape, dtype=torch.float64)
        for state in state_dicts:
            total += state[key].to(torch.float64)
        averaged[key] = (total / len(state_dicts)).to(last.dtype)
    return averaged


def last_checkpoints(run_dir: Path, count: int) -> list[Path]:
    """The ``count`` checkpoints of the highest distinct global steps under ``run_dir/checkpoints``."""
    found = sorted((run_dir / "checkpoints").rglob("*.ckpt"))
    if not found:
        raise DataError(f"no checkpoints under {str(run_dir / 'checkpoints')!r}: pass a run directory of train.py or .ckpt files")
    by_step: dict[int, Path] = {}
    for path in found:
        step = int(_load(path).get("global_step", -1))
        by_step.setdefault(step, path)  # copies of one step (last.ckpt, best-*) count once
    steps = sorted(by_step)[-count:]
    return [by_step[step] for step in steps]


def average_checkpoints(paths: list[Path], output: Path) -> dict[str, Any]:
    """Write the mean of ``paths``' weights to ``output`` (other contents from the last path)."""
    if not paths:
        raise ConfigError("give at least one checkpoint to average")
    import torch

    from trident.converters.weight_only import refuse_quantized
    from trident.tasks.frozen_base import FROZEN_BASE_KEY

    checkpoints = [_load(path) for path in paths]
    for path, checkpoint in zip(paths, checkpoints, strict=True):  # its int layers are in a record, not the weights
        refuse_quantized(checkpoint, path, "an average is taken of float weights (average those, then quantize the "
                         "average)")
    bases = {str((c.get(FROZEN_BASE_KEY) or {}).get("fingerprint")) for c in checkpoints}
    if len(bases) > 1:  # a LoRA run's adapters on one base each: means over other bases mean nothing
        raise DataError("the checkpoints adapt different frozen bases (finetune=lora from other init_from weights): "
                        "average checkpoints of one run only")
    result = {k: v for k, v in checkpoints[-1].items() if k not in TRAINING_STATE}
    result["state_dict"] = average_state_dicts([c["state_dict"] for c in checkpoints])
    result["averaged_from"] = [str(p) for p in paths]
    output.parent.mkdir(parents=True, exist_ok=True)
    torch.save(result, output)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", type=Path, help=".ckpt files, or one run directory with --last N")
    parser.add_argument("-o", "--output", type=Path, required=True)
    parser.add_argument("--last", type=int, default=None, help="average the last N checkpoints of a run directory")
    args = parser.parse_args(argv)

    def run() -> None:
        if args.last is not None:
            if len(args.inputs) != 1 or not args.inputs[0].is_dir():
                raise ConfigError("--last N takes exactly one run directory (outputs/runs/<date>/<run>)")
            if args.last < 1:
                raise ConfigError(f"--last must be at least 1, got {args.last}")
            paths = last_checkpoints(args.inputs[0], args.last)
        else:
            paths = list(args.inputs)
        average_checkpoints(paths, args.output)
        print(f"averaged {len(paths)} checkpoints -> {args.output}")
        for path in paths:
            print(f"  {path}")

    run_with_clear_errors(run)


if __name__ == "__main__":
    main()
