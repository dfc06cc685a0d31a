"""Experiment loggers from the ``logger`` config group. W&B never stops a run: without a login,
or when its server cannot be reached, the run logs offline (``wandb sync`` uploads it later)."""

from __future__ import annotations

import logging
import netrc
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import hydra.utils
from lightning.pytorch.loggers import Logger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from trident.extras import require_package
from trident.tracking.server_probe import server_reachable
from trident.tracking.wandb_artifacts import check_log_model
from trident.tracking.wandb_journal import JOURNAL, WandbJournal

log = logging.getLogger(__name__)

SYNC_HINT = "upload later with `python -m trident.tracking.wandb_files sync <run or sweep dir>`"


def wandb_base_url() -> str:
    """The W&B server: ``WANDB_BASE_URL``, else the library's default."""
    import wandb  # here, not at the top: a second to import, and only logger=wandb needs it

    return os.environ.get("WANDB_BASE_URL") or str(wandb.Settings().base_url)


def wandb_logged_in() -> bool:
    """True when an API key is configured (env var or ~/.netrc), without touching the network."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    path = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    if not path.is_file():
        return False
    try:
        hosts = netrc.netrc(path).hosts
    except (netrc.NetrcParseError, OSError):
        return False
    return urlsplit(wandb_base_url()).hostname in hosts or "api.wandb.ai" in hosts


def resolve_wandb_mode(requested: str) -> str:
    """``auto`` -> ``online`` with a login, else ``offline``; ``WANDB_MODE`` in the environment wins,
    as W&B users expect. ``online`` without a login or a reachable server also becomes ``offline``,
    with a warning: a dashboard problem must not cost a training run."""
    mode = os.environ.get("WANDB_MODE") or requested
    if mode not in ("auto", "online"):
        return mode
    if not wandb_logged_in():
        if mode == "online":
            log.warning("W&B online logging needs a login (WANDB_API_KEY or `wandb login`): logging offline; %s", SYNC_HINT)
        else:
            log.warning("No W&B login found: logging offline; %s", SYNC_HINT)
        return "offline"
    if not server_reachable(wandb_base_url()):
        log.warning("W&B server %s cannot be reached: logging offline; %s", wandb_base_url(), SYNC_HINT)
        return "offline"
    return "online"


def check_logger_config(loggers_cfg: DictConfig | dict[str, Any]) -> None:
    """Before any work: what the chosen loggers need is installed, and MLflow's server answers."""
    if "wandb" in loggers_cfg:
        check_log_model(loggers_cfg["wandb"].get("log_model", False))
    if "tensorboard" in loggers_cfg:
        require_package("tensorboard")  # now, not as Lightning's traceback after the data is prepared
    if "mlflow" in loggers_cfg:
        from trident.tracking.mlflow_logging import check_mlflow_config  # here: only logger=mlflow needs it

        check_mlflow_config(loggers_cfg["mlflow"])


def build_loggers(cfg: DictConfig, run_dir: Path, run_id: str, resumed_step: int | None) -> list[Logger]:
    """Instantiate every entry of ``cfg.logger`` (a mapping name -> logger config). ``run_id``
    (kept in the run directory) makes a resumed run continue the same W&B run; an attempt that
    resumes from a checkpoint at ``resumed_step`` first sends W&B the rows logged before it
    again (:class:`WandbJournal`: a SIGTERM can cost W&B its last rows)."""
    loggers: list[Logger] = []
    for name, logger_cfg in (cfg.get("logger") or {}).items():
        if name == "wandb":
            wandb_logger = _wandb_logger(cfg, logger_cfg, run_dir, run_id)
            # The journal first: it resends the earlier rows before W&B gets this attempt's first one.
            loggers += [WandbJournal(run_dir / "wandb" / JOURNAL, wandb_logger, resumed_step), wandb_logger]
            continue
        if name == "mlflow":
            from trident.tracking.mlflow_logging import mlflow_logger  # here: only logger=mlflow needs it

            logger = mlflow_logger(logger_cfg, run_dir)
        else:
            logger = hydra.utils.instantiate(logger_cfg, save_dir=str(run_dir))
        # Every logger keeps the resolved config that W&B gets (_wandb_logger), not only the module's hyperparameters.
        logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
        loggers.append(logger)
    return loggers


# W&B's run (``WandbLogger.experiment``) exists on global rank 0 only; other DDP ranks get a
# stand-in whose attributes are no-op functions, so e.g. ``experiment.summary.update`` fails there.
@rank_zero_only
def record_summary(loggers: list[Logger], values: dict[str, float]) -> None:
    """Write ``values`` into the W&B run summary (the numbers a dashboard's runs table compares)."""
    for logger in loggers:
        if isinstance(logger, WandbLogger):
            logger.experiment.summary.update(values)


def _wandb_logger(cfg: DictConfig, logger_cfg: DictConfig, run_dir: Path, run_id: str) -> WandbLogger:
    import wandb  # here, not at the top: a second to import, and only logger=wandb needs it

    options: dict[str, Any] = OmegaConf.to_container(logger_cfg, resolve=True)  # type: ignore[assignment]
    options.pop("_target_", None)
    requested = options.pop("mode", "auto")
    options.pop("log_model", None)  # trident uploads the best checkpoint itself (trident.tracking.wandb_artifacts)
    # Other DDP ranks get no W&B run (Lightning's stand-in): no login check, server probe or warning there.
    mode = resolve_wandb_mode(requested) if rank_zero_only.rank == 0 else requested  # type: ignore[attr-defined]
    # wandb.init retries for 90 s by default when the server answers badly; bound it.
    settings = wandb.Settings(init_timeout=float(options.pop("init_timeout", 30)))
    # The resolved Hydra config, not only the module's hyperparameters, so runs can be compared by any key.
    config = OmegaConf.to_container(cfg, resolve=True)
    logger = WandbLogger(save_dir=str(run_dir), mode=mode, id=run_id, resume="allow", settings=settings, **options)
    try:
        logger.log_hyperparams(config)  # starts the W&B run
    except (wandb.Error, OSError) as err:
        if mode != "online":
            raise
        log.warning("W&B could not start an online run (%s): logging offline; %s", str(err).splitlines()[0], SYNC_HINT)
        # The failed online attempt still holds the run id in W&B's service: start a fresh service.
        wandb.teardown()
        logger = WandbLogger(save_dir=str(run_dir), mode="offline", id=run_id, resume="allow", settings=settings, **options)
        logger.log_hyperparams(config)
    summarize_monitor(logger, cfg.task.monitor, cfg.task.monitor_mode)
    return logger


@rank_zero_only
def summarize_monitor(logger: WandbLogger, monitor: str, mode: str) -> None:
    """Let W&B keep the best value of the monitored metric in the run summary as it is logged
    (``<monitor>.min`` or ``.max``, next to the last value), so a run stopped early shows it too.
    Its x-axis stays Lightning's ``trainer/global_step``: an explicit definition replaces the glob's."""
    logger.experiment.define_metric(monitor, step_metric="trainer/global_step", step_sync=True, summary=f"{mode},last")
