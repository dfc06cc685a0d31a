"""Hydra's basic sweeper (every combination of the swept values) without the combinations a preset
excludes: e.g. ``task=vit`` with ``pos_encoding=alibi``, which a task refuses, so a sweep over one axis
across the tasks runs only what each task allows, with no failed jobs.

``hydra/sweeper: excluding`` (conf/hydra/sweeper/excluding.yaml) selects it; ``hydra.sweeper.exclude``
lists the excluded combinations, each a list of overrides that a job must all have to be left out. An
exclusion that matches no job (a misspelt value) fails before any job runs.
"""

from __future__ import annotations

from collections.abc import Sequence

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.types import Override

from trident.errors import ConfigError, run_with_clear_errors


class ExcludingSweeper(BasicSweeper):
    def __init__(
        self, max_batch_size: int | None, params: dict[str, str] | None = None, exclude: Sequence[Sequence[str]] = ()
    ) -> None:
        super().__init__(max_batch_size, params)
        for rule in exclude:
            if isinstance(rule, str) or not all(isinstance(o, str) and "=" in o for o in rule):
                raise ConfigError(
                    f"hydra.sweeper.exclude entry {rule!r} is not a list of key=value overrides: "
                    "write e.g. [task=vit, pos_encoding=alibi]"
                )
        self.exclude = [frozenset(rule) for rule in exclude]

    def split_arguments(  # type: ignore[override]  # an instance method: it needs the exclusions
        self, overrides: list[Override], max_batch_size: int | None
    ) -> list[list[list[str]]]:
        return run_with_clear_errors(lambda: self._kept_batches(overrides, max_batch_size))

    def _kept_batches(self, overrides: list[Override], max_batch_size: int | None) -> list[list[list[str]]]:
        (jobs,) = BasicSweeper.split_arguments(overrides, None)
        unmatched = [sorted(rule) for rule in self.exclude if not any(rule <= set(job) for job in jobs)]
        if unmatched:
            raise ConfigError(
                f"hydra.sweeper.exclude {unmatched} matches no job of the sweep: "
                "write each override as the sweep spells it (key=value, one of the swept values)"
            )
        kept = [job for job in jobs if not any(rule <= set(job) for rule in self.exclude)]
        size = max_batch_size or len(kept) or 1
        return [kept[start : start + size] for start in range(0, len(kept), size)]
