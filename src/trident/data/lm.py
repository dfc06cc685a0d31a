"""Language-modelling data: corpus -> tokenizer -> token stream -> packed fixed-length blocks.

Preparation (reading, tokenizer training, tokenization) runs once per distinct data config and
is cached on disk under ``cache_dir``; later runs, and every DDP rank, load the cached arrays.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from filelock import FileLock
from tokenizers import Tokenizer
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from trident.checks import is_int
from trident.data.base import TridentDataModule
from trident.data.cache import content_key, fresh_staging, publish_cache
from trident.data.corpora import SPLITS, load_corpus
from trident.data.order import EpochShuffleSampler
from trident.data.tokenization import tokenizer_for, tokenizer_key
from trident.errors import ConfigError, DataError

CACHE_VERSION = 2  # bump when the preparation below changes its output (2: no Arrow copy of the tokens)


class PackedBlocks(Dataset[tuple[Tensor, Tensor]]):
    """Non-overlapping windows of ``block_size + 1`` tokens: inputs and next-token targets."""

    def __init__(self, ids: np.ndarray, block_size: int) -> None:
        self.ids = ids
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = index * self.block_size
        window = torch.from_numpy(self.ids[start : start + self.block_size + 1].astype(np.int64))
        return window[:-1], window[1:]  # (T,), (T,)


class LMDataModule(TridentDataModule):
    def __init__(
        self,
        source: str = "shakespeare",
        files: list[str] | None = None,
        hub_path: str | None = None,
        hub_config: str | None = None,
        text_column: str = "text",
        translation: str = "k",
        tokenizer: str = "char",
        vocab_size: int = 8192,
        block_size: int = 256,
        batch_size: int = 32,
        split: tuple[float, float, float] = (0.9, 0.05, 0.05),
        train_tokens: int | None = None,
        cache_dir: str = "outputs/cache",
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = True,
        sample_prompts: list[str] | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(num_workers=num_workers, pin_memory=pin_memory, persistent_workers=persistent_workers)
        if block_size <= 0 or batch_size <= 0:
            raise ConfigError(
                f"data.block_size and data.batch_size must be positive, got {block_size}, {batch_size}: "
                "set both to positive integers (e.g. data.block_size=256 data.batch_size=32)"
            )
        self.source = source
        # Only the options of the chosen source matter (and enter the cache key).
        all_options: dict[str, dict[str, Any]] = {
            "files": {"files": files},
            "hub": {"path": hub_path, "name": hub_config, "text_column": text_column},
            "bible": {"translation": translation},
        }
        self.source_options: dict[str, Any] = all_options.get(source, {})
        self.tokenizer_kind = tokenizer
        self.vocab_size_target = vocab_size
        self.block_size = block_size
        self.batch_size = batch_size
        self.split = list(split)
        if train_tokens is not None and not (is_int(train_tokens) and train_tokens > block_size):
            raise ConfigError(
                f"data.train_tokens={train_tokens} must be an integer above one block (data.block_size={block_size}): "
                "e.g. data.train_tokens=50000, or data.train_tokens=null to train on the whole train split"
            )
        # Training reads the first train_tokens of the train split (the cache keeps all of it).
        self.train_tokens = train_tokens
        self.sample_prompts = list(sample_prompts or [])
        self.seed = seed  # the training order of epoch e is a function of (seed, e)
        # Local files enter the key by their content, hub datasets by name (datasets keeps their fingerprint).
        key_options = {**self.source_options, "files": content_key(files)} if source == "files" else self.source_options
        key = json.dumps(
            [CACHE_VERSION, source, key_options, tokenizer_key(tokenizer), vocab_size if tokenizer != "char" else 0, self.split],
            sort_keys=True,
            default=str,
        )
        self.cache_path = Path(cache_dir) / "lm" / hashlib.sha256(key.encode()).hexdigest()[:16]
        self.tokenizer: Tokenizer | None = None
        self.splits: dict[str, np.ndarray] = {}

    @property
    def vocab_size(self) -> int:
        if self.tokenizer is None:
            raise RuntimeError("call prepare_data() and setup() before reading vocab_size")
        return self.tokenizer.get_vocab_size()

    def prepare_data(self) -> None:
        self.cache_path.parent.mkdir(parents=True, exist_ok=True)
        # A lock, so concurrent jobs (DDP ranks, parallel sweeps) build the cache once.
        with FileLock(str(self.cache_path) + ".lock"):
            if not (self.cache_path / "meta.json").exists():
                self._build_cache()

    def _build_cache(self) -> None:
        corpus = load_corpus(self.source, self.source_options, self.split)
        for name in SPLITS:
            if not any(t.strip() for t in corpus[name]["text"]):
                raise DataError(f"the {name} split of data.source={self.source} is empty: use a larger corpus or change data.split")
        tokenizer = tokenizer_for(self.tokenizer_kind, corpus["train"]["text"], vocab_size=self.vocab_size_target)
        staging = fresh_staging(self.cache_path)
        staging.mkdir(parents=True)

        def encode(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
            return {"ids": [e.ids for e in tokenizer.encode_batch(batch["text"])]}

        dtype = np.uint16 if tokenizer.get_vocab_size() < 2**16 else np.int32
        counts = {}
        for name in SPLITS:
            tokenized = corpus[name].map(
                encode, batched=True, remove_columns=["text"], desc=f"Tokenizing {name}",
                cache_file_name=str(staging / f"{name}.arrow"),
            )
            ids = np.fromiter((i for row in tokenized["ids"] for i in row), dtype=dtype)
            np.save(staging / f"{name}.npy", ids)
            counts[name] = int(ids.size)
            # Training reads only the .npy: the Arrow table it came from (4x larger) goes.
            del tokenized
            (staging / f"{name}.arrow").unlink()
        publish_cache(staging, self.cache_path, tokenizer, {"tokens": counts, "vocab_size": tokenizer.get_vocab_size()})

    def setup(self, stage: str | None = None) -> None:
        if self.tokenizer is not None:
            return
        self.tokenizer = Tokenizer.from_file(str(self.cache_path / "tokenizer.json"))
        for name in SPLITS:
            self.splits[name] = np.load(self.cache_path / f"{name}.npy", mmap_mode="r")
            if name == "train" and self.train_tokens is not None:
                self.splits[name] = self.splits[name][: self.train_tokens]
            if len(self.splits[name]) <= self.block_size:
                raise DataError(
                    f"the {name} split has {len(self.splits[name])} tokens, fewer than one block of "
                    f"data.block_size={self.block_size}+1: lower data.block_size or use a larger corpus"
                )

    def blocks(self, split: str) -> Dataset:
        """The examples of ``split``: packed input/target windows (a subclass may cut them otherwise)."""
        return PackedBlocks(self.splits[split], self.block_size)

    def split_loader(self, split: str, train: bool) -> DataLoader:
        blocks = self.blocks(split)
        order = EpochShuffleSampler(len(blocks), self.batch_size, self.seed, **self.shard()) if train else None
        return DataLoader(
            blocks,
            batch_size=self.batch_size,
            sampler=order,
            drop_last=train,
            **self.loader_options(),
        )

    def task_inputs(self) -> dict[str, Any]:
        """What the task module needs from the data: vocabulary, tokenizer, prompts for samples."""
        if self.tokenizer is None:
            raise RuntimeError("call prepare_data() and setup() before task_inputs()")
        return {
            "vocab_size": self.vocab_size,
            "tokenizer_json": self.tokenizer.to_str(),
            "sample_prompts": self.sample_prompts,
        }

    def save_to(self, run_dir: Path) -> None:
        """Keep the tokenizer with the run, so the run directory alone can decode its outputs."""
        if self.tokenizer is not None:
            self.tokenizer.save(str(run_dir / "tokenizer.json"))

    def token_counts(self) -> dict[str, int]:
        return {name: len(ids) for name, ids in self.splits.items()}

