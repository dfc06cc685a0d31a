"""One ``train.py`` job and its run directory: the command line read before Hydra starts, config
composition, the training pipeline, job status, sweeps, resume and SLURM requeue, DDP ranks,
checkpoint files and the W&B files a run leaves.

Nothing is imported here: ``train.py`` checks its command line with :mod:`trident.runs.command_line`
before torch, Lightning and W&B load.
"""
