"""Type tests for config values: YAML and the command line give bools, which Python counts as ints."""

from __future__ import annotations

from typing import Any


def is_int(value: Any) -> bool:
    """An integer, not a bool (``True`` would pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An integer or a float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
