"""User-facing errors: each message names the problem and the fix in one line, and the commands
print them as one ``error: ...`` line instead of a traceback (:func:`run_with_clear_errors`); and the
type tests for config values that decide them (:func:`is_int`, :func:`is_number`)."""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


class TridentError(Exception):
    """A problem the user can fix (bad config value, missing file, ...).

    ``train.py`` prints these as a single ``error: ...`` line instead of a traceback, and exits
    with ``exit_status``.
    """

    exit_status = 2


class ConfigError(TridentError, ValueError):
    """An invalid or inconsistent configuration value."""


class DataError(TridentError):
    """A missing, empty or unreadable dataset or corpus."""


class TrainingDiverged(TridentError):
    """Training produced a non-finite loss (the run stops before the bad step)."""


def did_you_mean(word: str, choices: Sequence[str], prefix: str = "") -> str:
    """`` (did you mean <prefix><closest>?)`` for a misspelt name, or an empty string."""
    close = difflib.get_close_matches(word, choices, n=1)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def choose(table: Mapping[str, T], name: str, setting: str) -> T:
    """``table[name]`` for a part chosen by name in the config (``setting``, e.g. ``model.norm``);
    an unknown name fails loudly, naming the choices."""
    if name not in table:
        hint = did_you_mean(str(name), list(table))
        raise ConfigError(f"{setting}={name!r} is not supported{hint}: choose one of {', '.join(table)}")
    return table[name]


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


def run_with_clear_errors(fn: Callable[[], T], cleanup: Callable[[], None] | None = None) -> T:
    """Call ``fn``; on a user error run ``cleanup`` (e.g. remove a run directory the failure left
    empty), print ``error: <message>`` and exit with its status (2). ``HYDRA_FULL_ERROR=1`` shows
    the traceback instead."""
    try:
        return fn()
    except Exception as err:
        user_error = find_user_error(err)
        if user_error is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        if cleanup is not None:
            cleanup()
        print(f"error: {user_error}", file=sys.stderr)
        sys.exit(user_error.exit_status)


# Type tests for config values: YAML and the command line give bools, which Python counts as ints.
def is_int(value: Any) -> bool:
    """An integer, not a bool (``True`` would pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An integer or a float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
