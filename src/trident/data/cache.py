"""Prepared-data caches built in a staging directory and published by one rename, so a run never
picks up a half-built cache (the data modules hold a file lock while they build)."""

from __future__ import annotations

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
