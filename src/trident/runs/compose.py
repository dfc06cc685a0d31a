"""Compose the training config from Python (tests, notebooks) exactly as ``train.py`` composes it:
where ``conf/`` is, and the config's own resolvers."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from trident.runs.sweeps import job_subdir


def find_conf_dir() -> Path:
    """The config groups: ``trident/conf`` inside an installed package (``pip install .`` copies the
    repository's ``conf/`` there), else ``conf/`` at the top of the checkout this module lives in."""
    package = Path(__file__).resolve().parents[1]  # .../trident
    installed = package / "conf"
    return installed if (installed / "train.yaml").is_file() else package.parents[1] / "conf"


CONF_DIR = find_conf_dir()
# Files of weights an init_from may name, whose suffix is no part of the run's name.
WEIGHT_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".safetensors")


def compose_train_config(overrides: Sequence[str], output_dir: Path | None = None, conf_dir: Path = CONF_DIR) -> DictConfig:
    """``conf/train.yaml`` with ``overrides``, as ``python train.py <overrides>`` would compose it;
    ``output_dir`` replaces the run directory Hydra would choose."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(conf_dir)):
        cfg = compose("train", overrides=list(overrides), return_hydra_config=True)
    # ${hydra:...} interpolations (the run directory) resolve against this config.
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        if output_dir is not None:
            cfg.paths.output_dir = str(output_dir)
        del cfg.hydra
    return cfg


def device_count(devices: Any) -> int | None:
    """``trainer.devices`` as a number of devices per node; None for ``-1``/``auto`` (all there are)."""
    if isinstance(devices, (list, tuple, ListConfig)):
        return len(devices)
    text = str(devices)
    return int(text) if text.isdigit() and int(text) > 0 else None


def slurm_gpus_per_node(accelerator: str, devices: Any) -> int | None:
    """The slurm launcher's ``gpus_per_node``: none for a CPU trainer, else ``trainer.devices``
    (1 when that is ``-1``/``auto``: then set ``hydra.launcher.gpus_per_node``)."""
    return None if accelerator == "cpu" else device_count(devices) or 1


def slurm_tasks_per_node(devices: Any, gpus_per_node: int | None) -> int:
    """The slurm launcher's ``tasks_per_node``: one task (DDP rank) per device of the node, i.e.
    ``trainer.devices`` when it is a number, else the node's GPUs."""
    return device_count(devices) or gpus_per_node or 1


# Loader workers a GPU preset starts per device: past this many, collating trident's prepared examples gains nothing.
MAX_LOADER_WORKERS = 8


def loader_workers(devices: Any) -> int:
    """The GPU presets' ``data.num_workers``: ``min(8, CPUs this process may use / devices of this node)``, at least 1;
    ``trainer.devices=-1``/``auto`` counts the GPUs there are. Each DDP rank starts its own workers, so the node's CPUs
    are shared among its devices (a Slurm job's CPUs per task are what the process may use)."""
    import torch  # the GPUs are counted only when a preset asks, as the run starts

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    per_node = device_count(devices) or max(1, torch.cuda.device_count())
    return max(1, min(MAX_LOADER_WORKERS, cpus // per_node))


def model_name(model: str, *, _root_: DictConfig) -> str:
    """``run_name``'s model part: ``model.name``, or with ``init_from`` the source's name, since the source fixes the
    architecture (a run from ``models/TinyLlama-1.1B`` is ``lm-chat-TinyLlama-1.1B-...``, not ``lm-chat-tiny-...``):
    a directory's or Hub id's last part, a weights file's name without its suffix, a checkpoint's run directory
    (without the ``<time>_`` Hydra puts before a run's name). An ``init_from`` still ``???`` (an experiment's
    ``pretrained_run``) leaves ``model.name``: the run refuses it in one line, after Hydra named the directory."""
    try:
        init_from = OmegaConf.select(_root_, "init_from")
    except OmegaConfBaseException:
        return str(model)
    if init_from is None or not str(init_from).strip():
        return str(model)
    path = PurePosixPath(str(init_from).rstrip("/"))
    if path.parent.name == "checkpoints":  # <run>/checkpoints/last.ckpt: the run's
        path = path.parent.parent
    name = path.stem if path.suffix in WEIGHT_SUFFIXES else path.name
    return re.sub(r"^\d{2}-\d{2}-\d{2}_", "", name) or str(model)


# conf/hydra/launcher/slurm.yaml resolves these when Hydra sets up a sweep's launcher (in train.py's
# process, before any job imports the pipeline).
OmegaConf.register_new_resolver("trident.slurm_gpus_per_node", slurm_gpus_per_node, replace=True)
OmegaConf.register_new_resolver("trident.slurm_tasks_per_node", slurm_tasks_per_node, replace=True)
# conf/trainer/_fast.yaml's data.num_workers (trainer=gpu, ddp, fsdp).
OmegaConf.register_new_resolver("trident.loader_workers", loader_workers, replace=True)
# conf/train.yaml's run_name (and with it the run directory's name) reads this.
OmegaConf.register_new_resolver("trident.model_name", model_name, replace=True)
# conf/data/shakespeare.yaml's data.contiguous: on for a model with a memory (model.memory_length > 0).
OmegaConf.register_new_resolver("trident.has_memory", lambda length: bool(length), replace=True)
# conf/hydra/default.yaml: a sweep job's directory, which Hydra resolves as the job starts.
OmegaConf.register_new_resolver("trident.job_subdir", job_subdir, replace=True)
