"""One ``train.py`` job and its run directory: the command line read before Hydra starts, config
composition, the training pipeline, job status, sweeps, resume, the FLOP budget, checkpoint files.
Launching it (DDP, SLURM, signals, requeue) is :mod:`trident.launch`; reading the W&B files a run
leaves, :mod:`trident.tracking.wandb_files`.

Nothing is imported here: ``train.py`` checks its command line with :mod:`trident.runs.command_line`
before torch, Lightning and W&B load.
"""
