"""Turn user-fixable failures into one clear line instead of a traceback."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TypeVar

from trident.errors import TridentError

T = TypeVar("T")


def find_user_error(err: BaseException) -> TridentError | None:
    """The TridentError behind ``err``, following ``raise ... from`` chains (Hydra's
    ``instantiate`` wraps constructor errors in its own exception)."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if isinstance(current, TridentError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def run_with_clear_errors(fn: Callable[[], T]) -> T:
    """Call ``fn``; on a user error print ``error: <message>`` and exit with status 2.

    Set ``HYDRA_FULL_ERROR=1`` to get the full traceback instead.
    """
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - we re-raise anything that is not a user error
        user_error = find_user_error(err)
        if user_error is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {user_error}", file=sys.stderr)
        sys.exit(2)
