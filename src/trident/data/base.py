"""What the pipeline expects of every trident data module, whatever the task."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import lightning as L
import torch
from filelock import FileLock
from lightning.fabric.utilities.seed import pl_worker_init_function
from tokenizers import Tokenizer
from torch.utils.data import DataLoader, Dataset

from trident.data.order import EpochShuffleSampler, ResumableOrder
from trident.data.readers import SPLITS
from trident.errors import ConfigError

if TYPE_CHECKING:  # Hydra's config, imported where a run is configured, not where a checkpoint loads
    from omegaconf import DictConfig

    from trident.data.chat_template import ChatTemplate


class WeightsSource(Protocol):
    """What an ``init_from`` source states (trident.weights.pretrained.PretrainedWeights), as the task's and the data's
    hooks read it: each says which of its settings the source fixes (:meth:`TridentDataModule.settings_from_source`,
    ``TridentTask.settings_from_source``), so the weights room names no task and no setting."""

    @property
    def source(self) -> str: ...  # the path or name it was read from

    @property
    def model(self) -> Mapping[str, Any]: ...  # its architecture: the model settings of its (first) stack

    @property
    def task_options(self) -> Mapping[str, Any]: ...  # the task settings its network was built with

    @property
    def data_options(self) -> Mapping[str, Any]: ...  # the data settings it was built or trained for

    @property
    def tokenizer(self) -> Tokenizer | None: ...

    @property
    def vocab_size(self) -> int | None: ...  # rows of its token table where an outside source states them

    @property
    def tokenizer_settings(self) -> Mapping[str, str]: ...  # its chat template and special tokens


def stage_file(text: str, staged: Path) -> None:
    """``text`` at ``staged``, unless a file is there (named by its content: the same text), written whole or not at
    all (a run that starts beside another reads a complete file)."""
    if not staged.is_file():
        staged.parent.mkdir(parents=True, exist_ok=True)
        temporary = staged.with_suffix(".tmp")
        temporary.write_text(text)
        temporary.replace(staged)


def source_tokenizer_file(source: WeightsSource, data: DictConfig, explicit: Sequence[str]) -> dict[str, str]:
    """``data.tokenizer`` -> the file the source's tokenizer is staged in (under ``data.cache_dir``, named by its
    content, so a resume that reads the run's copy names the same file), for data that reads the source's tokenizer
    (never a retrained one); {} for a source without one. A tokenizer the command line names too is one line."""
    if source.tokenizer is None or "tokenizer" not in data:
        return {}
    if "data.tokenizer" in explicit:
        raise ConfigError(f"data.tokenizer={data.tokenizer} and init_from={source.source} both name a tokenizer: "
                          "drop data.tokenizer (the weights come with theirs)")
    digest = hashlib.sha256(source.tokenizer.to_str().encode()).hexdigest()[:16]
    return {"data.tokenizer": str(Path(data.cache_dir) / "tokenizers" / f"{digest}.json")}


def stage_source_tokenizer(source: WeightsSource, data: DictConfig) -> None:
    """The source's tokenizer in the file ``data.tokenizer`` names (:func:`source_tokenizer_file`)."""
    if source.tokenizer is not None and data.get("tokenizer"):
        stage_file(source.tokenizer.to_str(), Path(str(data.tokenizer)))


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

    @classmethod
    def settings_from_source(cls, source: WeightsSource, data: DictConfig, explicit: Sequence[str]) -> dict[str, Any]:
        """What an ``init_from`` ``source`` fixes in this data's settings (``data`` group), config path -> value: each
        data setting the source states that this data has (a bounded position table's context length, a ViT's patch
        size). ``explicit``: the keys the command line set (``data.image_size``)."""
        return {f"data.{key}": value for key, value in source.data_options.items() if key in data}

    @classmethod
    def stage_source(cls, source: WeightsSource, data: DictConfig) -> None:
        """Write what only the source holds where this data's settings (``data``, as
        :meth:`settings_from_source` set them) name it: once as the run starts, and again for eval.py where the data
        cache lost it (from the run's ``init/`` record). Nothing by default."""

    @classmethod
    def source_template(cls, source: WeightsSource, data: DictConfig) -> ChatTemplate | None:
        """The chat template of ``source`` (its record: a run's ``init/``) when this data's settings render with it;
        None by default (data that renders no conversations). trident-chat reads it there and stages nothing."""
        return None

    def epoch_loader(self, examples: Dataset, train: bool, batch_size: int, seed: int, **options: Any) -> DataLoader:
        """``examples`` in batches of ``batch_size``: in training, whole batches in an order drawn anew each epoch from
        ``seed`` (this rank's share, :class:`EpochShuffleSampler`); else all of them in order. ``options``: further
        DataLoader arguments (a ``collate_fn``)."""
        order = EpochShuffleSampler(len(examples), batch_size, seed, **self.shard()) if train else None  # type: ignore[arg-type]
        return DataLoader(examples, batch_size=batch_size, sampler=order, drop_last=train, **options, **self.loader_options())

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
    beside the splits, which :meth:`_build_cache` writes and :meth:`load_splits` reads. A subclass sets both
    attributes in its ``__init__``."""

    cache_path: Path
    tokenizer: Tokenizer | None  # None until setup()

    def prepare_data(self) -> None:
        self.cache_path.parent.mkdir(parents=True, exist_ok=True)
        # A lock, so concurrent jobs (DDP ranks, parallel sweeps) build the cache once.
        with FileLock(str(self.cache_path) + ".lock"):
            if not (self.cache_path / "meta.json").exists():
                self._build_cache()

    @abstractmethod
    def _build_cache(self) -> None:
        """Prepare the splits, the tokenizer and ``meta.json`` into ``cache_path`` (meta.json last: it marks the cache
        whole)."""

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

    @classmethod
    def settings_from_source(cls, source: WeightsSource, data: DictConfig, explicit: Sequence[str]) -> dict[str, Any]:
        """Text data reads the source's tokenizer (never a retrained one) from a file under the data cache named by its
        content (:meth:`stage_source` writes it), so a resume that reads the run's copy names the same file."""
        return super().settings_from_source(source, data, explicit) | source_tokenizer_file(source, data, explicit)

    @classmethod
    def stage_source(cls, source: WeightsSource, data: DictConfig) -> None:
        """The source's tokenizer in the file ``data.tokenizer`` names."""
        stage_source_tokenizer(source, data)

    def save_to(self, run_dir: Path) -> None:
        """Keep the tokenizer with the run, so the run directory alone can decode its outputs."""
        if self.tokenizer is not None:
            self.tokenizer.save(str(run_dir / "tokenizer.json"))
