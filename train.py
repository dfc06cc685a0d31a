"""Train a Transformer: `python train.py task=lm pos_encoding=rope` (see README for all options)."""

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from trident.cli import check_group_choices, check_overrides, run_with_clear_errors
from trident.pipeline import train

CONF_DIR = Path(__file__).resolve().parent / "conf"


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    metrics = run_with_clear_errors(lambda: train(cfg), run_dir=Path(cfg.paths.output_dir))
    # Returned for Hydra sweepers (e.g. Optuna): the monitored validation metric.
    value = metrics.get(cfg.task.monitor)
    return None if value is None else float(value)


if __name__ == "__main__":
    check_group_choices(sys.argv[1:], CONF_DIR)
    check_overrides(sys.argv[1:], CONF_DIR)
    main()
