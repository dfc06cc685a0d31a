"""``--only loss_chunk``: the cross-entropy over a GPT-2 vocabulary (50,304) on whole logits against the chunked one
(``task.loss_chunk``, trident.training.chunked_loss): peak memory and the time of the head, the loss and their
backward.

Peak memory is read in a fresh child process per variant (``python -m trident.bench.chunked_loss <chunk>``): its peak
RSS (``VmHWM``) after one loss and backward, minus its RSS once the inputs exist. Tensors of this size are mmap'ed by
the allocator and returned when freed, so the high-water mark is the most bytes the variant held at once (the CPU
build of torch has no allocator statistics); a process per variant keeps one variant's peak from hiding another's.
Times are taken in this process, the variants in turns.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from trident.backbone import VocabularyHead
from trident.bench.memory import peak_rss_bytes
from trident.bench.results import Row, Settings, milliseconds, verdict
from trident.bench.timing import Budget, interleaved, synchronize
from trident.training.chunked_loss import DEFAULT_LOSS_CHUNK, chunked_cross_entropy

VOCAB, WIDTH, TOKENS = 50_304, 768, 4_096  # GPT-2 small's head; 8 rows of 512 tokens
QUICK = (1_000, 64, 256)
CHUNKS = (0, DEFAULT_LOSS_CHUNK, 256)  # 0: the plain loss on whole logits
MIB = 2**20
# The default chunk holds at most half the plain loss's peak at 4,096 tokens (four chunks) and is no slower.
PEAK_TARGET, SPEED_TARGET = 0.5, 0.95


def shape(quick: bool) -> tuple[int, int, int]:
    return QUICK if quick else (VOCAB, WIDTH, TOKENS)


def loss_and_backward(chunk: int, quick: bool, device: torch.device) -> Callable[[], None]:
    """One forward and backward of the head and its loss (the hidden states and the head's weight get gradients)."""
    vocab, width, tokens = shape(quick)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, width, generator=generator).to(device).requires_grad_()
    head = nn.Linear(width, vocab, bias=False).to(device)
    targets = torch.randint(0, vocab, (tokens,), generator=generator).to(device)

    def run() -> None:
        if chunk:
            loss = chunked_cross_entropy(VocabularyHead(hidden, head, chunk=chunk), targets, ignore_index=-100)[0]
        else:  # trident.objectives.tokens.NextToken's plain loss
            loss = F.cross_entropy(head(hidden).float(), targets, reduction="sum")
        loss.backward()
        hidden.grad, head.weight.grad = None, None
        synchronize(device)

    return run


def child_peak(chunk: int, quick: bool) -> dict[str, float]:
    """``{"inputs_mib", "peak_mib"}`` of a fresh process running ``chunk``'s loss and backward once."""
    command = [sys.executable, "-m", "trident.bench.chunked_loss", str(chunk), *(["--quick"] if quick else [])]
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    done = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> None:
    """The child process: prints its RSS once the inputs exist and its peak after one loss and backward."""
    chunk, quick = int(argv[0]), "--quick" in argv[1:]
    run = loss_and_backward(chunk, quick, torch.device("cpu"))
    inputs = peak_rss_bytes() / MIB
    run()
    print(json.dumps({"inputs_mib": inputs, "peak_mib": peak_rss_bytes() / MIB}))


def label(chunk: int) -> str:
    return "whole logits (task.loss_chunk=0)" if chunk == 0 else f"task.loss_chunk={chunk}"


def loss_chunk_rows(settings: Settings) -> list[Row]:
    chunks = CHUNKS[:2] if settings.quick else CHUNKS  # a smoke test: one child process less
    # Peak RSS is the memory of a CPU run (on a GPU the tensors live in device memory).
    peaks = {chunk: child_peak(chunk, settings.quick) for chunk in chunks} if settings.device.type == "cpu" else {}
    seconds = interleaved({str(chunk): loss_and_backward(chunk, settings.quick, settings.device) for chunk in chunks},
                          Budget(settings.warmup, settings.repeats))
    vocab, width, tokens = shape(settings.quick)

    def held(chunk: int) -> float:  # MiB the loss and backward added to the inputs at their peak
        return peaks[chunk]["peak_mib"] - peaks[chunk]["inputs_mib"]

    def summary(chunk: int) -> str:
        memory = f"peak +{held(chunk):,.0f} MiB" if peaks else "peak: CPU only"
        return f"{memory}; {milliseconds(seconds[str(chunk)])}"

    rows = []
    for chunk in chunks[1:]:
        checked = chunk == DEFAULT_LOSS_CHUNK
        share = held(chunk) / held(0) if peaks else None
        speed = seconds["0"] / seconds[str(chunk)]
        met = (share is not None and share <= PEAK_TARGET) and speed >= SPEED_TARGET
        rows.append(Row(
            "loss_chunk", f"cross-entropy at a vocabulary of {vocab:,} for {tokens:,} tokens (width {width}): head "
                          f"matmul, loss and backward, {label(chunk)}",
            summary(chunk), f"{label(0)}: {summary(0)}",
            (f"{share:.2f}x the peak memory; " if share is not None else "") + f"{speed:.2f}x the speed",
            f"<= {PEAK_TARGET}x the peak, >= {SPEED_TARGET}x the speed" if checked else "-",
            verdict(met) if checked else "-",
            f"peak: the VmHWM of a fresh child process per variant after one loss and backward, less its RSS once the "
            f"inputs exist (plain: {peaks[0]['inputs_mib']:,.0f} MiB); times in this process, variants in turns, "
            f"median of {settings.repeats}; fp32, {torch.get_num_threads()} torch threads" if peaks
            else "peak memory measured on CPU runs only",
        ))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
