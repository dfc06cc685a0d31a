"""Rich progress bars for the long steps outside the training loop (data preparation)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar

from rich.progress import track

T = TypeVar("T")


def progress_track(items: Sequence[T] | Iterable[T], description: str, total: float | None = None) -> Iterator[T]:
    """Iterate with a rich progress bar (transient, so logs stay readable); ``total`` sizes the
    bar of an iterator that has no length."""
    yield from track(items, description=description, total=total, transient=True)
