"""Testing a checkpoint as ``eval.py`` does (trident.commands.evaluate, and trident-quantize before and after it
quantizes a run): the model and data rebuilt from the run's ``config_resolved.yaml``, then ``trainer.test``."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trident.errors import ConfigError, DataError
from trident.weights.run_config import run_config_of

if TYPE_CHECKING:
    from omegaconf import DictConfig, ListConfig

# torch and Lightning (~8 s) are imported once the arguments are checked and the checkpoint's path exists,
# so that a mistake in them is one error line at once; ``--help`` imports neither (nor omegaconf).

# Lightning asks for the training callbacks when restoring a checkpoint; testing needs none of them.
warnings.filterwarnings("ignore", message=r"Be aware that when using `ckpt_path`, callbacks")


def find_run_config(checkpoint: Path) -> Path:
    """``config_resolved.yaml`` of the run that wrote ``checkpoint`` (the nearest parent that has one)."""
    config = run_config_of(checkpoint)
    if config is not None:
        return config
    raise DataError(
        f"no config_resolved.yaml above {str(checkpoint)!r}: eval.py needs a checkpoint inside a train.py run "
        "directory (outputs/runs/<date>/<run>/checkpoints/*.ckpt)"
    )


def result_name(checkpoint: Path, run_dir: Path) -> str:
    """The name of a checkpoint's results in ``<run>/eval/``: the stem of one of the run's checkpoints
    (``checkpoints/last.ckpt``: ``last``), with its folders in the run for another (``quantized-int8/last.ckpt``:
    ``quantized-int8-last``), which would otherwise take the name of the run's own."""
    parts = checkpoint.resolve().relative_to(run_dir.resolve()).with_suffix("").parts
    return "-".join(parts[1:] if parts[0] == "checkpoints" else parts)


def check_no_group_choice(saved: DictConfig | ListConfig, overrides: DictConfig) -> None:
    """``task=vit`` or ``model=small`` would replace a group of the run's settings by a word: the
    checkpoint is tested as it was trained; only the keys inside a group can change."""
    from omegaconf import DictConfig

    for key, value in overrides.items():
        if isinstance(saved, DictConfig) and isinstance(saved.get(key), DictConfig) and not isinstance(value, DictConfig):
            raise ConfigError(f"eval.py overrides keys of the run's config, not config groups: {key}={value} would replace "
                              f"the run's {key} settings; drop it (the checkpoint is tested as it was trained) or set one "
                              f"of its keys, {key}.<key>=<value>")


def load_config(arguments: list[str]) -> tuple[DictConfig, Path]:
    """The run's saved config with the command-line ``key=value`` overrides applied."""
    from omegaconf import DictConfig, OmegaConf

    bad = [a for a in arguments if "=" not in a]
    if bad:
        raise ConfigError(f"eval.py takes key=value arguments, got {bad[0]!r}: e.g. python eval.py ckpt_path=<run>/checkpoints/last.ckpt")
    overrides = OmegaConf.from_dotlist(arguments)
    ckpt = overrides.pop("ckpt_path", None)
    if not ckpt:
        raise ConfigError("eval.py needs ckpt_path=<a .ckpt file or a run directory>: e.g. "
                          "ckpt_path=outputs/runs/<date>/<run>/checkpoints/last.ckpt")
    checkpoint = Path(str(ckpt))
    if not checkpoint.exists():
        raise DataError(f"checkpoint {str(checkpoint)!r} not found: fix ckpt_path (paths are relative to the directory you run from)")
    from trident.weights.checkpoints import checkpoint_of

    checkpoint = checkpoint_of(checkpoint)  # a run directory: its best, else last checkpoint (as trident.load)
    saved = OmegaConf.load(find_run_config(checkpoint))
    check_no_group_choice(saved, overrides)
    cfg = OmegaConf.merge(saved, overrides)
    if not isinstance(cfg, DictConfig):
        raise DataError("config_resolved.yaml is not a mapping: it was not written by train.py")
    if "optimizer" in cfg:  # a run saved before the optimizer was chosen by name still loads
        from trident.training.optim import optimizer_by_name

        cfg.optimizer = optimizer_by_name(OmegaConf.to_container(cfg.optimizer, resolve=True))  # type: ignore[arg-type]
    # The checkpoint holds the weights: neither init_from's source nor (in vit runs of an earlier
    # version) the timm file named by model.pretrained is read again. init_from stays: finetune=lora
    # names its base by it (a LoRA checkpoint's frozen base is refilled from <run>/init, trident.weights.frozen_base).
    for group in ("model", "task"):
        cfg[group].pop("pretrained", None)
    if "distill" in cfg:  # a teacher (distill=kd) serves the training loss alone: the test scores the student only
        cfg.distill = {"name": "none", "teacher": None}
        # config_resolved.yaml holds the task's copy of the group resolved (task.distill), not ${distill}.
        if "distill" in cfg.task:
            cfg.task.distill = cfg.distill
    if os.environ.get("TRIDENT_CACHE_DIR") and "cache_dir" in cfg.data:  # image data has no cache
        cfg.data.cache_dir = os.environ["TRIDENT_CACHE_DIR"]
    from trident.weights.init_from import stage_run_source

    stage_run_source(find_run_config(checkpoint).parent, cfg.data)
    return cfg, checkpoint


