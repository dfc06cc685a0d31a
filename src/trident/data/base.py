"""What the pipeline expects of every trident data module, whatever the task."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import lightning as L
from torch.utils.data import DataLoader


class TridentDataModule(L.LightningDataModule, ABC):
    """A LightningDataModule that also tells the task what it needs to build its network.

    Loader options shared by every data module: ``num_workers`` background processes prepare
    batches while the model trains; ``persistent_workers`` keeps them alive between epochs and
    validations (no restart cost); ``pin_memory`` puts batches in page-locked memory, which makes
    copies to a GPU faster and does nothing for a CPU run.
    """

    def __init__(self, *, num_workers: int = 0, pin_memory: bool = False, persistent_workers: bool = True) -> None:
        super().__init__()
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.persistent_workers = persistent_workers

    def loader_options(self) -> dict[str, Any]:
        """DataLoader keyword arguments for the worker options (persistent workers need workers)."""
        return {
            "num_workers": self.num_workers,
            "pin_memory": self.pin_memory,
            "persistent_workers": self.persistent_workers and self.num_workers > 0,
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
        """The DataLoader of ``split`` (train / validation / test); ``train`` shuffles."""

    def train_dataloader(self) -> DataLoader:
        return self.split_loader("train", train=True)

    def val_dataloader(self) -> DataLoader:
        return self.split_loader("validation", train=False)

    def test_dataloader(self) -> DataLoader:
        return self.split_loader("test", train=False)
