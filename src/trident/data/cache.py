"""Prepared-data caches built in a staging directory and published by one rename, so a run never
picks up a half-built cache (the data modules hold a file lock while they build)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer


def fresh_staging(cache_path: Path) -> Path:
    """An empty place (not yet created) beside ``cache_path`` to build the cache in."""
    staging = cache_path.with_name(cache_path.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    return staging


def publish_cache(staging: Path, cache_path: Path, tokenizer: Tokenizer, meta: dict[str, Any]) -> None:
    """Add the tokenizer and ``meta.json`` (written last: its presence marks a complete cache),
    then move ``staging`` to ``cache_path`` in one rename."""
    tokenizer.save(str(staging / "tokenizer.json"))
    (staging / "meta.json").write_text(json.dumps(meta, indent=1))
    shutil.rmtree(cache_path, ignore_errors=True)
    staging.rename(cache_path)


def content_key(files: Any) -> Any:
    """``data.files`` (a path, a list, or {split: path(s)}; a path may be a directory) with each existing file replaced by the
    sha256 of its bytes and its suffix (which decides how it is parsed), for the cache key: a file
    edited in place, or another file reached by the same relative path, gets a new cache. Paths
    that name no file stay as written; reading the data reports them."""
    if isinstance(files, dict):
        return {split: content_key(paths) for split, paths in files.items()}
    if isinstance(files, (list, tuple)):
        return [content_key(path) for path in files]
    path = Path(str(files))
    if files is not None and path.is_dir():  # a folder of files or a saved dataset: every file in it
        return {str(p.relative_to(path)): content_key(p) for p in sorted(path.rglob("*")) if p.is_file()}
    if files is None or not path.is_file():
        return files
    with path.open("rb") as handle:
        return f"sha256:{hashlib.file_digest(handle, 'sha256').hexdigest()}{path.suffix.lower()}"
