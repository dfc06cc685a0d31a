"""Token-budget batching: within budget, every example exactly once per epoch, also split over DDP ranks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trident.data.batching import LengthBuckets, TokenBudgetBatchSampler, collate_pairs
from trident.data.translation import TranslationDataModule
from trident.errors import ConfigError
from trident.models.seq2seq import EncoderDecoder

from .backbone_helpers import make_cfg

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


def test_length_buckets_give_each_bucket_one_shape_and_every_example_once_over_ddp_ranks() -> None:
    """Sampler and collate alone, with DDP's halved batches: still one (rows, length) per bucket."""
    src, tgt = lengths(n=997)
    buckets = LengthBuckets(multiple=16, longest=130, max_tokens=700)
    items = [(np.arange(1, n + 1), np.arange(1, m + 2), "", "") for n, m in zip(src, tgt)]  # ids: 1..n, BOS..EOS
    for world_size in (1, 2):
        samplers = [TokenBudgetBatchSampler(src, tgt, max_tokens=700, seed=5, num_replicas=world_size, rank=rank,
                                            buckets=buckets) for rank in range(world_size)]
        shares = [list(sampler) for sampler in samplers]
        assert len({len(share) for share in shares}) == 1
        indices = [i for share in shares for batch in share for i in batch]
        assert sorted(indices) == list(range(len(src)))
        shapes = {collate_pairs([items[i] for i in batch], buckets=buckets)["src"].shape
                  for share in shares for batch in share}
        assert len(shapes) <= len(range(16, 130 + 15, 16)), f"{len(shapes)} shapes for 9 buckets"
        assert all(rows * length <= 700 for rows, length in shapes)


def test_buckets_refuse_a_multiple_that_is_not_a_positive_number() -> None:
    with pytest.raises(ConfigError, match="data.length_multiple must be a positive number of tokens or null, got 0"):
        TranslationDataModule(length_multiple=0)


def test_bucketed_epoch_takes_few_shapes_drops_no_token_and_leaves_the_loss_unchanged(tmp_path: Path) -> None:
    """Through the data module: an epoch of data.length_multiple=8 batches has at most max_len / 8 shapes (batch,
    source, target), every training pair's tokens exactly once, and the summed NLL and its token count of each padded
    batch (filler rows included) equal those of the same pairs padded to their longest (float64)."""
    path = tmp_path / "pairs.tsv"
    path.write_text("".join(f"{'word ' * (1 + i % 23)}{i}\t{'Wort ' * (1 + (i * 7) % 29)}{i}\n" for i in range(400)))
    options = {"source": "files", "files": str(path), "vocab_size": 300, "max_len": 48, "max_tokens": 400,
               "split": [0.9, 0.05, 0.05], "cache_dir": str(tmp_path / "cache")}
    module = TranslationDataModule(**options, length_multiple=8)
    module.prepare_data()
    module.setup()
    batches = list(module.train_dataloader())
    shapes = {(*b["src"].shape, b["tgt_in"].size(1)) for b in batches}
    assert len(shapes) <= 48 // 8 < len(batches), shapes
    assert all(rows * length <= 400 for rows, length, _ in shapes)
    real_rows = [(tuple(s[s != 0].tolist()), tuple(t[t != 0].tolist()))
                 for b in batches for s, t, keep in zip(b["src"], b["tgt_out"], b["tgt_out"].ne(0).any(1)) if keep]
    dataset = module.datasets["train"]
    expected = [(tuple(s.tolist()), tuple(t[1:].tolist())) for s, t in zip(dataset.src_ids, dataset.tgt_ids)]
    assert sorted(real_rows) == sorted(expected), "every pair's tokens once, no token dropped"

    torch.manual_seed(0)
    net = EncoderDecoder(make_cfg(max_seq_len=48), module.task_inputs()["vocab_size"], pad_id=0).double().eval()
    assert any(not bool(b["tgt_out"].ne(0).any(1).all()) for b in batches), "filler rows tested too"
    for batch in batches:
        keep = batch["tgt_out"].ne(0).any(1)
        items = [(s[s != 0].numpy(), np.concatenate(([1], t[t != 0].numpy())), "", "")
                 for s, t in zip(batch["src"][keep], batch["tgt_out"][keep])]
        unpadded = collate_pairs(items)
        with torch.no_grad():
            losses = [F.cross_entropy(net(b["src"], b["tgt_in"]).flatten(0, 1), b["tgt_out"].flatten(),
                                      ignore_index=0, reduction="sum") for b in (batch, unpadded)]
        assert batch["tgt_out"].ne(0).sum() == unpadded["tgt_out"].ne(0).sum()
        assert losses[0].item() == pytest.approx(losses[1].item(), rel=1e-9)


@pytest.mark.parametrize("decoder_start", [None, 2])
def test_filler_rows_train_nothing_whatever_the_decoder_starts_from(tmp_path: Path, decoder_start: int | None) -> None:
    """Through compose and the pipeline's task: each bucketed training batch's loss, its trained-token count (the
    global-batch mean's denominator) and its gradients equal those of its real pairs alone, padded to their longest
    (float64 network; the objective's cross-entropy runs in float32); with a decoder start (BART's task.decoder_start_id) the decoder predicts <s> first, but a filler row,
    which has no target, must not train that <s>."""
    from trident.objectives import TRAIN
    from trident.runs.pipeline import build_data_and_task, check_config

    from .conftest import compose_config

    path = tmp_path / "pairs.tsv"
    path.write_text("".join(f"{'word ' * (1 + i % 13)}{i}\t{'Wort ' * (1 + (i * 7) % 17)}{i}\n" for i in range(200)))
    cfg = compose_config(["task=translation", "model=nano", "data=parallel_files", f"data.files={path}", "data.max_len=32",
                          "data.max_tokens=256", "data.length_multiple=8", "data.vocab_size=300", "model.dropout=0.0", "data.max_seq_len=33",
                          f"data.cache_dir={tmp_path / 'cache'}", f"task.decoder_start_id={decoder_start or 'null'}"],
                         output_dir=tmp_path / "run")
    datamodule, task = build_data_and_task(cfg, check_config(cfg), "fit")
    task.double()
    batches = [b for b in datamodule.train_dataloader() if not bool(b["tgt_out"].ne(0).any(1).all())][:3]
    assert batches, "batches with filler rows"
    for batch in batches:
        keep = batch["tgt_out"].ne(0).any(1)
        items = [(s[s != 0].numpy(), np.concatenate(([t_in[0].item()], t[t != 0].numpy())), "", "")
                 for s, t_in, t in zip(batch["src"][keep], batch["tgt_in"][keep], batch["tgt_out"][keep])]
        results = []
        for case in (batch, collate_pairs(items)):
            task.zero_grad()
            loss, _ = task.objective(task, case, TRAIN)
            loss.summed.backward()
            results.append((float(loss.summed), int(loss.count), [p.grad.clone() for p in task.net.parameters()]))
        (bucketed, bucketed_count, bucketed_grads), (plain, plain_count, plain_grads) = results
        assert bucketed_count == plain_count
        assert bucketed == pytest.approx(plain, rel=1e-5)
        for got, expected in zip(bucketed_grads, plain_grads):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-7)
