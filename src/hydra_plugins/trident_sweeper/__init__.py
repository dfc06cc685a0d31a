"""trident's Hydra sweeper (a Hydra plugin must live in the ``hydra_plugins`` namespace package).

Hydra finds plugins by walking the directories of ``hydra_plugins``; an editable install
(``pip install -e .``) maps this package through an import hook that such a walk cannot see, so
:func:`register_sweeper` registers the sweeper by hand before Hydra looks for it."""

from __future__ import annotations

import importlib

from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper


def register_sweeper() -> type[Sweeper]:
    """Register :class:`ExcludingSweeper` with Hydra and return it.

    Hydra's first plugin scan re-executes every plugin module it finds, BasicSweeper's included, so the
    sweeper module is reloaded after that scan: a class made before it would derive from a BasicSweeper
    that Hydra has since replaced (``super(BasicSweeper, self)`` then fails)."""
    plugins = Plugins.instance()  # the first call scans
    module = importlib.reload(importlib.import_module("hydra_plugins.trident_sweeper.excluding_sweeper"))
    plugins.register(module.ExcludingSweeper)
    return module.ExcludingSweeper
