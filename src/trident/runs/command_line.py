"""``train.py``'s command line, read once before Hydra starts and before torch, Lightning and W&B are
imported: a misspelt key or option fails in about a second, as one ``error:`` line and exit status 2.

:func:`prepare_command_line` is that one step. A DDP worker gets its job's command line (see
:mod:`trident.launch.distributed`; under torchrun, :mod:`trident.launch.torchrun`); otherwise the ``group=option`` choices are checked against
``conf/``, the config is composed once with the command line (a sweep with its first values), and
``resume=...`` becomes the resumed run's overrides (:mod:`trident.runs.resume`). Everything here
imports Hydra and OmegaConf only.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, ValueType
from hydra.core.plugins import Plugins
from hydra.errors import ConfigCompositionException, HydraException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trident.errors import ConfigError, did_you_mean, run_with_clear_errors
from trident.extras import composition_extra, plugin_extra
from trident.launch.torchrun import check_one_job, job_of_rank_zero, torchrun_rank
from trident.launch.workers import JOB_VARIABLE, is_ddp_worker, worker_arguments
from trident.runs.compose import CONF_DIR, compose_train_config
from trident.runs.resume import MULTIRUN_FLAGS, resume_arguments, resumed_run_dir


def prepare_command_line(argv: Sequence[str], conf_dir: Path = CONF_DIR) -> list[str]:
    """The arguments Hydra gets for ``train.py <argv>``: checked, with ``resume=...`` expanded.
    A user error exits here with one ``error:`` line (status 2)."""
    run_with_clear_errors(lambda: check_one_job(list(argv), MULTIRUN_FLAGS))
    rank = torchrun_rank()
    if rank not in (None, 0):  # torchrun started this rank: it runs rank 0's job (trident.launch.torchrun)
        os.environ[JOB_VARIABLE] = run_with_clear_errors(lambda: job_of_rank_zero(rank))
        return worker_arguments(argv)
    if is_ddp_worker():
        return worker_arguments(argv)  # its launching process checked this command line already
    # Other Hydra flags (--help, --cfg, -cn...) change what the command line means: Hydra checks
    # those command lines itself after composing.
    hydra_checks = any(arg.startswith("-") and arg not in MULTIRUN_FLAGS for arg in argv)

    def checked() -> list[str]:
        check_group_choices(argv, conf_dir)
        if not hydra_checks and resumed_run_dir(argv) is not None:
            # Checked with the run's saved overrides first: a key of a group that the run chose
            # (callbacks.early_stopping.patience after callbacks=early_stopping) is a key of its config.
            arguments = resume_arguments(argv, None, conf_dir)
            compose_checked([a for a in arguments if not a.startswith("hydra.run.dir=")], conf_dir)
            return arguments
        cfg = None if hydra_checks else compose_checked(argv, conf_dir)
        return resume_arguments(argv, cfg, conf_dir)

    return run_with_clear_errors(checked)


def check_group_choices(argv: Sequence[str], conf_dir: Path) -> None:
    """Fail in one line on ``group=option`` arguments naming no file in ``conf/<group>/``.

    Hydra would report the same after composing, as a multi-line message. Sweeps (``a,b`` and
    ``choice(a,b)``, which trident.report.adaptive writes) are checked per value; ``glob(...)`` picks among
    the options itself, and a value Hydra cannot parse is left to :func:`compose_checked`.
    """
    for arg in argv:
        key, sep, value = arg.partition("=")
        group = conf_dir / key.lstrip("+")
        if not sep or "." in key or not group.is_dir() or value in ("null", ""):
            continue
        choices = group_options(key.lstrip("+"), group)
        for option in _group_values(arg):
            if option not in choices and (missing := plugin_extra(f"{key.lstrip('+')}/{option}")):
                raise missing  # e.g. hydra/launcher=slurm without the [slurm] extra
            if option not in choices:
                raise ConfigError(f"{key.lstrip('+')}={option} does not exist: choose one of {', '.join(choices)}")


def _group_values(arg: str) -> list[str]:
    """The options a ``group=...`` argument names: one per job of a sweep, or the options of a list."""
    try:
        override = OverridesParser.create().parse_override(arg)
    except HydraException:  # OverrideParseException, or the grammar's own error
        return []
    if override.value_type == ValueType.GLOB_CHOICE_SWEEP:  # matched against the options by Hydra
        return []
    if override.is_choice_sweep():
        return list(override.sweep_string_iterator())
    if override.is_sweep_override():
        return []
    value = override.value()
    # A list (logger=[wandb,tensorboard]) picks several options of the group at once.
    return [str(option) for option in value] if isinstance(value, list) else [str(value)]


def compose_checked(argv: Sequence[str], conf_dir: Path) -> DictConfig:
    """The config composed with the command line's ``key=value`` arguments (a sweep with its first
    value), so that a misspelt key or a malformed value fails in one line instead of Hydra's
    multi-line report."""
    overrides = [arg for arg in argv if arg not in MULTIRUN_FLAGS]
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except OverrideParseException as err:
        raise ConfigError(
            f"cannot read the command line ({_first_line(err)}): write key=value, quoting values that hold spaces or brackets"
        ) from None
    single = [one for text, override in zip(overrides, parsed) if (one := _one_value(text, override)) is not None]
    try:
        return compose_train_config(single, conf_dir=conf_dir)
    except (ConfigCompositionException, OmegaConfBaseException) as err:
        raise ConfigError(_composition_error(err, single, conf_dir)) from None


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
    # The keys next to the misspelt one, from the config without it (composed again on this error path only).
    others = [o for o in overrides if o.lstrip("+~").partition("=")[0] != key.group(1)]
    try:
        cfg = compose_train_config(others, conf_dir=conf_dir)
    except (ConfigCompositionException, OmegaConfBaseException):
        return f"{key.group(1)} is not a config key: fix its spelling, or add a new key with +{key.group(1)}=<value>"
    node = OmegaConf.select(cfg, parent) if parent else cfg
    keys = [str(k) for k in node] if isinstance(node, DictConfig) else []
    hint = did_you_mean(leaf, keys, f"{parent}." if parent else "")
    return f"{key.group(1)} is not a config key{hint}: fix its spelling, or add a new key with +{key.group(1)}=<value>"


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0].rstrip(".")


def group_options(name: str, group_dir: Path) -> list[str]:
    """The options of config group ``name``: its files (but ``_*.yaml``, parts the options share,
    e.g. ``model/_architecture.yaml``), and for Hydra's own groups also the options that installed
    plugins provide (e.g. ``hydra/launcher=submitit_slurm``)."""
    options = {p.stem for p in group_dir.glob("*.yaml") if not p.name.startswith("_")}
    if name.startswith("hydra/"):
        Plugins.instance()  # discovering the plugins registers their configs
        options |= {o.removesuffix(".yaml") for o in ConfigStore.instance().list(name)}
    return sorted(options)
