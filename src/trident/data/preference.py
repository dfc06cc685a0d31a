"""Preference data (``data=preference``): prompts with a chosen and a rejected answer (TRL's standard and
conversational formats, :mod:`trident.data.preference_rows`) -> token ids of each answer after its prompt, cut to
``max_length`` keeping the answers -> batches of the chosen sequences then the rejected ones, whose targets are the
answer tokens only (:class:`PreferenceBatch`), for ``task=lm objective=dpo``. Unpaired rows (TRL's unpaired
format: ``prompt``, ``completion``, ``label``, for ``objective=kto``) -> batches of single answers with their labels
(:class:`UnpairedBatch`).

Truncation (:func:`~trident.data.preference_rows.fit_pair`): the prompt's start is cut (to ``max_prompt_length``,
then further where the prompt and the longer answer exceed ``max_length``), an answer's end only where it alone
does not fit; a pair whose answers are then the same is dropped. One warning line counts both.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from trident.data.base import WeightsSource, stage_file
from trident.data.cache import content_key, fresh_staging, publish_cache
from trident.data.chat import shakespeare_conversations, source_template_dir
from trident.data.chat_template import (
    ChatTemplate,
    Message,
    _tokenizer_config,
    chat_template_of,
    read_template,
    recorded_template,
    special_tokens_of,
)
from trident.data.lm import LMDataModule
from trident.data.preference_rows import (
    ANSWERS,
    Row,
    encode_answers,
    encode_pair,
    fit_answers,
    fit_pair,
    pair_of,
    read_rows,
)
from trident.data.readers import SPLITS
from trident.data.special_tokens import IGNORE_INDEX
from trident.data.tokenization import plain_encoder, tokenizer_for, tokenizer_key
from trident.errors import ConfigError, DataError

if TYPE_CHECKING:
    from omegaconf import DictConfig

log = logging.getLogger(__name__)

CACHE_VERSION = 3  # 2: the shipped set; each split's origin; 3: unpaired rows
PREFERENCE_SOURCES = ("shakespeare", "files")


class PreferenceBatch(NamedTuple):
    """B pairs as one batch of 2B sequences, as TRL's ``concatenated_forward`` runs them: the chosen ones, then the
    rejected ones (row i and row B + i share their prompt)."""

    inputs: Tensor  # (2B, T) prompt and answer tokens, padded on the right
    targets: Tensor  # (2B, T) the next token where it is an answer token, else IGNORE_INDEX
    reference: Tensor  # (2B,) the reference policy's log-probabilities of the answers, or (0,): not precomputed


class UnpairedBatch(NamedTuple):
    """N single answers (TRL's unpaired format, KTO's), each desirable or not."""

    inputs: Tensor  # (N, T) prompt and answer tokens, padded on the right
    targets: Tensor  # (N, T) the next token where it is an answer token, else IGNORE_INDEX
    desirable: Tensor  # (N,) bool: the row's label


def padded(sequences: list[np.ndarray], prompts: list[int]) -> tuple[Tensor, Tensor]:
    """Sequences (prompt and answer) and their prompts' lengths -> inputs (N, T) padded on the right to the longest,
    and targets (N, T): the next token where it is an answer token, else IGNORE_INDEX."""
    longest = max(len(s) for s in sequences)
    inputs = torch.zeros(len(sequences), longest, dtype=torch.long)
    targets = torch.full((len(sequences), longest), IGNORE_INDEX, dtype=torch.long)
    for row, (ids, prompt) in enumerate(zip(sequences, prompts, strict=True)):
        inputs[row, : len(ids)] = torch.from_numpy(ids.astype(np.int64))
        # Position j predicts token j + 1: the answer's tokens are predicted from position prompt - 1 on.
        targets[row, prompt - 1 : len(ids) - 1] = inputs[row, prompt : len(ids)]
    return inputs, targets


class Pairs(Dataset[tuple[int, ...]]):
    """A split's pairs: the chosen and the rejected sequence (prompt and answer), and the prompt's length; and the
    reference log-probabilities of both answers once precomputed (``reference``, (N, 2))."""

    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        self.arrays = arrays
        self.reference: Tensor | None = None

    def __len__(self) -> int:
        return len(self.arrays["prompt_lengths"])

    def __getitem__(self, index: int) -> tuple[int, ...]:
        return (index,)

    def sequence(self, field: str, index: int) -> np.ndarray:
        start, stop = self.arrays[f"{field}_offsets"][index : index + 2]
        return self.arrays[f"{field}_ids"][start:stop]

    def collate(self, items: list[tuple[int, ...]]) -> PreferenceBatch:
        """Pairs -> :class:`PreferenceBatch` padded to its longest sequence."""
        indices = [index for (index,) in items]
        sequences = [self.sequence(field, i) for field in ("chosen", "rejected") for i in indices]
        prompts = [int(self.arrays["prompt_lengths"][i]) for i in indices] * 2
        inputs, targets = padded(sequences, prompts)
        reference = torch.zeros(0)
        if self.reference is not None:
            reference = torch.cat([self.reference[indices, 0], self.reference[indices, 1]])
        return PreferenceBatch(inputs, targets, reference)

    def answer_tokens(self) -> int:
        return int(sum(len(self.arrays[f"{f}_ids"]) for f in ANSWERS) - 2 * self.arrays["prompt_lengths"].sum())


class Examples(Pairs):
    """A split's unpaired answers: each sequence (prompt and answer), its prompt's length and its label."""

    def __len__(self) -> int:
        return len(self.arrays["labels"])

    def collate(self, items: list[tuple[int, ...]]) -> UnpairedBatch:  # type: ignore[override]
        """Answers -> :class:`UnpairedBatch` padded to its longest sequence, in the loader's order."""
        indices = [index for (index,) in items]
        inputs, targets = padded([self.sequence("completion", i) for i in indices],
                                 [int(self.arrays["prompt_lengths"][i]) for i in indices])
        return UnpairedBatch(inputs, targets, torch.from_numpy(self.arrays["labels"][indices].astype(bool)))

    def answer_tokens(self) -> int:
        return int(len(self.arrays["completion_ids"]) - self.arrays["prompt_lengths"].sum())


