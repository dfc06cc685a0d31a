"""Streams of text -> token ids on disk (``<split>.bin``, raw uint16 / int32), read back as memory maps.

Tokenizing runs in batches on every core (the fast tokenizers' ``encode_batch_fast`` spreads a
batch over its Rust threads; a character tokenizer is a table lookup in numpy), and ids go to
disk batch by batch, so memory stays bounded by one batch whatever the corpus size. Every
training process maps the same file: the operating system keeps one copy in its page cache.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Tokenizer, models

from trident.data.streams import Piece, Stream
from trident.data.tokenization import END_OF_TEXT, every_character

log = logging.getLogger(__name__)

BATCH_PIECES = max(8, 4 * (os.cpu_count() or 1))  # enough pieces per batch to keep every core busy


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.int32)


def end_of_document(tokenizer: Tokenizer) -> int:
    """The id that ends each document (logged): ``<|endoftext|>`` where the vocabulary has it; else the
    special token the tokenizer's post-processor closes a text with (BERT's ``[SEP]``, RoBERTa's and
    T5's ``</s>``); else ``<|endoftext|>`` added to ``tokenizer`` as a special token (one more id)."""
    found = tokenizer.token_to_id(END_OF_TEXT)
    if found is not None:
        log.info("data: each document ends in %s (id %d)", END_OF_TEXT, found)
        return found
    closing = closing_special(tokenizer)
    if closing is not None:
        log.info("data: each document ends in %s (id %d, the token the tokenizer's post-processor puts after a text; "
                 "it has no %s)", closing, tokenizer.token_to_id(closing), END_OF_TEXT)
        return tokenizer.token_to_id(closing)
    tokenizer.add_special_tokens([AddedToken(END_OF_TEXT, special=True)])
    added = tokenizer.token_to_id(END_OF_TEXT)
    log.info("data: each document ends in %s (id %d, added to the tokenizer: it had no end-of-document token)",
             END_OF_TEXT, added)
    return added


def closing_special(tokenizer: Tokenizer) -> str | None:
    """The last special token the post-processor puts after a single text, if any."""
    encoding = tokenizer.encode("a")
    texts = [i for i, sequence in enumerate(encoding.sequence_ids) if sequence is not None]
    after = encoding.tokens[texts[-1] + 1 :] if texts else []
    return after[-1] if after else None


class Encoder:
    """``tokenizer`` as a function of a batch of texts -> one flat id array: each piece's ids are those
    of ``tokenizer.encode(text, add_special_tokens=False)`` with the file's truncation and padding off (a
    corpus is never cut to a model's length; special tokens never sit inside a document), and
    ``separator`` after each piece that ends a document (:func:`end_of_document`; None where none does)."""

    def __init__(self, tokenizer: Tokenizer, separator: int | None) -> None:
        self.tokenizer = Tokenizer.from_str(tokenizer.to_str())  # a copy: truncation and padding go below
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.dtype = token_dtype(tokenizer.get_vocab_size())
        self.separator = separator
        self.char_table = _char_table(tokenizer) if is_character_tokenizer(tokenizer) else None

    def __call__(self, pieces: list[Piece]) -> np.ndarray:
        if self.char_table is not None:
            encoded = [self._chars(text) for text, _ in pieces]
        else:
            texts = [text for text, _ in pieces]
            encoded = [np.asarray(e.ids, dtype=self.dtype)
                       for e in self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
        out: list[np.ndarray] = []
        for ids, (_, ends_document) in zip(encoded, pieces):
            out.append(ids)
            if ends_document:
                assert self.separator is not None, "a document ends in a stream given no separator"
                out.append(np.array([self.separator], dtype=self.dtype))
        return np.concatenate(out) if out else np.empty(0, dtype=self.dtype)

    def _chars(self, text: str) -> np.ndarray:
        table = self.char_table
        assert table is not None
        points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)  # one code point per character
        return table[np.minimum(points, len(table) - 1)].astype(self.dtype)  # beyond the table: its last entry, <unk>


def is_character_tokenizer(tokenizer: Tokenizer) -> bool:
    """Whether ``tokenizer`` is trident's character tokenizer (:mod:`trident.data.tokenization`), the one
    case where a lookup per code point gives ``encode``'s ids: a word-level model whose every word is
    one character (the pre-tokenizer isolates each), nothing that rewrites a character first (no
    normalizer), no added tokens (matched in the text before pre-tokenizing) and no post-processor.
    Any other file, word-level ones included, goes through ``tokenizers`` itself."""
    config = json.loads(tokenizer.to_str())
    probe = Tokenizer(models.WordLevel())  # how a tokenizer.json writes the character pre-tokenizer
    probe.pre_tokenizer = every_character()
    return (
        isinstance(tokenizer.model, models.WordLevel)
        and config["normalizer"] is None
        and config["pre_tokenizer"] == json.loads(probe.to_str())["pre_tokenizer"]
        and not config["added_tokens"]
        and config["post_processor"] is None
        and tokenizer.token_to_id(config["model"]["unk_token"]) is not None
    )


def _char_table(tokenizer: Tokenizer) -> np.ndarray:
    """code point -> id of a character tokenizer, one entry past the largest known code point for
    the unknown token (the id of every character the table does not hold)."""
    unk = tokenizer.token_to_id(json.loads(tokenizer.to_str())["model"]["unk_token"])
    chars = {token: i for token, i in tokenizer.get_vocab().items() if len(token) == 1}
    table = np.full(max(map(ord, chars), default=-1) + 2, unk, dtype=np.int64)
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
