"""Callbacks that keep a long run safe: exact RNG resume and non-finite losses (stop signals:
:mod:`trident.launch.preemption`).

The pipeline adds them to every run (they are not optional config: a resumed run that silently
diverges, or a NaN model written over the last good checkpoint, is never wanted).
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any, cast

import lightning as L
import numpy as np
import torch
from torch import Tensor

from trident.errors import ConfigError, TrainingDiverged
from trident.parallel.tensor_parallel import grad_norm

log = logging.getLogger(__name__)


def collect_rng_states() -> dict[str, Any]:
    """The global random states, as plain tensors and lists (loadable with ``weights_only=True``)."""
    legacy_state = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    _, keys, position, has_gauss, cached_gauss = legacy_state
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": [keys.tolist(), int(position), int(has_gauss), float(cached_gauss)],
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    keys, position, has_gauss, cached_gauss = states["numpy"]
    np.random.set_state(("MT19937", np.asarray(keys, dtype=np.uint32), position, has_gauss, cached_gauss))
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


class RandomStates(L.Callback):
    """Saves the torch / CUDA / NumPy / Python RNG states in every checkpoint and restores them
    right before the first resumed training step, so dropout draws the same masks as an
    uninterrupted run. (Data order does not depend on them: see ``trident.data.order``.)"""

    def __init__(self) -> None:
        self._to_restore: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return collect_rng_states()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._to_restore = state_dict

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Not at load time: the sanity check and building the data iterators come in between.
        if self._to_restore is not None:
            restore_rng_states(self._to_restore)
            self._to_restore = None


NONFINITE_LOSS_MODES = ("stop", "skip")


class NonFiniteLossGuard(L.Callback):
    """A non-finite training loss (or gradient) either stops the run before the optimizer step,
    so no NaN weights are ever trained on or checkpointed (``stop``), or drops that step (``skip``).
    The loss of every micro-batch of the step counts (gradient accumulation), not the last one's alone.

    Gradients are checked too because under DDP they are averaged over ranks: one rank's NaN loss
    reaches every rank's gradients, and all ranks must decide alike. With fp16 loss scaling,
    infinite gradients are routine (the scaler skips those steps itself), so only the loss counts.
    """

    def __init__(self, mode: str = "stop", last_checkpoint: Path | None = None) -> None:
        if mode not in NONFINITE_LOSS_MODES:
            raise ConfigError(f"nonfinite_loss={mode!r} is not a choice: use one of {', '.join(NONFINITE_LOSS_MODES)}")
        self.mode = mode
        self.last_checkpoint = last_checkpoint
        self._losses: list[Tensor] = []  # () each: the losses of the optimizer step's micro-batches so far
        self.skipped_steps: list[int] = []

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Tensor) -> None:
        self._losses.append(loss.detach())  # checked once per step: no device sync per micro-batch

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        losses = torch.stack(self._losses) if self._losses else torch.zeros(0)
        self._losses = []
        nonfinite = losses[~torch.isfinite(losses)]
        loss_finite = nonfinite.numel() == 0
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        loss_scaling = str(trainer.precision).startswith("16")
        # Over every device mesh the gradients live on (tensor parallelism: two).
        grads_finite = loss_scaling or not params or bool(torch.isfinite(grad_norm(params)))
        if loss_finite and grads_finite:
            return
        step = trainer.global_step + 1
        what = "gradient" if loss_finite else f"loss {float(nonfinite[0]):g}"
        if self.mode == "skip":
            for group in optimizer.param_groups:
                for param in group["params"]:
                    param.grad = None  # the optimizer leaves parameters without a gradient untouched
            self.skipped_steps.append(step)
            log.warning("non-finite training %s at step %d: step skipped (nonfinite_loss=skip)", what, step)
            return
        kept = f"; the last good checkpoint is {self.last_checkpoint}" if self.last_checkpoint and self.last_checkpoint.exists() else ""
        raise TrainingDiverged(
            f"non-finite training {what} at step {step}: lower optimizer.lr, raise scheduler.warmup_steps, "
            f"set trainer.gradient_clip_val, or use precision=bf16 instead of fp16; nonfinite_loss=skip drops such "
            f"steps instead{kept}"
        )
