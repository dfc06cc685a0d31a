"""Translation's training rate on a GPU (docs/gpu.md, "Why translation was slow in half precision"): target tokens
per second of a transformer_base step on token-budget batches of Bible-like lengths, fp32 and bf16, batches padded
to their longest (a new shape nearly every step) or in length buckets, attention by PyTorch's choice (auto: cuDNN
first on Hopper) or without cuDNN (task=translation's no_cudnn). Every rate goes into the JUnit report; the test
asserts what the fix promises: bf16 without cuDNN is faster than fp32, on either kind of batch."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from trident.backbone import TransformerConfig
from trident.data.batching import LengthBuckets, TokenBudgetBatchSampler, TranslationBatch, collate_pairs
from trident.models.seq2seq import EncoderDecoder

VOCAB, MAX_LEN, MAX_TOKENS, STEPS = 8000, 256, 8192, 30


def batches(buckets: LengthBuckets | None) -> list[TranslationBatch]:
    """STEPS + 3 batches of the GPU check's budget over 20,000 pairs of verse-like lengths (sources 5 to 120 tokens,
    targets about 10% longer)."""
    rng = np.random.default_rng(0)
    src = rng.integers(5, 121, 20_000)
    tgt = np.clip((src * rng.uniform(0.9, 1.3, src.size)).astype(int), 3, MAX_LEN - 1)
    items = [(rng.integers(3, VOCAB, n), np.concatenate(([1], rng.integers(3, VOCAB, m - 1), [2])), "", "")
             for n, m in zip(src, tgt)]
    sampler = TokenBudgetBatchSampler(src, tgt, MAX_TOKENS, seed=0, buckets=buckets)
    return [collate_pairs([items[i] for i in batch], buckets=buckets) for batch in itertools.islice(sampler, STEPS + 3)]


def target_tokens_per_second(net: EncoderDecoder, data: list[TranslationBatch], dtype: torch.dtype) -> float:
    """Steps 4 to STEPS + 3 timed (3 warm-up steps), the optimizer step included, as the Throughput callback times."""
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)

    def step(batch: TranslationBatch) -> None:
        src, tgt_in, tgt_out = (batch[key].cuda(non_blocking=True) for key in ("src", "tgt_in", "tgt_out"))
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            logits = net(src, tgt_in)
        F.cross_entropy(logits.float().flatten(0, 1), tgt_out.flatten(), ignore_index=0).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for batch in data[:3]:
        step(batch)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for batch in data[3:]:
        step(batch)
    torch.cuda.synchronize()
    return sum(int(b["tgt_out"].ne(0).sum()) for b in data[3:]) / (time.perf_counter() - start)


def test_bf16_translation_without_cudnn_outruns_fp32_on_bucketed_and_unbucketed_batches(
        record_property: Callable[[str, object], None]) -> None:
    shapes = {"unbucketed": batches(None), "bucketed": batches(LengthBuckets(16, MAX_LEN, MAX_TOKENS))}
    rates = {}
    for (kind, data), backend, dtype in itertools.product(shapes.items(), ("auto", "no_cudnn"),
                                                          (torch.float32, torch.bfloat16)):
        torch.manual_seed(0)
        cfg = TransformerConfig(d_model=512, n_heads=8, n_layers=6, d_ff=2048, max_seq_len=MAX_LEN, dropout=0.1,
                                pos_encoding="sinusoidal", sdpa_backend=backend)
        net = EncoderDecoder(cfg, VOCAB, pad_id=0).cuda().train()
        name = f"{kind} {backend} {str(dtype).removeprefix('torch.')}"
        rates[name] = target_tokens_per_second(net, data, dtype)
        record_property(name, f"{rates[name]:,.0f} target tokens/s")
    record_property("distinct shapes", {kind: len({b["src"].shape for b in data}) for kind, data in shapes.items()})
    for kind in shapes:
        assert rates[f"{kind} no_cudnn bfloat16"] > rates[f"{kind} no_cudnn float32"], rates
