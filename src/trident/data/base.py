"""What the pipeline expects of every trident data module, whatever the task."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import lightning as L
from torch.utils.data import DataLoader


class TridentDataModule(L.LightningDataModule, ABC):
    """A LightningDataModule that also tells the task what it needs to build its network."""

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
