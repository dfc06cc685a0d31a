"""The chunked cross-entropy on a GPU (``task.loss_chunk``): Liger-Kernel's fused linear cross entropy, where it is
installed, gives the torch version's loss and gradients; both give the plain loss's under bf16 autocast, without
holding the whole batch's logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trident.backbone import VocabularyHead
from trident.data.masking import IGNORE_INDEX
from trident.training import chunked_loss

VOCAB, WIDTH, TOKENS = 50_304, 768, 8_192


def _inputs(device: torch.device) -> tuple[torch.Tensor, nn.Linear, torch.Tensor]:
    generator = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(TOKENS, WIDTH, device=device, generator=generator).requires_grad_()
    head = nn.Linear(WIDTH, VOCAB, bias=False, device=device)
    targets = torch.randint(0, VOCAB, (TOKENS,), device=device, generator=generator)
    targets[: TOKENS // 8] = IGNORE_INDEX  # prompts that train nothing
    return hidden, head, targets


def _loss_and_grads(hidden: torch.Tensor, head: nn.Linear, targets: torch.Tensor, chunk: int,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden.grad, head.weight.grad = None, None
    with torch.autocast("cuda", dtype=torch.bfloat16):
        if chunk:
            loss = chunked_loss.chunked_cross_entropy(VocabularyHead(hidden, head, chunk=chunk), targets,
                                                      ignore_index=IGNORE_INDEX)[0]
        else:
            loss = F.cross_entropy(head(hidden).float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
    loss.backward()
    return loss.detach(), hidden.grad.clone(), head.weight.grad.clone()


def _assert_close(got: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...]) -> None:
    # bf16 matmuls in both: their gradients agree to bf16's precision, not fp32's.
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=2e-2 * float(b.abs().max()))


@pytest.mark.parametrize("liger", [False, True])
def test_the_chunked_loss_on_a_gpu_equals_the_plain_one(liger: bool, cuda: torch.device,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    if liger:
        pytest.importorskip("liger_kernel", reason="Liger-Kernel is not installed: pip install liger-kernel")
    monkeypatch.setattr(chunked_loss, "LIGER", liger)
    hidden, head, targets = _inputs(cuda)
    if liger:  # this Liger's functional API is the one called (not the torch version in its place)
        assert chunked_loss._liger(hidden, head.weight, None, targets, IGNORE_INDEX, None) is not None
    plain = _loss_and_grads(hidden, head, targets, 0)
    _assert_close(_loss_and_grads(hidden, head, targets, 1024), plain)


def test_liger_and_the_torch_version_agree_and_hold_less_than_the_whole_logits(
        cuda: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("liger_kernel", reason="Liger-Kernel is not installed: pip install liger-kernel")
    hidden, head, targets = _inputs(cuda)
    peaks, results = {}, {}
    for liger in (False, True):
        monkeypatch.setattr(chunked_loss, "LIGER", liger)
        torch.cuda.reset_peak_memory_stats(cuda)
        start = torch.cuda.memory_allocated(cuda)
        results[liger] = _loss_and_grads(hidden, head, targets, 1024)
        peaks[liger] = torch.cuda.max_memory_allocated(cuda) - start
    _assert_close(results[True], results[False])
    whole_logits = TOKENS * VOCAB * 4  # one fp32 copy of the whole batch's logits
    assert max(peaks.values()) < whole_logits, peaks
