"""Text corpora as streams of pieces, so preparation never holds a corpus in memory.

A stream is a function that starts a new pass over the corpus: it yields ``(text, ends_document)``
pieces (a text file in newline-aligned chunks of ~256 K characters, a table one row per
document). Preparation makes several passes (count, train the tokenizer, tokenize), each
reading the files again rather than keeping them.
"""

from __future__ import annotations

import gzip
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from trident.data.readers import (
    TEXT_SUFFIXES,
    check_file,
    check_split,
    check_utf8,
    expand,
    files_by_split,
    format_suffix,
    load_table,
    open_text,
    saved_splits,
    split_name,
)
from trident.errors import ConfigError, DataError

if TYPE_CHECKING:
    # `datasets` (with pandas and pyarrow) takes a second to import: imported where a table is read.
    import datasets

log = logging.getLogger(__name__)

Piece = tuple[str, bool]  # (text, whether a document ends with it)
Stream = Callable[[], Iterator[Piece]]
CHUNK_CHARS = 1 << 18


def text_file_pieces(path: Path, chunk_chars: int = CHUNK_CHARS) -> Iterator[Piece]:
    """A UTF-8 text file (one document, gzip-compressed or not) in chunks that end at a line break."""
    carry = ""
    try:
        with open_text(path) as handle:  # \r\n stays as written
            while block := handle.read(chunk_chars):
                text = carry + block
                cut = piece_end(text)
                if cut == 0 and len(text) < 16 * chunk_chars:  # no line break yet: read on
                    carry = text
                    continue
                cut = cut or len(text)
                yield text[:cut], False
                carry = text[cut:]
    except UnicodeDecodeError:
        check_utf8(path)  # names the line that is not UTF-8
        raise
    except (gzip.BadGzipFile, EOFError) as err:  # check_file read only its first block
        raise DataError(f"{path} is damaged gzip data ({err}): compress it again, or decompress what is left") from None
    yield carry, True


def piece_end(text: str) -> int:
    """Where a piece of ``text`` ends: after its last line break between two characters that are not
    whitespace, so the pieces tokenize as the whole text does for tokenizers that split at whitespace
    (GPT-2's byte-level BPE joins a line break to the spaces around it); else after its last line
    break; 0 without one."""
    end = len(text) - 1  # the character after the break must be there to look at
    while (newline := text.rfind("\n", 0, end)) > 0:
        if not text[newline - 1].isspace() and not text[newline + 1].isspace():
            return newline + 1
        end = newline
    return text.rfind("\n") + 1


def table_pieces(table: datasets.Dataset, column: str) -> Iterator[Piece]:
    """Each non-empty row of ``column`` is one document."""
    for batch in table.iter(batch_size=1000):
        for text in batch[column]:
            if text:
                yield str(text), True


def file_stream(paths: list[Path], column: str) -> Stream:
    """Text files stream as they are; the other formats go through ``datasets`` (read once here,
    so a malformed file fails before any work)."""
    import datasets

    parts: list[Path | datasets.Dataset] = []
    for path in (p for given in paths for p in expand(given)):
        if path.is_file() and format_suffix(path) in TEXT_SUFFIXES:
            check_file(path)
            parts.append(path)
        else:
            table = load_table(path, [column])
            if isinstance(table, datasets.DatasetDict):
                raise DataError(f"{path} holds a DatasetDict ({', '.join(table)}): give it as the only data.files path")
            parts.append(table)

    def pieces() -> Iterator[Piece]:
        for part in parts:
            yield from text_file_pieces(part) if isinstance(part, Path) else table_pieces(part, column)

    return pieces


def list_stream(texts: list[str]) -> Stream:
    """In-memory texts (the packaged corpora) joined by line breaks, as one continuous text."""

    def pieces() -> Iterator[Piece]:
        for i, text in enumerate(texts):
            yield (text if i == len(texts) - 1 else text + "\n"), False

    return pieces


