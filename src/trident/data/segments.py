"""Contiguous segments (``data.contiguous``): the order a model with a memory (``model.memory_length``) reads.

Transformer-XL's batchify: the split's token stream is cut into ``ranks * rows`` contiguous streams of equal length,
rank r reading streams r * rows .. (r + 1) * rows - 1 as the rows of its batches, so that row b of batch j + 1 is the
segment that follows row b of batch j in the text. The order is the same every epoch (nothing is shuffled); the
tokens after the last whole segment of each stream are not read.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset, DistributedSampler

from trident.errors import DataError


class ContiguousSegments(Dataset[tuple[Tensor, Tensor]]):
    """Example ``j * streams + s``: segment j of stream s, ``block_size`` inputs and their next-token targets."""

    def __init__(self, ids: np.ndarray, block_size: int, streams: int) -> None:
        self.ids = ids
        self.block_size = block_size
        self.streams = streams
        self.stride = (len(ids) - 1) // streams  # tokens per stream (the last target may be the next stream's first)
        self.segments = self.stride // block_size  # per stream

    def __len__(self) -> int:
        return self.segments * self.streams

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        segment, stream = divmod(index, self.streams)
        start = stream * self.stride + segment * self.block_size
        window = torch.from_numpy(self.ids[start : start + self.block_size + 1].astype(np.int64))
        return window[:-1], window[1:]  # (T,), (T,)


class ContiguousOrder(DistributedSampler):
    """Rank ``rank``'s rows of :class:`ContiguousSegments`, batch after batch: its ``rows`` streams, segment 0 of each,
    then segment 1, ... A DataLoader batching them by ``rows`` gives each batch row its own stream. A
    ``DistributedSampler`` already, so Lightning keeps it (its own would deal examples out round-robin); ``set_epoch``
    changes nothing, :meth:`skip_next` resumes mid-epoch (a :class:`trident.data.order.ResumableOrder`)."""

    def __init__(self, segments: ContiguousSegments, rows: int, num_replicas: int = 1, rank: int = 0) -> None:
        super().__init__(segments, num_replicas=num_replicas, rank=rank, shuffle=False)
        self.segments, self.rows = segments, rows
        self._skip_batches = 0

    def skip_next(self, batches: int) -> None:
        self._skip_batches = batches

    def __len__(self) -> int:
        return self.segments.segments * self.rows

    def __iter__(self) -> Iterator[int]:
        start, self._skip_batches = self._skip_batches, 0
        first = self.rank * self.rows
        for segment in range(start, self.segments.segments):
            base = segment * self.segments.streams + first
            yield from range(base, base + self.rows)


def contiguous_segments(ids: np.ndarray, block_size: int, rows: int, ranks: int, split: str,
                        train: bool) -> tuple[ContiguousSegments, int]:
    """The segments of ``split`` for ``ranks`` ranks of ``rows`` rows each, and the rows: training wants every row it
    was given; evaluation takes fewer streams where a split is too short for ``rows`` per rank."""
    whole = (len(ids) - 1) // block_size  # segments the split holds
    if train and whole < rows * ranks:
        raise DataError(f"the train split holds {whole} segments of data.block_size={block_size}, fewer than "
                        f"{ranks * rows} contiguous streams (data.batch_size={rows} on {ranks} rank(s)) of one segment: "
                        "lower data.batch_size or data.block_size, or use a larger corpus")
    rows = min(rows, whole // ranks)
    if rows == 0:
        raise DataError(f"the {split} split holds {whole} segments of data.block_size={block_size}, fewer than one per "
                        f"rank ({ranks}): lower data.block_size or use a larger corpus")
    return ContiguousSegments(ids, block_size, rows * ranks), rows
