"""Test-only callbacks that train.py loads by ``_target_`` to look inside a run: the dtype its
matrix products ran in, the network as training starts, and a failure of one DDP rank at a chosen step."""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import lightning as L
import torch
from torch import nn

from trident.errors import DataError


class LinearOutputDtypes(L.Callback):
    """Collects the dtype of every ``nn.Linear`` output in training steps (in ``seen``, shared by
    the class so a test reads it after ``train`` returns): float32, or bfloat16 under autocast.
    Sampling after a validation runs outside the precision plugin's autocast, so it is left out."""

    seen: ClassVar[set[torch.dtype]] = set()

    def __init__(self) -> None:
        self.in_step = False

    def _record(self, module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        if self.in_step:
            self.seen.add(output.dtype)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for module in pl_module.modules():
            if isinstance(module, nn.Linear):
                module.register_forward_hook(self._record)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self.in_step = True

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.in_step = False


class NetworkAtStart(L.Callback):
    """A copy of the task's network as training starts (step 0, in ``nets``, shared by the class), in eval mode."""

    nets: ClassVar[list[nn.Module]] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.nets.append(copy.deepcopy(pl_module.net).eval())


class NetworkAtEnd(L.Callback):
    """A copy of the task's network as fitting ends (after every ``on_train_end``: an EMA has swapped in its average),
    in ``nets``, shared by the class, in eval mode."""

    nets: ClassVar[list[nn.Module]] = []

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.nets.append(copy.deepcopy(pl_module.net).eval())


class FailOnRank(L.Callback):
    """Raises a user error (DataError) on global rank ``rank`` after training step ``step``."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            raise DataError(f"injected failure of rank {self.rank}: nothing to fix")
