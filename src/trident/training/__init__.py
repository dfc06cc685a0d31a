"""What every task's training shares: optimizers and schedules, losses, callbacks, loggers,
precision and FLOP accounting, checks of the run settings.

Nothing is imported here: a command that loads a task (trident-export, trident-chat, trident-sample) imports the
modules it uses, not the loggers (Hydra, W&B) beside them.
"""
