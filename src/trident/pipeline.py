"""The training pipeline behind ``train.py``: config -> data, task, callbacks, loggers, trainer -> fit, test."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import hydra.utils
import lightning as L
import wandb
from hydra.errors import InstantiationException
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint
from omegaconf import DictConfig, ListConfig, OmegaConf
from rich.console import Console
from rich.syntax import Syntax
from rich.tree import Tree

from trident.backbone import TransformerConfig, pos_encoding_class
from trident.cli import find_user_error
from trident.data.base import TridentDataModule
from trident.errors import ConfigError
from trident.training.loggers import build_loggers
from trident.training.optim import fused_allowed

log = logging.getLogger(__name__)

# Library notices that say nothing about the user's run.
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
_NOTICES = ("litlogger", "Skipping setting a default `ModelSummary`")


class _DropLibraryNotices(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(notice in record.getMessage() for notice in _NOTICES)


logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_DropLibraryNotices())


def backbone_options(cfg: DictConfig) -> dict[str, Any]:
    """The ``model`` group (sizes, architecture) and the ``pos_encoding`` group as one plain dict,
    validated by :class:`TransformerConfig`."""
    options: dict[str, Any] = OmegaConf.to_container(cfg.model, resolve=True)  # type: ignore[assignment]
    options.pop("name", None)
    options.pop("pretrained", None)  # weights to load, not a shape (read by the task)
    options["pos_encoding"] = cfg.pos_encoding.name
    options["pos_encoding_options"] = dict(cfg.pos_encoding.get("options") or {})
    # The sequence geometry comes with the data, not the size: a task class may derive it
    # (e.g. ViT: patch grid and class token from the image size); by default it is data.max_seq_len.
    task_class = hydra.utils.get_class(cfg.task._target_)
    geometry = getattr(task_class, "backbone_geometry", None)
    if geometry is None:
        options["max_seq_len"] = cfg.data.max_seq_len
    else:
        options.update(geometry(_plain(cfg.data), _plain(cfg.task)))
    return options


def _plain(node: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(node, resolve=True)  # type: ignore[return-value]


def check_task_data(cfg: DictConfig) -> None:
    """The data option must feed the task (e.g. not image data for the language model)."""
    task_class = hydra.utils.get_class(cfg.task._target_)
    data_class = hydra.utils.get_class(cfg.data._target_)
    expected = getattr(task_class, "DATA_MODULE", TridentDataModule)
    if not issubclass(data_class, expected):
        raise ConfigError(
            f"data={cfg.data.name} ({data_class.__name__}) is not data for task={cfg.task.name}, which needs "
            f"{expected.__name__}: choose a {cfg.task.name} data option (README, config groups)"
        )


def check_config(cfg: DictConfig) -> TransformerConfig:
    """Fail before any work when values are inconsistent, with a message naming the fix."""
    check_task_data(cfg)
    backbone = TransformerConfig(**backbone_options(cfg))
    encoding = pos_encoding_class(backbone.pos_encoding)
    block_size = cfg.data.get("block_size")
    if block_size is not None and block_size > backbone.max_seq_len:
        kind = "the learned table" if encoding.bounded_length else "the configured context"
        raise ConfigError(
            f"data.block_size={block_size} is longer than data.max_seq_len={backbone.max_seq_len} ({kind}): "
            f"raise data.max_seq_len or lower data.block_size"
        )
    return backbone


def print_config_tree(cfg: DictConfig) -> None:
    tree = Tree("config", guide_style="dim")
    for key, value in cfg.items():
        text = OmegaConf.to_yaml(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else str(value)
        tree.add(str(key)).add(Syntax(text, "yaml", theme="ansi_dark", background_color="default"))
    Console().print(tree)


def save_resolved_config(cfg: DictConfig, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config_resolved.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))


# Keys of the `data` and `task` groups that the pipeline reads; the rest are constructor arguments.
PIPELINE_KEYS = {"data": ("name", "max_seq_len"), "task": ("name", "monitor", "monitor_mode")}


def constructor_args(cfg: DictConfig, group: str) -> dict[str, Any]:
    args: dict[str, Any] = OmegaConf.to_container(cfg[group], resolve=True)  # type: ignore[assignment]
    for key in PIPELINE_KEYS[group]:
        args.pop(key, None)
    return args


def instantiate(config: Any, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` that lets a user error (ConfigError, DataError) raised by a
    constructor through as itself, instead of wrapped in Hydra's InstantiationException."""
    try:
        return hydra.utils.instantiate(config, **kwargs)
    except InstantiationException as err:
        user_error = find_user_error(err)
        if user_error is None:
            raise
        raise user_error from err


def build_callbacks(cfg: DictConfig, has_logger: bool) -> list[Callback]:
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]
    # LearningRateMonitor refuses to run without a logger (logger=none): leave it out then.
    return [c for c in callbacks if has_logger or not isinstance(c, LearningRateMonitor)]


def compile_network(task: L.LightningModule, enabled: Any) -> None:
    """``compile=true``: torch.compile the task's network in place (``nn.Module.compile``), so
    parameter names, checkpoints and the LightningModule hooks stay as they are."""
    if not isinstance(enabled, bool):
        raise ConfigError(f"compile must be true or false, got {enabled!r}")
    if enabled:
        task.net.compile()


def train(cfg: DictConfig) -> dict[str, float]:
    """Run one training job; returns the final metrics (for sweeps and tests)."""
    run_dir = Path(cfg.paths.output_dir)
    backbone = check_config(cfg)
    if cfg.get("print_config", True):
        print_config_tree(cfg)
    save_resolved_config(cfg, run_dir)
    L.seed_everything(cfg.seed, workers=True)

    datamodule = instantiate(constructor_args(cfg, "data"), _convert_="all")
    if not isinstance(datamodule, TridentDataModule):
        raise ConfigError(f"data._target_ must name a TridentDataModule subclass, got {type(datamodule).__name__}")
    datamodule.prepare_data()
    datamodule.setup("fit")
    datamodule.save_to(run_dir)
    task: L.LightningModule = instantiate(
        constructor_args(cfg, "task"),
        backbone=vars(backbone),
        optimizer=fused_allowed(
            _plain(cfg.optimizer), str(cfg.trainer.precision), cfg.trainer.get("gradient_clip_val")
        ),
        scheduler=OmegaConf.to_container(cfg.scheduler, resolve=True),
        **datamodule.task_inputs(),
        _convert_="all",
        _recursive_=False,  # the optimizer config stays a plain dict, built in configure_optimizers
    )
    compile_network(task, cfg.get("compile", False))
    loggers = build_loggers(cfg, run_dir)
    callbacks = build_callbacks(cfg, has_logger=bool(loggers))
    trainer: L.Trainer = instantiate(
        cfg.trainer, callbacks=callbacks, logger=loggers or False, default_root_dir=str(run_dir), _convert_="all"
    )
    try:
        trainer.fit(task, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        if cfg.get("test", True):
            best = _best_checkpoint(trainer)
            trainer.test(task, datamodule=datamodule, ckpt_path=best, weights_only=False)
            metrics.update({k: float(v) for k, v in trainer.callback_metrics.items()})
    finally:
        if wandb.run is not None:
            wandb.finish()  # exactly one W&B run per job, also when a multirun reuses the process
    log.info("Run directory: %s", run_dir)
    return metrics


def _best_checkpoint(trainer: L.Trainer) -> str | None:
    checkpoint = trainer.checkpoint_callback
    if isinstance(checkpoint, ModelCheckpoint) and checkpoint.best_model_path:
        return checkpoint.best_model_path
    return None
