"""Evaluation-harness tasks during training (``callbacks=harness``): :class:`HarnessEvaluation` runs chosen tasks of
EleutherAI's harness on the model being trained every ``every_n_steps`` optimizer steps and once training ends, and
logs each task's metrics as ``harness/<task>/<metric>`` beside the validation loss.

The evaluation leaves the training as it found it: the model back in the mode it was in, every random state (torch,
CUDA, NumPy, Python: the harness seeds them all) put back, so a run with the callback trains step for step like one
without it. Under DDP, rank 0 evaluates the whole task on its (identical) copy of the weights while the other ranks
wait at a barrier; sharded weights (FSDP, tensor parallelism) are refused at the start, since one rank alone cannot
run the model.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import WandbLogger

from trident.errors import ConfigError, is_int, is_number
from trident.launch.preemption import PreemptionCheckpoint
from trident.parallel.fsdp import shards_weights
from trident.tracking.loggers import record_summary
from trident.tracking.steps import ends_optimizer_step
from trident.training.callbacks import MetricHistory
from trident.training.resilience import collect_rng_states, restore_rng_states

log = logging.getLogger(__name__)
PREFIX = "harness/"
STAGE = "harness"  # the stage of its rows in metrics.jsonl


def metric_values(results: dict[str, Any]) -> dict[str, float]:
    """The harness's ``results`` ({task: {"acc,none": 0.5, "acc_stderr,none": ..., "alias": ...}}) as
    ``harness/<task>/<metric>`` (a filter other than ``none`` added as ``<metric>_<filter>``); standard errors left
    out (a run's spread across seeds is what the sweep report compares)."""
    values = {}
    for task, metrics in results.items():
        for key, value in metrics.items():
            name, _, kind = key.partition(",")
            if not kind or "_stderr" in name or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            values[f"{PREFIX}{task}/{name}" + ("" if kind == "none" else f"_{kind}")] = float(value)
    return values


def sample_table(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The harness's logged samples of one task as a table (``columns``, ``data``): each document's id, prompt (its
    first request's context), target, responses (generated texts, or each choice's log-likelihood) and metrics."""
    metrics = list(rows[0]["metrics"]) if rows else []
    data = []
    for row in rows:
        responses = [text if isinstance(text, str) else round(float(text[0]), 4) for text in row["filtered_resps"]]
        data.append([row["doc_id"], str(row["arguments"][0][0]), str(row["target"]),
                     responses[0] if len(responses) == 1 else json.dumps(responses),
                     *(row[m] if isinstance(row[m], (int, float)) else str(row[m]) for m in metrics)])  # chrF's: a pair
    return {"columns": ["doc_id", "prompt", "target", "response", *metrics], "data": data}


class HarnessEvaluation(L.Callback):
    """Runs ``tasks`` (harness task names: trident's shipped ones, those of ``include_path``, the harness's own) every
    ``every_n_steps`` optimizer steps (null: only at the end) and once training ends, ``limit`` documents each."""

    def __init__(self, tasks: list[str], every_n_steps: int | None = None, limit: float | None = None,
                 num_fewshot: int | None = None, batch_size: int = 8, include_path: str | None = None,
                 seed: int = 0) -> None:
        names = [str(name) for name in tasks or []]
        if not names:
            raise ConfigError("callbacks.harness.tasks is empty: name the harness tasks to run, e.g. "
                              "callbacks.harness.tasks=[trident_shakespeare_next_line]")
        if every_n_steps is not None and (not is_int(every_n_steps) or every_n_steps < 1):
            raise ConfigError(f"callbacks.harness.every_n_steps={every_n_steps} must be a whole number >= 1, or null "
                              "(only at the end of training)")
        if limit is not None and not (is_number(limit) and limit > 0):
            raise ConfigError(f"callbacks.harness.limit={limit} must be > 0 (documents per task, or a fraction of "
                              "them below 1), or null (every document)")
        if not is_int(batch_size) or batch_size < 1:
            raise ConfigError(f"callbacks.harness.batch_size={batch_size} must be a whole number >= 1")
        self.tasks, self.every_n_steps, self.limit = names, every_n_steps, limit
        self.num_fewshot, self.batch_size, self.include_path, self.seed = num_fewshot, batch_size, include_path, seed
        from trident.extras import require_package
        from trident.runs.harness_tasks import task_manager

        require_package("lm_eval")
        # Built with the callbacks, before the run directory gets its files: an unknown task leaves no run behind.
        self._manager = task_manager(self.tasks, include_path, "callbacks.harness.include_path")
        self._last_step: int | None = None
        self.last_values: dict[str, float] = {}

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        from trident.tasks.base import GENERATE

        if GENERATE not in getattr(pl_module, "CAPABILITIES", ()) or getattr(pl_module, "tokenizer", None) is None:
            from trident.runs.harness import OTHER_EVALUATIONS

            name = getattr(pl_module, "NAME", type(pl_module).__name__)
            raise ConfigError(f"callbacks=harness scores a language model (task=lm), not task={name}: remove it and "
                              f"evaluate with {OTHER_EVALUATIONS.get(name, 'trident-eval')}")
        if shards_weights(trainer.strategy):
            raise ConfigError("callbacks=harness needs the whole model on rank 0, which FSDP and tensor parallelism "
                              "shard: use trainer=ddp, or run trident-harness on the run's checkpoint afterwards")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.every_n_steps and ends_optimizer_step(trainer) and trainer.global_step % self.every_n_steps == 0:
            self._evaluate(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A stop signal (decided alike on every rank) leaves the time to the checkpoint and the next attempt.
        stopping = any(c.stop is not None for c in trainer.callbacks if isinstance(c, PreemptionCheckpoint))  # type: ignore[attr-defined]
        if self._last_step != trainer.global_step and not stopping:  # the last step was not already evaluated
            self._evaluate(trainer, pl_module)
        # The final values join the run's metrics (status.json, the sweep report) and the W&B summary.
        if trainer.is_global_zero:  # the values are rank 0's (the other ranks waited)
            for name, value in self.last_values.items():
                trainer.callback_metrics[name] = torch.tensor(value, dtype=torch.float64)  # float(): exactly the value
            record_summary(trainer.loggers, self.last_values)

    def _evaluate(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Rank 0 evaluates the weights after ``trainer.global_step`` optimizer steps; the others wait for it."""
        self._last_step = step = trainer.global_step
        if trainer.is_global_zero:
            # Each module's own mode: a frozen part that training keeps in eval mode stays so.
            modes, states = [(module, module.training) for module in pl_module.modules()], collect_rng_states()
            tables = any(isinstance(logger, WandbLogger) for logger in trainer.loggers)
            try:
                results = self._run(pl_module, samples=tables)
            finally:
                for module, training in modes:
                    module.training = training
                restore_rng_states(states)
            self.last_values = metric_values(results["results"])
            for logger in trainer.loggers:
                logger.log_metrics(self.last_values, step=step)
                if isinstance(logger, WandbLogger):
                    for task, rows in results.get("samples", {}).items():
                        logger.log_table(key=f"{PREFIX}{task}/samples", **sample_table(rows), step=step)
            self._append_history(trainer, step)
            text = "  ".join(f"{name}={value:.4g}" for name, value in sorted(self.last_values.items()))
            log.info("step %d  %s", step, text)
        trainer.strategy.barrier("harness")

    def _run(self, pl_module: L.LightningModule, samples: bool) -> dict[str, Any]:
        from lm_eval import simple_evaluate

        from trident.runs.harness import TridentLM, special_ids

        eot, prefix = special_ids(pl_module.net, pl_module.tokenizer, pl_module.tokenizer_settings)
        model = TridentLM(pl_module.net, pl_module.tokenizer, eot_token_id=eot, prefix_token_id=prefix,
                          batch_size=self.batch_size, name="the model in training")
        results = simple_evaluate(model=model, tasks=self.tasks, num_fewshot=self.num_fewshot, limit=self.limit,
                                  task_manager=self._manager, bootstrap_iters=0, log_samples=samples,
                                  random_seed=self.seed, numpy_random_seed=self.seed, torch_random_seed=self.seed,
                                  fewshot_random_seed=self.seed)
        assert results is not None  # None on ranks other than the model's 0: TridentLM is rank 0 of one
        return results

    def _append_history(self, trainer: L.Trainer, step: int) -> None:
        """A ``harness`` row in the run's ``metrics.jsonl`` (the pipeline's :class:`MetricHistory`)."""
        history = next((c for c in trainer.callbacks if isinstance(c, MetricHistory)), None)  # type: ignore[attr-defined]
        values = {name: value for name, value in self.last_values.items() if not math.isnan(value)}
        if history is None or not values:
            return
        path = Path(history.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as rows:
            rows.write(json.dumps({"step": step, "stage": STAGE, **values}) + "\n")
