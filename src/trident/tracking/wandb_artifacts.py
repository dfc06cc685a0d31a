"""``logger.wandb.log_model=best``: the run's best checkpoint as a W&B model artifact, so a dashboard links
a result to its weights; offline, the artifact lands in the offline run (its record in the run's ``.wandb``
file, the checkpoint under ``artifacts/`` beside it) and ``wandb sync`` uploads it.

trident uploads it itself rather than through Lightning's ``WandbLogger(log_model=...)``: that one uploads
the checkpoints of whichever ModelCheckpoint saved last, which in trident is ``last_checkpoint``
(``last.ckpt`` every N steps), not the best one, and it records no config with them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import Logger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from trident.errors import ConfigError


def check_log_model(value: Any) -> None:
    """``false`` (the default: a checkpoint holds the optimizer state too, about three times the weights, and
    every run of a sweep would add one to the W&B storage; the run directory keeps it anyway) or ``best``."""
    if value is not False and value != "best":  # `is`: YAML's false, not 0
        raise ConfigError(f"logger.wandb.log_model={value} is not a choice: set false (no upload) or best "
                          "(the best checkpoint as a W&B artifact when fitting ends)")


@rank_zero_only
def log_best_checkpoint(loggers: list[Logger], checkpoint: str | None, cfg: DictConfig, best: float | None) -> None:
    """With ``logger.wandb.log_model=best``: ``checkpoint`` as the artifact ``model-<run id>`` (aliases
    best and latest; a resumed run adds a version), its metadata the run's resolved config, the monitored
    metric and its best value."""
    if checkpoint is None or (cfg.get("logger") or {}).get("wandb", {}).get("log_model") != "best":
        return
    import wandb  # the W&B logger imported it already

    for logger in loggers:
        if isinstance(logger, WandbLogger):
            run = logger.experiment
            metadata = {"config": OmegaConf.to_container(cfg, resolve=True), "monitor": cfg.task.monitor,
                        "best": best, "checkpoint": Path(checkpoint).name}
            artifact = wandb.Artifact(f"model-{run.id}", type="model", metadata=metadata)
            artifact.add_file(str(_kept_in_run(checkpoint, Path(run.dir).parent)), policy="immutable")
            run.log_artifact(artifact, aliases=["best", "latest"])


def _kept_in_run(checkpoint: str, wandb_run_dir: Path) -> Path:
    """The checkpoint's contents under the W&B run's own directory (``artifacts/``), which ``wandb sync`` reads:
    not W&B's staging folder in the home directory, and safe from a later best checkpoint replacing the file.
    A hard link where the file system allows it: no second copy on disk."""
    kept = wandb_run_dir / "artifacts" / Path(checkpoint).name
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.unlink(missing_ok=True)
    try:
        os.link(checkpoint, kept)
    except OSError:
        shutil.copyfile(checkpoint, kept)
    return kept
