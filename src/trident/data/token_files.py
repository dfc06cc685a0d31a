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

from trident.data.special_tokens import PAD_TOKEN, SEP_TOKEN, SEQ_END_TOKEN, SEQ_PAD_TOKEN
from trident.data.streams import Piece, Stream
from trident.data.tokenization import END_OF_TEXT, every_character
from trident.errors import DataError

log = logging.getLogger(__name__)

BATCH_PIECES = max(8, 4 * (os.cpu_count() or 1))  # enough pieces per batch to keep every core busy
# A split with more unknown or padding ids than this share stops. Text under a tokenizer made for it is
# a few percent unknown at most (BERT's English WordPiece well under 1 %; a character vocabulary only
# misses characters unseen in training); a tokenizer that does not read the text (another language or
# script, a normalizer skipped, a broken file) gives mostly unknowns, and the broken cases seen gave
# 100 %. Half is far from both: no alarm on real text, and a model is never trained on noise.
MOSTLY_FILLER = 0.5
PAD_NAMES = (PAD_TOKEN, SEQ_PAD_TOKEN)
SEPARATOR_NAMES = (SEP_TOKEN, SEQ_END_TOKEN)  # BERT's, and RoBERTa's / T5's, for a file without their post-processor
BLANK_LINE = "\n\n"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.int32)


def end_of_document(tokenizer: Tokenizer) -> list[int]:
    """The ids that end each document (logged), the first of: ``<|endoftext|>`` in the vocabulary; the
    special token the tokenizer's post-processor closes a text with (BERT's ``[SEP]``, RoBERTa's and
    T5's ``</s>``); ``[SEP]`` or ``</s>`` in the vocabulary; a blank line, where the tokenizer reads
    one (a character vocabulary: weights that come with it keep fitting it); else ``<|endoftext|>``
    added to ``tokenizer`` as a special token (one more id)."""
    vocabulary = tokenizer.get_vocab()
    if END_OF_TEXT in vocabulary:
        return _ends_in([vocabulary[END_OF_TEXT]], END_OF_TEXT, "in the vocabulary")
    if (closing := closing_special(tokenizer)) is not None:
        return _ends_in([vocabulary[closing]], closing, "the token the post-processor puts after a text")
    for name in SEPARATOR_NAMES:
        if name in vocabulary:
            return _ends_in([vocabulary[name]], name, "the vocabulary's separator")
    blank = tokenizer.encode(BLANK_LINE, add_special_tokens=False).ids
    if blank and not np.isin(blank, filler_ids(tokenizer)).any():
        return _ends_in(blank, "a blank line", "the vocabulary has no end-of-document token")
    tokenizer.add_special_tokens([AddedToken(END_OF_TEXT, special=True)])
    return _ends_in([tokenizer.token_to_id(END_OF_TEXT)], END_OF_TEXT, "added: the vocabulary had no separator")


def _ends_in(ids: list[int], name: str, why: str) -> list[int]:
    log.info("data: each document ends in %s (ids %s, %s)", name, ids, why)
    return ids


def closing_special(tokenizer: Tokenizer) -> str | None:
    """The last special token the post-processor puts after a single text, if any."""
    after = special_tokens_around(tokenizer)[1]
    return after[-1] if after else None


def special_tokens_around(tokenizer: Tokenizer) -> tuple[list[str], list[str]]:
    """The special tokens the post-processor puts before and after a single text: ``[CLS]`` and
    ``[SEP]`` for BERT, ``<s>`` and ``</s>`` for RoBERTa, none for trident's own tokenizers."""
    probe = Tokenizer.from_str(tokenizer.to_str())  # a copy: the file's padding would add tokens after the text
    probe.no_padding()
    probe.no_truncation()
    encoding = probe.encode("a")
    texts = [i for i, sequence in enumerate(encoding.sequence_ids) if sequence is not None]
    if not texts:
        return [], []
    return encoding.tokens[: texts[0]], encoding.tokens[texts[-1] + 1 :]


class Encoder:
    """``tokenizer`` as a function of a batch of texts -> one flat id array: each piece's ids are those
    of ``tokenizer.encode(text, add_special_tokens=False)`` with the file's truncation and padding off (a
    corpus is never cut to a model's length; special tokens never sit inside a document), and
    ``separator`` after each piece that ends a document (:func:`end_of_document`; None where none does)."""

    def __init__(self, tokenizer: Tokenizer, separator: list[int] | None) -> None:
        self.tokenizer = Tokenizer.from_str(tokenizer.to_str())  # a copy: truncation and padding go below
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.dtype = token_dtype(tokenizer.get_vocab_size())
        self.separator = None if separator is None else np.array(separator, dtype=self.dtype)
        self.fillers = filler_ids(tokenizer)
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
                out.append(self.separator)
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


def filler_ids(tokenizer: Tokenizer) -> np.ndarray:
    """The ids that stand for no text: the model's unknown token and the padding tokens."""
    config = json.loads(tokenizer.to_str())
    model, padding = config["model"], config["padding"]
    names = {model.get("unk_token"), *PAD_NAMES, padding["pad_token"] if padding else None}
    ids = {tokenizer.token_to_id(name) for name in names if name} | {model.get("unk_id")}  # unk_id: Unigram's
    return np.array(sorted(i for i in ids if i is not None), dtype=np.int64)


def check_informative(split: str, tokens: int, fillers: int, tokenizer_name: str) -> None:
    """Stop on a split whose ids are mostly unknown or padding (:data:`MOSTLY_FILLER`), whatever the cause."""
    if tokens and fillers > MOSTLY_FILLER * tokens:
        raise DataError(
            f"the {split} split is {fillers / tokens:.0%} unknown or padding ids ({fillers:,} of {tokens:,}) with "
            f"data.tokenizer={tokenizer_name}: that tokenizer does not read this text (another language, or a "
            "vocabulary or normalizer that does not fit it); use a tokenizer.json made for this text, or data.tokenizer=bpe"
        )


def batches(stream: Stream, size: int = BATCH_PIECES) -> Iterator[list[Piece]]:
    pieces = stream()
    while batch := list(islice(pieces, size)):
        yield batch


def write_tokens(stream: Stream, encoder: Encoder, path: Path) -> tuple[int, int]:
    """Tokenize ``stream`` into ``path``, batch by batch; returns the number of tokens and how many of
    them are unknown or padding (:func:`filler_ids`)."""
    count = fillers = 0
    with path.open("wb") as out:
        for batch in batches(stream):
            ids = encoder(batch)
            out.write(ids.tobytes())
            count += ids.size
            fillers += int(np.isin(ids, encoder.fillers).sum())
    return count, fillers


def read_tokens(path: Path, dtype: str, count: int) -> np.ndarray:
    """The ids written by :func:`write_tokens`, memory-mapped read-only (not loaded)."""
    if count == 0:
        return np.empty(0, dtype=dtype)
    return np.memmap(path, dtype=np.dtype(dtype), mode="r", shape=(count,))
