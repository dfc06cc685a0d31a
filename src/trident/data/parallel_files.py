"""Your own parallel text for translation: TSV, JSON lines, or two line-aligned files per split (each
also gzip-compressed: ``train.tsv.gz``, ``train.en.gz``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets

from trident.data.corpora import load_dataset_or_explain
from trident.data.readers import check_file, check_utf8, expand, files_by_split, format_suffix, open_bytes, open_text
from trident.errors import ConfigError, DataError


def load_parallel_files(files: Any, src_lang: str, tgt_lang: str) -> datasets.DatasetDict:
    """``data.files`` (one path, a list, or {split: path(s)}) -> a table per given split. A split
    is TSV (``src<TAB>tgt``), JSON lines, or two line-aligned files ``<name>.<src_lang>`` and
    ``<name>.<tgt_lang>`` (give both, or the common prefix ``<name>``)."""
    tables = {}
    for split, paths in files_by_split(files).items():
        aligned = line_aligned_files(paths, src_lang, tgt_lang)
        if aligned is not None:
            tables[split] = aligned_pairs(*aligned, src_lang, tgt_lang)
            continue
        data_files = [str(p) for given in paths for p in expand(given)]
        for path in data_files:
            check_file(Path(path))
        suffixes = {format_suffix(Path(p)) for p in data_files}
        for path in data_files:
            check_utf8(Path(path))
        if suffixes <= {".jsonl", ".json"}:
            builder, kwargs = "json", {}
        elif suffixes <= {".tsv", ".txt"}:
            features = datasets.Features({src_lang: datasets.Value("string"), tgt_lang: datasets.Value("string")})
            # Tab-separated, no header, no quoting: a verse may contain quotes; "NA" is a word, not missing.
            builder, kwargs = "csv", {"sep": "\t", "column_names": [src_lang, tgt_lang], "features": features,
                                      "quoting": 3, "na_filter": False}
        else:
            raise ConfigError(
                f"data.files.{split} must be .tsv (src<TAB>tgt) or .jsonl files, or two line-aligned files "
                f"<name>.{src_lang} and <name>.{tgt_lang}; got {', '.join(data_files)}"
            )
        tables[split] = load_dataset_or_explain(builder, {"data_files": data_files, "split": "train", **kwargs},
                                                "check data.files", what="parallel data")
    return datasets.DatasetDict(tables)


def line_aligned_files(paths: list[Path], src_lang: str, tgt_lang: str) -> tuple[Path, Path] | None:
    """``[x.en, x.de]``, or the prefix ``x`` of existing ``x.en`` and ``x.de``, as (source, target)."""
    if len(paths) == 1 and not paths[0].exists():
        pair = paths[0].with_name(f"{paths[0].name}.{src_lang}"), paths[0].with_name(f"{paths[0].name}.{tgt_lang}")
        return pair if all(p.is_file() for p in pair) else None
    if len(paths) == 2:
        by_suffix = {format_suffix(p).lstrip("."): p for p in paths}
        if set(by_suffix) == {src_lang, tgt_lang}:
            return by_suffix[src_lang], by_suffix[tgt_lang]
    return None


def aligned_pairs(src_path: Path, tgt_path: Path, src_lang: str, tgt_lang: str) -> datasets.Dataset:
    """Line i of one file translates line i of the other; files of different lengths are refused."""
    counts = []
    for path in (src_path, tgt_path):
        check_file(path)
        check_utf8(path)
        with open_bytes(path) as handle:
            counts.append(sum(1 for _ in handle))
    if counts[0] != counts[1]:
        raise DataError(
            f"{src_path} has {counts[0]} lines but {tgt_path} has {counts[1]}: line-aligned parallel files "
            "need one line per sentence in each (fix the shorter file, or use one TSV file)"
        )

    # In memory, as the translation data keeps its sentences anyway (and from_generator's cache
    # would be keyed by the path, not the content).
    columns = {}
    for language, path in ((src_lang, src_path), (tgt_lang, tgt_path)):
        with open_text(path) as handle:
            columns[language] = [line.rstrip("\r\n") for line in handle]
    return datasets.Dataset.from_dict(columns)
