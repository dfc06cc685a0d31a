"""``model.attention`` against the sequence length: forward + backward time and memory of one encoder layer with
softmax attention (SDPA), Performer and Linformer, and of one causal layer with softmax and Performer (issue 55)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from trident.backbone import Decoder, Encoder, TransformerConfig
from trident.bench.memory import saved_activation_bytes
from trident.bench.results import Row, Settings, milliseconds, speedup
from trident.bench.timing import Budget, interleaved, synchronize

LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_LENGTHS = (32, 64)
# A method stops at the first length where one call would take longer than this (its last time, scaled as the
# square of the length: softmax's cost; the linear methods stop later than this predicts, if at all).
CALL_LIMIT_S = 60.0
LINFORMER_K = 256  # the paper's k, the same at every length (a projection of max_seq_len = the length)
# What each compared method is: the stack, and its model.attention.
METHODS: dict[str, tuple[type[nn.Module], str]] = {
    "softmax": (Encoder, "softmax"),
    "performer": (Encoder, "performer"),
    "linformer": (Encoder, "linformer"),
    "causal softmax": (Decoder, "softmax"),
    "causal performer": (Decoder, "performer"),
}


def _layer(settings: Settings, method: str, length: int) -> nn.Module:
    stack, attention = METHODS[method]
    torch.manual_seed(0)
    width = (16, 2) if settings.quick else (64, 2)  # small: the attention, not the projections, should dominate
    cfg = TransformerConfig(d_model=width[0], n_heads=width[1], n_layers=1, d_ff=2 * width[0], dropout=0.0,
                            max_seq_len=length, pos_encoding="none", attention=attention,
                            linformer={"k": min(LINFORMER_K, length // 2)})
    return stack(cfg).to(settings.device).train()


def _memory_bytes(settings: Settings, forward: Callable[[], Tensor], step: Callable[[], None]) -> int:
    """A GPU's peak allocation over a forward and backward; on a CPU, which has no allocator statistics, the bytes
    autograd keeps for the backward (trident.bench.memory): SDPA's fused kernels keep no (T, T) weights there."""
    if settings.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(settings.device)
        before = torch.cuda.memory_allocated(settings.device)
        step()
        return torch.cuda.max_memory_allocated(settings.device) - before
    return saved_activation_bytes(forward)


def linear_attention_rows(settings: Settings) -> list[Row]:
    lengths = QUICK_LENGTHS if settings.quick else LENGTHS
    last: dict[str, tuple[int, float]] = {}  # method -> (length, seconds) of its last measured call
    stopped: dict[str, int] = {}  # method -> the length it stopped at
    rows = []
    for length in lengths:
        steps, memory = {}, {}
        for method in METHODS:
            previous = last.get(method)
            if method in stopped or (previous and previous[1] * (length / previous[0]) ** 2 > CALL_LIMIT_S):
                stopped.setdefault(method, length)
                continue
            layer = _layer(settings, method, length)
            x = torch.randn(1, length, layer.cfg.d_model, device=settings.device, requires_grad=True)

            def forward(layer: nn.Module = layer, x: Tensor = x) -> Tensor:
                return layer(x).square().mean()

            def step(forward: Callable[[], Tensor] = forward, layer: nn.Module = layer) -> None:
                forward().backward()
                layer.zero_grad(set_to_none=True)
                synchronize(settings.device)

            steps[method] = step
            memory[method] = _memory_bytes(settings, forward, step)
        # Long lengths: fewer repeats, the machine's noise being small beside seconds per call.
        budget = Budget(settings.warmup, settings.repeats if length <= 4096 else min(settings.repeats, 2))
        times = interleaved(steps, budget)
        last.update({method: (length, seconds) for method, seconds in times.items()})
        rows.append(_row(length, times, memory, stopped, settings))
    return rows


def _features(settings: Settings) -> int:
    """The Performer layers' feature count (the default for their head width)."""
    return _layer(settings, "performer", 4 * LINFORMER_K).blocks[0].self_attn.mixer.features


def _row(length: int, times: dict[str, float], memory: dict[str, int], stopped: dict[str, int],
         settings: Settings) -> Row:
    mib = 2**20

    def measured(method: str) -> str:
        if method not in times:
            return f"{method}: stopped at {stopped[method]} (a call would exceed {CALL_LIMIT_S:.0f} s)"
        return f"{method} {milliseconds(times[method])}, {memory[method] / mib:.1f} MiB"

    def ratio(method: str, reference: str) -> str:
        if method not in times or reference not in times:
            return f"{method}: -"
        return (f"{method} {speedup(times[method], times[reference]):.2f}x faster, "
                f"{memory[method] / memory[reference]:.2f}x the memory")

    width = "d=16, 2 heads" if settings.quick else "d=64, 2 heads"
    memory_kind = ("peak allocated" if settings.device.type == "cuda"
                   else "memory = tensors autograd keeps for the backward (no CPU allocator peak)")
    return Row(
        "linear_attention", f"model.attention, 1 layer fwd+bwd, {width}, batch 1 x {length}",
        "; ".join(measured(m) for m in ("performer", "linformer", "causal performer")),
        "; ".join(measured(m) for m in ("softmax", "causal softmax")),
        "; ".join((ratio("performer", "softmax"), ratio("linformer", "softmax"),
                   ratio("causal performer", "causal softmax"))),
        "-", "-",
        f"softmax: SDPA (fused kernel, no (T, T) weights kept); performer: model.performer.features=null "
        f"(head_dim ln head_dim = {_features(settings)}); "
        f"linformer: k={min(LINFORMER_K, length // 2)}; {memory_kind}",
    )
