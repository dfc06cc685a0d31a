"""Fewer memory passes (issue 57) on a GPU: rope's rotation without ``cat`` and Gemma's norm through torch's fused
``rms_norm`` equal the forms they replaced in bf16 and fp32, and ``compile=blocks`` trains the LM under FSDP2's and
plain bf16 (the CPU suite checks the same logic: tests/test_rope_passes.py, test_norm_dropout_passes.py,
test_compile_blocks.py; the speed is the bench's ``passes`` and ``mfu`` rows)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trident.backbone import apply_rotary
from trident.backbone.layers import OffsetRMSNorm
from trident.runs.pipeline import train

from ..conftest import compose_config
from ..test_norm_dropout_passes import hand_written_offset_rms_norm
from ..test_rope_passes import _Ops, old_apply_rotary
from .probes import TrainingProbe
from .runs import TASK_RUNS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_and_norm_equal_the_replaced_forms(dtype: torch.dtype, cuda: torch.device) -> None:
    torch.manual_seed(0)
    angles = torch.randn(64, 32, device=cuda)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    x = torch.randn(4, 64, 8, 64, device=cuda).to(dtype).transpose(1, 2).requires_grad_()
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 4e-2}
    ours, expected = apply_rotary(x, cos, sin), old_apply_rotary(x, cos, sin)
    torch.testing.assert_close(ours, expected, **tolerance)
    grad = torch.randn_like(ours)
    torch.testing.assert_close(torch.autograd.grad(ours, x, grad)[0], torch.autograd.grad(expected, x, grad)[0],
                               **tolerance)
    norm = OffsetRMSNorm(512, eps=1e-6).to(cuda)
    with torch.no_grad():
        norm.weight.normal_(std=0.3)
    h = torch.randn(8, 128, 512, device=cuda).to(dtype)
    with _Ops() as seen:
        out = norm(h)
    torch.testing.assert_close(out, hand_written_offset_rms_norm(h, norm.weight, 1e-6), **tolerance)
    assert "pow" not in seen.ops, f"not one fused kernel: {seen.ops}"


@pytest.mark.parametrize("trainer", ["gpu", "fsdp"])
def test_compile_blocks_trains_the_lm(trainer: str, tmp_path: Path) -> None:
    overrides = [*TASK_RUNS["lm"](tmp_path), f"trainer={trainer}", "trainer.devices=1", "precision=bf16",
                 "compile=blocks", "logger=none", "test=false", "trainer.max_steps=3",
                 "+callbacks.probe._target_=tests.gpu.probes.TrainingProbe"]
    TrainingProbe.last = None
    train(compose_config(overrides, output_dir=tmp_path))
    probe = TrainingProbe.last
    assert probe is not None and probe.device is not None and probe.device.type == "cuda"
    assert len(probe.losses) == 3 and probe.weights_finite
