"""The config a ``train.py`` run saves in its directory, and finding it from a checkpoint. Nothing heavy is
imported: the commands find a run's config before torch loads."""

from __future__ import annotations

from pathlib import Path

# The run's config with every interpolation resolved, written as the run starts (trident.runs.pipeline).
RUN_CONFIG = "config_resolved.yaml"


def run_config_of(checkpoint: Path) -> Path | None:
    """``config_resolved.yaml`` of the train.py run that wrote ``checkpoint`` (the nearest parent that has one)."""
    for parent in checkpoint.resolve().parents:
        if (parent / RUN_CONFIG).is_file():
            return parent / RUN_CONFIG
    return None
