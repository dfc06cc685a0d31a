"""Hydra's basic sweeper (every combination of the swept values) without the combinations a preset
excludes: e.g. ``task=vit`` with ``pos_encoding=alibi``, which a task refuses, so a sweep over one axis
across the tasks runs only what each task allows, with no failed jobs.

``hydra/sweeper: excluding`` (conf/hydra/sweeper/excluding.yaml) selects it; ``hydra.sweeper.exclude``
lists the excluded combinations, each a list of overrides that a job must all have to be left out. An
exclusion with a key the sweep does not set fails before any job runs, and leaves no sweep directory;
one whose values this sweep does not reach (a command line that sweeps fewer values) is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.types import Override

from trident.errors import ConfigError, run_with_clear_errors
from trident.runs.sweeps import discard_refused_sweep

log = logging.getLogger(__name__)


class ExcludingSweeper(BasicSweeper):
    def __init__(
        self, max_batch_size: int | None, params: dict[str, str] | None = None, exclude: Sequence[Sequence[str]] = ()
    ) -> None:
        super().__init__(max_batch_size, params)
        self.rules = exclude  # checked with the sweep's overrides, where a refusal can clean up

    def split_arguments(  # type: ignore[override]  # an instance method: it needs the exclusions
        self, overrides: list[Override], max_batch_size: int | None
    ) -> list[list[list[str]]]:
        # The multirun wrote sweep.json as it started: a refused sweep leaves no directory behind.
        return run_with_clear_errors(lambda: self._kept_batches(overrides, max_batch_size), cleanup=self._discard_sweep)

    def _discard_sweep(self) -> None:
        if self.config is not None:  # set up by Hydra (a test may split arguments without)
            discard_refused_sweep(Path(self.config.hydra.sweep.dir))

    def _exclusions(self) -> list[frozenset[str]]:
        for rule in self.rules:
            if isinstance(rule, str) or not all(isinstance(o, str) and "=" in o for o in rule):
                raise ConfigError(
                    f"hydra.sweeper.exclude entry {rule!r} is not a list of key=value overrides: "
                    "write e.g. [task=vit, pos_encoding=alibi]"
                )
        return [frozenset(rule) for rule in self.rules]

    def _kept_batches(self, overrides: list[Override], max_batch_size: int | None) -> list[list[list[str]]]:
        exclude = self._exclusions()
        (jobs,) = BasicSweeper.split_arguments(overrides, None)
        keys = [o.get_key_element() for o in overrides]
        unknown = sorted({item.split("=", 1)[0] for rule in exclude for item in rule} - set(keys))
        if unknown:
            raise ConfigError(
                f"hydra.sweeper.exclude names {', '.join(unknown)}, which this sweep does not set: "
                f"write each override as the sweep spells it, with a key among {', '.join(keys)}"
            )
        for rule in exclude:
            if not any(rule <= set(job) for job in jobs):  # e.g. a command line that sweeps fewer values
                log.warning("hydra.sweeper.exclude %s matches no job of this sweep", sorted(rule))
        kept = [job for job in jobs if not any(rule <= set(job) for rule in exclude)]
        size = max_batch_size or len(kept) or 1
        return [kept[start : start + size] for start in range(0, len(kept), size)]