def shakespeare_pairs(conversations: list[list[Message]], seed: int = 0) -> list[Row]:
    """The shipped preference set, from data=chat's shipped conversations ("Continue <SPEAKER>'s speech:" with a
    line): the speech's true next lines chosen, the next lines of another speech (drawn with ``seed``, from anywhere
    in the plays) rejected; a pair whose two answers are the same text is left out."""
    order = np.random.default_rng(seed).permutation(len(conversations))
    pairs = []
    for i, j in enumerate(order):
        asked, answer = conversations[i]
        other = conversations[j][1]
        if other["content"] != answer["content"]:
            pairs.append(pair_of({"prompt": [asked], "chosen": [answer], "rejected": [other]}, f"shipped pair {i + 1}"))
    return pairs


def preference_template(choice: str | None, tokenizer: str) -> tuple[ChatTemplate | None, dict[str, str]]:
    """``data.template`` read as data=chat reads it -> the template of conversational pairs and the special tokens
    (whose ``eos_token`` ends each standard answer). A tokenizer directory without a chat template (a base model's,
    named or defaulted to) gives its special tokens and no template: standard pairs need none."""
    named = Path(choice if choice is not None else tokenizer)
    if choice != "default" and named.is_dir():
        config = _tokenizer_config(named)
        if not chat_template_of(named, config):
            return None, special_tokens_of(named, config)
    template = read_template(choice, tokenizer)
    return template, template.special_tokens


