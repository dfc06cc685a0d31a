"""Train a Transformer: `python train.py task=lm pos_encoding=rope` (see README for all options)."""

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from trident.cli import check_group_choices, check_overrides, run_with_clear_errors
from trident.distributed import worker_argv, workers_follow
from trident.jobs import run_job
from trident.resume import resume_arguments

CONF_DIR = Path(__file__).resolve().parent / "conf"


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    # DDP workers that Lightning starts during this job run this job, in this run directory.
    overrides = HydraConfig.get().overrides
    with workers_follow(overrides.hydra, overrides.task, Path(cfg.paths.output_dir)):
        # Returned for Hydra sweepers (e.g. Optuna): the best value of the monitored validation metric.
        return run_job(cfg)


if __name__ == "__main__":
    sys.argv = worker_argv(sys.argv)
    check_group_choices(sys.argv[1:], CONF_DIR)
    check_overrides(sys.argv[1:], CONF_DIR)
    # resume=<run dir> / resume=auto: Hydra must reuse the run's directory and overrides.
    sys.argv[1:] = run_with_clear_errors(lambda: resume_arguments(sys.argv[1:], CONF_DIR))
    main()
