"""What the pipeline expects of every trident data module, whatever the task."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from trident.data.order import DistributedOrder, EpochShuffleSampler, ResumableOrder


class TridentDataModule(L.LightningDataModule, ABC):
    """A LightningDataModule that also tells the task what it needs to build its network.

    Loader options shared by every data module: ``num_workers`` background processes prepare
    batches while the model trains; ``persistent_workers`` keeps them alive between epochs and
    validations (no restart cost); ``pin_memory`` puts batches in page-locked memory, which makes
    copies to a GPU faster and does nothing for a CPU run.

    Its ``state_dict`` (saved in every checkpoint) is the training position: epoch and batches
    already trained in it. On resume, the training loader's sampler (a :class:`ResumableOrder`)
    skips those batches, so the run continues with the batch the interrupted run would have drawn.
    """

    def __init__(self, *, num_workers: int = 0, pin_memory: bool = False, persistent_workers: bool = True) -> None:
        super().__init__()
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.persistent_workers = persistent_workers
        self._resume_position: tuple[int, int] | None = None

    def loader_options(self) -> dict[str, Any]:
        """DataLoader keyword arguments: the worker options (persistent workers need workers) and
        a private generator (validation passes do not move the global random state)."""
        return {
            "num_workers": self.num_workers,
            "pin_memory": self.pin_memory,
            "persistent_workers": self.persistent_workers and self.num_workers > 0,
            "generator": self.private_generator(),
        }

    @abstractmethod
    def task_inputs(self) -> dict[str, Any]:
        """Keyword arguments for the task module that come from the data (vocabulary size, classes...).
        Called after ``prepare_data()`` and ``setup()``."""

    @abstractmethod
    def save_to(self, run_dir: Path) -> None:
        """Write what a run needs to be read later (e.g. the tokenizer) into its directory."""

    @abstractmethod
    def split_loader(self, split: str, train: bool) -> DataLoader:
        """The DataLoader of ``split`` (train / validation / test); ``train`` shuffles with a
        :class:`ResumableOrder` sampler or batch sampler. Pass ``**self.loader_options()``: it holds
        the worker options and a private generator (a loader otherwise draws its workers' base
        seed from the global RNG on every pass)."""

    def train_order(self, size: int, batch_size: int, seed: int) -> EpochShuffleSampler | DistributedOrder:
        """The training sampler of ``size`` examples: a new order every epoch from ``(seed, epoch)``;
        under a DDP strategy, this rank's share of it (Lightning leaves a distributed sampler as it
        is, instead of wrapping the order in a sampler of its own)."""
        order = EpochShuffleSampler(size, batch_size, seed)
        trainer = self.trainer  # None outside a Trainer
        sharding = getattr(trainer.strategy, "distributed_sampler_kwargs", None) if trainer is not None else None
        if not sharding:
            return order
        return DistributedOrder(order, num_replicas=sharding["num_replicas"], rank=sharding["rank"])

    @staticmethod
    def private_generator() -> torch.Generator:
        """For a DataLoader: keeps validation passes from moving the global RNG (dropout) between a
        checkpoint and the next training step, which would make a resumed run diverge."""
        return torch.Generator().manual_seed(0)

    def state_dict(self) -> dict[str, Any]:
        trainer = self.trainer
        if trainer is None:
            return {}
        # `processed` counts the batches whose training step ran, also when the checkpoint is
        # written from on_train_batch_end (before Lightning marks the batch completed).
        done = trainer.fit_loop.epoch_loop.batch_progress.current.processed  # type: ignore[attr-defined]
        if done >= trainer.num_training_batches:  # saved after the epoch's last step: next comes a new epoch
            return {"epoch": trainer.current_epoch + 1, "batches_done": 0}
        return {"epoch": trainer.current_epoch, "batches_done": done}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            self._resume_position = (int(state_dict["epoch"]), int(state_dict["batches_done"]))

    def train_dataloader(self) -> DataLoader:
        loader = self.split_loader("train", train=True)
        if self._resume_position is not None:
            epoch, done = self._resume_position
            self._resume_position = None
            order = loader.batch_sampler if isinstance(loader.batch_sampler, ResumableOrder) else loader.sampler
            if not isinstance(order, ResumableOrder):
                raise TypeError(f"{type(self).__name__}.split_loader('train') must shuffle with a ResumableOrder sampler")
            order.set_epoch(epoch)
            order.skip_next(done)
        return loader

    def val_dataloader(self) -> DataLoader:
        return self.split_loader("validation", train=False)

    def test_dataloader(self) -> DataLoader:
        return self.split_loader("test", train=False)
