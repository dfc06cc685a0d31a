"""Turn user-fixable failures into one clear line instead of a traceback."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from hydra.core.config_store import ConfigStore
from hydra.core.plugins import Plugins

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


def check_group_choices(argv: Sequence[str], conf_dir: Path) -> None:
    """Fail in one line on ``group=option`` arguments naming no file in ``conf/<group>/``.

    Hydra would report the same after composing, as a multi-line message; checking the command
    line first keeps the promise of one line and exit status 2. Sweeps (``a,b``) are checked per value.
    """
    for arg in argv:
        key, sep, value = arg.partition("=")
        group = conf_dir / key.lstrip("+")
        if not sep or "." in key or not group.is_dir() or value in ("null", ""):
            continue
        choices = group_options(key.lstrip("+"), group)
        for option in value.split(","):
            if option not in choices:
                print(f"error: {key.lstrip('+')}={option} does not exist: choose one of {', '.join(choices)}", file=sys.stderr)
                sys.exit(2)


def group_options(name: str, group_dir: Path) -> list[str]:
    """The options of config group ``name``: its files, and for Hydra's own groups also the
    options that installed plugins provide (e.g. ``hydra/launcher=submitit_slurm``)."""
    options = {p.stem for p in group_dir.glob("*.yaml")}
    if name.startswith("hydra/"):
        Plugins.instance()  # discovering the plugins registers their configs
        options |= {o.removesuffix(".yaml") for o in ConfigStore.instance().list(name)}
    return sorted(options)


def discard_failed_run_dir(run_dir: Path) -> None:
    """Remove a run directory that a failure left with nothing but Hydra's bookkeeping."""
    if not run_dir.is_dir():
        return
    contents = {p.name for p in run_dir.iterdir()}
    log = run_dir / "train.log"
    if contents <= {".hydra", "train.log", "config_resolved.yaml"} and (not log.exists() or log.stat().st_size < 4096):
        shutil.rmtree(run_dir, ignore_errors=True)


def run_with_clear_errors(fn: Callable[[], T], run_dir: Path | None = None) -> T:
    """Call ``fn``; on a user error print ``error: <message>`` and exit with status 2, removing
    ``run_dir`` if the failure left it empty. ``HYDRA_FULL_ERROR=1`` shows the traceback instead."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - we re-raise anything that is not a user error
        user_error = find_user_error(err)
        if user_error is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        if run_dir is not None:
            discard_failed_run_dir(run_dir)
        print(f"error: {user_error}", file=sys.stderr)
        sys.exit(2)
