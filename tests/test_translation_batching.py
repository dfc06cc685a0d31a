"""Token-budget batching: within budget, every example exactly once per epoch, also split over DDP ranks."""

from __future__ import annotations

import numpy as np
import pytest

from trident.data.batching import TokenBudgetBatchSampler

# Tiny tensors: intra-op threads only contend for the shared cores.
pytestmark = pytest.mark.usefixtures("single_thread")


def lengths(n: int = 1500, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    src = rng.integers(1, 120, n)
    tgt = np.clip(src + rng.integers(-10, 11, n), 1, 130)  # targets about as long as their sources
    return src, tgt


def test_batches_stay_within_budget_and_cover_every_example_once() -> None:
    src, tgt = lengths()
    sampler = TokenBudgetBatchSampler(src, tgt, max_tokens=1000, seed=3)
    for _ in range(3):  # three epochs
        batches = list(sampler)
        assert len(batches) == len(sampler)
        assert all(sampler.padded_tokens(b) <= 1000 for b in batches)
        assert all(len(b) * max(max(src[b]), max(tgt[b])) <= 1000 for b in batches)
        flat = [i for b in batches for i in b]
        assert sorted(flat) == list(range(len(src)))
    # Length bucketing keeps padding small: compare real tokens with the padded budget used.
    used = sum(sampler.padded_tokens(b) for b in batches)
    real = sum(int(np.maximum(src, tgt)[b].sum()) for b in batches)
    assert real / used > 0.9


def test_each_epoch_has_a_new_order_and_a_seed_repeats_it() -> None:
    src, tgt = lengths()
    sampler = TokenBudgetBatchSampler(src, tgt, max_tokens=1000, seed=3)
    first, second = list(sampler), list(sampler)
    assert first != second
    again = TokenBudgetBatchSampler(src, tgt, max_tokens=1000, seed=3)
    assert list(again) == first
    again.set_epoch(1)
    assert list(again) == second


def test_fixed_order_for_evaluation() -> None:
    src, tgt = lengths()
    sampler = TokenBudgetBatchSampler(src, tgt, max_tokens=1000, reshuffle_each_epoch=False)
    first = list(sampler)
    assert list(sampler) == first
    # Shuffled once: the first batches are not simply the shortest examples.
    assert max(int(np.maximum(src, tgt)[b].max()) for b in first[:3]) > 30
    ordered = list(TokenBudgetBatchSampler(src, tgt, max_tokens=1000, shuffle=False))
    maxima = [int(np.maximum(src, tgt)[b].max()) for b in ordered]
    assert maxima == sorted(maxima)


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_ranks_get_disjoint_complete_equal_shares(world_size: int) -> None:
    src, tgt = lengths(n=997)
    for epoch in range(2):
        shares = []
        for rank in range(world_size):
            sampler = TokenBudgetBatchSampler(src, tgt, max_tokens=700, seed=5, num_replicas=world_size, rank=rank)
            sampler.set_epoch(epoch)
            shares.append(list(sampler))
            assert len(shares[-1]) == len(sampler)
        assert len({len(s) for s in shares}) == 1, "every rank runs the same number of steps"
        indices = [i for share in shares for batch in share for i in batch]
        assert len(indices) == len(set(indices)) == len(src), "disjoint, and together complete"
        assert all(len(b) * max(max(src[b]), max(tgt[b])) <= 700 for share in shares for b in share)


def test_max_sentences_caps_batch_size() -> None:
    src, tgt = lengths()
    batches = list(TokenBudgetBatchSampler(src, tgt, max_tokens=100_000, max_sentences=64))
    assert max(len(b) for b in batches) == 64


def test_example_longer_than_the_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="longer than the token budget max_tokens=50"):
        TokenBudgetBatchSampler([10, 60], [10, 20], max_tokens=50)
