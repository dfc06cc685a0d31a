"""Language-modelling data: corpus -> tokenizer -> token stream -> packed fixed-length blocks.

Preparation (reading, tokenizer training, tokenization) runs once per distinct data config and
is cached on disk under ``cache_dir``; later runs, and every DDP rank, load the cached arrays.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from trident.data.base import TextDataModule
from trident.data.cache import content_key, fresh_staging, publish_cache
from trident.data.corpora import corpus_streams
from trident.data.readers import SPLITS
from trident.data.segments import ContiguousOrder, contiguous_segments
from trident.data.streams import split_streams
from trident.data.token_files import Encoder, check_informative, end_of_document, read_tokens, write_tokens
from trident.data.tokenization import tokenizer_for, tokenizer_key
from trident.errors import ConfigError, DataError, is_int

log = logging.getLogger(__name__)

# Bump when the preparation below changes its output (2: no Arrow copy of the tokens; 3: streamed
# into memory-mapped .bin files, documents of files / hub data end in <|endoftext|>; 4: a tokenizer.json's
# own ids, no special tokens inside documents, a separator for every vocabulary).
CACHE_VERSION = 4


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


class LMDataModule(TextDataModule):
    def __init__(
        self,
        source: str = "shakespeare",
        files: Any = None,
        hub_path: str | None = None,
        hub_config: str | None = None,
        text_column: str = "text",
        translation: str = "k",
        tokenizer: str = "char",
        vocab_size: int = 8192,
        block_size: int = 256,
        batch_size: int = 32,
        split: tuple[float, float, float] = (0.9, 0.05, 0.05),
        test_on_validation: bool = False,
        train_tokens: int | None = None,
        cache_dir: str = "outputs/cache",
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = True,
        sample_prompts: list[str] | None = None,
        seed: int = 0,
        contiguous: bool = False,
    ) -> None:
        super().__init__(num_workers=num_workers, pin_memory=pin_memory, persistent_workers=persistent_workers)
        if not isinstance(contiguous, bool):
            raise ConfigError(f"data.contiguous must be true or false, got {contiguous!r}")
        if contiguous and type(self).blocks is not LMDataModule.blocks:
            raise ConfigError(f"data.contiguous=true reads plain text as contiguous segments (task=lm): "
                              f"{type(self).__name__} cuts its examples otherwise: set data.contiguous=false")
        # Contiguous segments, row b of batch j + 1 continuing row b of batch j (trident.data.segments), in the same
        # order every epoch: what a model with a memory reads (model.memory_length sets it); else shuffled blocks.
        self.contiguous = contiguous
        if block_size <= 0 or batch_size <= 0:
            raise ConfigError(
                f"data.block_size and data.batch_size must be positive, got {block_size}, {batch_size}: "
                "set both to positive integers (e.g. data.block_size=256 data.batch_size=32)"
            )
        self.source = source
        # Only the options of the chosen source matter (and enter the cache key).
        all_options: dict[str, dict[str, Any]] = {
            "files": {"files": files, "text_column": text_column},
            "hub": {"path": hub_path, "name": hub_config, "text_column": text_column},
            "bible": {"translation": translation},
        }
        self.source_options: dict[str, Any] = all_options.get(source, {})
        self.tokenizer_kind = tokenizer
        self.vocab_size_target = vocab_size
        self.block_size = block_size
        self.batch_size = batch_size
        self.split = list(split)
        self.test_on_validation = bool(test_on_validation)
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
            [CACHE_VERSION, source, key_options, tokenizer_key(tokenizer), vocab_size if tokenizer != "char" else 0, self.split,
             self.test_on_validation],
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

    def _build_cache(self) -> None:
        given = corpus_streams(self.source, self.source_options)
        streams = split_streams(given, self.split, self.test_on_validation)
        pieces = sum(1 for _ in streams["train"]())
        # Documents of the user's data end in a separator; the packaged corpora are one text each.
        documents = self.source in ("files", "hub")
        tokenizer = tokenizer_for(
            self.tokenizer_kind, (text for text, _ in streams["train"]()), vocab_size=self.vocab_size_target,
            length=pieces, end_of_text=documents,
        )
        separator = end_of_document(tokenizer) if documents else None  # may add <|endoftext|> to the tokenizer
        staging = fresh_staging(self.cache_path)
        staging.mkdir(parents=True)
        encoder = Encoder(tokenizer, separator)
        written = {name: write_tokens(streams[name], encoder, staging / f"{name}.bin") for name in SPLITS}
        counts = {name: count for name, (count, _) in written.items()}
        for name, (count, fillers) in written.items():
            if count == 0:
                raise DataError(
                    f"the {name} split of data.source={self.source} is empty ({counts['train']} train tokens): "
                    "use a larger corpus, give the split in data.files, or change data.split"
                )
            check_informative(name, count, fillers, self.tokenizer_kind)
        origin = {name: "given" if name in given else "cut from the end of train" for name in SPLITS}
        if self.test_on_validation:
            origin["test"] = "the validation split (data.test_on_validation=true)"
        meta = {"tokens": counts, "vocab_size": tokenizer.get_vocab_size(), "dtype": encoder.dtype.name, "origin": origin}
        publish_cache(staging, self.cache_path, tokenizer, meta)

    def load_splits(self, meta: dict[str, Any]) -> dict[str, str]:
        for name in SPLITS:
            # A read-only memory map: every process (DDP ranks, loader workers) shares the page cache.
            self.splits[name] = read_tokens(self.cache_path / f"{name}.bin", meta["dtype"], meta["tokens"][name])
            if name == "train" and self.train_tokens is not None:
                self.splits[name] = self.splits[name][: self.train_tokens]
            if len(self.splits[name]) <= self.block_size:
                raise DataError(
                    f"the {name} split has {len(self.splits[name])} tokens, fewer than one block of "
                    f"data.block_size={self.block_size}+1: lower data.block_size or use a larger corpus"
                )
        return {name: f"{meta['tokens'][name]:,} tokens" for name in SPLITS}

    def blocks(self, split: str) -> Dataset:
        """The examples of ``split``: packed input/target windows (a subclass may cut them otherwise)."""
        return PackedBlocks(self.splits[split], self.block_size)

    def split_loader(self, split: str, train: bool) -> DataLoader:
        if not self.contiguous:
            return self.epoch_loader(self.blocks(split), train, self.batch_size, self.seed)
        shard = self.shard()
        segments, rows = contiguous_segments(self.splits[split], self.block_size, self.batch_size, shard["num_replicas"],
                                             split, train)
        order = ContiguousOrder(segments, rows, **shard)
        return DataLoader(segments, batch_size=rows, sampler=order, drop_last=True, **self.loader_options())

    def task_inputs(self) -> dict[str, Any]:
        """What the task module needs from the data: vocabulary, tokenizer, prompts for samples."""
        if self.tokenizer is None:
            raise RuntimeError("call prepare_data() and setup() before task_inputs()")
        return {
            "vocab_size": self.vocab_size,
            "tokenizer_json": self.tokenizer.to_str(),
            "sample_prompts": self.sample_prompts,
        }

    def token_counts(self) -> dict[str, int]:
        return {name: len(ids) for name, ids in self.splits.items()}

