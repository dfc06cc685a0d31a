"""Launching a job: DDP worker processes (one run directory per job, rank-0-only outputs, ranks that
fail together), stop signals (finish the step, save, stop) and SLURM's requeue.

Nothing is imported here: ``train.py`` reads a DDP worker's command line with
:mod:`trident.launch.workers` before torch, Lightning and W&B load.
"""
