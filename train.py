"""Train a Transformer: `python train.py task=lm pos_encoding=rope` (see README for all options)."""

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from trident.cli import check_group_choices, check_overrides, run_with_clear_errors
from trident.distributed import is_global_zero, worker_argv, workers_follow
from trident.pipeline import train
from trident.resume import resume_arguments

CONF_DIR = Path(__file__).resolve().parent / "conf"


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    run_dir = Path(cfg.paths.output_dir)
    # DDP workers that Lightning starts during this job run this job, in this run directory.
    overrides = HydraConfig.get().overrides
    with workers_follow(overrides.hydra, overrides.task, run_dir):
        # The run directory is rank 0's to clean up after a failure.
        metrics = run_with_clear_errors(lambda: train(cfg), run_dir=run_dir if is_global_zero() else None)
    # Returned for Hydra sweepers (e.g. Optuna): the monitored validation metric.
    value = metrics.get(cfg.task.monitor)
    return None if value is None else float(value)


if __name__ == "__main__":
    sys.argv = worker_argv(sys.argv)
    check_group_choices(sys.argv[1:], CONF_DIR)
    check_overrides(sys.argv[1:], CONF_DIR)
    # resume=<run dir> / resume=auto: Hydra must reuse the run's directory and overrides.
    sys.argv[1:] = run_with_clear_errors(lambda: resume_arguments(sys.argv[1:], CONF_DIR))
    main()
