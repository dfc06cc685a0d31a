"""What a run records and where: the experiment loggers (W&B, MLflow, CSV: loggers.py), the one step axis of every
record (steps.py), W&B offline files read back and uploaded (wandb_files.py), the rows a resumed attempt resends
(wandb_journal.py), the best checkpoint as an artifact, tables of text and figures.

Nothing is imported here: a command that loads a task imports the modules it uses, not the loggers beside them.
"""
