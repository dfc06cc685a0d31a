"""Mixed precision on a GPU through the real pipeline: fp16 with Lightning's GradScaler (with
gradient clipping, and with the fused optimizer), and bf16 against fp32 on the same data."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from trident.runs.pipeline import train

from ..conftest import SMALL, compose_config
from .probes import TrainingProbe

STEPS = 60
# The nano LM on Shakespeare characters, no dropout (model=nano), one GPU, no logger or test pass:
# only the optimizer steps differ between the runs compared here.
GPU_RUN = ("trainer=gpu", "compile=false", "logger=none", "test=false", "data.block_size=64", "data.batch_size=32",
           f"trainer.max_steps={STEPS}", f"trainer.val_check_interval={STEPS}",
           "+callbacks.probe._target_=tests.gpu.probes.TrainingProbe")
# bf16 keeps 8 mantissa bits (relative rounding 2^-9 per operation). On this project's CPU the
# bf16-mixed loss after these 60 steps was within 1e-4 (relative) of fp32's on the same batches;
# 1e-2 leaves room for the GPU's other kernels while lost updates or a diverging run exceed it.
BF16_LOSS_TOLERANCE = 0.01


def run(run_dir: Path, *overrides: str) -> TrainingProbe:
    TrainingProbe.last = None
    train(compose_config([*SMALL, *GPU_RUN, *overrides], output_dir=run_dir))
    probe = TrainingProbe.last
    assert probe is not None and probe.device is not None and probe.device.type == "cuda"
    assert len(probe.losses) == STEPS
    return probe


def assert_learned(probe: TrainingProbe) -> None:
    assert probe.weights_finite, "no inf/NaN weights after training"
    first, last = probe.mean_loss(slice(5)), probe.mean_loss(slice(-5, None))
    assert last < 0.85 * first, f"the loss must fall: first steps {first:.3f}, last steps {last:.3f}"


def test_fp16_trains_with_grad_scaler_and_clipping_on_foreach_kernels(tmp_path: Path) -> None:
    """Default gradient clipping (1.0) with optimizer.fused=true: Lightning cannot clip a fused
    optimizer's gradients under 16-mixed, so trident.training.optim.fused_allowed falls back to foreach."""
    probe = run(tmp_path, "precision=fp16", "optimizer.fused=true", "trainer.gradient_clip_val=1.0")
    assert isinstance(probe.scaler, torch.amp.GradScaler) and probe.scaler.is_enabled()
    assert not probe.optimizer_defaults.get("fused") and probe.optimizer_defaults.get("foreach") is True
    assert math.isfinite(probe.scaler.get_scale()) and probe.scaler.get_scale() > 0
    assert_learned(probe)


def test_fp16_trains_with_grad_scaler_and_the_fused_optimizer(tmp_path: Path) -> None:
    """Without clipping the fused AdamW kernel stays, and unscales the gradients itself."""
    probe = run(tmp_path, "precision=fp16", "optimizer.fused=true", "trainer.gradient_clip_val=0")
    assert isinstance(probe.scaler, torch.amp.GradScaler) and probe.scaler.is_enabled()
    assert probe.optimizer_defaults.get("fused") is True
    assert_learned(probe)


def test_bf16_loss_stays_within_tolerance_of_fp32(tmp_path: Path) -> None:
    """Same seed, same batches, same initial weights: bf16-mixed follows fp32's loss curve.
    bf16 needs no GradScaler; with the default clipping, fused=true stays fused under bf16-mixed (trident
    clips itself: TridentTask.configure_gradient_clipping) and in fp32."""
    overrides = ("optimizer.fused=true", "trainer.gradient_clip_val=1.0")
    fp32 = run(tmp_path / "fp32", "precision=fp32", *overrides)
    bf16 = run(tmp_path / "bf16", "precision=bf16", *overrides)
    assert bf16.scaler is None
    assert bf16.optimizer_defaults.get("fused") is True
    assert fp32.optimizer_defaults.get("fused") is True
    assert_learned(fp32)
    assert_learned(bf16)
    reference, mixed = fp32.mean_loss(slice(-5, None)), bf16.mean_loss(slice(-5, None))
    assert mixed == pytest.approx(reference, rel=BF16_LOSS_TOLERANCE), (fp32.losses[-5:], bf16.losses[-5:])
