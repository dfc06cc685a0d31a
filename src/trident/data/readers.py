"""Your own data files -> Hugging Face ``datasets`` tables, whatever the task.

``data.files`` is one path, a list of paths, or ``{train: ..., validation: ..., test: ...}``; a
path is a file (``.txt``, ``.jsonl``/``.json``, ``.csv``/``.tsv``, ``.parquet``; the text formats
also gzip-compressed, ``docs.jsonl.gz``), a directory written by ``Dataset.save_to_disk`` /
``DatasetDict.save_to_disk``, or a directory of such files. Every problem with a file (missing, empty,
binary, not UTF-8, a malformed JSON line, a missing column) is one :class:`DataError` line that names
the file and the fix.
"""

from __future__ import annotations

import codecs
import gzip
import json
import logging
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from trident.errors import ConfigError, DataError

if TYPE_CHECKING:
    # `datasets` (with pandas and pyarrow) takes a second to import: imported where a table is read.
    import datasets

log = logging.getLogger(__name__)

SPLITS = ("train", "validation", "test")
SPLIT_ALIASES = {"train": ("train",), "validation": ("validation", "valid", "val", "dev"), "test": ("test",)}


TEXT_SUFFIXES = (".txt", ".text")
# File suffix -> the `datasets` builder that reads it (and its options).
TABLE_BUILDERS: dict[str, tuple[str, dict[str, Any]]] = {
    ".jsonl": ("json", {}),
    ".json": ("json", {}),
    ".csv": ("csv", {}),
    ".tsv": ("csv", {"sep": "\t"}),
    ".parquet": ("parquet", {}),
}
DATA_SUFFIXES = (*TEXT_SUFFIXES, *TABLE_BUILDERS)
# A text format may come gzip-compressed (`datasets` decompresses json and csv itself); parquet compresses
# its own columns.
GZIP_SUFFIX = ".gz"
GZIP_FORMATS = (*TEXT_SUFFIXES, ".jsonl", ".json", ".csv", ".tsv")


