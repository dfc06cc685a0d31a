"""Evaluate a language model on tasks of EleutherAI's evaluation harness (``lm-eval``, trident's ``[eval]`` extra):
a trident run (its best, else last checkpoint) or a Hugging Face causal-LM directory, through trident's own model
(:class:`trident.runs.harness.TridentLM`). The options are the harness's own (``lm_eval --tasks ...``). A masked LM
(a task=mlm run, a BERT directory) scores continuations by pseudo-log-likelihood and runs no generation tasks.

    trident-harness outputs/runs/<date>/<run> --tasks my_task --include_path my_tasks/ --num_fewshot 2 --limit 100
    trident-harness exported_hf_dir --tasks my_task --include_path my_tasks/ --batch_size 8 --log_samples

The results (the harness's JSON, and each task's per-request log-likelihoods or generations with --log_samples) go to
``--output_path``, by default the run's (or directory's) ``harness/`` folder.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from trident.errors import run_with_clear_errors

# lm_eval, torch and the model are imported once the arguments are parsed: ``--help`` answers without them.


def limit(text: str) -> float:
    """--limit: a number of documents per task (>= 1), or a fraction of them (0 < limit < 1), as the harness reads it."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (documents per task, or a fraction of them below 1), got {text!r}")
    return int(value) if value >= 1 else value


def batch_size(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return int(text)


def num_fewshot(text: str) -> int:
    """--num_fewshot: a count of examples (the harness would record a negative one as the task's n-shot)."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {text!r}")
    return int(text)


def key_value(text: str) -> tuple[str, str]:
    """--wandb_args: each a wandb.init argument, ``key=value``."""
    key, equals, value = text.partition("=")
    if not equals or not key:
        raise argparse.ArgumentTypeError(f"must be key=value (a wandb.init argument, e.g. project=trident), got {text!r}")
    return key, value


def output_folder(out: Path, created: list[Path]) -> Path:
    """``out``, created before the evaluation runs (added to ``created`` when it is new, for a refused evaluation to
    leave no empty folder): a path that cannot be a folder is one line, not a traceback after the whole evaluation."""
    from trident.errors import ConfigError

    if not out.exists():
        created.append(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"--output_path {str(out)!r} cannot be a folder of results ({err.strerror}): pass a "
                          "directory that can be created and written") from err
    return out


def new_stamp(out: Path) -> str:
    """The UTC time that names this evaluation's files in ``out``, its ``results_<stamp>.json`` created (empty) here:
    never an earlier evaluation's name, though two end within the same second (``-1``, ``-2``... then)."""
    base = stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    for n in itertools.count(1):
        try:
            (out / f"results_{stamp}.json").open("x").close()
            break
        except FileExistsError:
            stamp = f"{base}-{n}"
    return stamp


def log_to_wandb(results: dict[str, Any], samples: dict[str, Any] | None, init: dict[str, str], out: Path) -> None:
    """The results as the harness's own ``--wandb_args`` logs them: metrics in the run's summary and a table of them,
    each task's samples as a table (with ``--log_samples``), in a W&B run started with ``init``."""
    import wandb
    from lm_eval.loggers import WandbLogger

    logger = WandbLogger(init_args={"dir": str(out), **init})
    try:
        logger.post_init(results)
        logger.log_eval_result()
        if samples:
            logger.log_eval_samples(samples)
    finally:
        wandb.finish()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trident-harness", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path, help="a task=lm or task=mlm run directory or .ckpt, or a Hugging Face causal or masked LM "
                                               "directory")
    parser.add_argument("--tasks", required=True, help="comma-separated harness task names")
    parser.add_argument("--include_path", default=None, help="a folder of your own task YAMLs")
    parser.add_argument("--num_fewshot", type=num_fewshot, default=None, help="examples before each question (task default)")
    parser.add_argument("--limit", type=limit, default=None, help="documents per task (or a fraction below 1)")
    parser.add_argument("--batch_size", type=batch_size, default=1)
    parser.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda, cuda:1, mps)")
    parser.add_argument("--apply_chat_template", action="store_true", help="render prompts with the model's template")
    parser.add_argument("--log_samples", action="store_true", help="write each request's scores or generation")
    parser.add_argument("--output_path", type=Path, default=None, help="default: <run or directory>/harness")
    parser.add_argument("--seed", type=int, default=0, help="few-shot draws and sampled generations")
    parser.add_argument("--wandb_args", nargs="+", type=key_value, default=None, metavar="KEY=VALUE",
                        help="log to W&B with these wandb.init arguments (project=... mode=offline ...; its files "
                             "go to the output path unless dir= says otherwise)")
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.tasks.split(",") if name.strip()]
    if not names:
        parser.error("--tasks: name at least one task")

    def run() -> None:
        from trident.extras import require_package

        require_package("lm_eval")
        import torch
        from lm_eval import simple_evaluate
        from lm_eval.utils import handle_non_serializable, make_table

        from trident.runs.harness import harness_model
        from trident.runs.harness_tasks import task_manager

        manager = task_manager(names, args.include_path)
        model = harness_model(args.model, batch_size=args.batch_size, chat=args.apply_chat_template,
                              device=torch.device(args.device))
        out = output_folder(args.output_path or (args.model.parent if args.model.is_file() else args.model) / "harness",
                            created)
        torch.manual_seed(args.seed)
        results = simple_evaluate(model=model, tasks=names, num_fewshot=args.num_fewshot, limit=args.limit,
                                  log_samples=args.log_samples, apply_chat_template=args.apply_chat_template,
                                  task_manager=manager, random_seed=args.seed, numpy_random_seed=args.seed,
                                  torch_random_seed=args.seed, fewshot_random_seed=args.seed)
        assert results is not None  # None on ranks other than 0 only
        stamp = new_stamp(out)
        samples = results.pop("samples", None)
        (out / f"results_{stamp}.json").write_text(json.dumps(results, indent=2, default=handle_non_serializable))
        for task, rows in (samples or {}).items():
            lines = (json.dumps(row, default=handle_non_serializable) for row in rows)
            (out / f"samples_{task}_{stamp}.jsonl").write_text("\n".join(lines) + "\n")
        if args.wandb_args:
            log_to_wandb(results, samples, dict(args.wandb_args), out)
        sys.stdout.write(make_table(results) + f"\nresults in {out}\n")

    created: list[Path] = []

    def remove_empty() -> None:
        for folder in created:
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()

    run_with_clear_errors(run, cleanup=remove_empty)


if __name__ == "__main__":
    main()
