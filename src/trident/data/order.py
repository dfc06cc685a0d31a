"""Training data order that a resumed run can reproduce exactly.

The order of every epoch is a pure function of ``(seed, epoch)``, never of the global random
state, and a sampler can be told to start its next pass a number of batches into the epoch:
that is all a run killed mid-epoch needs to continue with the very batch it would have drawn.
:class:`~trident.data.base.TridentDataModule` stores the position in every checkpoint.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import numpy as np
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from torch.utils.data import Sampler


@runtime_checkable
class ResumableOrder(Protocol):
    """A (batch) sampler whose epochs are reproducible and whose next pass can skip ahead."""

    def set_epoch(self, epoch: int) -> None: ...

    def skip_next(self, batches: int) -> None:
        """Start the next pass ``batches`` batches into the epoch (once; later passes start at 0)."""


class EpochShuffleSampler(Sampler[int]):
    """A new random permutation of ``range(size)`` every epoch, drawn from ``(seed, epoch)`` alone.

    Lightning calls ``set_epoch`` at the start of every epoch (as for ``DistributedSampler``).
    """

    def __init__(self, size: int, batch_size: int, seed: int) -> None:
        self.size = size
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self._skip_batches = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def skip_next(self, batches: int) -> None:
        self._skip_batches = batches

    def permutation(self, epoch: int) -> np.ndarray:
        # A private generator: drawing the order never moves the global RNG that dropout uses.
        return np.random.default_rng([self.seed, epoch]).permutation(self.size)

    def __iter__(self) -> Iterator[int]:
        # Runs on the first next(): a DataLoader builds its iterator before the pass begins.
        start, self._skip_batches = self._skip_batches * self.batch_size, 0
        yield from self.permutation(self.epoch)[start:].tolist()

    def __len__(self) -> int:
        return self.size


class DistributedOrder(DistributedSamplerWrapper):
    """One DDP rank's share of an :class:`EpochShuffleSampler`, dealt out as Lightning would deal it
    (rank r takes every ``num_replicas``-th index of the epoch's order, no reshuffling), but
    resumable: the skip applies to this rank's own share, which is what a DDP run's position counts
    (skipping in the shared order would hand each rank the other ranks' batches again)."""

    def __init__(self, order: EpochShuffleSampler, num_replicas: int, rank: int) -> None:
        super().__init__(order, num_replicas=num_replicas, rank=rank, shuffle=False)
        self.batch_size = order.batch_size
        self._skip_batches = 0

    def skip_next(self, batches: int) -> None:
        self._skip_batches = batches

    def __iter__(self) -> Iterator[int]:
        start, self._skip_batches = self._skip_batches * self.batch_size, 0
        return itertools.islice(super().__iter__(), start, None)
