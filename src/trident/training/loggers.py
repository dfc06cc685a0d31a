"""Experiment loggers from the ``logger`` config group; W&B goes offline when there is no login."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import hydra.utils
from lightning.pytorch.loggers import Logger, WandbLogger
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)


def wandb_logged_in() -> bool:
    """True when an API key is configured (env var or ~/.netrc), without touching the network."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")


def resolve_wandb_mode(requested: str) -> str:
    """``auto`` -> ``online`` with a login, else ``offline`` (sync later with ``wandb sync``).
    ``WANDB_MODE`` in the environment wins, as W&B users expect."""
    mode = os.environ.get("WANDB_MODE") or requested
    if mode == "auto":
        mode = "online" if wandb_logged_in() else "offline"
        if mode == "offline":
            log.warning("No W&B login found: logging offline; upload later with `wandb sync <run dir>/wandb/offline-run-*`")
    return mode


def build_loggers(cfg: DictConfig, run_dir: Path) -> list[Logger]:
    """Instantiate every entry of ``cfg.logger`` (a mapping name -> logger config)."""
    loggers: list[Logger] = []
    for name, logger_cfg in (cfg.get("logger") or {}).items():
        if name == "wandb":
            loggers.append(_wandb_logger(cfg, logger_cfg, run_dir))
        else:
            loggers.append(hydra.utils.instantiate(logger_cfg, save_dir=str(run_dir)))
    return loggers


def record_summary(loggers: list[Logger], values: dict[str, float]) -> None:
    """Write ``values`` into the W&B run summary (the numbers a dashboard's runs table compares)."""
    for logger in loggers:
        if isinstance(logger, WandbLogger):
            logger.experiment.summary.update(values)


def _wandb_logger(cfg: DictConfig, logger_cfg: DictConfig, run_dir: Path) -> WandbLogger:
    options: dict[str, Any] = OmegaConf.to_container(logger_cfg, resolve=True)  # type: ignore[assignment]
    options.pop("_target_", None)
    mode = resolve_wandb_mode(options.pop("mode", "auto"))
    logger = WandbLogger(save_dir=str(run_dir), mode=mode, **options)
    # The resolved Hydra config, not only the module's hyperparameters, so runs can be compared by any key.
    logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    return logger
