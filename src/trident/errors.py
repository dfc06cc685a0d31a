"""User-facing errors: each message names the problem and the fix in one line."""

import difflib
from collections.abc import Sequence


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
