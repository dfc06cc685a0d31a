"""Compose the training config from Python (tests, notebooks) exactly as ``train.py`` composes it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict


def find_conf_dir() -> Path:
    """The config groups: ``trident/conf`` inside an installed package (``pip install .`` copies the
    repository's ``conf/`` there), else ``conf/`` at the top of the checkout this module lives in."""
    package = Path(__file__).resolve().parents[1]  # .../trident
    installed = package / "conf"
    return installed if (installed / "train.yaml").is_file() else package.parents[1] / "conf"


CONF_DIR = find_conf_dir()


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
