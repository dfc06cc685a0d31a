"""What the pipeline expects of every trident data module, whatever the task."""

from __future__ import annotations

import functools
import json
import logging
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.seed import pl_worker_init_function
from tokenizers import Tokenizer
from torch.utils.data import DataLoader

from trident.data.order import ResumableOrder
from trident.data.readers import SPLITS


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
        """DataLoader keyword arguments: the worker options (persistent workers need workers), a
        private generator (validation passes do not move the global random state), and the workers'
        seeding by the data-parallel rank: Lightning's own would take the global rank, and the ranks of
        one tensor-parallel group, sharing each batch, would augment it differently."""
        return {
            "num_workers": self.num_workers,
            "pin_memory": self.pin_memory,
            "persistent_workers": self.persistent_workers and self.num_workers > 0,
            "generator": self.private_generator(),
            "worker_init_fn": functools.partial(pl_worker_init_function, rank=self.shard()["rank"]),
        }

    @abstractmethod
    def task_inputs(self) -> dict[str, Any]:
        """Keyword arguments for the task module that come from the data (vocabulary size, classes...).
        Called after ``prepare_data()`` and ``setup()``."""

    def tokenizer_settings(self) -> dict[str, str]:
        """Settings of how the data renders text that the run keeps beside its tokenizer (the task's
        ``tokenizer_settings``: checkpoints, the Hugging Face export); ``data=chat`` records its chat template."""
        return {}

    @abstractmethod
    def save_to(self, run_dir: Path) -> None:
        """Write what a run needs to be read later (e.g. the tokenizer) into its directory."""

    @abstractmethod
    def split_loader(self, split: str, train: bool) -> DataLoader:
        """The DataLoader of ``split`` (train / validation / test); ``train`` shuffles with a
        :class:`ResumableOrder` sampler or batch sampler. Pass ``**self.loader_options()``: it holds
        the worker options and a private generator (a loader otherwise draws its workers' base
        seed from the global RNG on every pass)."""

    def shard(self) -> dict[str, int]:
        """``num_replicas`` and ``rank`` of the trainer this module feeds (one process outside
        DDP), for a sampler that deals the training data out by rank itself. They are the data-parallel ones:
        the ranks of one tensor-parallel group (trainer.strategy.tensor_parallel_size) share each batch."""
        shard = self.trainer.distributed_sampler_kwargs if self.trainer is not None else None
        if shard is None:
            return {"num_replicas": 1, "rank": 0}
        return {"num_replicas": shard["num_replicas"], "rank": shard["rank"]}

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


class TextDataModule(TridentDataModule):
    """A data module of text prepared once into ``cache_path`` (:func:`trident.data.cache.publish_cache`):
    its tokenizer (``tokenizer.json``) and ``meta.json`` (where each split came from, ``origin``)
    beside the splits, which :meth:`load_splits` reads. A subclass sets both attributes in its ``__init__``."""

    cache_path: Path
    tokenizer: Tokenizer | None  # None until setup()

    def setup(self, stage: str | None = None) -> None:
        if self.tokenizer is not None:
            return
        self.tokenizer = Tokenizer.from_file(str(self.cache_path / "tokenizer.json"))
        meta = json.loads((self.cache_path / "meta.json").read_text())
        sizes = self.load_splits(meta)
        # Said on every run, cache hit or not, by the data module's own logger: where each split came from.
        logging.getLogger(type(self).__module__).info(
            "data: %s", "; ".join(f"{split} {meta['origin'][split]} ({sizes[split]})" for split in SPLITS)
        )

    @abstractmethod
    def load_splits(self, meta: dict[str, Any]) -> dict[str, str]:
        """Read the prepared splits (the tokenizer is read); each split's size for the log ("8,000 tokens")."""

    def save_to(self, run_dir: Path) -> None:
        """Keep the tokenizer with the run, so the run directory alone can decode its outputs."""
        if self.tokenizer is not None:
            self.tokenizer.save(str(run_dir / "tokenizer.json"))
