"""Fewer memory passes (issue 57), timed against what they replaced in the same process: rope's rotation without
``cat``, Gemma's norm through ``F.rms_norm``, dropout modules not called at rate 0; one row each, and the LM
training step that uses all three. The replaced forms are written out here as the baseline."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from unittest import mock

import torch
from torch import Tensor, nn

from trident.backbone import TransformerBlock, apply_rotary
from trident.bench.levers import _lm, _loss, _shape
from trident.bench.results import Row, Settings, milliseconds, speedup
from trident.bench.timing import Budget, interleaved, synchronize, training_step
from trident.models import generate


def cat_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rope's rotation before issue 57: ``rotate_half`` concatenates the negated halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat((-x2, x1), dim=-1) * sin.to(x.dtype)


def hand_written_offset_norm(self: nn.Module, x: Tensor) -> Tensor:
    """Gemma's norm before issue 57: square, mean, rsqrt, scale and gain as separate passes."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
    return (h * (1.0 + self.weight.float())).type_as(x)


def always_called_branch(self: TransformerBlock, out: Tensor, scale: nn.Module) -> Tensor:
    """A block's residual branch before issue 57: dropout called at every rate."""
    if not self.training:
        return scale(out)
    return self.drop_path(scale(self.dropout(out)))


@contextmanager
def replaced_forms() -> Iterator[None]:
    """The backbone with the three replaced forms back in place."""
    with ExitStack() as stack:
        stack.enter_context(mock.patch("trident.backbone.attention.apply_rotary", cat_rotary))
        stack.enter_context(mock.patch("trident.backbone.layers.OffsetRMSNorm.forward", hand_written_offset_norm))
        stack.enter_context(mock.patch.object(TransformerBlock, "_branch", always_called_branch))
        yield


def _forward_backward(function: Callable[[Tensor], Tensor], x: Tensor, device: torch.device) -> Callable[[], None]:
    def run() -> None:
        function(x).backward(torch.ones_like(x))
        synchronize(device)

    return run


def passes_rows(settings: Settings) -> list[Row]:
    budget = Budget(settings.warmup, settings.repeats)
    model, ids = _lm(settings, pos_encoding="rope", norm="rmsnorm_offset", dropout=0.0)
    encoding = model.decoder.pos_encoding
    cos, sin = encoding.rotary(torch.arange(ids.size(1) - 1, device=settings.device))
    heads, width = model.cfg.n_heads, model.cfg.head_dim
    # (B, nh, T, hs) as attention has it: a transposed view of (B, T, nh, hs)
    q = torch.randn(ids.size(0), ids.size(1) - 1, heads, width, device=settings.device).transpose(1, 2)
    q.requires_grad_()
    rope = interleaved({
        "new": _forward_backward(lambda t: apply_rotary(t, cos, sin), q, settings.device),
        "cat": _forward_backward(lambda t: cat_rotary(t, cos, sin), q, settings.device),
    }, budget)
    norm = model.decoder.blocks[0].ffn_norm
    h = torch.randn(ids.size(0), ids.size(1) - 1, model.cfg.d_model, device=settings.device, requires_grad=True)
    norms = interleaved({
        "new": _forward_backward(norm, h, settings.device),
        "hand-written": _forward_backward(lambda t: hand_written_offset_norm(norm, t), h, settings.device),
    }, budget)
    step = training_step(model, _loss(model, ids), settings.device)

    def replaced_step() -> None:
        with replaced_forms():
            step()

    steps = interleaved({"new": step, "replaced": replaced_step}, budget)
    decoding = _decoding(model, ids, settings, budget)
    shape = f"(B, nh, T, hs) = {tuple(q.shape)}"
    return [
        Row("passes", f"rope rotation without cat, forward + backward, {shape}", f"new {milliseconds(rope['new'])}",
            f"cat {milliseconds(rope['cat'])}", f"{speedup(rope['new'], rope['cat']):.2f}x faster", "-", "-",
            "fp32; on a GPU each saved pass is a kernel and a read/write of q or k"),
        Row("passes", f"Gemma norm (rmsnorm_offset) via F.rms_norm, forward + backward, {tuple(h.shape)}",
            f"new {milliseconds(norms['new'])}", f"hand-written {milliseconds(norms['hand-written'])}",
            f"{speedup(norms['new'], norms['hand-written']):.2f}x faster", "-", "-",
            "the same operations on a CPU (composite); one fused kernel each way on a GPU"),
        Row("passes", f"LM train step, rope + rmsnorm_offset + dropout 0: {_shape(model, ids)}",
            f"new {milliseconds(steps['new'])}", f"replaced forms {milliseconds(steps['replaced'])}",
            f"{speedup(steps['new'], steps['replaced']):.2f}x faster", "-", "-",
            "the same model and weights, the three replaced forms patched back in for the baseline"),
        Row("passes", f"greedy decoding with a KV cache, the same model: {decoding['tokens']:.0f} tokens after "
            f"a {decoding['prompt']:.0f}-token prompt", f"new {milliseconds(decoding['new'])}",
            f"replaced forms {milliseconds(decoding['replaced'])}",
            f"{speedup(decoding['new'], decoding['replaced']):.2f}x faster", "-", "-",
            "one position per call: the rotation without a graph runs no autograd Function"),
    ]


def _decoding(model: nn.Module, ids: Tensor, settings: Settings, budget: Budget) -> dict[str, float]:
    """Seconds per greedy generation of the LM row's model (eval), new and with the replaced forms, in turns."""
    context = ids.size(1) - 1  # the model's max_seq_len
    prompt = ids[:1, : min(16, context // 4)]
    tokens = context - prompt.size(1)  # the rest of the context, one position at a time
    model.eval()

    def run() -> None:
        generate(model, prompt, tokens, temperature=0.0)
        synchronize(settings.device)

    def replaced_run() -> None:
        with replaced_forms():
            run()

    times = interleaved({"new": run, "replaced": replaced_run}, budget)
    model.train()
    return {**times, "tokens": float(tokens), "prompt": float(prompt.size(1))}
