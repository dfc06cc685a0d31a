"""Fewer memory passes (issue 57): Gemma's norm through torch's ``rms_norm`` (one fused kernel on a GPU) with the
outputs and gradients of the hand-written one, and no dropout work at rate 0 (torch launches no kernel for p=0;
the blocks do not call the modules either)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from trident.backbone import Decoder
from trident.backbone.layers import OffsetRMSNorm, make_norm

from .backbone_helpers import make_cfg
from .test_rope_passes import _Ops


def hand_written_offset_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The norm before issue 57 (transformers' GemmaRMSNorm): float32, gain 1 + weight, cast back."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).type_as(x)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_offset_rms_norm_equals_the_hand_written_one(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    norm = OffsetRMSNorm(48, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(std=0.3)
    norm = norm.to(dtype)
    x = (torch.randn(3, 5, 48) * 3).to(dtype).requires_grad_()
    grad = torch.randn(3, 5, 48).to(dtype)
    ours = norm(x)
    ours_grads = torch.autograd.grad(ours, (x, norm.weight), grad)
    expected = hand_written_offset_rms_norm(x, norm.weight, 1e-6)
    expected_grads = torch.autograd.grad(expected, (x, norm.weight), grad)
    assert ours.dtype == dtype
    tolerance = {torch.float64: {"rtol": 0, "atol": 1e-12}, torch.float32: {"rtol": 1e-6, "atol": 1e-6},
                 torch.bfloat16: {"rtol": 1e-2, "atol": 1e-2}}[dtype]  # bf16: one rounding of the same fp32 value
    torch.testing.assert_close(ours, expected, **tolerance)
    for got, want in zip(ours_grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, **tolerance)


def test_offset_rms_norm_is_torch_rms_norm() -> None:
    """One call of torch's norm (its fused kernel where the device has one), not a chain of elementwise ops."""
    norm = OffsetRMSNorm(16, eps=1e-6)
    calls: list[Any] = []
    original = torch.nn.functional.rms_norm

    def counting(*args: Any, **kwargs: Any) -> Tensor:
        calls.append(args)
        return original(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.functional, "rms_norm", counting)
        norm(torch.randn(2, 16))
    assert len(calls) == 1


def test_layernorm_and_rmsnorm_are_torch_modules() -> None:
    """``layernorm`` and ``rmsnorm`` already run torch's one-kernel norms (F.layer_norm, F.rms_norm)."""
    assert type(make_norm("layernorm", 8)) is nn.LayerNorm and type(make_norm("rmsnorm", 8)) is nn.RMSNorm


DROPOUT_OPS = {"bernoulli", "bernoulli_", "native_dropout", "dropout", "rand", "uniform_"}


def training_step_ops(**overrides: Any) -> list[str]:
    torch.manual_seed(0)
    decoder = Decoder(make_cfg(pos_encoding="rope", **overrides)).train()
    x = torch.randn(2, 6, 32, requires_grad=True)
    with _Ops() as seen:
        decoder(x).sum().backward()
    return seen.ops


def test_rate_zero_launches_no_dropout_work_and_a_rate_does() -> None:
    assert not DROPOUT_OPS & set(training_step_ops())  # dropout, attn_dropout, drop path all 0
    assert DROPOUT_OPS & set(training_step_ops(dropout=0.1))


def test_rate_zero_calls_no_dropout_module_and_changes_no_output() -> None:
    """The blocks and the embedding skip their dropout modules at rate 0 (in training too), read at each call: a
    rate set to 0 after build (DPO's disable_dropout) is skipped as well; the output is eval's, as calling them gave."""
    torch.manual_seed(0)
    decoder = Decoder(make_cfg(dropout=0.0)).train()
    called: list[nn.Module] = []
    for module in decoder.modules():
        if isinstance(module, nn.Dropout):
            module.register_forward_pre_hook(lambda module, args: called.append(module))
    x = torch.randn(2, 6, 32)
    out = decoder(x)
    assert called == []
    decoder.blocks[0].dropout.p = 0.5
    torch.manual_seed(1)
    decoder(x)
    assert called == [decoder.blocks[0].dropout] * 2  # the attention branch and the feed-forward branch
    decoder.blocks[0].dropout.p = 0.0
    torch.testing.assert_close(decoder(x), out, rtol=0, atol=0)
    torch.testing.assert_close(decoder.eval()(x), out, rtol=0, atol=0)  # rate 0 in training: eval's output
