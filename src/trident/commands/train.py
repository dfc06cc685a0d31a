"""Train a Transformer: ``trident-train task=lm pos_encoding=rope``, or ``python train.py ...`` in a
checkout (docs/configuration.md for all options)."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from hydra_plugins.trident_sweeper import register_sweeper
from trident.errors import run_with_clear_errors
from trident.runs.command_line import prepare_command_line
from trident.runs.compose import CONF_DIR
from trident.runs.resume import kept_on_refusal
from trident.runs.train_help import train_help, wants_help


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def train_job(cfg: DictConfig) -> float | None:
    # Imported once the command line is known to be good: torch, Lightning and W&B take seconds.
    from trident.launch.distributed import workers_follow
    from trident.runs.jobs import run_job

    # DDP workers that Lightning starts during this job run this job, in this run directory.
    overrides = HydraConfig.get().overrides
    with workers_follow(overrides.hydra, overrides.task, Path(cfg.paths.output_dir)):
        # Returned for Hydra sweepers (e.g. Optuna): the best value of the monitored validation metric.
        return run_job(cfg)


def main() -> None:
    if wants_help(sys.argv[1:]):  # answered here: Hydra's own --help takes seconds to list the groups
        print(run_with_clear_errors(lambda: train_help(sys.argv[1:])))
        return
    sys.argv[1:] = prepare_command_line(sys.argv[1:])
    register_sweeper()  # hydra/sweeper=excluding, whichever way trident was installed
    with kept_on_refusal(sys.argv[1:]):
        train_job()


if __name__ == "__main__":
    main()
