"""The training pipeline behind ``train.py``: config -> data, task, callbacks, loggers, trainer -> fit, test."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import warnings
from pathlib import Path
from typing import Any

import hydra.utils
import lightning as L
from hydra.errors import InstantiationException
from lightning.pytorch.callbacks import Callback, LearningRateMonitor
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from rich.console import Console
from rich.syntax import Syntax
from rich.tree import Tree

from trident.backbone import TransformerConfig, pos_encoding_class
from trident.converters import check_run, converter_settings, unsplittable
from trident.data.base import TridentDataModule
from trident.data.tokenization import TOKENIZER_KINDS, read_tokenizer
from trident.errors import ConfigError, did_you_mean, find_user_error, is_int
from trident.launch.distributed import WorkerProcesses, check_workers_can_start, is_global_zero, ranks_fail_together
from trident.launch.preemption import PreemptionCheckpoint
from trident.launch.requeue import latest_checkpoint
from trident.parallel.distributed_checkpoint import check_sharded_resume
from trident.parallel.fsdp import shards_weights
from trident.parallel.tensor_parallel import check_tensor_parallel_config
from trident.runs.attempts import EpochBoundaryResume, FinalStepCheckpoint, keep_csv_history_until, keep_history_until
from trident.runs.budget import apply_flops_budget, check_budget, check_training_batches, first_batch_flops
from trident.runs.lifecycle import name_initial_copies, prepare_networks, write_artifacts
from trident.runs.lr_find import check_tunable, check_tune_config, find_learning_rate
from trident.runs.resume import checkpoint_to_resume, run_identity
from trident.runs.run_end import best_checkpoint, early_stop_record, finish_wandb, report_trainable
from trident.tasks.base import TridentTask
from trident.tasks.networks import companions_beside, converting_later, save_initial_companions
from trident.tracking.loggers import build_loggers, check_logger_config, record_summary
from trident.tracking.steps import ValidationRowStep, count_validation_in_optimizer_steps
from trident.tracking.wandb_artifacts import log_best_checkpoint
from trident.training.callbacks import MetricHistory
from trident.training.optim import check_optimizer_config, check_scheduler_config, fused_allowed
from trident.training.precision import check_precision
from trident.training.resilience import NonFiniteLossGuard, RandomStates
from trident.training.run_checks import check_callbacks, check_early_stopping, check_seed, check_trainer_config
from trident.weights.checkpoints import AtomicCheckpointIO, read_checkpoint
from trident.weights.init_from import copy_source, source_for_run
from trident.weights.run_config import RUN_CONFIG
from trident.weights.sources import DERIVED_SETTINGS
from trident.weights.teacher import stage_teacher
from trident.weights.transfer import embeddings_only_option, new_head_option, report_transfer

log = logging.getLogger(__name__)

# Library notices that say nothing about the user's run.
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
# trident's data modules resume mid-epoch themselves (their state_dict; trident.data.order).
warnings.filterwarnings("ignore", message=r".*checkpoint that ended before the epoch ended and your dataloader is not resumable.*")
# fp16 on a CPU: trident.training.precision says so in one line. The model summary's size estimate is not the point.
warnings.filterwarnings("ignore", message=r".*AMP with fp16 is not supported on CPU.*")
warnings.filterwarnings("ignore", message=r".*is not supported by the model summary.*")
# On a SLURM login node (or this project's one-machine test cluster) a local run is intended.
warnings.filterwarnings("ignore", message=r".*The `srun` command is available on your system but is not used.*")
# The data setting of a sequence's length: LM / MLM blocks, classify texts ([CLS] included), translation sentences.
SEQUENCE_LENGTH_KEYS = ("block_size", "max_length", "max_len")
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
    if options.get("pretrained") is not None:
        raise ConfigError(f"model.pretrained was replaced by init_from: run with init_from={options['pretrained']} "
                          "(a timm file, a Hugging Face directory or a trident checkpoint or run)")
    options.pop("pretrained", None)  # null in the saved configs of earlier runs
    settings = [f.name for f in dataclasses.fields(TransformerConfig) if f.name not in DERIVED_SETTINGS]
    for key in options:
        if key not in settings:
            raise ConfigError(
                f"model.{key} is not a model setting{did_you_mean(key, settings, 'model.')}: "
                f"remove it; the model group takes {', '.join(settings)}"
            )
    options["pos_encoding"] = cfg.pos_encoding.name
    options["pos_encoding_options"] = dict(cfg.pos_encoding.get("options") or {})
    # The sequence geometry comes with the data, not the size: data.max_seq_len, or what the task
    # derives from the data (e.g. ViT: patch grid and class token from the image size).
    options.update(configured_task_class(cfg).backbone_geometry(_plain(cfg.data), _plain(cfg.task), options))
    return options


def configured_task_class(cfg: DictConfig) -> type[TridentTask]:
    """The class ``task._target_`` names; every task derives from :class:`TridentTask`."""
    task_class = hydra.utils.get_class(cfg.task._target_)
    if not (isinstance(task_class, type) and issubclass(task_class, TridentTask)):
        raise ConfigError(f"task._target_={cfg.task._target_} is not a trident task: name a subclass of "
                          "trident.tasks.base.TridentTask (conf/task/*.yaml)")
    return task_class


def _plain(node: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(node, resolve=True)  # type: ignore[return-value]


def check_constructor_keys(cfg: DictConfig, group: str) -> None:
    """Every key of the ``data`` or ``task`` group must be an argument of its class's constructor
    (a key added with ``+data.batchsize=8`` would otherwise fail deep inside Hydra's instantiate)."""
    parameters = inspect.signature(hydra.utils.get_class(cfg[group]._target_)).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    names = [name for name in parameters if name != "self"]
    for key in constructor_args(cfg, group):
        if key != "_target_" and key not in parameters:
            raise ConfigError(
                f"{group}.{key} is not a setting of {group}={cfg[group].name}{did_you_mean(key, names, f'{group}.')}: "
                f"remove it; {group}={cfg[group].name} takes {', '.join(names)}"
            )


def check_config(cfg: DictConfig, source_fixes_context: bool = False) -> TransformerConfig:
    """Fail before any work when values are inconsistent, with a message naming the fix. ``source_fixes_context``: the
    ``init_from`` source states ``data.max_seq_len`` (a learned table's length, a Hugging Face model's
    ``max_position_embeddings``), so the fix for a sequence longer than it is never to raise it."""
    check_seed(cfg.get("seed", 0))
    check_trainer_config(_plain(cfg.trainer))
    check_callbacks(cfg.get("callbacks") or {}, cfg.trainer.get("strategy"))
    # The data must feed the task; a task checks its own settings against the data and positions too (e.g. task=mlm).
    configured_task_class(cfg).validate_config(cfg)
    check_early_stopping((cfg.get("callbacks") or {}).get("early_stopping"), cfg.task.name,
                         configured_task_class(cfg).validation_metrics(cfg))
    check_constructor_keys(cfg, "data")
    check_constructor_keys(cfg, "task")
    if cfg.data.get("tokenizer") not in (None, *TOKENIZER_KINDS):
        read_tokenizer(str(cfg.data.tokenizer))  # a file: read now, not after the corpus is prepared
    check_optimizer_config(_plain(cfg.optimizer))
    check_scheduler_config(_plain(cfg.scheduler))
    check_tune_config(cfg.get("tune"), cfg.get("resume"), cfg.get("ckpt_path"))
    check_logger_config(cfg.get("logger") or {})
    key = next((k for k in SEQUENCE_LENGTH_KEYS if cfg.data.get(k) is not None), None)
    if key is not None and (not is_int(cfg.data[key]) or cfg.data[key] <= 0):  # before data.max_seq_len follows it
        raise ConfigError(f"data.{key} must be a positive integer, got {cfg.data[key]!r}: set e.g. data.{key}=128")
    backbone = TransformerConfig(**backbone_options(cfg))
    converter_settings(cfg, backbone)  # the finetune group's settings fit this model
    check_tensor_parallel_config(_plain(cfg.trainer), backbone, unsplittable(cfg))  # it fits the heads and processes
    if key is not None:
        check_sequence_length(cfg, key, backbone.max_seq_len, pos_encoding_class(backbone.pos_encoding).bounded_length,
                              source_fixes_context)
    return backbone


def check_sequence_length(cfg: DictConfig, key: str, max_seq_len: int, bounded: bool, fixed: bool = False) -> None:
    """``data.<key>`` fits the context; the fix names keys that work: an ``init_from`` source that ``fixed``
    ``data.max_seq_len`` (a learned table, a stated context) refuses it raised."""
    length = cfg.data[key]
    if length <= max_seq_len:
        return
    kind = "the learned table" if bounded else "the configured context"
    how = "with its learned table" if bounded else "to the context it states"
    fix = (f"init_from={cfg.init_from} fixes data.max_seq_len {how}: lower data.{key} to at most {max_seq_len}"
           if fixed else f"raise data.max_seq_len or lower data.{key}")
    raise ConfigError(f"data.{key}={length} is longer than data.max_seq_len={max_seq_len} ({kind}): {fix}")


def print_config_tree(cfg: DictConfig) -> None:
    tree = Tree("config", guide_style="dim")
    for key, value in cfg.items():
        text = OmegaConf.to_yaml(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else str(value)
        tree.add(str(key)).add(Syntax(text, "yaml", theme="ansi_dark", background_color="default"))
    Console().print(tree)


def save_resolved_config(cfg: DictConfig, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RUN_CONFIG).write_text(OmegaConf.to_yaml(cfg, resolve=True))


# ckpt_path values that Lightning resolves itself (no file of that name).
LIGHTNING_CHECKPOINT_NAMES = ("last", "hpc", "best")

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


def build_data_and_task(cfg: DictConfig, backbone: TransformerConfig, stage: str) -> tuple[TridentDataModule, TridentTask]:
    """The data module, prepared and set up for ``stage`` (``fit``, ``test``), and the task built on
    ``backbone`` with the data's inputs (vocabulary, tokenizer, classes): for train.py and eval.py alike."""
    datamodule = instantiate(constructor_args(cfg, "data"), _convert_="all")
    if not isinstance(datamodule, TridentDataModule):
        raise ConfigError(f"data._target_ must name a TridentDataModule subclass, got {type(datamodule).__name__}")
    datamodule.prepare_data()
    datamodule.setup(stage)
    task: TridentTask = instantiate(
        constructor_args(cfg, "task"),
        backbone=vars(backbone),
        optimizer=fused_allowed(
            _plain(cfg.optimizer), str(cfg.trainer.precision), cfg.trainer.get("gradient_clip_val")
        ),
        scheduler=_plain(cfg.scheduler),
        **converter_settings(cfg, backbone),  # each converter's settings by name: the lifecycle applies them
        **datamodule.task_inputs(),
        _convert_="all",
        _recursive_=False,  # the optimizer config stays a plain dict, built in configure_optimizers
    )
    return datamodule, task


def build_trainer(trainer_cfg: Any, **kwargs: Any) -> L.Trainer:
    """``lightning.Trainer`` from the ``trainer`` config, writing checkpoints atomically and reading
    them with ``weights_only=True`` (:class:`AtomicCheckpointIO`); a value Lightning refuses
    (precision, step counts, devices...) becomes one clear line instead of Hydra's wrapped traceback."""
    plugins = [*(instantiate(p) for p in trainer_cfg.get("plugins") or []), AtomicCheckpointIO()]
    if SLURMEnvironment.detect():
        # Stop signals are trident's (PreemptionCheckpoint), not Lightning's SLURM auto-requeue.
        plugins.append(SLURMEnvironment(auto_requeue=False))
    try:
        trainer = instantiate(trainer_cfg, plugins=plugins, **kwargs, _convert_="all")
    except InstantiationException as err:
        cause = err.__cause__
        if not isinstance(cause, (MisconfigurationException, ValueError, TypeError)):
            raise
        reason = str(cause).strip().splitlines()[0]
        raise ConfigError(f"the trainer settings are invalid ({reason}): fix that trainer.* value (conf/trainer, precision=...)") from err
    count_validation_in_optimizer_steps(trainer)  # val_check_interval in optimizer steps (trident.tracking.steps)
    return trainer


def read_resume_checkpoint(ckpt_path: str | None, strategy: Any) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint to resume from, read (and so checked) before any work; None when starting
    fresh or when it names one of Lightning's own choices (``last``, ``hpc``, ...). Of a sharded
    checkpoint, only the shapes of the weights: each rank of ``trainer.strategy`` loads its shards itself."""
    if not ckpt_path or ckpt_path in LIGHTNING_CHECKPOINT_NAMES or str(ckpt_path).startswith("registry"):
        return None
    check_sharded_resume(Path(ckpt_path), shards_weights(strategy))
    return Path(ckpt_path), read_checkpoint(Path(ckpt_path), "ckpt_path", weights=False)


def build_callbacks(cfg: DictConfig, has_logger: bool) -> list[Callback]:
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]
    # LearningRateMonitor refuses to run without a logger (logger=none): leave it out then.
    return [c for c in callbacks if has_logger or not isinstance(c, LearningRateMonitor)]


def metric_history(cfg: DictConfig, run_dir: Path) -> MetricHistory:
    """Every run keeps ``metrics.jsonl``, whatever the ``callbacks`` and ``logger`` choices."""
    return MetricHistory(run_dir / "metrics.jsonl", monitor=cfg.task.monitor, mode=cfg.task.monitor_mode)


def check_values_given(cfg: DictConfig) -> None:
    """A value a config leaves to the user (``???``: ``pretrained_run``, ``data.data_dir``...) that is
    still unset is one error line, not OmegaConf's traceback where it is first read."""
    def unset(node: Any, prefix: str) -> list[str]:
        if isinstance(node, dict):
            return [key for name, value in node.items() for key in unset(value, f"{prefix}{name}.")]
        return [prefix.removesuffix(".")] if node == "???" else []

    missing = unset(OmegaConf.to_container(cfg, resolve=False), "")  # unresolved: reading resolves into the ???
    if missing:
        raise ConfigError(f"{', '.join(missing)} not set: add {missing[0]}=<value> to the command line")


def train(cfg: DictConfig) -> dict[str, float]:
    """Run one training job; returns the final metrics (for sweeps and tests). A stop signal
    (:class:`PreemptionCheckpoint`) ends it with :class:`trident.launch.requeue.JobStopped`."""
    run_dir = Path(cfg.paths.output_dir)
    preemption = PreemptionCheckpoint(run_dir)
    # A stop signal may come at any time, e.g. while the data is prepared: it is noted from here on.
    with preemption.listening():
        return _train(cfg, run_dir, preemption)


def _train(cfg: DictConfig, run_dir: Path, preemption: PreemptionCheckpoint) -> dict[str, float]:
    check_values_given(cfg)
    resume_from = checkpoint_to_resume(cfg.get("resume"), cfg.get("ckpt_path"), run_dir)
    # Before the config is checked: the source's architecture replaces the model settings.
    embeddings_only = embeddings_only_option(cfg.get("init_only"))
    source = source_for_run(configured_task_class(cfg), cfg, run_dir, resume_from, embeddings_only)
    new_head = new_head_option(cfg.get("init_new_head", False))
    backbone = check_config(cfg, source is not None and "max_seq_len" in source.data_options)
    check_run(cfg)  # what the finetune group's converter forbids a run
    flops_budget = check_budget(cfg)
    check_workers_can_start(cfg.trainer)
    saved = read_resume_checkpoint(resume_from, cfg.trainer.get("strategy"))
    # Every DDP rank runs this function; only rank 0 writes the run's files.
    writes_outputs = is_global_zero()
    if writes_outputs and cfg.get("print_config", True):
        print_config_tree(cfg)
    L.seed_everything(cfg.seed, workers=True)

    name_initial_copies(configured_task_class(cfg), cfg, run_dir, bool(resume_from))  # e.g. DPO's reference policy in full fine-tuning
    stage_teacher(configured_task_class(cfg), cfg, run_dir, bool(resume_from))  # distill=kd: <run>/init/teacher.*
    # The lifecycle (trident.runs.lifecycle): the source's weights first, then the converters; run-relative companions.
    with converting_later(), companions_beside(run_dir):
        datamodule, task = build_data_and_task(cfg, backbone, "fit")
    if source is not None and source.tokenizer is not None:  # the run decodes and exports as its source did
        task.tokenizer_settings = dict(source.tokenizer_settings)
    task.tokenizer_settings |= datamodule.tokenizer_settings()  # the template the run trained with wins over the source's
    check_training_batches(cfg, datamodule.split_loader("train", train=True))
    if flops_budget is not None:  # equal compute: the steps follow from the FLOPs of a step
        apply_flops_budget(cfg, first_batch_flops(task, datamodule))
    # A resumed run's checkpoint holds its weights; a new run starts from the source's.
    transferred = prepare_networks(task, cfg, source, saved, bool(resume_from), new_head, embeddings_only)
    check_tunable(cfg.get("tune"), task)
    if preemption.received:  # before training began: the run's checkpoints are as they were
        raise preemption.stopped_early(int(saved[1]["global_step"]) if saved else 0, latest_checkpoint(run_dir))
    guard = NonFiniteLossGuard(cfg.get("nonfinite_loss", "stop"), preemption.path)
    history = metric_history(cfg, run_dir)
    if saved is not None and writes_outputs:  # one training in metrics.jsonl, each step once
        keep_history_until(history.path, int(saved[1]["global_step"]))
        keep_csv_history_until(run_dir, int(saved[1]["global_step"]))
    workers = WorkerProcesses()
    callbacks = [*build_callbacks(cfg, has_logger=bool(cfg.get("logger"))), RandomStates(), preemption, guard, history,
                 workers, FinalStepCheckpoint(), EpochBoundaryResume(), ValidationRowStep()]
    trainer = build_trainer(cfg.trainer, callbacks=callbacks, logger=False, default_root_dir=str(run_dir))
    with open_dict(cfg):
        # What runs, next to what was asked (trainer.precision): fp16 runs as bf16-mixed on a CPU.
        cfg.precision_used = check_precision(trainer, str(cfg.trainer.precision)) if writes_outputs else str(trainer.precision)
    # The run directory gets its files and its W&B run only now: a config error above leaves none behind.
    if writes_outputs:
        if source is not None:
            copy_source(source, run_dir)  # <run>/init: the run never needs the source again
        if not resume_from:
            save_initial_companions(task)  # <run>/init/<key>.safetensors: what a resume reads again
        save_resolved_config(cfg, run_dir)
        datamodule.save_to(run_dir)
    resumed_step = int(saved[1]["global_step"]) if saved else None
    loggers = build_loggers(cfg, run_dir, run_identity(run_dir)["run_id"], resumed_step)
    trainer.loggers = loggers
    if transferred is not None and writes_outputs:
        report_transfer(transferred, run_dir / "init" / "weights.csv", loggers)
    report_trainable(task, loggers)
    succeeded = False
    try:
        # The launching process answers for its DDP workers: the job fails if one of them does.
        with ranks_fail_together(trainer, workers):
            if cfg.get("tune"):  # tune=lr_find: Lightning's learning-rate finder on the task as built, instead of training
                metrics = find_learning_rate(cfg, trainer, task, datamodule)
                succeeded = True
                return metrics
            try:
                trainer.fit(task, datamodule=datamodule, ckpt_path=resume_from, weights_only=True)
            except SIGTERMException:
                # Lightning stops by itself on a signal that came before trident's handler was in place.
                preemption.stop = preemption.stop or preemption.stopped_early(trainer.global_step, latest_checkpoint(run_dir))
            _raise_stop(preemption, writes_outputs)  # also when the signal came with the last step: no test
            log_best_checkpoint(trainer.loggers, best_checkpoint(trainer), cfg, history.best)  # logger.wandb.log_model
            if writes_outputs:
                write_artifacts(task, run_dir, str(cfg.get("init_from")), best_checkpoint(trainer))
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
            metrics.update(early_stop_record(trainer))  # callbacks=early_stopping: the step it stopped at
            if history.best is not None:
                metrics[f"best/{history.monitor}"] = history.best
            if cfg.get("test", True):
                best = best_checkpoint(trainer)
                trainer.test(task, datamodule=datamodule, ckpt_path=best, weights_only=True)
                _raise_stop(preemption, writes_outputs)  # a signal during the test
                metrics.update({k: float(v) for k, v in trainer.callback_metrics.items()})
            # Dashboards compare runs by their summary: the best validation value next to the test metrics.
            # trainer.loggers, not loggers: a SIGTERM that came after the test has taken W&B's (ended) service out.
            record_summary(trainer.loggers, {k: v for k, v in metrics.items() if k.startswith(("best/", "test/"))})
        succeeded = True
    finally:
        finish_wandb(succeeded, signalled=preemption.received is not None)
    log.info("Run directory: %s", run_dir)
    return metrics


def _raise_stop(preemption: PreemptionCheckpoint, writes_outputs: bool) -> None:
    """End the job with its :class:`JobStopped` if a stop signal has stopped it."""
    if preemption.stop is not None:
        if writes_outputs:  # once per job, not once per DDP rank
            log.warning("Stopped by %s (%s)", preemption.stop.signal, preemption.stop.outcome)
        raise preemption.stop
