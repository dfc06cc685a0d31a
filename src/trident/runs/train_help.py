"""``trident-train --help``: the config groups with their options and the config the command line composes, as
Hydra's own ``--help`` shows them, in a fraction of its time.

Hydra's help lists each group's options through a fresh config repository per group (it deep-copies every
config, 160 times for trident's groups): 3-4 s of a 4 s answer. The options are the files of ``conf/<group>/``
(:func:`group_options`, which ``train.py`` checks choices against too), so they are read from the directory;
the config is composed once, with the command line's overrides, as a run would compose it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from omegaconf import OmegaConf

from trident.runs.command_line import compose_checked, group_options
from trident.runs.compose import CONF_DIR

HELP_FLAGS = ("--help", "-h")


def wants_help(argv: Sequence[str]) -> bool:
    """``--help`` / ``-h`` on the command line (Hydra's ``--hydra-help`` stays Hydra's)."""
    return any(arg in HELP_FLAGS for arg in argv)


def config_groups(conf_dir: Path) -> dict[str, list[str]]:
    """Every config group under ``conf_dir`` (nested ones as ``architecture/task``) -> its options; Hydra's own
    groups (``hydra/...``) are left to ``--hydra-help``."""
    groups = {}
    for directory in sorted(path for path in conf_dir.rglob("*") if path.is_dir()):
        name = directory.relative_to(conf_dir).as_posix()
        if name != "hydra" and not name.startswith("hydra/") and (options := group_options(name, directory)):
            groups[name] = options
    return groups


def train_help(argv: Sequence[str], conf_dir: Path = CONF_DIR) -> str:
    """The help text of ``trident-train <argv>``: the groups, then the config that ``argv``'s overrides compose."""
    overrides = [arg for arg in argv if not arg.startswith("-")]
    groups = "\n".join(f"{name}: {', '.join(options)}" for name, options in config_groups(conf_dir).items())
    config = OmegaConf.to_yaml(compose_checked(overrides, conf_dir))
    return (
        "trident-train: train a Transformer (docs/configuration.md). Hydra's own options: --hydra-help\n\n"
        "== Configuration groups ==\nCompose your configuration from those groups (group=option)\n\n"
        f"{groups}\n\n\n== Config ==\nOverride anything in the config (foo.bar=value)\n\n{config}"
    )
