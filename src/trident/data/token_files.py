"""Streams of text -> token ids on disk (``<split>.bin``, raw uint16 / int32), read back as memory maps.

Tokenizing runs in batches on every core (the fast tokenizers' ``encode_batch_fast`` spreads a
batch over its Rust threads; a character tokenizer is a table lookup in numpy), and ids go to
disk batch by batch, so memory stays bounded by one batch whatever the corpus size. Every
training process maps the same file: the operating system keeps one copy in its page cache.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, models

from trident.data.streams import Piece, Stream
from trident.data.tokenization import END_OF_TEXT, UNK

BATCH_PIECES = max(8, 4 * (os.cpu_count() or 1))  # enough pieces per batch to keep every core busy


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.int32)


class Encoder:
    """``tokenizer`` as a function of a batch of texts -> one flat id array, ``END_OF_TEXT``
    after each piece that ends a document."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.dtype = token_dtype(tokenizer.get_vocab_size())
        self.end_of_text = tokenizer.token_to_id(END_OF_TEXT)
        self.unk = tokenizer.token_to_id(UNK) or 0
        self.char_table = _char_table(tokenizer, self.unk)

    def __call__(self, pieces: list[Piece]) -> np.ndarray:
        if self.char_table is not None:
            encoded = [self._chars(text) for text, _ in pieces]
        else:
            encoded = [np.asarray(e.ids, dtype=self.dtype) for e in self.tokenizer.encode_batch_fast([t for t, _ in pieces])]
        out: list[np.ndarray] = []
        for ids, (_, ends_document) in zip(encoded, pieces):
            out.append(ids)
            if ends_document and self.end_of_text is not None:
                out.append(np.array([self.end_of_text], dtype=self.dtype))
        return np.concatenate(out) if out else np.empty(0, dtype=self.dtype)

    def _chars(self, text: str) -> np.ndarray:
        table = self.char_table
        assert table is not None
        points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)  # one code point per character
        inside = points < len(table)
        return np.where(inside, table[np.where(inside, points, 0)], self.unk).astype(self.dtype)


def _char_table(tokenizer: Tokenizer, unk: int) -> np.ndarray | None:
    """code point -> id for a character tokenizer (``<unk>`` where absent), or None for others:
    the same ids as ``tokenizer.encode``, at numpy speed."""
    if not isinstance(tokenizer.model, models.WordLevel):
        return None
    chars = {token: i for token, i in tokenizer.get_vocab().items() if len(token) == 1}
    table = np.full(max(map(ord, chars), default=0) + 1, unk, dtype=np.int64)
    for char, index in chars.items():
        table[ord(char)] = index
    return table


def batches(stream: Stream, size: int = BATCH_PIECES) -> Iterator[list[Piece]]:
    pieces = stream()
    while batch := list(islice(pieces, size)):
        yield batch


def write_tokens(stream: Stream, encoder: Encoder, path: Path) -> int:
    """Tokenize ``stream`` into ``path``, batch by batch; returns the number of tokens."""
    count = 0
    with path.open("wb") as out:
        for batch in batches(stream):
            ids = encoder(batch)
            out.write(ids.tobytes())
            count += ids.size
    return count


def read_tokens(path: Path, dtype: str, count: int) -> np.ndarray:
    """The ids written by :func:`write_tokens`, memory-mapped read-only (not loaded)."""
    if count == 0:
        return np.empty(0, dtype=dtype)
    return np.memmap(path, dtype=np.dtype(dtype), mode="r", shape=(count,))
