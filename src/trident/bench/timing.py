"""Interleaved timing and one-training-step closures shared by every benchmark row."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class Budget:
    """How long to measure: untimed warm-up calls, then timed repeats of every variant."""

    warmup: int
    repeats: int


def interleaved(variants: dict[str, Callable[[], object]], budget: Budget) -> dict[str, float]:
    """Median seconds per call of each variant, timed in turns (A B, B A, A B ...) so that a noisy
    neighbour or a frequency change hits every variant alike and none always runs first (right
    after another model evicted its weights from the caches), after ``budget.warmup`` untimed rounds."""
    for _ in range(budget.warmup):
        for run in variants.values():
            run()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_index in range(budget.repeats):
        order = list(variants.items())
        for name, run in order if round_index % 2 == 0 else reversed(order):
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(samples) for name, samples in times.items()}


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so that a timed call includes it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager[None]:
    """bf16/fp16 autocast (what ``precision=bf16`` does through Lightning), or nothing for fp32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer every compared training step uses: AdamW with trident's default fused kernel."""
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)


def training_step(
    model: nn.Module,
    loss: Callable[[], Tensor],
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    optimizer: torch.optim.Optimizer | None = None,
    clip: float | None = None,
) -> Callable[[], None]:
    """A closure doing one optimizer step: forward (under autocast) and loss, backward, the gradients' norm clipped
    to ``clip`` where given (``trainer.gradient_clip_val``, as Lightning clips them), AdamW."""
    model.train()
    optimizer = optimizer or adamw(model)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with autocast(device, dtype):
            value = loss()
        value.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], clip)
        optimizer.step()
        synchronize(device)

    return step