def flat(sequences: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Sequences -> their tokens end to end and the offsets (N + 1,) where each starts."""
    offsets = np.cumsum([0, *map(len, sequences)])
    return np.array([t for s in sequences for t in s], dtype=np.int64), offsets


class PreferenceDataModule(LMDataModule):
    """``data=preference``: pairs of ``data.files`` (``data.source=files``) or the shipped set built from the plays
    (``data.source=shakespeare``, :func:`shakespeare_pairs`) for ``objective=dpo``, ``orpo`` or ``kto``; or unpaired
    answers of ``data.files`` for ``objective=kto``. Splits the files do not give are cut from the train rows in order
    by ``data.split``. With ``init_from``, the source's chat template and special tokens are read from the run's record
    of it, staged as data=chat stages them (:meth:`stage_source`), even where the source has no template: its eos ends
    the standard answers."""

    @classmethod
    def settings_from_source(cls, source: WeightsSource, data: DictConfig, explicit: Sequence[str]) -> dict[str, Any]:
        """The source's tokenizer and, unless ``data.template`` names another, its special tokens and chat template."""
        fixed = super().settings_from_source(source, data, explicit)
        staged = source_template_dir(data, source.tokenizer_settings, template_needed=False)
        if staged is not None and data.get("template") in (None, staged):
            fixed["data.template"] = staged
        return fixed

    @classmethod
    def stage_source(cls, source: WeightsSource, data: DictConfig) -> None:
        super().stage_source(source, data)
        if cls._names_source_settings(source, data):
            stage_file(json.dumps(dict(source.tokenizer_settings)), Path(str(data.template)) / "tokenizer_config.json")

    @classmethod
    def source_template(cls, source: WeightsSource, data: DictConfig) -> ChatTemplate | None:
        if not cls._names_source_settings(source, data) or not source.tokenizer_settings.get("chat_template"):
            return None
        return recorded_template(str(data.template), source.tokenizer_settings)

    @staticmethod
    def _names_source_settings(source: WeightsSource, data: DictConfig) -> bool:
        """Whether ``data.template`` is the source's staged directory, by its name (its content)."""
        staged = source_template_dir(data, source.tokenizer_settings, template_needed=False)
        return staged is not None and bool(data.get("template")) and Path(str(data.template)).name == Path(staged).name

    def __init__(self, source: str = "shakespeare", files: Any = None, template: str | None = None, tokenizer: str = "char",
                 vocab_size: int = 8192, max_length: int = 512, max_prompt_length: int | None = None,
                 batch_size: int = 8, split: tuple[float, float, float] = (0.9, 0.05, 0.05),
                 cache_dir: str = "outputs/cache", num_workers: int = 0, pin_memory: bool = False,
                 persistent_workers: bool = True, seed: int = 0) -> None:
        super().__init__(tokenizer=tokenizer, vocab_size=vocab_size, block_size=max_length, batch_size=batch_size,
                         split=split, cache_dir=cache_dir, num_workers=num_workers, pin_memory=pin_memory,
                         persistent_workers=persistent_workers, sample_prompts=[], seed=seed)
        if source not in PREFERENCE_SOURCES:
            raise ConfigError(f"unknown data.source {source!r} for data=preference: choose one of "
                              f"{', '.join(PREFERENCE_SOURCES)} (with data.files)")
        if source != "files" and files:
            raise ConfigError(f"data.files is read with data.source=files, not data.source={source} (the shipped pairs): "
                              "add data.source=files")
        if source == "files" and not files:
            raise ConfigError("data=preference data.source=files needs data.files: JSONL, JSON, parquet or CSV files (or a save_to_disk "
                              "directory) of prompt / chosen / rejected rows")
        if max_prompt_length is not None and not 0 < max_prompt_length < max_length:
            raise ConfigError(f"data.max_prompt_length={max_prompt_length} leaves no room for an answer in "
                              f"data.max_length={max_length} tokens: set it between 1 and {max_length - 1}, or null")
        self.source, self.files = source, files
        self.max_length, self.max_prompt_length = max_length, max_prompt_length
        self.template_choice = template if template is not None else tokenizer
        self.template, self.special_tokens = preference_template(template, tokenizer)
        key = json.dumps([CACHE_VERSION, source, content_key(files) if source == "files" else None,
                          None if self.template is None else self.template.text, self.special_tokens,
                          tokenizer_key(tokenizer), vocab_size if tokenizer != "char" else 0, max_length,
                          max_prompt_length, self.split], sort_keys=True, default=str)
        self.cache_path = Path(cache_dir) / "preference" / hashlib.sha256(key.encode()).hexdigest()[:16]
        self.pairs: dict[str, Pairs] = {}  # each split's pairs, or answers (Examples) of unpaired rows

    def _build_cache(self) -> None:
        given = read_rows(self.files) if self.source == "files" else {"train": shakespeare_pairs(shakespeare_conversations())}
        train = given["train"]
        if self.template is None and (row := next((r for rows in given.values() for r in rows if r["conversational"]), None)):
            raise DataError(f"{row['where']} is a conversation, and data.template={self.template_choice} has no chat "
                            "template: give data.template=<a .jinja file or a tokenizer directory> (or default)")
        missing = [name for name in SPLITS[1:] if name not in given]
        share = dict(zip(SPLITS, self.split, strict=True))
        counts = [round(share[name] * len(train)) for name in missing]
        bounds = np.cumsum([len(train) - sum(counts), *counts])
        parts = dict(zip(["train", *missing], np.split(np.arange(len(train)), bounds[:-1]), strict=True))
        rows = given | {name: [train[i] for i in members] for name, members in parts.items()}

        unpaired = "completion" in train[0]
        answers = ("completion",) if unpaired else ANSWERS

        def texts() -> Any:  # what a char or BPE tokenizer is trained on: the train rows as they are encoded
            for pair in rows["train"]:
                for field in answers:
                    yield (self.template.render(pair["prompt"] + pair[field]) if pair["conversational"]
                           else pair["prompt"] + pair[field])

        tokenizer = tokenizer_for(self.tokenizer_kind, texts(), vocab_size=self.vocab_size_target, length=2 * len(train))
        encoder, eos = plain_encoder(tokenizer), self.special_tokens.get("eos_token")
        staging = fresh_staging(self.cache_path)
        staging.mkdir(parents=True)
        meta: dict[str, Any] = {"pairs": {}, "cut": {}, "dropped": {}, "origin": {}, "unpaired": unpaired}
        for name in SPLITS:
            kept, cut = [], 0
            for pair in rows[name]:
                if unpaired:
                    prompt, (completion,) = encode_answers(encoder, self.template, pair["prompt"], [pair["completion"]],
                                                           pair["conversational"], eos)
                else:
                    prompt, chosen, rejected = encode_pair(encoder, self.template, pair, eos)
                if not prompt:
                    raise DataError(f"{pair['where']}: the prompt encodes to no token, so nothing predicts the answers' "
                                    "first token: give the row a prompt")
                if unpaired:  # one answer: never dropped
                    prompt, (completion,), was_cut = fit_answers(prompt, [completion], self.max_prompt_length,
                                                                 self.max_length)
                    fitted: Any = (prompt, completion, pair["label"])
                else:
                    fitted, was_cut = fit_pair(prompt, chosen, rejected, self.max_prompt_length, self.max_length)
                cut += was_cut and fitted is not None
                if fitted is not None:
                    kept.append(fitted)
            if not kept:
                raise DataError(f"the {name} split of data=preference has no pair ({len(rows[name])} given, after "
                                f"truncation to data.max_length={self.max_length}): give more pairs or change data.split")
            arrays: dict[str, np.ndarray] = {"prompt_lengths": np.array([len(p) for p, _, _ in kept], dtype=np.int64)}
            if unpaired:
                arrays["completion_ids"], arrays["completion_offsets"] = flat([p + c for p, c, _ in kept])
                arrays["labels"] = np.array([label for _, _, label in kept], dtype=bool)
            for field, index in () if unpaired else (("chosen", 1), ("rejected", 2)):
                arrays[f"{field}_ids"], arrays[f"{field}_offsets"] = flat([pair[0] + pair[index] for pair in kept])
            np.savez(staging / f"{name}.npz", **arrays)
            meta["pairs"][name], meta["cut"][name], meta["dropped"][name] = len(kept), cut, len(rows[name]) - len(kept)
            meta["origin"][name] = "given" if name in given else "cut from the end of train's pairs"
        publish_cache(staging, self.cache_path, tokenizer, meta)

    def load_splits(self, meta: dict[str, Any]) -> dict[str, str]:
        if meta["unpaired"] and self.batch_size < 2:
            raise ConfigError("unpaired rows (objective=kto) need data.batch_size of 2 or more: KTO's KL reference point "
                              "is estimated from the batch's answers paired with other rows' prompts (TRL refuses 1 too)")
        for name in SPLITS:
            with np.load(self.cache_path / f"{name}.npz") as arrays:
                self.pairs[name] = (Examples if meta["unpaired"] else Pairs)({k: arrays[k] for k in arrays.files})
        cut, dropped = sum(meta["cut"].values()), sum(meta["dropped"].values())
        if cut or dropped:
            log.warning("data: %d pairs are longer than data.max_length=%d (or their prompt than data.max_prompt_length=%s) "
                        "tokens and lost their prompt's start (an answer its end only where it alone does not fit); %d "
                        "were dropped, their answers cut to the same tokens", cut, self.max_length,
                        self.max_prompt_length, dropped)
        return {name: f"{meta['pairs'][name]:,} {'answers' if meta['unpaired'] else 'pairs'}" for name in SPLITS}

    def blocks(self, split: str) -> Dataset:
        return self.pairs[split]

    def split_loader(self, split: str, train: bool) -> DataLoader:
        pairs = self.pairs[split]
        return self.epoch_loader(pairs, train, self.batch_size, self.seed, collate_fn=pairs.collate)

    def tokenizer_settings(self) -> dict[str, str]:
        """The template (and its special tokens) the conversational pairs are rendered with, as data=chat records it."""
        if self.template is None:
            return dict(self.special_tokens)
        return {**self.template.special_tokens, "chat_template": self.template.text,
                "end_of_turn": self.template.end_marker()}

    def token_counts(self) -> dict[str, int]:
        """Answer tokens of each split (what the log-probabilities sum over)."""
        return {name: pairs.answer_tokens() for name, pairs in self.pairs.items()}
