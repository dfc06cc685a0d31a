"""Train a Transformer: `python train.py task=lm pos_encoding=rope` (see README for all options)."""

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from trident.cli import check_group_choices
from trident.jobs import run_job

CONF_DIR = Path(__file__).resolve().parent / "conf"


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    # Returned for Hydra sweepers (e.g. Optuna): the best value of the monitored validation metric.
    return run_job(cfg)


if __name__ == "__main__":
    check_group_choices(sys.argv[1:], CONF_DIR)
    main()
