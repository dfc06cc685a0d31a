"""Greedy generation with the KV cache against recomputing the whole prefix at every step."""

from __future__ import annotations

import torch
from torch import nn

from trident.backbone import TransformerConfig
from trident.bench.results import Row, Settings, speedup, verdict
from trident.bench.timing import Budget, interleaved, synchronize
from trident.models import CausalLM, generate

PROMPT = 16
TARGETS = {256: 5.0, 1024: 10.0}  # new tokens -> the speed-up the issue asks for


def _model(settings: Settings, longest: int) -> tuple[CausalLM, int]:
    if settings.quick:
        cfg = TransformerConfig(d_model=32, n_heads=2, n_layers=1, d_ff=64, max_seq_len=PROMPT + longest, dropout=0.0)
        vocab = 64
    else:
        # Small enough that recomputing 1,040-token prefixes 1,024 times stays within a minute on 2 cores.
        cfg = TransformerConfig(d_model=192, n_heads=3, n_layers=3, d_ff=768, max_seq_len=PROMPT + longest, dropout=0.0)
        vocab = 256
    model = CausalLM(cfg, vocab).to(settings.device).eval()
    # Random weights give nearly uniform logits, where float rounding could flip a near-tie;
    # a wide embedding (also the tied head) makes every greedy choice decisive.
    nn.init.normal_(model.embed.weight, std=1.0)
    return model, vocab


def generation_rows(settings: Settings) -> list[Row]:
    """At torch's thread count and at one thread: a batch-1 decoding step is one-row matmuls, where
    splitting each tiny kernel over threads can cost more than it gives (most of all on a busy machine)."""
    lengths = (8, 16) if settings.quick else tuple(TARGETS)
    model, vocab = _model(settings, max(lengths))
    prompt = torch.randint(0, vocab, (1, PROMPT), generator=torch.Generator().manual_seed(0)).to(settings.device)
    rows = []
    default_threads = torch.get_num_threads()
    for threads in dict.fromkeys((default_threads, 1)):
        torch.set_num_threads(threads)
        try:
            rows += [_generation_row(settings, model, vocab, prompt, n, target, threads)
                     for n, target in zip(lengths, TARGETS.values())]
        finally:
            torch.set_num_threads(default_threads)
    return rows


def _generation_row(
    settings: Settings, model: CausalLM, vocab: int, prompt: torch.Tensor, new_tokens: int, target: float, threads: int
) -> Row:
    outputs: dict[str, torch.Tensor] = {}

    def run(use_cache: bool, n: int = new_tokens) -> None:
        outputs[str(use_cache)] = generate(model, prompt, n, temperature=0.0, use_cache=use_cache)
        synchronize(settings.device)

    run(True, 8), run(False, 8)  # warm-up on a short generation: the long ones take seconds each
    # The long no-cache generations dominate the benchmark's time: fewer repeats for them.
    repeats = 1 if settings.quick else max(1, min(settings.repeats, 5 if new_tokens <= 256 else 2))
    times = interleaved({"cache": lambda: run(True), "recompute": lambda: run(False)}, Budget(0, repeats))
    if not torch.equal(outputs["True"], outputs["False"]):
        raise AssertionError(f"greedy tokens differ with and without the KV cache at {new_tokens} new tokens")
    gain = speedup(times["cache"], times["recompute"])
    return Row(
        "generation",
        f"Greedy generation, {new_tokens} new tokens after a {PROMPT}-token prompt: d={model.cfg.d_model}, "
        f"{model.cfg.n_layers} layers, vocab {vocab}, batch 1, {threads} torch thread(s)",
        f"KV cache {times['cache']:.2f} s", f"recompute prefix {times['recompute']:.2f} s", f"{gain:.1f}x faster",
        f">= {target:g}x", verdict(gain >= target), "identical greedy tokens (asserted); median of "
        f"{repeats} run(s)",
    )
