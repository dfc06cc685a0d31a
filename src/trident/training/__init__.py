"""What every task's training shares: optimizers and schedules, losses and the global token-loss reduction,
callbacks, precision and FLOP accounting, fine-tuning options, resilience (RNG resume, non-finite losses), checks of
the run settings. Parallel mechanics are in trident.parallel, loggers and records in trident.tracking.

Nothing is imported here: a command that loads a task (trident-export, trident-chat, trident-sample) imports the
modules it uses, not the loggers (Hydra, W&B) beside them.
"""