class _DropBuilderErrors(logging.Filter):
    """A `datasets` builder logs a file it cannot read at ERROR, then raises: trident reports the raise
    as one line naming the file and the fix, so the builder's own lines would only repeat it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR


for _builder in ("json", "csv", "parquet"):
    logging.getLogger(f"datasets.packaged_modules.{_builder}.{_builder}").addFilter(_DropBuilderErrors())


def split_name(name: str) -> str:
    """``valid`` / ``dev`` / ``val`` -> ``validation``; an unknown split name is a ConfigError."""
    for split, aliases in SPLIT_ALIASES.items():
        if name in aliases:
            return split
    raise ConfigError(f"unknown split {name!r} in data.files: use train, validation and test")


def check_split(fractions: list[float]) -> None:
    """``data.split``: the train, validation and test fractions of a corpus that gives fewer splits."""
    if len(fractions) != 3 or any(f < 0 for f in fractions) or abs(sum(fractions) - 1.0) > 1e-6:
        raise ConfigError(f"data.split must be three non-negative fractions summing to 1, got {list(fractions)}")


def saved_splits(loaded: datasets.DatasetDict, path: Path) -> dict[str, datasets.Dataset]:
    """The splits of a saved ``DatasetDict`` whose names trident knows (train, validation / valid / dev,
    test); any other (IMDB's ``unsupervised``) is left out, and the log says so. It needs a train split."""
    splits = {}
    for name, table in loaded.items():
        try:
            splits[split_name(name)] = table
        except ConfigError:
            log.info("data: split %r of %s is not used (not train, validation or test)", name, path)
    if "train" not in splits:
        raise DataError(f"{path} has no train split (it has {', '.join(loaded)}): save one with it, or give "
                        "data.files={train: ..., validation: ..., test: ...}")
    return splits


def files_by_split(files: Any) -> dict[str, list[Path]]:
    """``data.files`` as {split: paths}; a path or a list of paths is the train split."""
    if not files:
        raise ConfigError("data.source=files needs data.files: a path, a list of paths, or {train: ..., validation: ...}")
    given = dict(files) if isinstance(files, dict) else {"train": files}
    by_split: dict[str, list[Path]] = {}
    for name, paths in given.items():
        paths = [paths] if isinstance(paths, (str, Path)) else list(paths or [])
        if paths:
            by_split.setdefault(split_name(str(name)), []).extend(Path(str(p)) for p in paths)
    if "train" not in by_split:
        raise ConfigError(f"data.files names splits {sorted(by_split)} but no train split: add data.files.train")
    return by_split


def is_gzip(path: Path) -> bool:
    return path.name.lower().endswith(GZIP_SUFFIX)


def format_suffix(path: Path) -> str:
    """The suffix that names a file's format, through a ``.gz``: ``docs.jsonl.gz`` -> ``.jsonl``."""
    return Path(path.name[: -len(GZIP_SUFFIX)]).suffix.lower() if is_gzip(path) else path.suffix.lower()


def open_bytes(path: Path) -> IO[bytes]:
    """A data file's bytes, decompressed when it is gzip."""
    return gzip.open(path, "rb") if is_gzip(path) else path.open("rb")


def open_text(path: Path, errors: str = "strict") -> IO[str]:
    """A data file as UTF-8 text with its line ends as written, decompressed when it is gzip."""
    if is_gzip(path):
        return gzip.open(path, "rt", encoding="utf-8", errors=errors, newline="")
    return path.open(encoding="utf-8", errors=errors, newline="")


def is_saved_dataset(path: Path) -> bool:
    """A directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def expand(path: Path) -> list[Path]:
    """A data file, a saved dataset, or every data file under a directory (sorted, recursive)."""
    if path.is_file() or (path.is_dir() and is_saved_dataset(path)):
        return [path.resolve()]
    if not path.is_dir():
        raise DataError(f"data file {str(path)!r} not found: fix data.files (paths are relative to the directory you run from)")
    found = sorted(p.resolve() for p in path.rglob("*") if p.is_file() and format_suffix(p) in DATA_SUFFIXES)
    if not found:
        raise DataError(f"directory {str(path)!r} holds no data files: put {', '.join(DATA_SUFFIXES)} files in it")
    return found


def check_file(path: Path) -> None:
    """Refuse an empty, binary or wrongly compressed file before a parser chokes on it with a traceback."""
    if path.is_dir():
        return
    if is_gzip(path) and format_suffix(path) in DATA_SUFFIXES and format_suffix(path) not in GZIP_FORMATS:
        raise DataError(f"{path} is gzip-compressed {format_suffix(path)}, which trident reads only uncompressed: "
                        "decompress it with gunzip")
    try:
        with open_bytes(path) as handle:
            head = handle.read(8192)
    except (gzip.BadGzipFile, EOFError) as err:
        raise DataError(f"{path} is not gzip data ({err}): decompress it with gunzip, or drop the .gz from its name") from None
    if not head.strip():
        raise DataError(f"{path} is empty: put data in it or remove it from data.files")
    if format_suffix(path) == ".parquet":
        if not head.startswith(b"PAR1"):
            raise DataError(f"{path} is not a parquet file (no PAR1 header): re-export it, or give it its real suffix")
    elif b"\0" in head:
        raise DataError(f"{path} is a binary file, not text: give a text, JSON lines, CSV/TSV or parquet file")


def load_table(path: Path, columns: list[str]) -> datasets.Dataset | datasets.DatasetDict:
    """One file or saved dataset as a ``datasets`` table (a saved ``DatasetDict`` stays one) that
    holds ``columns``; a text file is one row per line, its line breaks kept."""
    import datasets

    check_file(path)
    suffix = format_suffix(path)
    if path.is_dir():
        loaded: datasets.Dataset | datasets.DatasetDict = datasets.load_from_disk(str(path))
    elif suffix in TEXT_SUFFIXES:
        loaded = _load(path, "text", {"sample_by": "line", "keep_linebreaks": True})
    elif suffix in TABLE_BUILDERS:
        builder, options = TABLE_BUILDERS[suffix]
        if builder != "parquet":
            check_utf8(path)
        loaded = _load(path, builder, options)
    else:
        shown = suffix + (GZIP_SUFFIX if is_gzip(path) else "")
        raise DataError(f"{path} has suffix {shown!r}, which trident cannot read: use one of {', '.join(DATA_SUFFIXES)}")
    for table in loaded.values() if isinstance(loaded, datasets.DatasetDict) else [loaded]:
        missing = [c for c in columns if c not in table.column_names]
        if missing:
            raise DataError(
                f"{path} has no column {missing[0]!r} (its columns: {', '.join(table.column_names)}): "
                "set the data.*_column option to one of them"
            )
    return loaded


def _load(path: Path, builder: str, options: dict[str, Any]) -> datasets.Dataset:
    import datasets

    try:
        return datasets.load_dataset(builder, data_files=[str(path)], split="train", **options)
    except Exception as err:  # datasets wraps parser errors in its own types: find the cause
        if builder == "json":
            _raise_bad_json_line(path)
        if "corresponds to no data" in str(err):  # datasets' words for a table of no rows
            header = " (a header only)" if builder == "csv" else ""
            raise DataError(f"{path} has no rows{header}: put data in it or remove it from data.files") from None
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DataError(f"could not read {path} as {builder} ({first}): check the file's format and suffix") from err


def check_utf8(path: Path) -> None:
    """A text file that is not UTF-8 (e.g. Latin-1 or Windows-1252 text) is one error naming its first
    such line. pyarrow's JSON reader lets such bytes through to a traceback when the rows are read."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with open_bytes(path) as handle:
            while chunk := handle.read(1 << 20):
                decoder.decode(chunk)
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        with open_bytes(path) as handle:  # again, line by line, for the message
            for number, line in enumerate(handle, start=1):
                try:
                    line.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise DataError(f"{path} is not UTF-8 text (line {number}, byte {line[err.start]:#04x}: "
                                    f"{err.reason}): convert it to UTF-8, e.g. with iconv -f latin1 -t utf-8") from None


def _raise_bad_json_line(path: Path) -> None:
    """Name the first line of a JSON lines file that is not one JSON object."""
    with open_text(path, errors="replace") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path} line {number} is not valid JSON ({err.msg}): fix or remove that line") from None
            if not isinstance(value, dict):
                raise DataError(f"{path} line {number} is a JSON {type(value).__name__}, not an object: write one {{...}} per line")


def read_splits(files: Any, columns: list[str]) -> dict[str, datasets.Dataset]:
    """``data.files`` -> {split: one table with ``columns``} for the splits the files give. A
    saved ``DatasetDict`` (the only path given) brings its own splits."""
    import datasets

    by_split = files_by_split(files)
    if set(by_split) == {"train"} and len(by_split["train"]) == 1:
        only = expand(by_split["train"][0])
        if len(only) == 1 and only[0].is_dir():
            loaded = load_table(only[0], columns)
            if isinstance(loaded, datasets.DatasetDict):
                return {split: table.select_columns(columns) for split, table in saved_splits(loaded, only[0]).items()}
    tables: dict[str, datasets.Dataset] = {}
    for split, paths in by_split.items():
        parts = []
        for path in (p for given in paths for p in expand(given)):
            loaded = load_table(path, columns)
            if isinstance(loaded, datasets.DatasetDict):
                raise DataError(f"{path} holds a DatasetDict ({', '.join(loaded)}): give it as the only data.files path")
            parts.append(loaded.select_columns(columns))
        tables[split] = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    return tables