def evaluate(arguments: list[str], write: bool = True) -> dict[str, float]:
    """Rebuild data and task as train.py did, then test the checkpoint; returns the test metrics, also written to
    ``<run>/eval/`` unless ``write`` is False (trident-quantize: its report holds them, and the run's own results
    of its checkpoint, scored by eval.py with other overrides perhaps, stay as they are)."""
    cfg, checkpoint = load_config(arguments)
    import lightning as L
    from omegaconf import OmegaConf

    from trident.converters.weight_only import QUANTIZED_KEY
    from trident.runs.pipeline import build_data_and_task, build_trainer, check_config
    from trident.tasks.base import GENERATE
    from trident.tasks.frozen_base import reading
    from trident.tasks.networks import companions_beside
    from trident.training.callbacks import ModelCosts
    from trident.weights.checkpoints import check_checkpoint_fits, read_checkpoint
    from trident.weights.sources import find_base

    backbone = check_config(cfg)
    saved = read_checkpoint(checkpoint, "ckpt_path", weights=False)  # fails on a damaged file before the data is prepared
    if QUANTIZED_KEY in saved:  # trident-quantize folded the run's converters (finetune=lora) into its weights
        cfg.finetune = {"name": "full"}
    L.seed_everything(cfg.get("seed", 0), workers=True)
    with companions_beside(find_run_config(checkpoint).parent):  # a companion the run recorded relative to itself
        datamodule, task = build_data_and_task(cfg, backbone, "test")
    check_checkpoint_fits(saved, task, checkpoint)
    trainer_cfg: dict[str, Any] = OmegaConf.to_container(cfg.trainer, resolve=True)  # type: ignore[assignment]
    # Testing needs no logger, checkpoints or training limits, only the measures of the test that the task's
    # capabilities call for (a task that generates: what its decoding costs, callbacks.model_costs in training).
    # Chosen by the task, not by the run's saved callbacks: an LM run saved before that callback existed (its task
    # measured the costs itself) keeps them. One process tests the whole split exactly (a DDP run's distributed
    # sampler would pad it), whatever the run was trained on.
    measures = [measure() for capability, measure in ((GENERATE, ModelCosts),) if capability in type(task).CAPABILITIES]
    trainer_cfg.update(logger=False, enable_checkpointing=False, callbacks=measures,
                       default_root_dir=str(checkpoint.parent), devices=1, num_nodes=1, strategy="auto")
    trainer = build_trainer(trainer_cfg)
    with reading(checkpoint, find_base):  # a finetune=lora checkpoint's frozen base comes from where it is now
        trainer.test(task, datamodule=datamodule, ckpt_path=str(checkpoint), weights_only=True)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    run_dir = find_run_config(checkpoint).parent
    out = run_dir / "eval" / f"{result_name(checkpoint, run_dir)}.json"
    if write and trainer.is_global_zero:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"ckpt_path": str(checkpoint), "overrides": arguments, "metrics": metrics}, indent=1))
        print(f"metrics written to {out}")
    return metrics
