"""Turn user-fixable failures into one clear line instead of a traceback."""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn, TypeVar

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.core.plugins import Plugins
from hydra.errors import ConfigCompositionException, HydraException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trident.config import compose_train_config
from trident.errors import TridentError, did_you_mean
from trident.extras import composition_extra, plugin_extra

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
            if option not in choices and (missing := plugin_extra(f"{key.lstrip('+')}/{option}")):
                _fail(str(missing))
            if option not in choices:
                _fail(f"{key.lstrip('+')}={option} does not exist: choose one of {', '.join(choices)}")


def check_overrides(argv: Sequence[str], conf_dir: Path) -> None:
    """Compose the config once with the command line's ``key=value`` arguments (a sweep with its
    first value), so that a misspelt key or a malformed value fails in one line and exit status 2
    instead of Hydra's multi-line report. Other Hydra flags (``--cfg``, ``--help``, ``-cn``...)
    change what the command line means: Hydra checks those command lines itself."""
    if any(arg.startswith("-") and arg not in ("-m", "--multirun") for arg in argv):
        return
    overrides = [arg for arg in argv if not arg.startswith("-")]
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except OverrideParseException as err:
        _fail(f"cannot read the command line ({_first_line(err)}): write key=value, quoting values that hold spaces or brackets")
    single = [one for text, override in zip(overrides, parsed) if (one := _one_value(text, override)) is not None]
    try:
        compose_train_config(single, conf_dir=conf_dir)
    except (ConfigCompositionException, OmegaConfBaseException) as err:
        _fail(_composition_error(err, single, conf_dir))


def _one_value(text: str, override: Override) -> str | None:
    """``text`` itself, or for a sweep (``a,b``, ``range(...)``) the override with its first value;
    None for sweeps a sweeper expands itself (e.g. Optuna's ``interval(...)``)."""
    if not override.is_sweep_override():
        return text
    try:
        first = next(override.sweep_string_iterator())
    except HydraException:  # interval(), glob(), tag(): no list of values to take the first of
        return None
    return f"{text.partition('=')[0]}={first}"


def _composition_error(err: Exception, overrides: list[str], conf_dir: Path) -> str:
    if (missing := composition_extra(str(err))) is not None:  # e.g. hparams_search=... without the [sweep] extra
        return str(missing)
    key = re.search(r"Could not override '([^']+)'", str(err))
    if key is None:
        return f"the command line does not fit the config ({_first_line(err)}): fix that argument (see python train.py --help)"
    parent, _, leaf = key.group(1).rpartition(".")
    others = [o for o in overrides if o.lstrip("+~").partition("=")[0] != key.group(1)]
    try:
        node = OmegaConf.select(compose_train_config(others, conf_dir=conf_dir), parent) if parent else None
    except (ConfigCompositionException, OmegaConfBaseException):
        node = None
    hint = did_you_mean(leaf, [str(k) for k in node], f"{parent}.") if isinstance(node, DictConfig) else ""
    return f"{key.group(1)} is not a config key{hint}: fix its spelling, or add a new key with +{key.group(1)}=<value>"


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0].rstrip(".")


def _fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
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
    """Call ``fn``; on a user error print ``error: <message>`` and exit with its status (2), removing
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
        sys.exit(user_error.exit_status)
