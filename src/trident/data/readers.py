"""Your own data files -> Hugging Face ``datasets`` tables, whatever the task.

``data.files`` is one path, a list of paths, or ``{train: ..., validation: ..., test: ...}``; a
path is a file (``.txt``, ``.jsonl``/``.json``, ``.csv``/``.tsv``, ``.parquet``), a directory
written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``, or a directory of such files.
Every problem with a file (missing, empty, binary, a malformed JSON line, a missing column) is one
:class:`DataError` line that names the file and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trident.errors import ConfigError, DataError

if TYPE_CHECKING:
    # `datasets` (with pandas and pyarrow) takes a second to import: imported where a table is read.
    import datasets

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


def split_name(name: str) -> str:
    """``valid`` / ``dev`` / ``val`` -> ``validation``; an unknown split name is a ConfigError."""
    for split, aliases in SPLIT_ALIASES.items():
        if name in aliases:
            return split
    raise ConfigError(f"unknown split {name!r} in data.files: use train, validation and test")


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


def is_saved_dataset(path: Path) -> bool:
    """A directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def expand(path: Path) -> list[Path]:
    """A data file, a saved dataset, or every data file under a directory (sorted, recursive)."""
    if path.is_file() or (path.is_dir() and is_saved_dataset(path)):
        return [path.resolve()]
    if not path.is_dir():
        raise DataError(f"data file {str(path)!r} not found: fix data.files (paths are relative to the directory you run from)")
    found = sorted(p.resolve() for p in path.rglob("*") if p.is_file() and p.suffix.lower() in DATA_SUFFIXES)
    if not found:
        raise DataError(f"directory {str(path)!r} holds no data files: put {', '.join(DATA_SUFFIXES)} files in it")
    return found


def check_file(path: Path) -> None:
    """Refuse an empty or binary file before a parser chokes on it with a traceback."""
    if path.is_dir():
        return
    with path.open("rb") as handle:
        head = handle.read(8192)
    if not head.strip():
        raise DataError(f"{path} is empty: put data in it or remove it from data.files")
    if path.suffix.lower() == ".parquet":
        if not head.startswith(b"PAR1"):
            raise DataError(f"{path} is not a parquet file (no PAR1 header): re-export it, or give it its real suffix")
    elif b"\0" in head:
        raise DataError(f"{path} is a binary file, not text: give a text, JSON lines, CSV/TSV or parquet file")


def load_table(path: Path, columns: list[str]) -> datasets.Dataset | datasets.DatasetDict:
    """One file or saved dataset as a ``datasets`` table (a saved ``DatasetDict`` stays one) that
    holds ``columns``; a text file is one row per line, its line breaks kept."""
    import datasets

    check_file(path)
    suffix = path.suffix.lower()
    if path.is_dir():
        loaded: datasets.Dataset | datasets.DatasetDict = datasets.load_from_disk(str(path))
    elif suffix in TEXT_SUFFIXES:
        loaded = _load(path, "text", {"sample_by": "line", "keep_linebreaks": True})
    elif suffix in TABLE_BUILDERS:
        builder, options = TABLE_BUILDERS[suffix]
        loaded = _load(path, builder, options)
    else:
        raise DataError(f"{path} has suffix {suffix!r}, which trident cannot read: use one of {', '.join(DATA_SUFFIXES)}")
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
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DataError(f"could not read {path} as {builder} ({first}): check the file's format and suffix") from err


def _raise_bad_json_line(path: Path) -> None:
    """Name the first line of a JSON lines file that is not one JSON object."""
    with path.open(encoding="utf-8", errors="replace") as handle:
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
                return {split_name(name): table.select_columns(columns) for name, table in loaded.items()}
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
