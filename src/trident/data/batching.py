"""Token-budget batching (fairseq's ``--max-tokens``): batches of similar-length examples, each
filled up to a budget of padded tokens, so that little compute goes to padding.

A batch of ``n`` examples costs ``n * max_len`` tokens, where ``max_len`` is the longest side
(source or target) of any of its examples: the size of the larger padded tensor, padding
included. Examples are sorted by length (ties broken at random each epoch), cut greedily into
batches that stay within the budget, and the batch order is shuffled each epoch.
:func:`collate_pairs` pads a batch of sentence pairs into tensors.

With :class:`LengthBuckets` the batches take few shapes: both sides of a batch are padded to one length, its
longest side rounded up to a multiple (a bucket), and its rows to the bucket's batch size, budget // length, with
filler rows (a real row's source, no target: they add nothing to the loss). A batch's shape then follows from its
bucket alone, so an epoch holds at most one shape per bucket, which a compiled network or a per-shape attention
plan (cuDNN's) builds once instead of every step (docs/gpu.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TypedDict

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Sampler

from trident.errors import ConfigError


@dataclass(frozen=True)
class LengthBuckets:
    """Padded lengths in steps of ``multiple`` up to ``longest`` (the positional table's length), and each bucket's
    batch size under the token budget ``max_tokens`` (at most ``max_sentences``)."""

    multiple: int
    longest: int
    max_tokens: int
    max_sentences: int | None = None

    @classmethod
    def of(cls, multiple: int | None, longest: int, max_tokens: int) -> LengthBuckets | None:
        """``data.length_multiple``'s buckets, or None for ``null`` (each batch padded to its longest sentence)."""
        if multiple is None:
            return None
        if not (isinstance(multiple, int) and not isinstance(multiple, bool) and multiple > 0):
            raise ConfigError(f"data.length_multiple must be a positive number of tokens or null, got {multiple!r}: "
                              "set e.g. data.length_multiple=16, or null to pad each batch to its longest sentence")
        return cls(multiple, longest, max_tokens)

    def length(self, longest_side: int) -> int:
        """The padded length of a batch whose longest side is ``longest_side`` tokens."""
        return min(-(-longest_side // self.multiple) * self.multiple, self.longest)

    def rows(self, length: int) -> int:
        """The batch size of the bucket of padded ``length``: as many rows as the budget holds."""
        rows = max(1, self.max_tokens // length)
        return rows if self.max_sentences is None else min(rows, self.max_sentences)


class TokenBudgetBatchSampler(Sampler[list[int]]):
    """Yields lists of example indices; pass it as ``DataLoader(batch_sampler=...)``.

    With ``num_replicas > 1`` (DDP) every rank builds the same global list of batches (same
    seed and epoch) and takes every ``num_replicas``-th batch starting at ``rank``: the ranks
    see disjoint batches that together cover each example exactly once per epoch. The global
    number of batches is made divisible by ``num_replicas`` (by halving the fullest batches),
    so that every rank runs the same number of steps, as DDP requires.

    With ``buckets`` each example costs its bucket's length, and a batch holds at most its bucket's rows
    (:class:`LengthBuckets`): examples are taken in order of bucket (then of length) and a bucket's last few,
    too few for a batch, go on into the next bucket's first batch, padded to its length, so that an epoch has few
    batches short of their rows (:func:`collate_pairs` fills those up).

    The epoch advances by itself at the start of every pass; ``set_epoch`` sets it explicitly.
    ``shuffle=False`` yields batches in length order; ``reshuffle_each_epoch=False`` shuffles once
    (the same random order every pass), so that a limited number of evaluation batches is the same
    representative subset at every validation.
    """

    def __init__(
        self,
        src_lengths: Sequence[int] | np.ndarray,
        tgt_lengths: Sequence[int] | np.ndarray,
        max_tokens: int,
        *,
        shuffle: bool = True,
        reshuffle_each_epoch: bool = True,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
        max_sentences: int | None = None,
        buckets: LengthBuckets | None = None,
    ) -> None:
        self.src_lengths = np.asarray(src_lengths, dtype=np.int64)
        self.tgt_lengths = np.asarray(tgt_lengths, dtype=np.int64)
        if self.src_lengths.shape != self.tgt_lengths.shape or self.src_lengths.ndim != 1:
            raise ValueError("src_lengths and tgt_lengths must be 1-D and of the same length")
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, num_replicas={num_replicas})")
        self.lengths = np.maximum(self.src_lengths, self.tgt_lengths)  # (N,) padded cost per example
        self.buckets = buckets
        if buckets is not None:  # (N,) the padded length of each example's bucket
            self.lengths = np.array([buckets.length(int(n)) for n in self.lengths], dtype=np.int64)
        too_long = np.flatnonzero(self.lengths > max_tokens)
        if too_long.size:
            raise ValueError(
                f"{too_long.size} examples are longer than the token budget max_tokens={max_tokens} "
                f"(longest: {int(self.lengths.max())}); filter or truncate them first"
            )
        self.max_tokens = max_tokens
        self.max_sentences = max_sentences
        self.shuffle = shuffle
        self.reshuffle_each_epoch = reshuffle_each_epoch
        self.seed = seed
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self._skip_batches = 0
        # The batch boundaries depend only on the sorted sequence of lengths, not on how ties
        # are broken, so the number of batches is the same every epoch: compute it once.
        self._num_batches = len(self.global_batches(0))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def skip_next(self, batches: int) -> None:
        """Start the next pass ``batches`` of this rank's batches into the epoch (resuming mid-epoch)."""
        self._skip_batches = batches

    def global_batches(self, epoch: int) -> list[list[int]]:
        """All batches of one epoch, for every rank (the rank's share is every num_replicas-th)."""
        rng = np.random.default_rng([self.seed, epoch if self.reshuffle_each_epoch else 0])
        # Random tie-breaking (shuffle, then a stable sort) varies batch contents between epochs.
        order = rng.permutation(len(self.lengths)) if self.shuffle else np.arange(len(self.lengths))
        # Sort by padded length, then source, then target length: neighbours pad each other least.
        keys = (self.tgt_lengths[order], self.src_lengths[order], self.lengths[order])
        order = order[np.lexsort(keys)]  # lexsort: the last key is the primary one
        batches = self._fill(order)
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        return _make_divisible(batches, self.num_replicas)

    def _fill(self, order: np.ndarray) -> list[list[int]]:
        if self.buckets is not None:
            return self._fill_buckets(order, self.buckets)
        batches: list[list[int]] = []
        batch: list[int] = []
        batch_max = 0
        for index in order.tolist():
            length = int(self.lengths[index])
            new_max = max(batch_max, length)
            full = (len(batch) + 1) * new_max > self.max_tokens
            if batch and (full or (self.max_sentences is not None and len(batch) >= self.max_sentences)):
                batches.append(batch)
                batch, new_max = [], length
            batch.append(index)
            batch_max = new_max
        if batch:
            batches.append(batch)
        return batches

    def _fill_buckets(self, order: np.ndarray, buckets: LengthBuckets) -> list[list[int]]:
        """Batches of their bucket's rows, ``order`` sorted by bucket; a bucket's remainder leads the next bucket's
        first batch where it fits in that batch's rows, else it is a batch of its own (filled up when collated)."""
        batches: list[list[int]] = []
        batch: list[int] = []
        for index in order.tolist():
            rows = buckets.rows(int(self.lengths[index]))
            if len(batch) >= rows:  # the remainder of a shorter bucket, too many for this bucket's rows
                batches.append(batch)
                batch = []
            batch.append(index)
            if len(batch) == rows:
                batches.append(batch)
                batch = []
        if batch:
            batches.append(batch)
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        epoch, skip = self.epoch, self._skip_batches
        self.epoch, self._skip_batches = epoch + 1, 0  # runs on the first next(), so an unused iterator does not count
        yield from self.global_batches(epoch)[self.rank :: self.num_replicas][skip:]

    def __len__(self) -> int:
        return self._num_batches // self.num_replicas + int(self.rank < self._num_batches % self.num_replicas)

    def padded_tokens(self, batch: list[int]) -> int:
        """The budget a batch uses: its size times its longest side."""
        return len(batch) * int(self.lengths[batch].max())


def _make_divisible(batches: list[list[int]], num_replicas: int) -> list[list[int]]:
    """Halve the fullest batches until every rank gets the same number (halves stay in budget).
    Impossible only when there are fewer examples than ranks; then the counts stay uneven."""
    batches = list(batches)
    while len(batches) % num_replicas:
        fullest = max(range(len(batches)), key=lambda i: len(batches[i]))
        batch = batches[fullest]
        if len(batch) < 2:
            break
        half = len(batch) // 2
        batches[fullest : fullest + 1] = [batch[:half], batch[half:]]
    return batches


class TranslationBatch(TypedDict):
    src: Tensor  # (B, S) source ids ending in EOS, right-padded with PAD
    tgt_in: Tensor  # (B, T) BOS + target ids: the decoder input
    tgt_out: Tensor  # (B, T) target ids + EOS: what the decoder must predict
    src_text: list[str]  # raw text, for BLEU references and example tables
    tgt_text: list[str]


def collate_pairs(items: list[tuple[np.ndarray, np.ndarray, str, str]], pad_id: int = 0,
                  buckets: LengthBuckets | None = None) -> TranslationBatch:
    """Right-padded tensors of a batch of pairs; with ``buckets`` both sides padded to the batch's bucket length
    (S = T) and filler rows up to its rows: the first pair's source, a target of padding only (no loss, no tokens
    counted: :meth:`TranslationTask.throughput_units` counts the rows with a target)."""
    src_rows, tgt_rows = [item[0] for item in items], [item[1] for item in items]
    src_width, tgt_width = max(len(r) for r in src_rows), max(len(r) for r in tgt_rows)
    rows = len(items)
    if buckets is not None:
        length = buckets.length(max(src_width, tgt_width - 1))  # tgt_width - 1: the decoder's side, BOS or EOS off
        src_width, tgt_width, rows = length, length + 1, buckets.rows(length)

    def pad(sequences: list[np.ndarray], width: int) -> Tensor:
        out = torch.full((rows, width), pad_id, dtype=torch.long)
        for i, row in enumerate(sequences):
            out[i, : len(row)] = torch.from_numpy(row.astype(np.int64))
        return out

    src = pad(src_rows + [src_rows[0]] * (rows - len(items)), src_width)  # (B, S)
    tgt = pad(tgt_rows, tgt_width)  # (B, T + 1): filler rows all padding
    return {"src": src, "tgt_in": tgt[:, :-1], "tgt_out": tgt[:, 1:],
            "src_text": [item[2] for item in items], "tgt_text": [item[3] for item in items]}
