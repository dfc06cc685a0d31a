"""A callback the GPU tests add to real runs (``+callbacks.probe._target_=tests.gpu.probes.TrainingProbe``)
to see what the pipeline built and how training went, without changing the pipeline."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import lightning as L
import torch


class TrainingProbe(L.Callback):
    """Records the optimizer's kernel choice, the precision plugin's GradScaler, every training
    loss, and whether the weights are finite at the end. The last instance is kept on the class:
    Hydra builds it inside the pipeline, out of the test's reach."""

    last: ClassVar[TrainingProbe | None] = None

    def __init__(self) -> None:
        self.optimizer_defaults: dict[str, Any] = {}
        self.scaler: torch.amp.GradScaler | None = None
        self.losses: list[float] = []
        self.weights_finite: bool | None = None
        self.device: torch.device | None = None
        self.compiled = False
        TrainingProbe.last = self

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.optimizer_defaults = dict(trainer.optimizers[0].defaults)
        self.scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.device = pl_module.device
        # compile=true compiles the task's network in place (nn.Module.compile).
        self.compiled = getattr(pl_module, "net", None) is not None and pl_module.net._compiled_call_impl is not None

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.weights_finite = all(bool(torch.isfinite(p).all()) for p in pl_module.parameters())

    def mean_loss(self, steps: slice) -> float:
        """Mean training loss over ``steps`` (e.g. ``slice(-5, None)``: the last five), all finite."""
        values = self.losses[steps]
        assert values and all(math.isfinite(v) for v in values), self.losses
        return sum(values) / len(values)