def cut_stream(stream: Stream, shares: dict[str, float]) -> dict[str, Stream]:
    """Cut one stream into contiguous parts (in the order of ``shares``, fractions of its
    characters), each cut just after a line break, so no passage straddles two parts."""
    total = sum(len(text) for text, _ in stream())
    names = list(shares)
    ends, acc = [], 0.0
    for name in names:
        acc += shares[name]
        ends.append(total if name == names[-1] else int(total * acc))

    def part(wanted: str) -> Stream:
        def pieces() -> Iterator[Piece]:
            index, position = 0, 0
            for text, ends_document in stream():
                if not text and names[index] == wanted:  # a document's end with no text after its last chunk
                    yield text, ends_document
                while text:
                    room = ends[index] - position
                    if index == len(names) - 1 or len(text) <= room:
                        head, text, closes = text, "", ends_document
                    else:
                        newline = text.find("\n", max(room - 1, 0))
                        cut = len(text) if newline < 0 else newline + 1
                        head, text, closes = text[:cut], text[cut:], ends_document and cut == len(text)
                    if names[index] == wanted:
                        yield head, closes
                    position += len(head)
                    while index < len(names) - 1 and position >= ends[index]:
                        index += 1

        return pieces

    return {name: part(name) for name in names}


def split_streams(given: dict[str, Stream], fractions: list[float], test_on_validation: bool) -> dict[str, Stream]:
    """train / validation / test from the splits the data gives: each missing one is cut from the
    end of train with its ``data.split`` fraction (logged), never copied from another split,
    except test from validation when ``data.test_on_validation=true`` asks for it."""
    check_split(fractions)
    splits = dict(given)
    if test_on_validation:
        if "test" in splits or "validation" not in splits:
            raise ConfigError("data.test_on_validation=true needs a given validation split and no test split: drop the option or fix data.files")
        splits["test"] = splits["validation"]
        log.warning("data: the test split is the validation split (data.test_on_validation=true)")
    missing = [name for name in ("validation", "test") if name not in splits]
    if missing:
        share = dict(zip(("train", "validation", "test"), fractions))
        cut = {"train": 1.0 - sum(share[m] for m in missing)} | {m: share[m] for m in missing}
        if min(cut.values()) <= 0:
            raise ConfigError(f"data.split={list(fractions)} leaves no room to cut {' and '.join(missing)} from train: give them in data.files or change data.split")
        log.info("data: %s cut from the end of the train data (%s of its characters, data.split)",
                 " and ".join(missing), ", ".join(f"{m} {share[m]:.1%}" for m in missing))
        splits |= cut_stream(splits["train"], cut)
    return {name: splits[name] for name in ("train", "validation", "test")}


def local_streams(files: object, column: str) -> dict[str, Stream]:
    """``data.files`` -> a stream per split it gives (a saved DatasetDict gives its own)."""
    import datasets

    by_split = files_by_split(files)
    if set(by_split) == {"train"} and len(by_split["train"]) == 1:
        only = expand(by_split["train"][0])
        if only[0].is_dir():
            loaded = load_table(only[0], [column])
            if isinstance(loaded, datasets.DatasetDict):
                return {split: _table_stream(t, column) for split, t in saved_splits(loaded, only[0]).items()}
    return {name: file_stream(paths, column) for name, paths in by_split.items()}


def dict_streams(loaded: datasets.DatasetDict, column: str) -> dict[str, Stream]:
    """The splits of a hub dataset whose names trident knows (train, validation / valid / dev, test)."""
    streams = {}
    for name, table in loaded.items():
        try:
            streams[split_name(name)] = _table_stream(table, column)
        except ConfigError:
            log.info("data: split %r of the dataset is not used (not train, validation or test)", name)
    if "train" not in streams:
        raise DataError(f"the dataset has no train split (it has {', '.join(loaded)}): give data.files / data.hub_path with one")
    return streams


def _table_stream(table: datasets.Dataset, column: str) -> Stream:
    if column not in table.column_names:
        raise DataError(f"the dataset has no column {column!r} (its columns: {', '.join(table.column_names)}): set data.text_column")
    return lambda: table_pieces(table, column)
