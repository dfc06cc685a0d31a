"""The callback ``python -m trident.bench --only sharding`` (and the FSDP tests) load into ``train.py`` by
``_target_``: what each rank of a run holds and computes, written as ``rank<r>.json`` into the run directory."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lightning as L
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from trident.bench.memory import peak_rss_bytes
from trident.tracking.steps import ends_optimizer_step

# Steps left out of the step time: the first ones allocate (and under FSDP build the all-gather buffers).
WARM_UP_STEPS = 2


def local_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes this rank holds of ``tensors``: its shards of DTensors, the whole of the others."""
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


class RecordRank(L.Callback):
    """Writes ``rank<r>.json`` into the run directory: the training loss at every step (``train/loss``,
    over the global batch), the parameters it holds (its shards under FSDP), the
    bytes of its parameters, gradients and optimizer state at the second step, its peak RSS, its
    mean step time after the warm-up steps, and the sum of each whole parameter at the start (after a
    resume: as loaded). A run stopped by a signal writes it too, and a resumed run continues its
    record: the losses of every step, over all attempts."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.held: dict[str, Any] = {}
        self.start_sums: dict[str, float] = {}
        self.step_seconds: list[float] = []
        self._step_start = 0.0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        params = list(pl_module.parameters())
        self.held = {
            "total": sum(p.numel() for p in params),
            "local": sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params),
            "dtensors": sum(isinstance(p, DTensor) for p in params),
            "tensors": len(params),
        }
        # full_tensor() gathers the shards: every rank calls it.
        self.start_sums = {name: float((p.full_tensor() if isinstance(p, DTensor) else p).detach().double().sum())
                           for name, p in pl_module.named_parameters()}
        earlier = self._path(trainer)
        if trainer.global_step and earlier.is_file():  # resumed: the attempts before wrote the steps up to here
            record = json.loads(earlier.read_text())
            self.losses = record["losses"][: trainer.global_step]
            if "bytes" in record["params"]:
                self.held["bytes"] = record["params"]["bytes"]

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Optimizer) -> None:
        if trainer.global_step == 1:  # the optimizer state exists from the first step on
            params = list(pl_module.parameters())
            state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, Tensor)]
            self.held["bytes"] = {"parameters": local_bytes(params),
                                  "gradients": local_bytes(p.grad for p in params if p.grad is not None),
                                  "optimizer_state": local_bytes(state)}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self._step_start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # The step's train/loss (the global batch's token mean, logged as the optimizer step ends), once a step:
        # what training_step returns is a micro-batch's summed token losses times a scale (trident.training.token_loss).
        if ends_optimizer_step(trainer):
            self.losses.append(float(trainer.callback_metrics["train/loss"]))
        if len(self.losses) > WARM_UP_STEPS:
            self.step_seconds.append(time.perf_counter() - self._step_start)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._write(trainer)  # a stop signal ends fit with an exception: the steps so far count

    def _path(self, trainer: L.Trainer) -> Path:
        return Path(trainer.default_root_dir) / f"rank{trainer.global_rank}.json"

    def _write(self, trainer: L.Trainer) -> None:
        record = {"world_size": trainer.world_size, "backend": dist.get_backend() if dist.is_initialized() else None,
                  "device": str(trainer.strategy.root_device), "losses": self.losses, "params": self.held,
                  "start_sums": self.start_sums,
                  "peak_rss_bytes": peak_rss_bytes(),
                  "step_seconds": sum(self.step_seconds) / max(1, len(self.step_seconds))}
        self._path(trainer).write_text(json.dumps(record))
