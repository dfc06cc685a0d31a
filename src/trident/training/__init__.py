"""What every task's training shares: optimizers and schedules, losses, callbacks, loggers,
precision and FLOP accounting, checks of the run settings."""

from trident.training.callbacks import MetricHistory, MetricsToLog, Throughput
from trident.training.loggers import build_loggers, record_summary
from trident.training.losses import label_smoothed_cross_entropy
from trident.training.optim import build_optimizer, build_scheduler, optimizers_for
from trident.training.precision import check_precision
from trident.training.resilience import NonFiniteLossGuard, RandomStates

__all__ = [
    "MetricHistory",
    "MetricsToLog",
    "NonFiniteLossGuard",
    "RandomStates",
    "Throughput",
    "build_loggers",
    "build_optimizer",
    "build_scheduler",
    "check_precision",
    "label_smoothed_cross_entropy",
    "optimizers_for",
    "record_summary",
]
