"""``logger=mlflow``: Lightning's MLFlowLogger on a local store shared by the runs (``outputs/mlruns``)
or a tracking server. Unlike W&B, MLflow has no offline mode to fall back on: a server that cannot be
reached stops the run before any work, in one line."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from lightning.pytorch.loggers import MLFlowLogger
from omegaconf import DictConfig, OmegaConf

from trident.errors import ConfigError
from trident.extras import require_package
from trident.tracking.server_probe import server_reachable

# Tracking URI schemes of a store on this machine's disk (a plain path has none).
LOCAL_SCHEMES = ("", "file")


def check_mlflow_config(logger_cfg: DictConfig) -> None:
    """MLflow is installed, and a tracking server named by ``tracking_uri`` answers."""
    require_package("mlflow")
    uri = str(logger_cfg.get("tracking_uri") or "")
    if urlsplit(uri).scheme in ("http", "https") and not server_reachable(uri):
        raise ConfigError(f"logger.mlflow.tracking_uri={uri} cannot be reached: start the MLflow server "
                          "(mlflow server --port ...) or drop the override for the local store under outputs/mlruns")


def local_store_uri(uri: str) -> str:
    """``uri``, with a plain path (relative to the working directory) as the ``file:`` URI MLflow reads."""
    return Path(uri).resolve().as_uri() if urlsplit(uri).scheme == "" else uri


def mlflow_logger(logger_cfg: DictConfig, run_dir: Path) -> MLFlowLogger:
    options: dict[str, Any] = OmegaConf.to_container(logger_cfg, resolve=True)  # type: ignore[assignment]
    options.pop("_target_", None)
    uri = str(options.pop("tracking_uri", None) or run_dir)
    if urlsplit(uri).scheme in LOCAL_SCHEMES:
        # MLflow 3 keeps its file store in maintenance mode and refuses it unless asked: the local store
        # needs no server or database, which a first run or a cluster job without one wants.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return MLFlowLogger(tracking_uri=local_store_uri(uri), save_dir=str(run_dir), **options)
