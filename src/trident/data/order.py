"""Training data order that a resumed run can reproduce exactly.

The order of every epoch is a pure function of ``(seed, epoch)``, never of the global random
state, and a sampler can be told to start its next pass a number of batches into the epoch:
that is all a run killed mid-epoch needs to continue with the very batch it would have drawn.
:class:`~trident.data.base.TridentDataModule` stores the position in every checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import numpy as np
from torch.utils.data import DistributedSampler


@runtime_checkable
class ResumableOrder(Protocol):
    """A (batch) sampler whose epochs are reproducible and whose next pass can skip ahead."""

    def set_epoch(self, epoch: int) -> None: ...

    def skip_next(self, batches: int) -> None:
        """Start the next pass ``batches`` batches into the epoch (once; later passes start at 0)."""


class EpochShuffleSampler(DistributedSampler):
    """A new random permutation of ``range(size)`` every epoch, drawn from ``(seed, epoch)`` alone.

    Under DDP, rank ``r`` of ``num_replicas`` takes positions ``r, r + num_replicas, ...`` of it,
    after dropping the tail that does not divide evenly: every rank runs the same number of steps,
    and batch ``k`` of all ranks together is batch ``k`` of one process with their summed batch
    size. Being a ``DistributedSampler`` already, Lightning uses it as it is; it would otherwise
    wrap it in a second sharding with its own shuffle, which also ignores :meth:`skip_next`.
    Lightning calls ``set_epoch`` at the start of every epoch.
    """

    def __init__(self, size: int, batch_size: int, seed: int, num_replicas: int = 1, rank: int = 0) -> None:
        super().__init__(range(size), num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.size = size
        self.batch_size = batch_size
        self._skip_batches = 0

    def skip_next(self, batches: int) -> None:
        self._skip_batches = batches

    def permutation(self, epoch: int) -> np.ndarray:
        # A private generator: drawing the order never moves the global RNG that dropout uses.
        return np.random.default_rng([self.seed, epoch]).permutation(self.size)

    def __iter__(self) -> Iterator[int]:
        # Runs on the first next(): a DataLoader builds its iterator before the pass begins.
        start, self._skip_batches = self._skip_batches * self.batch_size, 0
        share = self.permutation(self.epoch)[: self.total_size][self.rank :: self.num_replicas]
        # In slices: one Python int per example of a large corpus would take gigabytes.
        for offset in range(start, len(share), 1 << 16):
            yield from share[offset : offset + (1 << 16)].tolist()
